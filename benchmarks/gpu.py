"""Training throughput on one GPU: dpool on ``[0, 0]`` against one process and ``nn.DataParallel``.

    python benchmarks/gpu.py                      # every workload, every setup
    python benchmarks/gpu.py --workloads probe --steps 50 --repeats 5
    python benchmarks/gpu.py --breakdown resnet --setups single,dpool1,dpool   # time per phase
    python benchmarks/gpu.py --trace traces/ --setups single,dpool1,dpool      # profiler traces, GPU idle
    python benchmarks/gpu.py --mps --setups dpool1,dpool                        # the same rows under MPS

Setups (all on cuda:0, inputs already on the GPU, fp32, SGD with momentum):
  single   the module in this process
  dataparallel  torch.nn.DataParallel(module, device_ids=[0]) (one replica: its per-call overhead)
  dpool    dpool.wrap(module, [0, 0]): two worker processes sharing GPU 0 over CUDA IPC
  dpool1   dpool.wrap(module, [0]): one worker process (framework cost without two processes
           time-slicing one GPU)

Workloads:
  resnet   a ResNet-18 (BasicBlock [2, 2, 2, 2], 64-512 channels) on 3x64x64 images, batch 256
  encoder  a 4-layer Transformer encoder (d_model 256, 8 heads), 64 sequences of 128 tokens
  probe    a 16x16 Linear on 8 rows: the step is all framework cost

Method: every setup is built once and warmed up; repeats are interleaved (A B C A B C ...) so that
noise hits each setup alike; each repeat times --steps full steps and ends with a device sync.
The table reports the median samples/s and step time, and for dpool its framework cost per step:
the step time minus the slower worker's forward+backward (``model.stats()``). Multi-GPU speed-up
cannot be measured on one GPU, and this benchmark does not claim it.

``--trace DIR`` runs a few steps of each setup under ``torch.profiler`` instead, in this process and (for
dpool) in every worker, writes each process's Chrome trace to ``DIR/<workload>-<setup>-<process>.json``,
and reports per setup the GPU's idle fraction over the steady steps (the time no kernel, copy or memset of
any of those processes ran, over the steps' wall time) and the framework cost (the step time minus a
single process's, at the same batch).

``--mps`` starts NVIDIA's Multi-Process Service (``nvidia-cuda-mps-control -d``, with its pipe and log
folders in a new temporary folder), runs the benchmark again with the other arguments in a new process that
is its client (as dpool's workers then are), and stops the service (``quit``) whatever happens; the rows'
setups carry an ``mps`` mark in ``--out``. Without ``nvidia-cuda-mps-control`` on the PATH it exits 2.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch
from torch import nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.provenance import provenance  # noqa: E402


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.b2(self.c2(F.relu(self.b1(self.c1(x))))) + self.skip(x))


class ResNet18(nn.Module):
    def __init__(self, classes: int = 100) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
        layers, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [Block(cin, cout, stride), Block(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(512, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.stem(x)).mean((2, 3)))


class Encoder(nn.Module):
    def __init__(self, vocab: int = 1000, d: int = 256, classes: int = 10) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 8, 4 * d, batch_first=True), 4)
        self.head = nn.Linear(d, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.emb(tokens)).mean(1))


def _workloads() -> dict[str, tuple[Callable[[], nn.Module], Callable[[torch.Generator], tuple], int]]:
    dev = "cuda:0"
    return {
        "resnet": (ResNet18, lambda g: (torch.randn(256, 3, 64, 64, generator=g).to(dev),
                                        torch.randint(0, 100, (256,), generator=g).to(dev)), 256),
        "encoder": (Encoder, lambda g: (torch.randint(0, 1000, (64, 128), generator=g).to(dev),
                                        torch.randint(0, 10, (64,), generator=g).to(dev)), 64),
        "probe": (lambda: nn.Linear(16, 16), lambda g: (torch.randn(8, 16, generator=g).to(dev),
                                                         torch.randint(0, 16, (8,), generator=g).to(dev)), 8),
    }


class Runner:
    def __init__(self, setup: str, workload: str) -> None:
        make, batch, self.rows = _workloads()[workload]
        torch.manual_seed(0)
        net = make().to("cuda:0")
        g = torch.Generator().manual_seed(0)
        self.data = [batch(g) for _ in range(4)]
        self.setup = setup
        if setup == "dataparallel":
            net = nn.DataParallel(net, device_ids=[0])
        elif setup.startswith("dpool"):
            import dpool

            net = dpool.wrap(net, [0] if setup == "dpool1" else [0, 0])
        self.model = net
        self.opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        self.overhead: list[float] = []

    def run(self, steps: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        cost = 0.0
        for i in range(steps):
            x, y = self.data[i % len(self.data)]
            self.opt.zero_grad(set_to_none=True)
            s0 = time.perf_counter()
            F.cross_entropy(self.model(x), y).backward()
            self.opt.step()
            if self.setup.startswith("dpool"):  # host time of the step minus the slower worker's (GPU-synced) busy time
                st = self.model.stats()["workers"]
                busy = max(w["forward_ms"] + w["backward_ms"] for w in st) / 1e3
                cost += (time.perf_counter() - s0) - busy
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if self.setup.startswith("dpool"):
            self.overhead.append(cost / steps * 1e3)
        return dt

    def close(self) -> None:
        if self.setup.startswith("dpool"):
            self.model.close()


def breakdown(r: Runner, steps: int, warmup: int) -> None:
    """Print the median time of each phase of a step, each phase ended by a device sync.

    The syncs stop the host from running ahead of the GPU, so the phases add up to more than a
    plain step; what they show is which phase a setup pays more in. For dpool, ``workers`` is the
    slower worker's busy time in forward and in backward (synced in the worker), and each round's wall
    time is split into its requests' and replies' way (``model.stats()``, medians over the workers).
    """
    phases: dict[str, list[float]] = {p: [] for p in ("forward", "loss", "backward", "optimizer", "step")}
    busy: dict[str, list[float]] = {"forward": [], "backward": []}
    split: dict[str, list[list[float]]] = {"forward": [], "backward": []}  # round, request, reply (model.stats())
    for i in range(warmup + steps):
        x, y = r.data[i % len(r.data)]
        r.opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        t = [time.perf_counter()]
        out = r.model(x)
        torch.cuda.synchronize()
        t.append(time.perf_counter())
        loss = F.cross_entropy(out, y)
        torch.cuda.synchronize()
        t.append(time.perf_counter())
        loss.backward()
        torch.cuda.synchronize()
        t.append(time.perf_counter())
        r.opt.step()
        torch.cuda.synchronize()
        t.append(time.perf_counter())
        if i < warmup:
            continue
        for k, name in enumerate(("forward", "loss", "backward", "optimizer")):
            phases[name].append((t[k + 1] - t[k]) * 1e3)
        phases["step"].append((t[-1] - t[0]) * 1e3)
        if r.setup.startswith("dpool"):
            stats = r.model.stats()
            for kind in ("forward", "backward"):  # each round split on the clock all processes share
                busy[kind].append(max(w[f"{kind}_ms"] for w in stats["workers"]))
                split[kind].append([stats["round_ms"][kind],
                                    statistics.median(w[f"{kind}_request_ms"] for w in stats["workers"]),
                                    statistics.median(w[f"{kind}_reply_ms"] for w in stats["workers"])])
    med = {k: statistics.median(v) for k, v in phases.items()}
    line = " | ".join(f"{k} {v:.2f}" for k, v in med.items())
    if busy["forward"]:
        line += (f" | workers: forward {statistics.median(busy['forward']):.2f}, "
                 f"backward {statistics.median(busy['backward']):.2f}")
        for kind in ("forward", "backward"):
            whole, there, back = (statistics.median(col) for col in zip(*split[kind]))
            line += f" | {kind} round {whole:.2f}: request {there:.2f}, reply {back:.2f}"
    print(f"{r.setup:7s} ms (median, synced phases): {line}", flush=True)
    r.close()


STEP_MARK = "dpool-bench-step"  # the profiler range around each traced step


def _start_profiler(_model: Any = None) -> None:
    """Start a CUDA profiler in this process (a worker's, through ``call_workers``; kept on the torch module)."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    prof.__enter__()
    torch._dpool_bench_profiler = prof  # type: ignore[attr-defined]


def _stop_profiler(path: str, _model: Any = None) -> str:
    """Stop the profiler :func:`_start_profiler` started, and write its Chrome trace to ``path`` (``{pid}``
    replaced by this process's)."""
    path = path.format(pid=os.getpid())
    torch.cuda.synchronize()
    prof = torch._dpool_bench_profiler  # type: ignore[attr-defined]
    prof.__exit__(None, None, None)
    prof.export_chrome_trace(path)
    return path


GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def trace_intervals(trace: dict) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """From one Chrome trace: the GPU activities' ``(start, end)`` and the step ranges', in microseconds on
    the clock every process of a machine shares (each trace's ``baseTimeNanoseconds`` added)."""
    base = trace.get("baseTimeNanoseconds", 0) / 1e3
    gpu, steps = [], []
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") != "X" or "dur" not in ev:
            continue
        span = (base + float(ev["ts"]), base + float(ev["ts"]) + float(ev["dur"]))
        if ev.get("cat") in GPU_CATEGORIES:
            gpu.append(span)
        elif ev.get("name") == STEP_MARK:
            steps.append(span)
    return gpu, steps


def idle_fraction(gpu: list[tuple[float, float]], window: tuple[float, float]) -> float:
    """The fraction of ``window`` during which none of the ``gpu`` intervals (of any process) ran."""
    start, end = window
    busy, reach = 0.0, start
    for a, b in sorted(gpu):
        a, b = max(a, reach), min(b, end)
        if b > a:
            busy += b - a
            reach = b
    return 1.0 - busy / (end - start) if end > start else 0.0


def trace(r: "Runner", workload: str, steps: int, warmup: int, out: str) -> dict[str, Any]:
    """Profile ``steps`` steps of ``r`` after ``warmup``: the traces written, the GPU's idle fraction over the
    steps after the first, and the step time."""
    os.makedirs(out, exist_ok=True)
    r.run(warmup)
    runtime = getattr(r.model, "_runtime", None)
    if runtime is not None:
        runtime.call_workers(_start_profiler)
    _start_profiler()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(steps):
        x, y = r.data[i % len(r.data)]
        with torch.profiler.record_function(STEP_MARK):
            r.opt.zero_grad(set_to_none=True)
            F.cross_entropy(r.model(x), y).backward()
            r.opt.step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / steps * 1e3
    paths = [_stop_profiler(os.path.join(out, f"{workload}-{r.setup}-coordinator.json"))]
    if runtime is not None:
        import functools

        paths += runtime.call_workers(functools.partial(_stop_profiler,
                                                        os.path.join(out, f"{workload}-{r.setup}-worker-{{pid}}.json")))
    gpu: list[tuple[float, float]] = []
    steps_seen: list[tuple[float, float]] = []
    for p in paths:
        with open(p) as f:
            g, st = trace_intervals(json.load(f))
        gpu += g
        steps_seen += st
    steps_seen.sort()
    window = (steps_seen[1][0], steps_seen[-1][1]) if len(steps_seen) > 1 else (0.0, 0.0)
    return {"workload": workload, "setup": r.setup, "ms_step": ms, "gpu_idle": idle_fraction(gpu, window),
            "traces": paths}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--workloads", default="resnet,encoder,probe")
    ap.add_argument("--setups", default="single,dataparallel,dpool")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--profile", default=None, metavar="WORKLOAD",
                    help="instead: cProfile the coordinator of dpool on WORKLOAD for --steps steps")
    ap.add_argument("--breakdown", default=None, metavar="WORKLOAD",
                    help="instead: where a step's time goes on WORKLOAD, phase by phase, for each of --setups")
    ap.add_argument("--trace", default=None, metavar="DIR",
                    help="instead: profiler traces of a few steps of each of --setups on each of --workloads, "
                         "written to DIR, with the GPU's idle fraction and the framework cost")
    ap.add_argument("--mps", action="store_true",
                    help="run the rest under NVIDIA's Multi-Process Service, started and stopped here")
    args = ap.parse_args(argv)
    if args.mps:
        return under_mps([a for a in (sys.argv[1:] if argv is None else argv) if a != "--mps"])
    if args.trace:
        torch.set_num_threads(1)
        rows = []
        for wname in args.workloads.split(","):
            single_ms = None
            for s in args.setups.split(","):
                r = Runner(s, wname)
                try:
                    row = trace(r, wname, min(args.steps, 10), args.warmup, args.trace)
                finally:
                    r.close()
                if s == "single":
                    single_ms = row["ms_step"]
                row["framework_ms"] = None if single_ms is None else row["ms_step"] - single_ms
                rows.append(row)
                cost = "" if row["framework_ms"] is None else f", framework {row['framework_ms']:.2f} ms"
                print(f"{wname} {s}: {row['ms_step']:.2f} ms/step, GPU idle {row['gpu_idle']:.1%}{cost} "
                      f"({len(row['traces'])} traces)", flush=True)
        with open(os.path.join(args.trace, "summary.json"), "w") as f:
            json.dump(rows, f, indent=1)
        return 0
    if args.breakdown:
        torch.set_num_threads(1)
        for s in args.setups.split(","):
            breakdown(Runner(s, args.breakdown), args.steps, args.warmup)
        return 0
    if args.profile:
        import cProfile
        import pstats

        r = Runner("dpool", args.profile)
        r.run(args.warmup)
        prof = cProfile.Profile()
        prof.enable()
        dt = r.run(args.steps)
        prof.disable()
        print(f"{args.profile}: {dt / args.steps * 1e3:.2f} ms/step; workers {r.model.stats()['workers']}")
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        r.close()
        return 0
    torch.set_num_threads(1)
    results: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                               "cuda": torch.version.cuda, "steps": args.steps, "repeats": args.repeats,
                               "mps": "CUDA_MPS_PIPE_DIRECTORY" in os.environ, **provenance(), "rows": []}
    print(f"# {results['gpu']}, torch {results['torch']} (CUDA {results['cuda']}); median of {args.repeats} "
          f"repeats of {args.steps} steps\n")
    print("| workload | setup | samples/s (min-max) | ms/step | vs single | dpool framework ms/step |")
    print("|---|---|---|---|---|---|")
    for wname in args.workloads.split(","):
        runners = {s: Runner(s, wname) for s in args.setups.split(",")}
        for r in runners.values():
            r.run(args.warmup)
            r.overhead.clear()
        times: dict[str, list[float]] = {s: [] for s in runners}
        for _ in range(args.repeats):
            for s, r in runners.items():
                times[s].append(r.run(args.steps))
        rows = runners[next(iter(runners))].rows
        med = {s: statistics.median(t) for s, t in times.items()}
        for s, t in times.items():
            rate = [rows * args.steps / x for x in t]
            cost = statistics.median(runners[s].overhead) if runners[s].overhead else None
            row = {"workload": wname, "setup": s, "samples_s": rows * args.steps / med[s],
                   "min": min(rate), "max": max(rate), "ms_step": med[s] / args.steps * 1e3,
                   "vs_single": med.get("single", med[s]) / med[s], "framework_ms": cost}
            results["rows"].append(row)
            print(f"| {wname} | {s} | {row['samples_s']:.0f} ({row['min']:.0f}-{row['max']:.0f}) | "
                  f"{row['ms_step']:.2f} | {row['vs_single']:.2f}x | {'' if cost is None else f'{cost:.2f}'} |",
                  flush=True)
        for r in runners.values():
            r.close()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def under_mps(rest: list[str]) -> int:
    """Start the MPS control daemon, run this benchmark with ``rest`` as its client, stop the daemon."""
    import shutil
    import subprocess
    import tempfile

    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        print("--mps: nvidia-cuda-mps-control is not on the PATH (it comes with NVIDIA's driver)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="dpool-mps-") as d:
        env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=os.path.join(d, "pipe"),
                   CUDA_MPS_LOG_DIRECTORY=os.path.join(d, "log"))
        os.makedirs(env["CUDA_MPS_PIPE_DIRECTORY"])
        os.makedirs(env["CUDA_MPS_LOG_DIRECTORY"])
        subprocess.run([control, "-d"], env=env, check=True)
        try:
            return subprocess.run([sys.executable, os.path.abspath(__file__), *rest], env=env).returncode
        finally:
            subprocess.run([control], input=b"quit\n", env=env, timeout=60)


if __name__ == "__main__":
    sys.exit(main())
