"""Training throughput of dpool against single-process, nn.DataParallel, DDP (gloo) and the ideal.

    python benchmarks/bench.py                     # full run: every workload, every setup
    python benchmarks/bench.py --smoke             # a few steps; runs inside the test suite
    python benchmarks/bench.py --workloads cnn --setups single,dpool
    python benchmarks/bench.py --per-worker        # coordinator CPU per probe step at 1, 2, 4, 8 workers

Method: every setup is built once and warmed up; then repeats are interleaved
(A B C … A B C …) so that machine noise hits every setup alike. Each repeat
times ``--steps`` full training steps (forward, loss, backward, SGD step) on
the same global batch. The table reports the median samples/s and the spread
(min–max) over repeats; ratios are taken between medians of the same run.

Setups, on N = --workers:
  single   one process, torch using every core
  dp       torch.nn.DataParallel; on a CPU-only machine it runs the whole batch in
           one module (DataParallel has no CPU parallelism), so it is `single` plus overhead
  ddp      DistributedDataParallel, gloo backend, N ranks, global batch / N each
  dpool    dpool.wrap with N CPU workers
  dpool-loss  the same with the loss on the workers: dpool.wrap(net, gather=False) and
           dpool.criterion(nn.CrossEntropyLoss()); the forward goes to the workers with the
           loss, and they run the loss's backward in the same round: one round per step
  ideal    one shard (global batch / N) forward+backward alone on cores / N threads:
           N-way parallelism with zero communication
  ceiling  N independent processes, each training one shard at the same time with
           cores / N threads and no communication at all: what this machine gives
           N concurrent shards (memory bandwidth and shared caches included).
           Not one of the issue's five setups; a diagnostic for reading `ideal`
  minimal  the least code with dpool's design (benchmarks/minimal.py): N persistent workers
           on dpool's settings, parameters and slots in shared memory, dpool's codec, the loss
           on the gathered output (two rounds a step, as `dpool`), the slots summed into .grad.
           Not a product (no autograd bridge, hooks, buffers, checks or failures): a diagnostic,
           the floor under dpool's own cost per step
  minimal-loss  the same with the loss on the workers (one round a step): the floor under `dpool-loss`
  nodes    dpool's cross-node mode: N coordinators on loopback gloo (one "node" each),
           one worker per node, global batch / N each: the same process count as `ddp`
           (not in the default set: `--setups nodes,ddp,dpool` compares the three)
  nodes-serial  the same with the buckets exchanged after the backward instead of during it
           (DPOOL_CROSS_NODE_OVERLAP=0): beside `nodes`, the table reports how much of the
           exchange the overlap hid behind the backward (`--setups nodes,nodes-serial,ddp`)
  minimal-nodes  the floor under `nodes` (benchmarks/minimal.py's MinimalNode): N gloo ranks, each a
           `minimal` node with one worker, its gradient averaged across the ranks as dpool does
           (x 1/N, then summed; two ranks swap point to point). A diagnostic, not in the default set
  nodes-loss  `nodes` with the loss on the workers, as `dpool-loss`: one round a step, then the
           exchange (`--setups nodes-loss,minimal-nodes-loss,ddp`)
  minimal-nodes-loss  the floor under `nodes-loss`: `minimal-nodes` with `minimal-loss`'s nodes

Every setup runs with the same heap setting: dpool's workers keep their heap between steps
(glibc's MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ at 1 GiB, see dpool/launch.py), and glibc reads
those variables only at process start, so this script exports them and starts itself again before any setup
runs: the one-process setups, DDP's ranks and dpool's workers all get them. Values already exported win.

Results go to --out as JSON (with the dpool version and commit measured) and a PNG chart; the Markdown table
is printed.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
from typing import Any

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.provenance import provenance  # noqa: E402
from benchmarks.workloads import WORKLOADS, Workload  # noqa: E402
from dpool.cpus import physical_cores  # noqa: E402

# the physical cores this run may use (affinity mask, cgroup quota), as dpool sizes its own defaults
CORES = physical_cores()


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, loss: Any, data: list, steps: int) -> float:
    t0 = time.perf_counter()
    for i in range(steps):
        x, y = data[i % len(data)]
        opt.zero_grad(set_to_none=True)
        loss(model(x), y).backward()
        opt.step()
    return time.perf_counter() - t0


def batches(w: Workload, rows: int, seed: int, count: int = 4) -> list:
    """``count`` batches of ``rows`` rows of workload ``w``, drawn from a generator seeded with ``seed``: the
    data every setup trains on, the same for a given seed."""
    g = torch.Generator().manual_seed(seed)
    return [w.batch(rows, g) for _ in range(count)]


class Local:
    """single / dp / ideal / dpool: run in this process."""

    def __init__(self, setup: str, w: Workload, workers: int, seed: int = 0) -> None:
        self.setup, self.w = setup, w
        torch.manual_seed(seed)
        net = w.make()
        self.data = batches(w, w.global_batch // workers if setup == "ideal" else w.global_batch, seed)
        self.threads = max(1, CORES // workers) if setup == "ideal" else CORES
        self.loss: Any = w.loss
        if setup == "dp":
            net = torch.nn.DataParallel(net)
            # This benchmark is about CPUs. Where torch sees a GPU, DataParallel has moved the
            # module to cuda:0 and would move each batch there; run it as on a CPU-only machine
            # (its own path without device_ids).
            net.module.to("cpu")
            net.device_ids = []
        if setup in ("dpool", "dpool-loss"):
            import dpool

            net = dpool.wrap(net, ["cpu"] * workers, gather=setup == "dpool")
            self.threads = 1  # dpool holds the coordinator to one thread while the pool is open
            if setup == "dpool-loss":  # every workload's loss is F.cross_entropy
                self.loss = dpool.criterion(torch.nn.CrossEntropyLoss())
        self.model = net
        self.opt = torch.optim.SGD(net.parameters(), lr=w.lr, momentum=0.9)
        self.samples = w.global_batch  # ideal: one shard's time stands for the whole batch

    def run(self, steps: int) -> float:
        torch.set_num_threads(self.threads)
        return _steps(self.model, self.opt, self.loss, self.data, steps)

    def close(self) -> None:
        if hasattr(self.model, "close"):
            self.model.close()


def _ddp_rank(rank: int, world: int, port: int, wname: str, conn: Any, mode: str = "ddp") -> None:
    """One rank of ``ddp``, one independent trainer of ``ceiling``, one dpool node of ``nodes`` (``nodes-serial``:
    without overlap; ``nodes-loss``: the loss on the workers), or one node of their floors, ``minimal-nodes``
    (``minimal-nodes-loss``)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(max(1, CORES // world))  # torchrun's default too: OMP_NUM_THREADS=1 per rank
    ddp = mode != "ceiling"  # a process group (and its barriers around each timing)
    if ddp:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    w = WORKLOADS[wname]
    torch.manual_seed(0)
    nodes = mode.startswith("nodes")
    floor = mode.startswith("minimal-nodes")
    loss: Any = w.loss
    data = batches(w, w.global_batch // world, rank + 1)
    if nodes or floor:
        # what torchrun --standalone --nproc-per-node=N gives each rank: dpool sizes and binds its workers by them
        os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"] = str(rank), str(world)
    if nodes:
        import dpool

        os.environ["DPOOL_CROSS_NODE_OVERLAP"] = "0" if mode == "nodes-serial" else "1"
        model = dpool.wrap(w.make(), ["cpu"], worker_threads=max(1, CORES // world), gather=mode != "nodes-loss")
        if mode == "nodes-loss":  # every workload's loss is F.cross_entropy
            loss = dpool.criterion(torch.nn.CrossEntropyLoss())
    elif floor:
        from benchmarks.minimal import Minimal, MinimalNode, train

        net = w.make()
        x = data[0][0]
        model = MinimalNode(Minimal(w.name, net, 1, x.size(0), tuple(x.shape[1:]), x.dtype,
                                    mode == "minimal-nodes-loss"))
    else:
        model = DDP(w.make()) if ddp else w.make()
    opt = torch.optim.SGD(net.parameters() if floor else model.parameters(), lr=w.lr, momentum=0.9)
    while True:
        steps = conn.recv()
        if steps is None:
            break
        if ddp:
            dist.barrier()
        waited = model._nodes.waited_s if nodes else 0.0
        reducer = model._runtime.reducer if nodes else None
        early = reducer.early if reducer is not None else 0
        elapsed = train(model, opt, data, steps) if floor else _steps(model, opt, loss, data, steps)
        if ddp:
            dist.barrier()
        conn.send((elapsed, (model._nodes.waited_s - waited) if nodes else 0.0,
                   (reducer.early - early, len(reducer.plan)) if reducer is not None else (0, 0)))
    if nodes or floor:
        model.close()
    if ddp:
        dist.destroy_process_group()


class DDPRunner:
    """``ddp``: N gloo ranks. ``ceiling``: the same N processes, with no process group and no all-reduce.
    ``nodes``: N dpool coordinators in cross-node mode, one worker each (``nodes-serial``: without overlap;
    ``nodes-loss``: the loss on the workers). ``minimal-nodes``: N gloo ranks, each a one-worker
    :class:`benchmarks.minimal.MinimalNode` (``minimal-nodes-loss``: the loss on its worker)."""

    def __init__(self, w: Workload, workers: int, mode: str = "ddp") -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for r in range(workers):
            a, b = ctx.Pipe()
            p = ctx.Process(target=_ddp_rank, args=(r, workers, port, w.name, b, mode), daemon=False)
            p.start()
            self.conns.append(a)
            self.procs.append(p)
        self.samples = w.global_batch
        self.waited: list[float] = []  # nodes: seconds per repeat rank 0 spent waiting in cross-node collectives
        self.buckets = (0, 0)  # nodes: buckets rank 0 launched during the backward in the last repeat, buckets per step

    def run(self, steps: int) -> float:
        for c in self.conns:
            c.send(steps)
        replies = [c.recv() for c in self.conns]
        self.waited.append(replies[0][1])
        self.buckets = replies[0][2]
        return max(r[0] for r in replies)

    def close(self) -> None:
        for c in self.conns:
            c.send(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()


class MinimalRunner:
    """minimal, minimal-loss: the least code with dpool's design (benchmarks/minimal.py), a floor under the cost
    of dpool and of dpool-loss."""

    def __init__(self, w: Workload, workers: int, loss_on_workers: bool, seed: int = 0) -> None:
        from benchmarks.minimal import Minimal

        if w.global_batch % workers:
            raise ValueError(f"minimal: {w.name}'s batch of {w.global_batch} does not split evenly over "
                             f"{workers} workers")
        torch.manual_seed(seed)
        net = w.make()
        self.data = batches(w, w.global_batch, seed)
        x = self.data[0][0]
        self.model = Minimal(w.name, net, workers, w.global_batch // workers, tuple(x.shape[1:]), x.dtype,
                             loss_on_workers)
        self.opt = torch.optim.SGD(net.parameters(), lr=w.lr, momentum=0.9)

    def run(self, steps: int) -> float:
        from benchmarks.minimal import train

        torch.set_num_threads(1)  # as dpool holds its coordinator to one thread
        return train(self.model, self.opt, self.data, steps)

    def close(self) -> None:
        self.model.close()


def make_runner(setup: str, w: Workload, workers: int) -> Any:
    if setup in ("minimal", "minimal-loss"):
        return MinimalRunner(w, workers, setup == "minimal-loss")
    if setup in ("ddp", "ceiling", "nodes", "nodes-serial", "nodes-loss", "minimal-nodes", "minimal-nodes-loss"):
        return DDPRunner(w, workers, mode=setup)
    return Local(setup, w, workers)


def bench(workloads: list[str], setups: list[str], workers: int, steps: int, warmup: int, repeats: int) -> dict:
    results: dict[str, Any] = {
        "machine": {
            "cores_physical": CORES, "cpus_logical": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "cpu": platform.processor() or platform.machine(),
            "heap": {k: os.environ.get(k) for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")},
        },
        **provenance(),
        "workers": workers, "steps": steps, "repeats": repeats, "workloads": {},
    }
    for wname in workloads:
        w = WORKLOADS[wname]
        runners = {}
        try:
            for s in setups:
                runners[s] = make_runner(s, w, workers)
                runners[s].run(warmup)
            times: dict[str, list[float]] = {s: [] for s in setups}
            for _ in range(repeats):
                for s in setups:  # interleaved: A B C A B C ...
                    times[s].append(runners[s].run(steps))
            waited = runners["nodes"].waited[-repeats:] if "nodes" in runners else None
            serial = runners["nodes-serial"].waited[-repeats:] if "nodes-serial" in runners else None
            buckets = runners["nodes"].buckets if "nodes" in runners else (0, 0)
        finally:
            for r in runners.values():
                r.close()
        entry: dict[str, Any] = {"global_batch": w.global_batch, "setups": {}}
        for s in setups:
            sps = [w.global_batch * steps / t for t in times[s]]
            ms = [1000 * t / steps for t in times[s]]
            entry["setups"][s] = {
                "samples_per_s": statistics.median(sps), "samples_per_s_min": min(sps), "samples_per_s_max": max(sps),
                "ms_per_step": statistics.median(ms), "ms_per_step_min": min(ms), "ms_per_step_max": max(ms),
            }
        med = {s: entry["setups"][s]["samples_per_s"] for s in setups}
        if "dpool" in med:
            entry["ratios"] = {f"dpool/{s}": med["dpool"] / med[s] for s in setups if s != "dpool"}
            if "ideal" in med:
                entry["framework_ms_per_step"] = (
                    entry["setups"]["dpool"]["ms_per_step"] - entry["setups"]["ideal"]["ms_per_step"]
                )
        if "dpool-loss" in med:  # the loss on the workers
            for s in ("ddp", "single", "minimal-loss"):
                if s in med:
                    entry.setdefault("ratios", {})[f"dpool-loss/{s}"] = med["dpool-loss"] / med[s]
            if "ideal" in med:
                entry["framework_loss_ms_per_step"] = (
                    entry["setups"]["dpool-loss"]["ms_per_step"] - entry["setups"]["ideal"]["ms_per_step"]
                )
        if waited is not None:  # the cross-node time the step could not hide (rank 0)
            entry["nodes_exposed_collective_ms_per_step"] = 1000 * statistics.median(waited) / steps
            entry["nodes_buckets_per_step"] = buckets[1]
            entry["nodes_buckets_during_backward_per_step"] = buckets[0] / steps
            if "ddp" in med:
                entry["ratios"] = {**entry.get("ratios", {}), "nodes/ddp": med["nodes"] / med["ddp"]}
            if serial is not None:  # the overlap: what exchanging during the backward hid (same run, interleaved)
                exposed = 1000 * statistics.median(serial) / steps
                entry["nodes_serial_exposed_collective_ms_per_step"] = exposed
                entry["nodes_hidden_collective_ms_per_step"] = exposed - entry["nodes_exposed_collective_ms_per_step"]
        # the cross-node mode with the loss on the workers against DDP; the floors against DDP; each mode against
        # its floor
        for a, b in (("nodes-loss", "ddp"), ("minimal-nodes", "ddp"), ("nodes", "minimal-nodes"),
                     ("minimal-nodes-loss", "ddp"), ("nodes-loss", "minimal-nodes-loss")):
            if a in med and b in med:
                entry.setdefault("ratios", {})[f"{a}/{b}"] = med[a] / med[b]
        results["workloads"][wname] = entry
    return results


def table(results: dict) -> str:
    setups = next(iter(results["workloads"].values()))["setups"].keys()
    lines = ["| workload | batch | " + " | ".join(f"{s} samples/s (ms/step)" for s in setups) + " | dpool ratios |",
             "|---" * (len(setups) + 3) + "|"]
    for wname, e in results["workloads"].items():
        cells = []
        for s in setups:
            d = e["setups"][s]
            cells.append(f"{d['samples_per_s']:.0f} ({d['ms_per_step']:.2f}; {d['ms_per_step_min']:.2f}–{d['ms_per_step_max']:.2f})")
        ratios = ", ".join(f"{k.split('/')[1]} {v:.2f}×" for k, v in e.get("ratios", {}).items()
                           if k.startswith("dpool/"))
        if "nodes/ddp" in e.get("ratios", {}):  # cross-node mode against DDP at the same process count
            ratios += (f"; nodes/ddp {e['ratios']['nodes/ddp']:.2f}×, nodes' exposed cross-node time "
                       f"{e['nodes_exposed_collective_ms_per_step']:.2f} ms/step")
            if "nodes_hidden_collective_ms_per_step" in e:
                ratios += (f" ({e['nodes_serial_exposed_collective_ms_per_step']:.2f} without overlap: "
                           f"{e['nodes_hidden_collective_ms_per_step']:.2f} ms/step hidden behind the backward)")
            ratios += (f"; buckets per step {e['nodes_buckets_per_step']}, "
                       f"{e['nodes_buckets_during_backward_per_step']:.1f} of them exchanged during the backward")
        for k in ("nodes-loss/ddp", "minimal-nodes/ddp", "nodes/minimal-nodes", "minimal-nodes-loss/ddp",
                  "nodes-loss/minimal-nodes-loss"):
            if k in e.get("ratios", {}):
                ratios += f"; {k} {e['ratios'][k]:.2f}×"
        if "framework_ms_per_step" in e:
            fw = e["framework_ms_per_step"]
            # dpool − ideal below zero is noise or a workload where dpool beats one shard alone (its
            # workers keep their heap): no framework cost to read, so it is not printed as negative
            ratios += f"; framework {fw:.2f} ms/step" if fw >= 0 else "; framework < 0 (dpool faster than ideal)"
        loss_ratios = ", ".join(f"{k.split('/')[1]} {v:.2f}×" for k, v in e.get("ratios", {}).items()
                                if k.startswith("dpool-loss/"))
        if loss_ratios:
            ratios += f"; dpool-loss: {loss_ratios}"
            fw = e.get("framework_loss_ms_per_step")
            if fw is not None:
                ratios += f", framework {fw:.2f} ms/step" if fw >= 0 else ", framework < 0"
        lines.append(f"| {wname} | {e['global_batch']} | " + " | ".join(cells) + f" | {ratios} |")
    m = results["machine"]
    lines.append("")
    lines.append(f"Machine: {m['cores_physical']} physical cores, {m['platform']}, Python {m['python']}, torch "
                 f"{m['torch']}; {results['workers']} workers/ranks; {results['repeats']} interleaved repeats of "
                 f"{results['steps']} steps; median (min–max). `dp` on a CPU-only machine runs the whole batch in "
                 "one module: DataParallel has no CPU parallelism. `ceiling`, `minimal` and `minimal-loss` are "
                 "diagnostics (see benchmarks/bench.py); framework = dpool − ideal ms/step.")
    return "\n".join(lines)


def chart(results: dict, path: str) -> bool:
    """Speed relative to one process (``single`` = 1), every workload on one scale, one group of bars per
    workload; the whiskers are the repeats' spread. Returns False (no chart) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wl = [w for w in results["workloads"] if "single" in results["workloads"][w]["setups"]]
    if not wl:
        return False
    setups = [s for s in next(iter(results["workloads"].values()))["setups"] if s != "single"]
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(wl), 3.8))
    width = 0.8 / max(1, len(setups))
    colors = {"dp": "#8a8", "ddp": "#47b", "dpool": "#d62", "dpool-loss": "#f95", "ideal": "#bbb", "ceiling": "#777",
              "minimal": "#c9c", "minimal-loss": "#dbd"}
    for k, setup in enumerate(setups):
        xs, ys, lo, hi = [], [], [], []
        for i, w in enumerate(wl):
            e = results["workloads"][w]["setups"]
            if setup not in e:
                continue
            base = e["single"]["samples_per_s"]
            v = e[setup]["samples_per_s"] / base
            xs.append(i + (k - (len(setups) - 1) / 2) * width)
            ys.append(v)
            lo.append(v - e[setup]["samples_per_s_min"] / base)
            hi.append(e[setup]["samples_per_s_max"] / base - v)
        ax.bar(xs, ys, width, yerr=[lo, hi], label=setup, color=colors.get(setup, f"C{k + 2}"),
               error_kw={"elinewidth": 0.6})
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(wl)), wl)
    ax.set_ylabel("speed relative to one process")
    ax.set_title(f"training throughput, {results['workers']} workers on {results['machine']['cores_physical']} "
                 "CPU cores (1 = one process)", fontsize=9)
    ax.legend(fontsize=7, ncol=len(setups), loc="upper center", bbox_to_anchor=(0.5, -0.09), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


class _SlowOnOneWorker(torch.nn.Module):
    """The MLP workload, plus 50 µs per row on the worker whose pid is ``slow_pid`` (a slower machine)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.slow_pid = -1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if os.getpid() == self.slow_pid:
            time.sleep(50e-6 * x.shape[0])
        return self.inner(x)


def balance_demo(steps: int, repeats: int) -> str:
    """samples/s with one deliberately slowed worker: even shards against balance="auto"."""
    import dpool

    w = WORKLOADS["mlp"]
    data = batches(w, w.global_batch, 0)
    rows = []
    for mode in ("even", "auto"):
        torch.manual_seed(0)
        model = dpool.wrap(_SlowOnOneWorker(w.make()), ["cpu", "cpu"], balance="auto" if mode == "auto" else None)
        slow = model.pids[1]
        model.worker_states(lambda m, p=slow: setattr(m, "slow_pid", p))
        opt = torch.optim.SGD(model.parameters(), lr=w.lr)
        _steps(model, opt, w.loss, data, 5)
        times = [_steps(model, opt, w.loss, data, steps) for _ in range(repeats)]
        shares = model._runtime.forwards.balancer.weights()
        model.close()
        sps = w.global_batch * steps / statistics.median(times)
        share = "even" if shares is None else "/".join(f"{x / sum(shares):.2f}" for x in shares)
        rows.append(f"| {mode} | {sps:.0f} | {share} |")
    return "\n".join(["| shards (worker 1 slowed by 50 µs/row) | samples/s | shares (worker 0/1) |", "|---|---|---|", *rows])


def attach_demo(repeats: int) -> str:
    """Time from dpool.wrap() to the end of the first training step: a warm daemon against spawning."""
    import subprocess
    import uuid

    import dpool

    w = WORKLOADS["cnn"]
    g = torch.Generator().manual_seed(0)
    x, y = w.batch(64, g)
    name = "bench" + uuid.uuid4().hex[:6]
    cli = [sys.executable, "-m", "dpool_workers.cli"]
    subprocess.run(cli + ["start", "--name", name, "--device-ids", "cpu,cpu"], check=True, capture_output=True)
    times: dict[str, list[float]] = {"embedded (spawn)": [], "attached (warm daemon)": []}
    try:
        for _ in range(repeats):
            for label, kw in (("embedded (spawn)", {"device_ids": ["cpu", "cpu"]}), ("attached (warm daemon)", {"pool": name})):
                torch.manual_seed(0)
                net = w.make()
                t0 = time.perf_counter()
                model = dpool.wrap(net, **kw)
                opt = torch.optim.SGD(model.parameters(), lr=w.lr)
                w.loss(model(x), y).backward()
                opt.step()
                times[label].append(time.perf_counter() - t0)
                model.close()
    finally:
        subprocess.run(cli + ["stop", "--name", name], capture_output=True)
    emb, att = (statistics.median(v) for v in times.values())
    rows = [f"| {k} | {statistics.median(v) * 1000:.0f} ms ({min(v) * 1000:.0f}–{max(v) * 1000:.0f}) |" for k, v in times.items()]
    return "\n".join(["| wrap() → end of first step (cnn, batch 64, 2 workers) | median (min–max) |", "|---|---|",
                      *rows, f"| **attached speed-up** | **{emb / att:.1f}×** |"])


_FRAME = 150  # bytes of a bare round's message: a forward request's size


def _zmq_echo(endpoint: str) -> None:
    """A bare ZeroMQ peer for per_worker(): answers every frame with itself, until b"bye"."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send(b"hi")
    while (frame := sock.recv()) != b"bye":
        sock.send(frame)
    sock.close(0)
    ctx.term()


def _unix_echo(sock: Any) -> None:
    """A bare AF_UNIX peer for per_worker(): answers every datagram with itself, until b"bye"."""
    while (frame := sock.recv(4096)) != b"bye":
        sock.send(frame)
    sock.close()


class _Bare:
    """Two bare round trips per "step" to ``peers`` Python processes that answer at once: what a transport
    alone costs the coordinator. Subclasses start the peers and run one round."""

    procs: list

    def _round(self) -> None:
        raise NotImplementedError

    def cpu_per_step(self, steps: int) -> float:
        """The coordinator's CPU seconds (all its threads) per two round trips."""
        for _ in range(min(50, steps)):
            self._round()
        c0 = time.process_time()
        for _ in range(steps):
            self._round()
            self._round()
        return (time.process_time() - c0) / steps

    def _join(self) -> None:
        for p in self.procs:
            p.join(10)


class _BareZmq(_Bare):
    """One ROUTER and ``peers`` DEALERs on ``ipc://``, as dpool's control channel."""

    def __init__(self, peers: int) -> None:
        import tempfile

        import zmq

        self.frame, self.more = b"x" * _FRAME, int(zmq.SNDMORE)
        self.tmp = tempfile.mkdtemp(prefix="dpool-bench-")
        endpoint = f"ipc://{self.tmp}/s"
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind(endpoint)
        self.procs = [mp.get_context("spawn").Process(target=_zmq_echo, args=(endpoint,)) for _ in range(peers)]
        for p in self.procs:
            p.start()
        self.idents = [self.router.recv_multipart()[0] for _ in range(peers)]

    def _round(self) -> None:
        for ident in self.idents:
            self.router.send(ident, self.more)
            self.router.send(self.frame)
        for _ in self.idents:
            self.router.recv_multipart()

    def close(self) -> None:
        for ident in self.idents:
            self.router.send_multipart([ident, b"bye"])
        self._join()
        self.router.close(0)
        self.ctx.term()
        shutil.rmtree(self.tmp, ignore_errors=True)


class _BareUnix(_Bare):
    """One ``AF_UNIX`` ``SOCK_SEQPACKET`` pair per peer, read through ``epoll``: no I/O thread."""

    def __init__(self, peers: int) -> None:
        import select
        import socket

        self.frame = b"x" * _FRAME
        pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(peers)]
        self.procs = [mp.get_context("spawn").Process(target=_unix_echo, args=(theirs,)) for _, theirs in pairs]
        for p in self.procs:
            p.start()
        for _, theirs in pairs:
            theirs.close()
        self.socks = [mine for mine, _ in pairs]
        self.by_fd = {s.fileno(): s for s in self.socks}
        self.epoll = select.epoll()
        for s in self.socks:
            self.epoll.register(s.fileno(), select.EPOLLIN)

    def _round(self) -> None:
        for s in self.socks:
            s.send(self.frame)
        left = len(self.socks)
        while left:
            for fd, _ in self.epoll.poll():
                self.by_fd[fd].recv(4096)
                left -= 1

    def close(self) -> None:
        for s in self.socks:
            s.send(b"bye")
        self._join()
        self.epoll.close()
        for s in self.socks:
            s.close()


def _spread(values: list[float]) -> str:
    """Median (min–max) of per-repeat values in ms."""
    return f"{statistics.median(values) * 1e3:.3f} ({min(values) * 1e3:.3f}–{max(values) * 1e3:.3f})"


def per_worker(counts: list[int], steps: int, repeats: int) -> str:
    """The coordinator's CPU time per probe step at each worker count, beside bare transports' share of it.

    CPU time (every thread of the coordinator's process), not wall time: 8 workers oversubscribe 2
    cores, and the question is what each added worker costs the coordinator. Every pool is built once
    and the repeats are interleaved (each repeat measures every count in turn), so that the machine's
    drift hits every count alike; the cost per added worker is taken within each repeat, and its median
    and spread over the repeats are printed. The CPU time is measured twice on the same pool: with
    dpool's defaults, and with the spin through short rounds off (``DPOOL_WAIT_SPIN_US=0``), since the
    time the coordinator spins (dpool.pool) counts as CPU time without being work per worker. Each count
    is measured on two pools: the loss computed on the gathered output (two rounds a step: forward, then
    backward), and the loss on the workers (``gather=False`` with ``dpool.criterion``: one round a step).
    Beside each mode, its floor: ``minimal`` (two rounds) and ``minimal-loss`` (one round) of
    benchmarks/minimal.py at the same worker count, the least code with dpool's design. The floor sleeps in
    its poll (it does not spin), so its slope compares with the ``DPOOL_WAIT_SPIN_US=0`` column. The bare
    columns are two round trips to as many Python peers that answer at once: over ZeroMQ as dpool's control
    channel uses it, and over plain ``AF_UNIX`` sockets, which have no I/O thread.
    """
    import dpool

    w = WORKLOADS["probe"]
    data = batches(w, w.global_batch, 0)
    modes = ("gathered", "loss")
    pools: dict[tuple[int, str], tuple[Any, torch.optim.Optimizer, Any]] = {}
    cpu: dict[tuple[int, str, bool], list[float]] = {(n, m, s): [] for n in counts for m in modes
                                                     for s in (True, False)}
    wall: dict[tuple[int, str], list[float]] = {(n, m): [] for n in counts for m in modes}
    bare: dict[tuple[int, str], list[float]] = {(n, k): [] for n in counts for k in ("zmq", "unix")}
    floors: dict[int, MinimalRunner] = {}  # one per count: its workers serve both kinds of step
    floor_cpu: dict[tuple[int, str], list[float]] = {(n, m): [] for n in counts for m in modes}
    try:
        for n in counts:
            for mode in modes:
                torch.manual_seed(0)
                model = dpool.wrap(w.make(), ["cpu"] * n, worker_threads=1, gather=mode == "gathered")
                loss = w.loss if mode == "gathered" else dpool.criterion(torch.nn.CrossEntropyLoss())
                pools[n, mode] = (model, torch.optim.SGD(model.parameters(), lr=w.lr, momentum=0.9), loss)
                _steps(pools[n, mode][0], pools[n, mode][1], loss, data, 20)
            floors[n] = MinimalRunner(w, n, loss_on_workers=False)
            for mode in modes:
                floors[n].model.loss_on_workers = mode == "loss"
                floors[n].run(20)
        for _ in range(repeats):
            for n in counts:
                for mode in modes:
                    model, opt, loss = pools[n, mode]
                    pool = model._runtime.pool  # the spin is the pool's (DPOOL_WAIT_SPIN_US sets it at wrap())
                    spin = pool.spin_s
                    for spinning in (True, False):
                        pool.spin_s = spin if spinning else 0.0
                        c0 = time.process_time()
                        took = _steps(model, opt, loss, data, steps)
                        cpu[n, mode, spinning].append((time.process_time() - c0) / steps)
                        if spinning:
                            wall[n, mode].append(took / steps)
                    pool.spin_s = spin
                    floors[n].model.loss_on_workers = mode == "loss"  # minimal-loss, else minimal
                    c0 = time.process_time()
                    floors[n].run(steps)
                    floor_cpu[n, mode].append((time.process_time() - c0) / steps)
                for kind, make in (("zmq", _BareZmq), ("unix", _BareUnix)):
                    b = make(n)
                    try:
                        bare[n, kind].append(b.cpu_per_step(steps))
                    finally:
                        b.close()
    finally:
        for model, _, _ in pools.values():
            model.close()
        for floor in floors.values():
            floor.close()
    med = statistics.median
    lines = ["| workers | coordinator CPU ms/step | wall ms/step | CPU ms/step, DPOOL_WAIT_SPIN_US=0 "
             "| floor (`minimal`): CPU ms/step "
             "| loss on the workers: CPU ms/step | wall ms/step | CPU ms/step, DPOOL_WAIT_SPIN_US=0 "
             "| floor (`minimal-loss`): CPU ms/step "
             "| bare ZeroMQ, 2 rounds: CPU ms | bare AF_UNIX, 2 rounds: CPU ms |", "|---" * 11 + "|"]
    lines += ["| " + " | ".join([str(n)] + [f"{med(v) * 1e3:.3f}" for m in modes
                                             for v in (cpu[n, m, True], wall[n, m], cpu[n, m, False], floor_cpu[n, m])]
                               + [f"{med(bare[n, k]) * 1e3:.3f}" for k in ("zmq", "unix")]) + " |"
              for n in counts]
    n0, n1 = counts[0], counts[-1]
    if n1 > n0:
        def slopes(series: dict, key0: Any, key1: Any) -> str:
            return _spread([(b - a) / (n1 - n0) for a, b in zip(series[key0], series[key1])])

        lines.append(f"| per added worker ({n0}→{n1}), median (min–max) of {repeats} repeats | "
                     + " | ".join(f"{slopes(cpu, (n0, m, True), (n1, m, True))} | "
                                  f"| {slopes(cpu, (n0, m, False), (n1, m, False))} "
                                  f"| {slopes(floor_cpu, (n0, m), (n1, m))}" for m in modes)
                     + f" | {slopes(bare, (n0, 'zmq'), (n1, 'zmq'))} | {slopes(bare, (n0, 'unix'), (n1, 'unix'))} |")
    return "\n".join(lines)


def same_heap_for_every_setup() -> None:
    """Start this script again with dpool's worker heap setting exported, unless it already is (see the
    module docstring): without it, the one-process and DDP setups would run on glibc's defaults while dpool's
    workers keep their heap, and the comparison would measure the setting rather than the runtime."""
    from dpool.launch import WORKER_MALLOC_KEEP

    if "MALLOC_MMAP_THRESHOLD_" in os.environ and "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(WORKER_MALLOC_KEEP))
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(WORKER_MALLOC_KEEP))
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="mlp,cnn,lstm,probe,resnet18")
    ap.add_argument("--setups", default="single,dp,ddp,dpool,dpool-loss,ideal,ceiling,minimal,minimal-loss")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None, help="steps per repeat (default: per workload)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="2 steps, 1 repeat: checks that the benchmark runs")
    ap.add_argument("--attach-demo", action="store_true",
                    help="only the start-up measurement: wrap() to first step, warm daemon against spawning")
    ap.add_argument("--balance-demo", action="store_true",
                    help="only the balanced-shards demo: one slowed worker, even shards against balance='auto'")
    ap.add_argument("--per-worker", action="store_true",
                    help="only the cost per added worker: coordinator CPU per probe step at 1, 2, 4, 8 workers")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    a = ap.parse_args(argv)
    if argv is None:
        same_heap_for_every_setup()
    workloads = a.workloads.split(",")
    setups = a.setups.split(",")
    if a.smoke:
        a.steps, a.warmup, a.repeats = 2, 1, 1
    if a.attach_demo:
        torch.set_num_threads(1)
        print(attach_demo(1 if a.smoke else a.repeats))
        return 0
    if a.per_worker:
        torch.set_num_threads(1)
        print(per_worker([1, 2] if a.smoke else [1, 2, 4, 8], a.steps or (5 if a.smoke else 300),
                         1 if a.smoke else a.repeats))
        return 0
    if a.balance_demo:
        torch.set_num_threads(1)
        print(balance_demo(a.steps or (3 if a.smoke else 30), a.repeats))
        return 0
    all_results: dict[str, Any] = {}
    for wname in workloads:
        steps = a.steps or {"mlp": 30, "cnn": 4, "lstm": 10, "probe": 300, "resnet18": 3}[wname]
        r = bench([wname], setups, a.workers, steps, a.warmup, a.repeats)
        if not all_results:
            all_results = r
        else:
            all_results["workloads"].update(r["workloads"])
        all_results["steps"] = "per workload"
    os.makedirs(a.out, exist_ok=True)
    stem = "smoke" if a.smoke else "latest"
    with open(os.path.join(a.out, f"{stem}.json"), "w") as f:
        json.dump(all_results, f, indent=2)
    if not chart(all_results, os.path.join(a.out, f"{stem}.png")):
        print("(no chart: matplotlib is not installed; `pip install matplotlib` draws one)")
    print(table(all_results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
