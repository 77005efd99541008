"""The speed tables of README.md and docs/performance.md, generated from the results files they name.

    python benchmarks/tables.py            # rewrite every generated table from benchmarks/results/
    python benchmarks/tables.py --check    # exit 1 if a page differs from what its files give (a test runs this)

A generated table sits in its page between ``<!-- generated: NAME -->`` and ``<!-- end generated -->``; only
that part of the page is rewritten. Each table says which files, dpool version and commit its numbers come from.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
CPU = "latest.json"            # benchmarks/bench.py: every CPU setup, the same heap setting for each
NODES = "nodes-cpu.json"       # benchmarks/bench.py --setups nodes,nodes-loss,minimal-nodes,ddp
GPU = "gpu-h100.json"          # benchmarks/gpu.py on one H100
GPU_MPS = "gpu-h100-mps.json"  # benchmarks/gpu.py --mps on the same H100


def load(name: str) -> dict[str, Any]:
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


def source(name: str, data: dict[str, Any]) -> str:
    """``benchmarks/results/NAME`` (dpool VERSION, commit HASH): where a table's numbers come from."""
    return f"`benchmarks/results/{name}` (dpool {data.get('dpool', '?')}, commit {data.get('commit', '?')})"


def _x(v: float) -> str:
    return f"{v:.2f}×"


def _sps(data: dict[str, Any], workload: str, setup: str) -> float:
    return data["workloads"][workload]["setups"][setup]["samples_per_s"]


def _heap(machine: dict[str, Any]) -> str:
    """The heap setting every setup of a CPU run had."""
    return ", ".join(f"`{k}={v}`" for k, v in machine.get("heap", {}).items() if v) or "glibc's defaults"


def _gpu(data: dict[str, Any], workload: str, setup: str) -> dict[str, Any]:
    return next(r for r in data["rows"] if r["workload"] == workload and r["setup"] == setup)


# README's rows: what a user's situation is, and the workload of the CPU run that stands for it
SITUATIONS = [
    ("CPU, a step of a few ms (small MLP)", "mlp"),
    ("CPU, a model that leaves cores idle (LSTM, small ops, Python-heavy forward)", "lstm"),
    ("CPU, a conv net with BatchNorm (a step of hundreds of ms)", "cnn"),
    ("CPU, a model that already uses every core (ResNet-18)", "resnet18"),
]


def when_to_use() -> str:
    """README's "When to use it": each setup's speed relative to one process, the fastest in bold (all of them when
    several are equal to two decimals)."""
    cpu, gpu, mps = load(CPU), load(GPU), load(GPU_MPS)
    lines = ["| your situation | one process | `nn.DataParallel` | DDP | dpool |", "|---|---|---|---|---|"]
    for text, w in SITUATIONS:
        single = _sps(cpu, w, "single")
        speed = {s: _sps(cpu, w, s) / single for s in ("single", "dp", "ddp", "dpool")}
        best = _x(max(speed.values()))  # (setups equal to two decimals are equally the fastest)
        cell = {s: f"**{_x(v)}**" if _x(v) == best else _x(v) for s, v in speed.items()}
        lines.append(f"| {text} | {cell['single']} | {cell['dp']} | {cell['ddp']} | {cell['dpool']} |")
    vs = {s: _gpu(gpu, "resnet", s)["vs_single"] for s in ("dp", "dpool")}
    with_mps = _gpu(mps, "resnet", "dpool")["vs_single"]
    lines.append(f"| one GPU (ResNet-18) | **1.00×** | {_x(vs['dp'])} | — | {_x(vs['dpool'])} with 2 workers; "
                 f"{_x(with_mps)} with MPS |")
    lines += [
        "| several GPUs on one machine | — | the API dpool keeps | the usual choice | not measured yet |",
        "| several machines | — | — | the usual choice | cross-node mode; not measured across machines yet |",
        "| a notebook, or a script run with `python` | yes | yes | needs `torchrun` | yes: no launcher, "
        "no `__main__` guard |",
        "| HF Trainer, Lightning | yes | HF: the Trainer's own DataParallel path; Lightning 2: none | yes | "
        "`python -m dpool train.py`; `DpoolTrainer`, `DpoolStrategy` |",
        "",
        f"Speed relative to one process; `nn.DataParallel` on a CPU runs one module, with no parallelism. CPU rows: "
        f"{source(CPU, cpu)}, {cpu['workers']} workers or ranks on "
        f"{cpu['machine']['cores_physical']} physical cores, {cpu['repeats']} interleaved repeats, every setup with "
        f"the same heap setting ([performance](docs/performance.md)). GPU row: {source(GPU, gpu)} and "
        f"{source(GPU_MPS, mps)}, {gpu['gpu']}, measured before the current step design and not run since.",
    ]
    return "\n".join(lines)


def cpu_table() -> str:
    """docs/performance.md's CPU table: samples/s (median ms per step; min–max) of every setup of the run."""
    cpu = load(CPU)
    setups = [s for s in ("single", "dp", "ddp", "dpool", "dpool-loss", "ideal", "ceiling", "minimal",
                          "minimal-loss") if s in next(iter(cpu["workloads"].values()))["setups"]]
    lines = ["| workload (global batch) | " + " | ".join(setups) + " | dpool vs single / DDP / ideal |",
             "|---" * (len(setups) + 2) + "|"]
    for w, e in cpu["workloads"].items():
        cells = []
        for s in setups:
            d = e["setups"][s]
            cells.append(f"{d['samples_per_s']:.0f} ({d['ms_per_step']:.2f} ms; {d['ms_per_step_min']:.2f}–"
                         f"{d['ms_per_step_max']:.2f})")
        r = {s: e["setups"]["dpool"]["samples_per_s"] / e["setups"][s]["samples_per_s"] for s in ("single", "ddp",
                                                                                                  "ideal")}
        lines.append(f"| {w} ({e['global_batch']}) | " + " | ".join(cells) + " | "
                     + " / ".join(_x(r[s]) for s in ("single", "ddp", "ideal")) + " |")
    m = cpu["machine"]
    heap = _heap(m)
    lines += ["", f"From {source(CPU, cpu)}: {m['cores_physical']} physical cores, Python {m['python']}, torch "
              f"{m['torch']}, {cpu['workers']} workers or ranks, {cpu['repeats']} interleaved repeats; every setup "
              f"ran with {heap}."]
    return "\n".join(lines)


def gpu_table() -> str:
    """docs/performance.md's one-GPU table: samples/s and speed relative to one process, with and without MPS."""
    gpu, mps = load(GPU), load(GPU_MPS)
    names = {"resnet": "ResNet-18, 3×64×64, batch 256", "encoder": "Transformer encoder, 4 layers, d 256, "
             "64×128 tokens", "probe": "overhead probe (Linear 16→16, batch 8)"}
    lines = ["| workload | one process | nn.DataParallel([0]) | dpool [0] | dpool [0, 0] | dpool [0, 0] with MPS |",
             "|---|---|---|---|---|---|"]
    for w, name in names.items():
        cells = [f"{_gpu(gpu, w, 'single')['samples_s']:.0f}"]
        for data, s in ((gpu, "dp"), (gpu, "dpool1"), (gpu, "dpool"), (mps, "dpool")):
            r = _gpu(data, w, s)
            cells.append(f"{r['samples_s']:.0f}, {_x(r['vs_single'])}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", f"Samples/s, and speed relative to one process in the same run, median of {gpu['repeats']} "
              f"interleaved repeats of {gpu['steps']} steps: {source(GPU, gpu)}; with MPS: {source(GPU_MPS, mps)}; "
              f"{gpu['gpu']}, torch {gpu['torch']}, CUDA {gpu['cuda']}."]
    return "\n".join(lines)


def nodes_table() -> str:
    """docs/multinode.md's table: cross-node mode on one machine against DDP at the same process count."""
    data = load(NODES)
    lines = ["| workload | nodes (2 × 1 worker) | nodes-loss | minimal-nodes | DDP, 2 ranks | DDP / nodes | "
             "DDP / nodes-loss |", "|---|---|---|---|---|---|---|"]
    for w, e in data["workloads"].items():
        ms = {s: e["setups"][s]["ms_per_step"] for s in ("nodes", "nodes-loss", "minimal-nodes", "ddp")}
        lines.append(f"| {w} | " + " | ".join(f"{ms[s]:.2f}" for s in ms) + " | "
                     f"{_x(ms['ddp'] / ms['nodes'])} | {_x(ms['ddp'] / ms['nodes-loss'])} |")
    m = data["machine"]
    heap = _heap(m)
    lines += ["", f"Median ms per step of {data['repeats']} interleaved repeats, from {source(NODES, data)}: two "
              f"coordinators on loopback on one machine of {m['cores_physical']} physical cores (not several "
              f"machines), every setup with {heap}. Above 1.00×, dpool is the faster."]
    return "\n".join(lines)


TABLES: dict[str, tuple[str, Callable[[], str]]] = {
    "when-to-use": ("README.md", when_to_use),
    "cpu": ("docs/performance.md", cpu_table),
    "gpu": ("docs/performance.md", gpu_table),
    "nodes": ("docs/multinode.md", nodes_table),
}


def render(page: str, text: str) -> str:
    """``text`` with each generated table of ``page`` as its files give it now."""
    for name, (where, make) in TABLES.items():
        if where != page:
            continue
        start, end = f"<!-- generated: {name} -->\n", "<!-- end generated -->"
        i = text.index(start) + len(start)
        j = text.index(end, i)
        text = text[:i] + make() + "\n" + text[j:]
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a page is not up to date")
    args = ap.parse_args(argv)
    stale = []
    for page in sorted({where for where, _ in TABLES.values()}):
        path = os.path.join(ROOT, page)
        with open(path) as f:
            old = f.read()
        new = render(page, old)
        if new != old:
            stale.append(page)
            if not args.check:
                with open(path, "w") as f:
                    f.write(new)
    if args.check and stale:
        print(f"not generated from benchmarks/results/ as they are now: {', '.join(stale)}; run "
              "python benchmarks/tables.py", file=sys.stderr)
        return 1
    print(("stale: " if args.check else "rewritten: ") + (", ".join(stale) or "none"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
