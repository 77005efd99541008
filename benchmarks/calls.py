"""How much Python a dpool step runs in the coordinator: the Python-level function calls of one probe step
(generator resumptions included), dpool's own among them, counted outside the waits for the workers'
replies (how long those spin depends on timing; the rest does not).

Unlike a step's time on a noisy machine, the count is the same from run to run: it is what a change to the
step's code removed or added. It is not time (a call costs from tens of nanoseconds to microseconds), and
how much distinct code a step runs matters as much as how often (docs/performance.md).

    python benchmarks/calls.py                # gathered outputs (two rounds a step)
    python benchmarks/calls.py --loss         # the loss on the workers (one round a step)
"""
from __future__ import annotations

import argparse
import json
import os
import sys

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from torch import nn


def count(loss_on_workers: bool, steps: int, warmup: int) -> dict[str, float]:
    """Calls per step of a Linear(8, 8) on a batch of 16 with two CPU workers, SGD, after ``warmup`` steps."""
    import dpool
    from dpool import pool as P

    torch.manual_seed(0)
    model = dpool.wrap(nn.Linear(8, 8), ["cpu", "cpu"], gather=not loss_on_workers)
    crit = dpool.criterion(nn.CrossEntropyLoss()) if loss_on_workers else nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 8), torch.randint(0, 8, (16,))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        crit(model(x), y).backward()
        opt.step()

    wait = P.Pool._wait.__code__
    counts = {"python_calls": 0, "dpool_calls": 0, "c_calls": 0}
    inside = [0]

    def profile(frame, event, arg):  # noqa: ANN001, ANN202
        if frame.f_code is wait:
            inside[0] += 1 if event == "call" else -1 if event == "return" else 0
        elif not inside[0]:
            if event == "call":
                counts["python_calls"] += 1
                counts["dpool_calls"] += f"{os.sep}dpool{os.sep}" in frame.f_code.co_filename
            elif event == "c_call":
                counts["c_calls"] += 1

    try:
        for _ in range(warmup):
            step()
        sys.setprofile(profile)
        try:
            for _ in range(steps):
                step()
        finally:
            sys.setprofile(None)
    finally:
        model.close()
    return {k: v / steps for k, v in counts.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--loss", action="store_true", help="the loss on the workers (gather=False, dpool.criterion)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=50)
    args = ap.parse_args(argv)
    print(json.dumps(count(args.loss, args.steps, args.warmup)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
