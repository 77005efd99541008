"""Lifecycle: forks, wrap/close cycles, close and the context manager, leftovers after exits and kills, name
shadowing, wrapping twice.

Each scenario that needs a coordinator of its own runs as a separate process (``run_script`` /
``run_scripts``, hard timeout and stacks dumped on a hang); the slow ones run side by side.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import warnings
import gc
import json
import weakref

import pytest
import torch

import dpool
from dpool.daemon_client import runtime_dir
from tests import models
from tests.conftest import dpool_segments, wait_for
from tests.helpers import PYPATH, ROOT, run_script, run_scripts, running, script_result

pytestmark = pytest.mark.slow


def _sockets_of(pid: int) -> list[str]:
    return [n for n in os.listdir(runtime_dir()) if n.startswith(f"dpool-{os.getuid()}-{pid}-")]


def _segments_of(pid: int) -> list[str]:
    return [n for n in dpool_segments() if n.startswith(f"dpool-{os.getuid()}-{pid}-")]


# ------------------------------------------------------------------------------------------ fork
FORK = """
import json, os, sys, time, torch, dpool
from torch.utils.data import DataLoader, Dataset

torch.manual_seed(0)
net = torch.nn.Linear(4, 2)
model = dpool.wrap(net, ["cpu", "cpu"])
x = torch.randn(6, 4)
expected = model(x).detach()
out = {}

pid = os.fork()
if pid == 0:  # the child: fails at once, and its exit (atexit, GC) must not touch the parent's pool
    t = time.monotonic()
    try:
        model(x)
        code = 1
    except dpool.ForkedChildError as e:
        code = 0 if "cannot be used in a forked child" in str(e) and time.monotonic() - t < 1 else 2
    sys.exit(code)
_, status = os.waitpid(pid, 0)
out["child_exit"] = os.waitstatus_to_exitcode(status)

# After a worker's error torch's DataLoader joins each worker for this long (5 s), with dpool or without:
# 10 of this test's 15 s. Shortened here; the workers and their error are the same.
import torch.utils.data._utils as loader_utils
loader_utils.MP_STATUS_CHECK_INTERVAL = 0.2

class Holder(Dataset):  # a dataset holding the model, read by forked DataLoader workers
    def __len__(self):
        return 4
    def __getitem__(self, i):
        return model(torch.randn(2, 4))

try:
    list(DataLoader(Holder(), num_workers=2, multiprocessing_context="fork"))
    out["loader"] = "no error"
except Exception as e:
    out["loader"] = str(e)
out["parent_same"] = torch.equal(model(x).detach(), expected)
out["pids_alive"] = all(p for p in model.pids)
model.close()
print("RESULT " + json.dumps(out))
"""


def test_forked_child_fails_fast_and_parent_pool_stays_usable():
    # Not run_script: its faulthandler watchdog makes a forked child hang at exit (a CPython limit).
    res = subprocess.run([sys.executable, "-c", FORK], capture_output=True, text=True, timeout=90, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=PYPATH))
    r = script_result(res)
    assert r["child_exit"] == 0  # ForkedChildError within a second, then a clean exit
    assert "ForkedChildError" in r["loader"] and "forked child" in r["loader"]
    assert r["parent_same"] is True and r["pids_alive"] is True


# ------------------------------------------------------------------------------------------ cycles
CYCLES = """
import json, os, resource, threading, torch, dpool
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))

def fds():
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass
    return out

def mappings():
    with open("/proc/self/maps") as f:
        return sum("dpool-" in line for line in f)

net = torch.nn.Linear(8, 8)
for i in range(9):
    if i == 3:  # after warm-up (lazy imports, thread pools): 6 more cycles must add nothing
        before = (fds(), mappings(), threading.active_count())
    m = dpool.wrap(net, ["cpu"])
    m(torch.randn(4, 8)).sum().backward()
    m.close()
f, maps, threads = before
print("RESULT " + json.dumps({"cycles": i + 1, "new_fds": {k: v for k, v in fds().items() if f.get(k) != v},
                              "mappings": [maps, mappings()], "threads": [threads, threading.active_count()]}))
"""


@pytest.mark.timeout(300)  # 9 worker start-ups: ~14 s on 2 idle cores, more on a busy machine
def test_wrap_close_cycles_under_ulimit_64_leave_no_fd_mapping_or_thread():
    r = script_result(run_script(CYCLES, timeout=280))
    # the 33rd wrap() used to fail with EMFILE under ulimit -n 64 (an fd kept per cycle): any fd, mapping or
    # thread a cycle keeps shows after the 6 cycles measured here (one cycle would show it), exactly
    assert r["cycles"] == 9
    assert r["new_fds"] == {} and r["mappings"][0] == r["mappings"][1] and r["threads"][0] == r["threads"][1]


def _train_and_drop(criterion: bool, optimizer: bool, pending: bool = False) -> tuple[weakref.ref, list[int]]:
    torch.manual_seed(0)
    m = dpool.wrap(torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)), ["cpu", "cpu"],
                   gather=not criterion)
    opt = torch.optim.SGD(m.parameters(), 0.1) if optimizer else None
    for _ in range(2):
        out = m(torch.randn(8, 6))
        loss = dpool.criterion(torch.nn.CrossEntropyLoss())(out, torch.randint(0, 3, (8,))) if criterion else out.sum()
        loss.backward()
        if opt is not None:
            opt.step()
            opt.zero_grad()
    if pending:  # a forward that waits for its loss (gather=False) when the model is dropped
        out = m(torch.randn(8, 6))
        assert m._runtime.state.pending is not None and out is not None
    return weakref.ref(m._runtime.pool), list(m.pids)


def test_the_input_segments_stay_bounded_with_the_loss_on_the_workers(wrap):
    """Each step's inputs are placed while the previous step's are still kept (its loss lives until the next
    one replaces it). They went after every kept span, so the frontier only moved on, and each time it reached
    the end the input segment was replaced by one twice as large: 64 MiB per worker after 300 steps of
    256 KiB shards, growing without end. Now they take the first gap that holds them: the same 1 MiB
    segment for good, and the same places (and cached views) step after step."""
    model = wrap(torch.nn.Linear(256, 8), gather=False)
    crit = dpool.criterion(torch.nn.CrossEntropyLoss())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(512, 256), torch.randint(0, 8, (512,))  # 256 KiB of inputs per shard
    segments = set()
    for _ in range(40):
        opt.zero_grad()
        loss = crit(model(x), y)
        loss.backward()
        opt.step()
        segments.add(model._runtime.io.segment(0, "in").name)
    assert [model._runtime.io.segment(w, "in").size for w in range(2)] == [1 << 20] * 2
    assert len(segments) == 1


def test_a_model_dropped_without_close_takes_its_workers_with_it():
    """A sweep over hyperparameters, or a notebook cell run again, drops models without close(). Each
    dropped model's pool used to stay alive until the interpreter exited, with its worker processes and
    their memory: the pool's finalizer held the control channel, whose callback held the pool, so not even
    the garbage collector could free it. Now the pool goes with its model: by reference counting alone
    (dpool keeps no cycle through the runtime), or at the collector's next pass where torch's optimizer
    keeps the model in a cycle of its own; with the loss on the workers too, and with a forward that waits for
    its loss."""
    gc.disable()
    try:
        for criterion, pending in ((False, False), (True, False), (True, True)):
            pool, pids = _train_and_drop(criterion, optimizer=False, pending=pending)
            assert pool() is None  # no collection ran: nothing kept it in a cycle
            assert wait_for(lambda: not any(running(p) for p in pids), timeout=10)
    finally:
        gc.enable()
    pools = [_train_and_drop(criterion, optimizer=True) for criterion in (False, True)]
    gc.collect()
    assert all(pool() is None for pool, _ in pools)
    assert wait_for(lambda: not any(running(p) for _, pids in pools for p in pids), timeout=10)


# ------------------------------------------------------------------------------------------ exits
EXIT_NO_CLOSE = """
import os, torch, dpool
m = dpool.wrap(torch.nn.Linear(2, 2), ["cpu", "cpu"])
m(torch.randn(4, 2)).sum().backward()
print("PIDS", os.getpid(), *m.pids, flush=True)
{then}
"""


def _pids(res_or_line: str) -> list[int]:
    line = [l for l in res_or_line.splitlines() if l.startswith("PIDS")][0]
    return [int(p) for p in line.split()[1:]]


def test_socket_files_removed_at_exit_sigterm_and_swept():
    # a script that never calls close(): the pool is closed at interpreter exit, socket file included
    res = run_script(EXIT_NO_CLOSE.format(then=""))
    assert res.returncode == 0, res.stderr
    me, *workers = _pids(res.stdout)
    assert _sockets_of(me) == [] and _segments_of(me) == []
    # SIGTERM (no handler): the workers see their coordinator die and remove its socket file
    env = dict(os.environ, PYTHONPATH=PYPATH)
    proc = subprocess.Popen([sys.executable, "-c", EXIT_NO_CLOSE.format(then="import time; time.sleep(60)")],
                            stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    me, *workers = _pids(proc.stdout.readline())
    assert _sockets_of(me) == []  # the name goes as soon as every worker has connected
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM
    assert wait_for(lambda: not any(running(p) for p in workers), timeout=10)
    assert _sockets_of(me) == [] and _segments_of(me) == []
    # a dead owner's socket file (coordinator and workers killed together) is swept by the next wrap()
    stale = os.path.join(runtime_dir(), f"dpool-{os.getuid()}-999999-0badf00d.sock")
    open(stale, "w").close()
    with dpool.wrap(torch.nn.Linear(2, 2), ["cpu"]):
        pass
    assert not os.path.exists(stale)


def test_jupyter_kernel_shut_down_gracefully_leaves_no_socket_file():
    # nbclient runs in its own process: its ZeroMQ context is not ours to leak-check
    code = """
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(
        "import os, torch, dpool\\n"
        "model = dpool.wrap(torch.nn.Linear(2, 2), ['cpu', 'cpu'])\\n"
        "model(torch.randn(4, 2)).sum().backward()\\n"
        "print(os.getpid(), *model.pids)")]  # no close(): the kernel's shutdown must clean up
    NotebookClient(nb, kernel_name="python3", timeout=90).execute()  # starts, runs, shuts the kernel down
    print("PIDS", nb.cells[0].outputs[0]["text"].strip())
    """
    res = run_script(code)
    assert res.returncode == 0, res.stderr[-3000:]
    kernel, *workers = _pids(res.stdout)
    assert wait_for(lambda: not any(running(p) for p in [kernel, *workers]), timeout=10)
    assert _sockets_of(kernel) == [] and _segments_of(kernel) == []


# Fault injection at an exact moment: the coordinator SIGKILLs itself right after it created a
# segment (named, mapped by nobody yet) of at least MIN bytes, the window in which a name can leak.
KILL_AFTER_SEGMENT = """
import os, signal, sys, torch, dpool
import dpool.transport.shm

MIN, NTH = {min_bytes}, {nth}
made = [0]
Real = dpool.transport.shm.Segment

class KillAfterCreate(Real):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        if self.size >= MIN:
            made[0] += 1
            if made[0] == NTH:
                print("KILLED", os.getpid(), self.name, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

dpool.transport.shm.Segment = KillAfterCreate  # what the CPU transport creates
{body}
"""

GROWTH = """
m = dpool.wrap(torch.nn.Linear(1024, 4), ["cpu", "cpu"])
print("PIDS", os.getpid(), *m.pids, flush=True)
m(torch.randn(16, 1024)).sum().backward()
m(torch.randn(8192, 1024)).sum().backward()   # 16 MiB per shard: new input segments
"""


def _kill_scenarios(specs: list[tuple[int, int, str]], env: dict | None = None) -> list[tuple[str, int]]:
    codes = [KILL_AFTER_SEGMENT.format(min_bytes=mb, nth=nth, body=body) for mb, nth, body in specs]
    out = []
    for res in run_scripts(codes, timeout=90, env=env):
        assert res.returncode == -signal.SIGKILL, res.stderr[-3000:]
        killed = [l for l in res.stdout.splitlines() if l.startswith("KILLED")][0]
        out.append((res.stdout, int(killed.split()[1])))
    return out


def test_coordinator_sigkilled_while_growing_segments_leaves_nothing():
    # the 1st and the 2nd new 16 MiB input segment: before any worker has seen either
    for stdout, me in _kill_scenarios([(16 << 20, 1, GROWTH), (16 << 20, 2, GROWTH)]):
        workers = _pids(stdout)[1:]
        assert wait_for(lambda: not any(running(p) for p in workers), timeout=10), "workers left"
        assert wait_for(lambda: not _segments_of(me) and not _sockets_of(me), timeout=5), _segments_of(me)


def test_close_and_context_manager_leave_nothing():
    with dpool.wrap(models.make("mlp"), ["cpu", "cpu"]) as model:
        pids = model.pids
        model(torch.randn(4, 12, dtype=torch.float64))
        assert all(running(p) for p in pids)
    assert not any(running(p) for p in pids)


COORDINATOR = """
import json, os, signal, sys, torch, dpool
from tests import models
model = dpool.wrap(models.make("mlp"), ["cpu", "cpu"])
model(torch.randn(4, 12, dtype=torch.float64)).sum().backward()
print(json.dumps(model.pids), flush=True)
{ending}
"""


def test_coordinator_exit_without_close():
    res = run_script(COORDINATOR.format(ending="sys.exit(0)"))
    assert res.returncode == 0, res.stderr
    pids = json.loads(res.stdout.splitlines()[-1])
    assert wait_for(lambda: not any(running(p) for p in pids), timeout=5)


def test_coordinator_exception_exit():
    res = run_script(COORDINATOR.format(ending="raise SystemExit('boom')"))
    assert res.returncode == 1 and "boom" in res.stderr
    pids = json.loads(res.stdout.splitlines()[-1])
    assert wait_for(lambda: not any(running(p) for p in pids), timeout=5)


def test_workers_exit_when_coordinator_is_killed():
    res = run_script(COORDINATOR.format(ending="os.kill(os.getpid(), signal.SIGKILL)"))
    assert res.returncode == -signal.SIGKILL
    pids = json.loads(res.stdout.splitlines()[-1])
    # the workers are orphans now (not our children): they must notice and exit on their own
    assert wait_for(lambda: not any(running(p) for p in pids), timeout=5), "workers outlived the coordinator"


def test_forgetting_close_leaves_no_resource_warning():
    code = """
    import torch, dpool
    m = dpool.wrap(torch.nn.Linear(2, 2), ["cpu", "cpu"])
    m(torch.randn(4, 2)).sum().backward()
    print("DONE")
    """
    import subprocess
    import sys
    import textwrap

    from tests.helpers import PYPATH, ROOT

    res = subprocess.run([sys.executable, "-X", "dev", "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         timeout=90, cwd=ROOT, env=dict(__import__("os").environ, PYTHONPATH=PYPATH))
    assert res.returncode == 0 and "DONE" in res.stdout, res.stderr[-2000:]
    assert "ResourceWarning" not in res.stderr, res.stderr[-2000:]


# ------------------------------------------------------------------------------------------ shadowing
def test_script_beside_its_own_workers_module(tmp_path):
    (tmp_path / "workers.py").write_text("raise SystemExit('the user\\'s workers.py was imported by dpool')\n")
    (tmp_path / "train.py").write_text(
        "import torch, dpool\n"
        "net = torch.nn.Linear(3, 2)\n"
        "with dpool.wrap(net, ['cpu', 'cpu']) as m:\n"
        "    m(torch.randn(4, 3)).sum().backward()\n"
        "print('OK', net.weight.grad.shape)\n")
    # The script's folder comes first on sys.path, before this checkout (and the offline site of a
    # GPU machine, scripts/gpu-test.sh), as for a user whose dpool is installed.
    env = dict(os.environ, PYTHONPATH=PYPATH)
    res = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=90,
                         env=env)
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]


# ------------------------------------------------------------------------------------------ wrap twice
def test_wrapping_a_bound_module_again_never_binds_two_pools():
    net = torch.nn.Linear(4, 2)
    a = dpool.wrap(net, ["cpu", "cpu"])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the same arguments: a model on the live pool, silently
            again = dpool.wrap(net, ["cpu", "cpu"])
        assert again.pids == a.pids and again.module is net
        again.close()  # closes that model alone (what a re-run notebook cell does to the one it replaced)
        a(torch.randn(3, 4)).sum().backward()
        old = a.pids
        with pytest.warns(UserWarning, match="already bound to a live dpool pool"):
            b = dpool.wrap(net, ["cpu"])  # other arguments: the old pool is closed first
        assert a.pids == [] and b.pids and not set(b.pids) & set(old)
        assert wait_for(lambda: not any(running(p) for p in old), timeout=10)
        with pytest.raises(dpool.PoolBrokenError, match="closed"):
            a(torch.randn(2, 4))
        b(torch.randn(3, 4)).sum().backward()
        assert net.weight.grad is not None
        b.close()
        c = dpool.wrap(net, ["cpu"])  # a closed model binds nothing: a new pool, no warning
        assert c is not b
        c.close()
    finally:
        a.close()


def test_closing_one_of_two_models_of_a_module_leaves_the_other_usable():
    """A module wrapped twice with the same arguments gives two models on one pool; closing either affects that
    model alone, in either order, and the pool stops with the last one (closed, or dropped)."""
    net = torch.nn.Linear(4, 2)
    first = dpool.wrap(net, ["cpu", "cpu"])
    second = dpool.wrap(net, ["cpu", "cpu"])
    pids = first.pids
    first.close()
    with pytest.raises(dpool.PoolBrokenError, match="closed"):
        first(torch.randn(2, 4))
    second(torch.randn(5, 4)).sum().backward()  # never closed: usable
    assert second.pids == pids and net.weight.grad is not None
    third = dpool.wrap(net, ["cpu", "cpu"])  # binds to the pool that is still open
    assert third.pids == pids
    del second
    gc.collect()
    third(torch.randn(3, 4))
    third.close()
    assert wait_for(lambda: not any(running(p) for p in pids), timeout=10)


@pytest.mark.timeout(60)
def test_a_model_reopened_on_use_joins_the_live_pool_of_its_module():
    """The trainers' model (one for the trainer's life, reopened by its next forward) made while the script's own
    model of the module was open shares that pool; reopened after its close, it joins the pool again (whose
    close lock it shares: no deadlock) instead of closing the script's model."""
    net = torch.nn.Linear(4, 2)
    mine = dpool.wrap(net, ["cpu", "cpu"])
    trainers = dpool.wrap(net, ["cpu", "cpu"])
    trainers._reopens = True  # (what dpool.integrations sets)
    trainers.close()
    trainers(torch.randn(3, 4)).sum().backward()  # reopened: on the script's pool
    assert trainers.pids == mine.pids
    mine(torch.randn(3, 4))  # still open
    mine.close()
    trainers(torch.randn(3, 4))
    trainers.close()


# ------------------------------------------------------------------------------------------ daemon
def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dpool_workers.cli", *args], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=PYPATH), cwd=ROOT)


def test_daemon_stop_during_a_client_run_and_client_killed_while_attaching():
    import uuid

    name = "t" + uuid.uuid4().hex[:8]
    assert _cli("start", "--name", name, "--device-ids", "cpu,cpu").returncode == 0
    try:
        # clients SIGKILLed while attaching: right after creating their parameter segment (before the
        # daemon knows them), and after their workers mapped it; the daemon must remove what is left
        attach = "m = dpool.wrap(torch.nn.Linear(4, 4), pool={name!r})\nm(torch.randn(4, 4)).sum().backward()\n"
        for nth in (2, 4):  # one client at a time: the pool has one lease
            for _, me in _kill_scenarios([(1, nth, attach.format(name=name))]):
                assert wait_for(lambda: not _segments_of(me), timeout=10), (nth, _segments_of(me))
        code = f"""
        import time, torch, dpool

        class Slow(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(4, 4)
            def forward(self, x):
                time.sleep(3)
                return self.lin(x)

        m = dpool.wrap(Slow(), pool={name!r})
        print("ATTACHED", flush=True)
        t = time.monotonic()
        try:
            m(torch.randn(4, 4))
        except dpool.DaemonLostError as e:
            print("LOST", round(time.monotonic() - t, 2), str(e).splitlines()[0], flush=True)
        """
        env = dict(os.environ, PYTHONPATH=PYPATH)
        import textwrap

        client = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        assert client.stdout.readline().strip() == "ATTACHED"
        time.sleep(0.5)  # the client is inside its forward
        t = time.monotonic()
        stop = _cli("stop", "--name", name, "--timeout", "5")
        took = time.monotonic() - t
        out, err = client.communicate(timeout=60)
        assert stop.returncode == 0 and took < 5, (took, stop.stderr)
        lost = [l for l in out.splitlines() if l.startswith("LOST")]
        assert lost and "stopped" in lost[0], out + err[-3000:]
    finally:
        _cli("stop", "--name", name)
