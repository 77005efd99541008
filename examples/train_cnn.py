"""Train a small CNN with BatchNorm on synthetic images, with dpool, nn.DataParallel or one process.

    python examples/train_cnn.py                          # dpool, one worker per physical core
    python examples/train_cnn.py --mode single            # the same run without dpool
    python examples/train_cnn.py --mode dataparallel
    python examples/train_cnn.py --workers 2 --epochs 3
    python examples/train_cnn.py --device cpu             # CPU workers even where there are GPUs

With GPUs (the default where torch sees one), the model lives on cuda:0 and dpool runs one
worker per GPU; on a single GPU, --workers N puts N workers on it (device_ids=[0] * N).

The data set is generated (nothing is downloaded): 10 classes of 3x32x32
images, each class a fixed random pattern plus noise, so the loss falls and
accuracy climbs within a few epochs. Prints a progress bar per epoch, the
loss, the held-out accuracy and the training throughput in samples/s.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

import dpool

# What dpool gives its workers: glibc keeps blocks up to 1 GiB in the heap between steps (docs/performance.md)
WORKER_MALLOC_KEEP = 1 << 30


class CNN(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        )
        self.head = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


def synthetic(n: int, seed: int, classes: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    patterns = torch.randn(classes, 3, 32, 32, generator=g)
    g.manual_seed(seed)
    y = torch.randint(0, classes, (n,), generator=g)
    x = patterns[y] + 0.7 * torch.randn(n, 3, 32, 32, generator=g)
    return x, y


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["dpool", "dataparallel", "single"], default="dpool")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--workers", type=int, default=None,
                    help="worker processes (default: one per physical core on CPU, per GPU on GPUs, 2 on one GPU)")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--train-size", type=int, default=4096)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--default-malloc", action="store_true",
                    help="run single/dataparallel with glibc's malloc defaults instead of dpool's worker setting")
    args = ap.parse_args()
    # dpool's workers keep their heap between steps (MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_, see
    # docs/performance.md); glibc reads them at start-up, so a baseline gets the same setting by starting again with it.
    # Otherwise --workers 1 would look 2.6x faster than --mode single for that reason alone.
    keep = str(WORKER_MALLOC_KEEP)
    if args.mode != "dpool" and not args.default_malloc and args.device == "cpu" and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=keep, MALLOC_TRIM_THRESHOLD_=keep)
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    heap = ("dpool's worker heap setting" if os.environ.get("MALLOC_MMAP_THRESHOLD_") == keep or args.mode == "dpool"
            else "glibc's malloc defaults")

    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    # default: dpool's own (one worker per GPU, or per physical core on CPU); one GPU gets two workers
    if args.workers is None:
        device_ids: list | None = [0, 0] if gpus == 1 else None
    else:
        device_ids = (list(range(gpus)) if gpus > 1 and args.workers == gpus else [0] * args.workers) if gpus \
            else ["cpu"] * args.workers
    dev = torch.device("cuda:0" if gpus else "cpu")
    torch.manual_seed(0)
    x_train, y_train = synthetic(args.train_size, seed=1)
    x_test, y_test = synthetic(1024, seed=2)
    if gpus:  # a GPU loader would hand over pinned batches; a synthetic set fits on the GPU
        x_train, y_train, x_test, y_test = (t.to(dev) for t in (x_train, y_train, x_test, y_test))
    net = CNN().to(dev)
    if args.mode == "dpool":
        model: nn.Module = dpool.wrap(net, device_ids)
    elif args.mode == "dataparallel":
        model = nn.DataParallel(net)  # on a CPU-only machine: one module, no parallelism
    else:
        model = net
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    print(f"mode={args.mode} device={dev} workers={model.device_ids if dpool.is_wrapped(model) else 1} "
          f"torch threads in this process={torch.get_num_threads()}")
    samples, train_time = 0, 0.0
    try:
        for epoch in range(args.epochs):
            model.train()
            perm = torch.randperm(args.train_size)
            bar = tqdm(range(0, args.train_size, args.batch_size), desc=f"epoch {epoch + 1}/{args.epochs}")
            t0 = time.perf_counter()
            for start in bar:
                idx = perm[start:start + args.batch_size]
                opt.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
                loss.backward()
                opt.step()
                samples += len(idx)
                bar.set_postfix(loss=f"{loss.item():.3f}")
            train_time += time.perf_counter() - t0
            model.eval()
            with torch.no_grad():
                pred = torch.cat([model(x_test[i:i + 512]).argmax(1) for i in range(0, len(x_test), 512)])
            print(f"epoch {epoch + 1}: loss {loss.item():.3f}, test accuracy {(pred == y_test).float().mean():.1%}")
    finally:
        if isinstance(model, dpool.DataParallel):
            model.close()
    print(f"throughput: {samples / train_time:.0f} samples/s ({args.mode})")
    print(f"(memory allocator: {heap}; the three modes use the same one unless --default-malloc is given, "
          "so compare them as they are)")


if __name__ == "__main__":
    main()
