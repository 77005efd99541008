"""The classic DataParallel tutorial, run under torch.nn.DataParallel and under dpool.

    python examples/compare_dataparallel.py

A Model(5 → 2) prints the size of what it receives from inside its forward.
Under nn.DataParallel on a CPU-only machine the whole batch of 30 goes to one
module (DataParallel has no CPU parallelism); with GPUs it is split across them,
as in the tutorial ("Let's use 2 GPUs!"). dpool uses every GPU too, or
--workers workers on a single one. Under dpool the batch is split
into even shards, one per worker process; the prints come from the workers and
reach this terminal labelled "[dpool worker k]".
"""
from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import dpool

INPUT_SIZE, OUTPUT_SIZE = 5, 2
BATCH_SIZE, DATA_SIZE = 30, 100


class RandomDataset(Dataset):
    def __init__(self, size: int, length: int) -> None:
        self.len = length
        self.data = torch.randn(length, size)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.data[index]

    def __len__(self) -> int:
        return self.len


class Model(nn.Module):
    def __init__(self, input_size: int, output_size: int) -> None:
        super().__init__()
        self.fc = nn.Linear(input_size, output_size)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        output = self.fc(input)
        print("\tIn model: input size", input.size(), "output size", output.size(), flush=True)
        return output


def run(name: str, model: nn.Module, loader: DataLoader, device: torch.device) -> None:
    print(f"--- {name} ---", flush=True)
    for data in loader:
        output = model(data.to(device))
        print("Outside: input size", data.size(), "output_size", output.size(), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    torch.manual_seed(0)
    loader = DataLoader(RandomDataset(INPUT_SIZE, DATA_SIZE), batch_size=BATCH_SIZE, shuffle=True)
    gpus = torch.cuda.device_count()
    device = torch.device("cuda:0" if gpus else "cpu")
    if gpus > 1:
        print(f"Let's use {gpus} GPUs!")
    run("torch.nn.DataParallel", nn.DataParallel(Model(INPUT_SIZE, OUTPUT_SIZE).to(device)), loader, device)
    ids: list = (list(range(gpus)) if gpus > 1 else [0] * args.workers) if gpus else ["cpu"] * args.workers
    with dpool.wrap(Model(INPUT_SIZE, OUTPUT_SIZE).to(device), ids) as model:
        run(f"dpool.wrap, workers on {ids}", model, loader, device)


if __name__ == "__main__":
    main()
