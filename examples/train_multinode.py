"""Train on several machines: one dpool node per machine, DDP's contract between the nodes.

Each node is a coordinator with its own local workers (gradients summed through shared memory);
only the coordinators talk across machines, over torch.distributed. Launch it with torchrun:

    # one machine, two "nodes" (what the tests run)
    torchrun --standalone --nproc-per-node=2 examples/train_multinode.py --check

    # two machines, one node each, 2 local workers per node
    torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 \\
        examples/train_multinode.py --workers 2

The data-loader contract: one DistributedSampler replica per node (not per worker), with the node
batch ``global_batch // world_size``; dpool splits the node batch over the node's workers. The
learning rate belongs to the global batch. Checkpoints are written by rank 0 only.
With ``--check``, rank 0 replays the run in one process on the global batches and compares the losses.
"""
from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import dpool


def make_data(n: int = 1024) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    y = (x[:, :4].sum(1) > 0).long() + (x[:, 4] > 1).long()  # 3 classes
    return TensorDataset(x, y)


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=64, help="global batch (all nodes together)")
    ap.add_argument("--workers", type=int, default=1, help="dpool workers per node")
    ap.add_argument("--lr", type=float, default=0.1, help="for the global batch")
    ap.add_argument("--checkpoint", default=None, help="where rank 0 saves the model and optimizer")
    ap.add_argument("--check", action="store_true", help="compare the losses with one process (on rank 0)")
    args = ap.parse_args()

    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=2))  # not gloo's default of 30 minutes
    world = dist.get_world_size()
    ds = make_data()
    sampler = DistributedSampler(ds, seed=0)  # num_replicas = the number of nodes
    loader = DataLoader(ds, batch_size=args.batch // world, sampler=sampler, drop_last=True)

    model = dpool.wrap(make_net(), device_ids=["cpu"] * args.workers)  # cross-node: the default group
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    crit = nn.CrossEntropyLoss()
    losses = []
    step = 0
    sampler.set_epoch(0)
    for x, y in loader:
        if step == args.steps:
            break
        opt.zero_grad()
        loss = crit(model(x), y)
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # for printing: the global batch's loss (mean of the nodes' means)
        losses.append(float(mean) / world)
        if model.is_main:
            print(f"step {step}: loss {losses[-1]:.6f}", flush=True)
        step += 1

    if args.checkpoint and model.is_main:  # rank 0 only; atomic, so a crash never leaves half a file
        tmp = args.checkpoint + ".tmp"
        torch.save({"model": dpool.unwrap(model).state_dict(), "opt": opt.state_dict()}, tmp)
        os.replace(tmp, args.checkpoint)
    dist.barrier()
    model.close()

    if args.check and dist.get_rank() == 0:
        ref = make_net()
        ropt = torch.optim.SGD(ref.parameters(), lr=args.lr, momentum=0.9)
        loaders = [DataLoader(ds, batch_size=args.batch // world, drop_last=True,
                              sampler=DistributedSampler(ds, num_replicas=world, rank=r, seed=0)) for r in range(world)]
        worst = 0.0
        for i, parts in enumerate(zip(*loaders)):
            if i == args.steps:
                break
            x = torch.cat([p[0] for p in parts])
            y = torch.cat([p[1] for p in parts])
            ropt.zero_grad()
            loss = crit(ref(x), y)
            loss.backward()
            ropt.step()
            worst = max(worst, abs(float(loss.detach()) - losses[i]))
        ok = worst <= 1e-5
        print(("same losses as one process on the global batch" if ok else "LOSSES DIFFER from one process")
              + f" (largest difference {worst:.2e} over {len(losses)} steps)", flush=True)
        if not ok:
            raise SystemExit(1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
