"""How a step's time depends on how long ago its code last ran: the same training step back to back, and
after an idle gap before each step.

``bench.py`` times steps back to back. A tiny step (the probe's, ~0.2 ms in one process) then finds its
code and data still in the CPU's caches; a larger model's step (the mlp's, ~12 ms on the workers) does
not: the coordinator's code for step ``t + 1`` last ran a whole round ago. This script measures what that
costs on the machine it runs on, by putting a gap of ``--gaps`` milliseconds before every timed step,
either sleeping (``time.sleep``) or spinning in Python, and reports the median time of the step itself.
The setups are ``bench.py``'s, built and stepped as its table runs them (``single`` on every core).

On the 2-core KVM guest of docs/performance.md's tables the single-process probe step took 0.23 ms back to back and
1.0-1.3 ms after a 12 ms gap, slept or spun alike: code that has not run for a few milliseconds runs
several times slower there, whatever ran in between (docs/performance.md). The framework cost
of a dpool step, and the cost of the coordinator's work between a larger model's rounds, grow the same way.

    python benchmarks/cold.py                       # probe: single process, dpool, dpool-loss
    python benchmarks/cold.py --workloads probe,mlp --gaps 0,2,12 --repeats 4
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench import Local
from benchmarks.workloads import WORKLOADS, Workload

__all__ = ["main"]

SETUPS = ("single", "dpool", "dpool-loss")


def _gap(kind: str, seconds: float) -> None:
    """Idle for ``seconds`` before a step: ``sleep`` gives the core away, ``spin`` keeps it in a Python loop."""
    if seconds <= 0:
        return
    if kind == "sleep":
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def measure(w: Workload, setups: list[str], gaps_ms: list[float], steps: int, repeats: int,
            workers: int) -> dict[tuple[str, str, float], float]:
    """Median µs per step for every (setup, gap kind, gap), the repeats interleaved across all of them."""
    runs = {s: Local(s, w, workers) for s in setups}  # bench.py's setups, as its table runs them
    times: dict[tuple[str, str, float], list[float]] = {}
    cases = [("none", 0.0)] + [(kind, g) for g in gaps_ms if g > 0 for kind in ("sleep", "spin")]
    try:
        for run in runs.values():  # warm-up
            run.run(max(5, steps // 5))
        for _ in range(repeats):
            for s, run in runs.items():
                for kind, g in cases:
                    total = 0.0
                    for _ in range(steps):
                        _gap(kind, g / 1e3)
                        total += run.run(1)
                    times.setdefault((s, kind, g), []).append(total / steps * 1e6)
    finally:
        for run in runs.values():
            run.close()
    return {key: statistics.median(v) for key, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="probe", help="comma-separated, from benchmarks/workloads.py")
    ap.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated, from {', '.join(SETUPS)}")
    ap.add_argument("--gaps", default="2,12", help="comma-separated idle gaps before each step, in ms")
    ap.add_argument("--steps", type=int, default=100, help="timed steps per repeat and case")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args(argv)
    setups = args.setups.split(",")
    unknown = [s for s in setups if s not in SETUPS] + [n for n in args.workloads.split(",") if n not in WORKLOADS]
    if unknown:
        ap.error(f"unknown setup or workload {unknown}")
    gaps = [float(g) for g in args.gaps.split(",")]
    print(f"median µs per step ({args.repeats} interleaved repeats of {args.steps} steps; 'none' is back to back)\n")
    for name in args.workloads.split(","):
        res = measure(WORKLOADS[name], setups, gaps, args.steps, args.repeats, args.workers)
        cases = sorted({(k, g) for _, k, g in res}, key=lambda c: (c[1], c[0]))
        print(f"| {name} | " + " | ".join("back to back" if k == "none" else f"{k} {g:g} ms" for k, g in cases) + " |")
        print("|---" * (len(cases) + 1) + "|")
        for s in setups:
            print(f"| {s} | " + " | ".join(f"{res[(s, k, g)]:.0f}" for k, g in cases) + " |")
        if "single" in setups:
            for s in setups:
                if s != "single":
                    print(f"| {s} − single | " + " | ".join(f"{res[(s, k, g)] - res[('single', k, g)]:.0f}"
                                                          for k, g in cases) + " |")
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
