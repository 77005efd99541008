"""The examples and the benchmark run (smoke mode), so they never rot."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

import dpool
from dpool.launch import WORKER_MALLOC_KEEP

from tests.helpers import PYPATH, ROOT


def _run(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=PYPATH)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def test_compare_dataparallel_example_shows_worker_prints():
    res = _run(["examples/compare_dataparallel.py", "--workers", "2"])
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "In model: input size torch.Size([30, 5])" in out  # DataParallel on CPU: one module
    assert "[dpool worker 0] \tIn model: input size torch.Size([15, 5])" in out
    assert "[dpool worker 1] \tIn model: input size torch.Size([15, 5])" in out
    assert "[dpool worker 0] \tIn model: input size torch.Size([5, 5])" in out  # last batch of 10


def test_train_cnn_example_learns():
    res = _run(["examples/train_cnn.py", "--epochs", "2", "--train-size", "1024", "--batch-size", "128",
                "--workers", "2"])
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    losses = [float(l.split("loss ")[1].split(",")[0]) for l in lines if l.startswith("epoch ")]
    assert len(losses) == 2 and losses[1] < losses[0]
    assert any(l.startswith("throughput:") and "samples/s (dpool)" in l for l in lines)


@pytest.mark.timeout(420)
def test_benchmark_smoke(tmp_path):
    """Every setup's code path on one workload (each further workload only repeats them), in one run: the default
    setups, and the cross-node ones: `nodes` (dpool's cross-node mode, 2 coordinators on loopback gloo) with its
    exposed cross-node time next to DDP's at the same process count and, beside `nodes-serial` (no overlap), how
    much of the exchange the overlap hid; `nodes-loss` (the loss on the workers) beside its floor
    `minimal-nodes-loss` (``MinimalNode``, whose numbers tests/test_multinode.py checks), the ratios to it and to
    DDP."""
    default = ["single", "dp", "ddp", "dpool", "dpool-loss", "ideal", "ceiling", "minimal", "minimal-loss"]
    nodes = ["nodes", "nodes-serial", "nodes-loss", "minimal-nodes-loss"]
    res = _run(["benchmarks/bench.py", "--smoke", "--workloads", "probe", "--setups", ",".join(default + nodes),
                "--out", str(tmp_path)], timeout=400)
    assert res.returncode == 0, res.stdout + res.stderr
    results = json.loads((tmp_path / "smoke.json").read_text())
    keep = str(WORKER_MALLOC_KEEP)  # every setup ran with dpool's worker heap setting, not the workers alone
    assert results["machine"]["heap"] == {"MALLOC_MMAP_THRESHOLD_": keep, "MALLOC_TRIM_THRESHOLD_": keep}
    assert results["dpool"] == dpool.__version__ and re.fullmatch(r"[0-9a-f]{12}(\+dirty)?", results["commit"])
    entry = results["workloads"]["probe"]
    assert set(entry["setups"]) == set(default + nodes)
    assert all(v["samples_per_s"] > 0 for v in entry["setups"].values())
    assert (tmp_path / "smoke.png").stat().st_size > 0
    assert "| probe |" in res.stdout and "dpool-loss: ddp" in res.stdout
    assert {"nodes-loss/ddp", "minimal-nodes-loss/ddp", "nodes-loss/minimal-nodes-loss"} <= set(entry["ratios"])
    assert entry["nodes_exposed_collective_ms_per_step"] >= 0 and entry["nodes_serial_exposed_collective_ms_per_step"] >= 0
    assert entry["nodes_hidden_collective_ms_per_step"] == pytest.approx(
        entry["nodes_serial_exposed_collective_ms_per_step"] - entry["nodes_exposed_collective_ms_per_step"])
    assert "nodes/ddp" in res.stdout and "hidden behind the backward" in res.stdout
    assert "nodes-loss/minimal-nodes-loss" in res.stdout


def test_benchmark_runs_without_matplotlib_and_says_so(tmp_path):
    """matplotlib is only in the examples' extra: without it the benchmark writes its numbers, no chart. (The heap
    setting exported here keeps the benchmark from starting itself again, which would drop the patched import.)"""
    code = ("import runpy, sys; sys.modules['matplotlib'] = None; "
            "sys.argv = ['bench.py', '--smoke', '--workloads', 'probe', '--setups', 'single,dpool', '--out', "
            f"{str(tmp_path)!r}]; sys.exit(runpy.run_path('benchmarks/bench.py', run_name='__main__'))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=PYPATH, MALLOC_MMAP_THRESHOLD_=str(WORKER_MALLOC_KEEP),
                                  MALLOC_TRIM_THRESHOLD_=str(WORKER_MALLOC_KEEP)))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "no chart: matplotlib is not installed" in res.stdout and "| probe |" in res.stdout
    assert (tmp_path / "smoke.json").exists() and not (tmp_path / "smoke.png").exists()


def test_benchmark_balance_demo_smoke():
    res = _run(["benchmarks/bench.py", "--smoke", "--balance-demo"])
    assert res.returncode == 0, res.stderr
    assert "| even |" in res.stdout and "| auto |" in res.stdout


def test_benchmark_per_worker_smoke():
    """--per-worker: the coordinator's CPU per probe step at each worker count (with dpool's defaults and
    without the spin through short rounds; the loss on the gathered output and on the workers), beside each
    mode's floor (minimal, minimal-loss) and two bare transports' (ZeroMQ, AF_UNIX)."""
    res = _run(["benchmarks/bench.py", "--smoke", "--per-worker"])
    assert res.returncode == 0, res.stderr
    rows = [line.split("|")[1:-1] for line in res.stdout.splitlines() if line.startswith("| ")]
    counts = [r[0].strip() for r in rows[1:]]
    assert counts[:2] == ["1", "2"] and counts[2].startswith("per added worker (1→2)"), res.stdout
    assert "floor (`minimal`)" in rows[0][4] and "floor (`minimal-loss`)" in rows[0][8], res.stdout
    for r in rows[1:3]:
        assert len(r) == 11 and all(float(c) > 0 for c in r[1:]), res.stdout
    assert len(rows[3]) == 11, res.stdout


def test_cold_code_benchmark_smoke(capsys):
    """benchmarks/cold.py: every setup's step, back to back and after each kind of gap, in one table (in this
    process, so the leak check sees its pools)."""
    from benchmarks import cold

    assert cold.main(["--setups", "single,dpool,dpool-loss", "--gaps", "1", "--steps", "3", "--repeats", "1"]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [c.strip() for c in rows[0]] == ["probe", "back to back", "sleep 1 ms", "spin 1 ms"], rows
    assert [r[0].strip() for r in rows[1:]] == ["single", "dpool", "dpool-loss", "dpool − single",
                                                "dpool-loss − single"], rows
    for r in rows[1:4]:
        assert all(float(c) > 0 for c in r[1:]), rows


def test_benchmark_attach_demo_smoke():
    res = _run(["benchmarks/bench.py", "--smoke", "--attach-demo"])
    assert res.returncode == 0, res.stderr
    assert "attached speed-up" in res.stdout


def test_smoke_results_are_not_tracked_and_negative_framework_cost_is_not_printed():
    """--smoke writes benchmarks/results/smoke.* by default: an ignored path, so a test run rewrites no
    tracked file. A dpool step faster than `ideal` has no framework cost to print as a negative number."""
    tracked = subprocess.run(["git", "ls-files", "benchmarks/results"], capture_output=True, text=True, cwd=ROOT)
    assert tracked.returncode == 0 and not [f for f in tracked.stdout.split() if "smoke" in f]
    ignored = subprocess.run(["git", "check-ignore", "-q", "benchmarks/results/smoke.json"], cwd=ROOT)
    assert ignored.returncode == 0
    sys.path.insert(0, ROOT)
    from benchmarks.bench import table

    row = {"global_batch": 8, "setups": {s: {"samples_per_s": 1.0, "ms_per_step": ms, "ms_per_step_min": ms,
                                             "ms_per_step_max": ms} for s, ms in (("dpool", 1.0), ("ideal", 1.5))},
           "ratios": {"dpool/ideal": 1.5}, "framework_ms_per_step": -0.5}
    text = table({"workloads": {"probe": row}, "workers": 2, "repeats": 1, "steps": 1,
                  "machine": {"cores_physical": 2, "python": "3", "torch": "2", "platform": "x"}})
    assert "framework -" not in text and "framework < 0" in text


def test_train_cnn_baseline_gets_the_same_allocator_setting():
    res = _run(["examples/train_cnn.py", "--mode", "single", "--epochs", "1", "--train-size", "128",
                "--batch-size", "64", "--device", "cpu"])  # a CPU allocator setting: CPU also on a GPU machine
    assert res.returncode == 0, res.stderr
    assert "memory allocator: dpool's worker heap setting" in res.stdout


def test_resnet18_workload_is_torchvisions_layout():
    """The benchmark's ResNet-18 (torchvision is not a dependency) has torchvision's resnet18's 11,689,512
    parameters and its 1000-class output at 64x64."""
    from benchmarks.workloads import WORKLOADS

    w = WORKLOADS["resnet18"]
    net = w.make()
    assert sum(p.numel() for p in net.parameters()) == 11_689_512
    x, y = w.batch(2, torch.Generator().manual_seed(0))
    assert net(x).shape == (2, 1000) and x.shape == (2, 3, 64, 64)


def test_minimal_floor_trains_what_one_process_trains_and_leaves_nothing():
    """benchmarks/minimal.py (the `minimal` and `minimal-loss` setups: the design's floor) computes the step of
    one process on the global batch, with the loss on the gathered output and with the loss on the workers, as
    dpool does; so its speed bounds dpool's. Its workers, sockets and files go at close."""
    import glob

    import torch.nn.functional as F

    from benchmarks.minimal import Minimal
    from benchmarks.workloads import WORKLOADS

    w = WORKLOADS["mlp"]
    g = torch.Generator().manual_seed(0)
    data = [w.batch(64, g) for _ in range(3)]
    nets = []
    for _ in range(3):
        torch.manual_seed(0)
        nets.append(w.make())
    ref, two, one = nets
    files = set(glob.glob("/dev/shm/dpool-minimal-*")) | set(glob.glob("/tmp/dpool-minimal-*"))
    floors: list[Minimal] = []
    try:
        floors.append(Minimal("mlp", two, 2, 32, (256,), torch.float32, loss_on_workers=False))
        floors.append(Minimal("mlp", one, 2, 32, (256,), torch.float32, loss_on_workers=True))
        opts = [torch.optim.SGD(n.parameters(), lr=0.1, momentum=0.9) for n in nets]
        for x, y in data:
            for o in opts:
                o.zero_grad()
            expected = F.cross_entropy(ref(x), y)
            expected.backward()
            losses = [f.step(x, y) for f in floors]
            for o in opts:
                o.step()
            assert losses == pytest.approx([expected.item()] * 2, rel=1e-5)
        with pytest.raises(ValueError, match="a batch of 63 rows, but 2 workers of 32 rows each"):
            floors[0].step(x[:63], y[:63])  # never a step on other rows than dpool's
        for name, p in ref.named_parameters():
            for net in (two, one):
                torch.testing.assert_close(dict(net.named_parameters())[name].detach(), p.detach(), rtol=0,
                                           atol=1e-6, msg=name)
    finally:
        for f in floors:
            f.close()
    left = set(glob.glob("/dev/shm/dpool-minimal-*")) | set(glob.glob("/tmp/dpool-minimal-*"))
    assert all(not f.procs for f in floors) and len(floors) == 2 and left == files


def test_gpu_trace_idle_fraction_merges_every_process_on_one_clock():
    """benchmarks/gpu.py --trace: a GPU activity of any process covers the window; traces on other bases
    are put on one clock; overlaps count once; what is outside the window does not count."""
    from benchmarks import gpu

    coordinator = {"baseTimeNanoseconds": 1_000_000, "traceEvents": [
        {"ph": "X", "name": gpu.STEP_MARK, "ts": 0, "dur": 100},
        {"ph": "X", "name": gpu.STEP_MARK, "ts": 100, "dur": 100},
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 150, "dur": 10},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 120, "dur": 50}]}  # host time: not the GPU's
    worker = {"baseTimeNanoseconds": 1_100_000, "traceEvents": [  # 100 us later
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 20, "dur": 40},  # 1120-1160
        {"ph": "X", "cat": "gpu_memcpy", "name": "c", "ts": 40, "dur": 30},  # 1140-1170 (overlaps)
        {"ph": "X", "cat": "kernel", "name": "late", "ts": 500, "dur": 10}]}  # after the window
    gpu_spans, steps = [], []
    for trace in (coordinator, worker):
        g, st = gpu.trace_intervals(trace)
        gpu_spans += g
        steps += st
    assert sorted(steps) == [(1000.0, 1100.0), (1100.0, 1200.0)]
    window = (1100.0, 1200.0)  # the steady steps: after the first
    # busy: 1120-1170 (two overlapping activities, counted once); the coordinator's 1150-1160 is inside it
    assert gpu.idle_fraction(gpu_spans, window) == pytest.approx(0.5)
    assert gpu.idle_fraction([], window) == 1.0


def test_call_count_of_a_step_is_the_same_run_after_run():
    """benchmarks/calls.py counts outside the waits: two runs give the same count, and dpool's calls are part of it."""
    runs = []
    for _ in range(2):
        res = _run(["benchmarks/calls.py", "--steps", "20", "--warmup", "10"], timeout=120)
        assert res.returncode == 0, res.stderr
        runs.append(json.loads(res.stdout.strip().splitlines()[-1]))
    assert runs[0] == runs[1]
    assert 0 < runs[0]["dpool_calls"] < runs[0]["python_calls"]


def test_the_gpu_check_scripts_plan_holds_on_cpu(tmp_path):
    """scripts/gpu-check.sh --dry-run: the wheels the GPU image lacks, the test selection and the output folder
    are checked without a GPU; a missing wheel says how to get it, a used output folder is refused."""
    env = dict(os.environ, PYTHON=sys.executable, DPOOL_WHEELS=str(tmp_path / "wheels"))

    def dry(out):
        return subprocess.run(["bash", "scripts/gpu-check.sh", "--dry-run", str(out)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)

    res = dry(tmp_path / "out")
    assert res.returncode == 1 and "no pyzmq wheel" in res.stderr and "gpu-wheels.sh" in res.stderr, res.stderr
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "pyzmq-27.3.0-cp312-abi3-manylinux_2_28_x86_64.whl").write_bytes(b"")
    res = dry(tmp_path / "out")
    assert res.returncode == 0 and "dry run OK" in res.stdout, res.stdout + res.stderr
    (tmp_path / "out" / "old.json").write_text("{}")
    res = dry(tmp_path / "out")
    assert res.returncode == 1 and "not empty" in res.stderr, res.stderr
