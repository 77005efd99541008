"""Cross-node mode: coordinators on loopback gloo, one process per "node", started with torchrun's
environment variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), as tests/multinode.py describes.

The equivalence runs are compared with DDP (bitwise) and with a single process on the union batch,
computed here. The fault rows check the error type, who it names, how long it took, the survivor's
exit code (never 134, never a hang), that its master is unchanged and that its workers are reaped.
All runs of a module start at once, so the 2-core machine overlaps their start-up.
"""
from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import psutil
import pytest
import torch
import torch.nn.functional as F

from tests.conftest import wait_for
from tests.helpers import ROOT
from tests.multinode import batches, make_deep, make_net, rows_of

# The first test that asks for a batch of runs (the module fixtures below) runs all of it inside its own pytest
# timeout: give it a batch's bound, not the 120 s of one test; each run is bounded by its own timeout too. On 2
# busy cores (the suite in two groups at once) the equivalence batch takes over 120 s.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


# Below the kernel's ephemeral range: a port the kernel handed out (bind to port 0) can be handed again
# to one of the many gloo connections of the runs started in parallel before rank 0 binds it (EADDRINUSE
# seen in CI). Each run of this process takes the next candidate; another process starts elsewhere.
_PORTS = itertools.count(10000 + (os.getpid() % 400) * 50)


def _free_port() -> int:
    """A loopback port outside the ephemeral range, free now, not used by an earlier run of this process."""
    for port in _PORTS:
        if port >= _ephemeral_low():
            break
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # the range ran out: fall back to the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Run:
    """N coordinator processes of one scenario.

    Each rank has a thread that stamps its exit the moment the process ends (the fault rows time it, so
    it must not depend on when :meth:`finish` gets to look), and two that drain its pipes as it writes.
    """

    def __init__(self, scenario: str, world: int, **params) -> None:
        self.out = tempfile.mkdtemp(prefix="dpool-mn-")
        params["out"] = self.out
        port = _free_port()
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                   PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), PYTHONFAULTHANDLER="1")
        env.pop("LOCAL_WORLD_SIZE", None)
        self.procs = [subprocess.Popen([sys.executable, "-m", "tests.multinode", scenario, json.dumps(params)],
                                       cwd=ROOT, env=dict(env, RANK=str(r)), stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True) for r in range(world)]
        self._started = time.monotonic()
        self.limit(100.0)
        self.ended: list[float | None] = [None] * world
        self.codes: list[int | None] = [None] * world
        self.outs: list[str] = [""] * world
        self.errs: list[str] = [""] * world
        self._threads = [threading.Thread(target=f, args=(r,), daemon=True)
                         for r in range(world) for f in (self._stamp_exit, self._read_out, self._read_err)]
        for t in self._threads:
            t.start()

    def _stamp_exit(self, r: int) -> None:
        self.codes[r] = self.procs[r].wait()
        self.ended[r] = time.time()

    def _read_out(self, r: int) -> None:
        self.outs[r] = self.procs[r].stdout.read()  # type: ignore[union-attr]

    def _read_err(self, r: int) -> None:
        self.errs[r] = self.procs[r].stderr.read()  # type: ignore[union-attr]

    def finish(self, timeout: float = 100.0, kill_after: dict[int, float] | None = None) -> "Run":
        """Wait for every rank; ranks in ``kill_after`` are SIGKILLed that many seconds after all the
        others ended (a SIGSTOPped rank). Every rank is killed ``timeout`` seconds after the run started."""
        self.limit(timeout, kill_after)
        while not self.poll():
            time.sleep(0.01)
        return self.close()

    def limit(self, timeout: float, kill_after: dict[int, float] | None = None) -> "Run":
        """Set what :meth:`poll` enforces (see :meth:`finish`)."""
        self._deadline = self._started + timeout
        self._kill_after = kill_after or {}
        return self

    def poll(self) -> bool:
        """Whether every rank has ended; kills the ranks that are due (see :meth:`finish`)."""
        if all(e is not None for e in self.ended):
            return True
        others = [e for r, e in enumerate(self.ended) if r not in self._kill_after]
        if others and all(e is not None for e in others):
            for r, delay in self._kill_after.items():
                if self.ended[r] is None and time.time() > max(others) + delay:  # type: ignore[type-var]
                    self.procs[r].kill()
        if time.monotonic() > self._deadline:
            for p in self.procs:
                p.kill()
        return False

    def close(self) -> "Run":
        """After :meth:`poll` said done: join the pipe readers and close the pipes."""
        for t in self._threads:  # the pipes close when the ranks' workers are gone too
            t.join(timeout=30)
        assert not any(t.is_alive() for t in self._threads), "a rank's pipes stayed open 30 s after it exited"
        for p in self.procs:
            p.stdout.close()  # type: ignore[union-attr]
            p.stderr.close()  # type: ignore[union-attr]
        return self

    def result(self, r: int) -> dict:
        lines = [ln for ln in self.outs[r].splitlines() if ln.startswith("RESULT ")]
        assert lines, f"rank {r} printed no result (exit {self.codes[r]}):\n{self.outs[r]}\n{self.errs[r]}"
        return json.loads(lines[-1][len("RESULT "):])

    def stamp(self, r: int, tag: str) -> float | None:
        lines = [ln for ln in self.outs[r].splitlines() if ln.startswith(tag + " ")]
        return float(lines[-1].split()[1]) if lines else None

    def tensors(self, r: int) -> dict:
        return torch.load(os.path.join(self.out, f"rank{r}.pt"))

    def cleanup(self) -> None:
        shutil.rmtree(self.out, ignore_errors=True)


# Runs side by side compete for the 2 cores (every rank and worker imports torch): the seven of ``runs``
# all at once took 73 s wall and 143 CPU-s, two at a time 53 s and 105 CPU-s (2 idle cores).
_AT_ONCE = 2


def run_all(specs: dict[str, tuple[str, int, dict, dict[int, float] | None]], timeout: float,
            at_once: int = _AT_ONCE) -> dict[str, Run]:
    """Run ``name -> (scenario, world, params, kill_after)``, ``at_once`` at a time in the order given (put
    the longest first), each bounded as :meth:`Run.finish` bounds it; the next starts when one ends."""
    waiting, live, done = list(specs), {}, {}
    try:
        while waiting or live:
            while waiting and len(live) < at_once:
                name = waiting.pop(0)
                scenario, world, params, kill_after = specs[name]
                live[name] = Run(scenario, world, **params).limit(timeout, kill_after)
            for name in [n for n, run in live.items() if run.poll()]:
                done[name] = live.pop(name).close()
            time.sleep(0.01)
    finally:
        for run in live.values():  # an error above: leave no rank behind
            for p in run.procs:
                p.kill()
    return {n: done[n] for n in specs}


@pytest.fixture(scope="module")
def runs():
    """Every equivalence scenario, the longest first."""
    started = run_all({
        "accumulate": ("accumulate", 2, dict(workers=2, heartbeat=0.002), None),
        "overlap": ("overlap", 2, dict(workers=[1, 2], without_numpy=True), None),
        "bn_sync_2x2": ("union", 2, dict(workers=[2, 2], buffers="sync", steps=1, head=False), None),
        "subgroup": ("overlap", 3, dict(workers=[1, 2], subgroup=True), None),
        "syncbn_2x2": ("union", 2, dict(workers=[2, 2], buffers="first", sync_bn=True), None),
        "syncbn_1x2": ("union", 2, dict(workers=[1, 2], buffers="average", sync_bn="torch"), None),
        "ddp": ("vs_ddp", 2, {}, None),
        "floor": ("minimal_nodes", 2, {}, None),
        "loss": ("loss_on_workers", 2, dict(workers=[1, 2]), None),
    }, timeout=150)
    yield started
    for run in started.values():
        run.cleanup()


def _ok(run: Run) -> None:
    for r, code in enumerate(run.codes):
        assert code == 0, f"rank {r} exited {code}:\n{run.outs[r]}\n{run.errs[r]}"


def _same(a, b, exact: bool = False) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x is None) == (y is None), (x, y)
        if x is not None:
            if exact:
                assert torch.equal(x, y), (x - y).abs().max()
            else:
                torch.testing.assert_close(x, y)


def test_one_worker_per_node_equals_ddp_bitwise(runs):
    run = runs["ddp"]
    _ok(run)
    r0, r1 = run.result(0), run.result(1)
    assert (r0["rank"], r0["world_size"], r0["is_main"]) == (0, 2, True)
    assert (r1["rank"], r1["is_main"]) == (1, False)
    t0, t1 = run.tensors(0), run.tensors(1)
    for t in (t0, t1):
        _same(t["dpool"]["params"], t["ddp"]["params"], exact=True)  # rank 1 started from other parameters
        _same(t["dpool"]["grads"], t["ddp"]["grads"], exact=True)
    # buffers="first" is DDP's broadcast_buffers: each rank holds its own last update until the next forward
    _same(t0["dpool"]["buffers"], t0["ddp"]["buffers"], exact=True)
    _same(t1["dpool"]["buffers"], t1["ddp"]["buffers"], exact=True)
    _same(t0["dpool"]["params"], t1["dpool"]["params"], exact=True)  # ranks stay identical
    for r in (r0, r1):
        assert "DPOOL_GLOO_LOOP='sometimes' is not a policy; use one of batch, none" in r["bad_policy"]
        # a rank that wraps another model: every rank raises at wrap(), naming that rank and the tensor
        name, shape = r0["first"]
        assert (f"rank 1 wraps a different model than rank 0: its 0th tensor: parameter {name!r} has shape {shape} "
                f"and dtype torch.float32, where rank 0 has parameter {name!r} with shape {shape} and dtype "
                f"torch.float64") in r["mismatch"], r["mismatch"]
    for r in (r0, r1):  # each step's one bucket was swapped with gloo's loop threads kept from preempting
        assert r["quiet_posts"] == 5, r["quiet_posts"]  # (NOTE [ gloo's loop thread ] in dpool/crossnode.py)
        assert r["loop_policies"] and set(r["loop_policies"]) == {os.SCHED_OTHER}, r["loop_policies"]


def test_the_cross_node_floor_trains_what_one_process_trains_and_leaves_nothing(runs):
    """benchmarks/minimal.py's MinimalNode (the benchmark's ``minimal-nodes``, the floor under the cross-node
    mode's speed) computes the step of one process on the union batch, as the cross-node mode does: its speed
    bounds that of ``nodes``. Its worker and files go at close."""
    from benchmarks.workloads import WORKLOADS

    run = runs["floor"]
    _ok(run)
    w = WORKLOADS["mlp"]
    g = torch.Generator().manual_seed(0)
    data = [w.batch(32, g) for _ in range(3)]
    torch.manual_seed(0)
    net = w.make()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
    t0, t1 = run.tensors(0), run.tensors(1)
    for t in (t0, t1):
        for got, want in zip(t["params"], net.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-6)
    _same(t0["params"], t1["params"], exact=True)  # the two halves add up alike on both ranks
    _same(t0["grads"], t1["grads"], exact=True)
    for r in (0, 1):
        assert (run.result(r)["left"], run.result(r)["workers_left"]) == ([], 0)


def test_eval_and_no_grad_forwards_issue_no_collectives(runs):
    run = runs["ddp"]
    _ok(run)
    assert run.result(0)["eval_collectives"] == 0 and run.result(1)["eval_collectives"] == 0


def _reference(steps: int, B: int = 12) -> dict:
    """One process on the union batch: plain BatchNorm over all rows, mean loss; then the half-used head."""
    from tests.multinode import state

    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches(steps, B):
        opt.zero_grad()
        F.mse_loss(net(x), y).backward()
        opt.step()
    x, y = batches(1, B, seed=7)[0]
    opt.zero_grad()
    rows0 = rows_of(0, 2, B)
    out = net(x)
    out = torch.cat([out[rows0] + net.extra(x[rows0]), out[rows0.stop:]])  # the head only on rank 0's rows
    F.mse_loss(out, y).backward()
    return state(net)


@pytest.mark.parametrize("name", ["syncbn_2x2", "syncbn_1x2"])
def test_nodes_train_like_one_process_on_the_union_batch(runs, name):
    """2 nodes x 2 workers, and nodes of 1 and 2 workers, with SyncBatchNorm spanning every worker of
    every node: parameters, gradients (a head used on one node only, a parameter used nowhere) and
    buffers equal one process with BatchNorm over the union batch."""
    run = runs[name]
    _ok(run)
    ref = _reference(4)
    t0, t1 = run.tensors(0), run.tensors(1)
    for t in (t0, t1):
        _same(t["params"], ref["params"])
        _same(t["grads"], ref["grads"])  # `extra`: averaged with zeros; `unused`: None everywhere
        _same(t["buffers"], ref["buffers"])
    _same(t0["params"], t1["params"], exact=True)
    _same(t0["grads"], t1["grads"], exact=True)
    assert t0["grads"][0] is None  # `unused`


def test_the_loss_on_the_workers_takes_one_round_a_step_across_nodes(runs):
    """Nodes of 1 and 2 workers with the loss on the workers: every training forward went with its loss, and
    the backward ran in that round wherever its gradient could be predicted (from the second step on: the
    first has no earlier output to predict the mean's denominator from). Each step's gradients, averaged over
    the nodes, equal those of the same training with a round for each, bitwise, and one process on the union
    batch. At the last step rank 1 scaled its loss: its early backward missed and ran its round while rank
    0's hit, and the nodes still combined the same step."""
    from tests.multinode import state

    run = runs["loss"]
    _ok(run)
    r0, r1 = run.result(0), run.result(1)
    assert r0["one_round"]["forward_rounds_saved"] == 5 and r1["one_round"]["forward_rounds_saved"] == 5, (r0, r1)
    assert r0["one_round"]["backward_rounds_saved"] == 4, r0  # steps 2 to 5
    assert r1["one_round"]["backward_rounds_saved"] == 3, r1  # steps 2 to 4: its scaled loss missed
    assert r0["rounds"]["forward_rounds_saved"] == 0 and r0["rounds"]["backward_rounds_saved"] == 0, r0
    assert r0["one_round"]["collectives"] == r0["rounds"]["collectives"] == r1["one_round"]["collectives"]
    # the reference: 4 steps on the union batch, then the last step's gradient with rank 1's rows counted twice
    net = make_net(bn=False)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches(4, 12):
        opt.zero_grad()
        F.mse_loss(net(x), y).backward()
        opt.step()
    x, y = batches(1, 12, seed=7)[0]
    opt.zero_grad()
    half = rows_of(0, 2, 12)
    ((F.mse_loss(net(x[half]), y[half]) + 2 * F.mse_loss(net(x[half.stop:]), y[half.stop:])) / 2).backward()
    ref = state(net)
    ts = {(r, name): torch.load(os.path.join(run.out, f"rank{r}.pt{name}")) for r in (0, 1)
          for name in ("one_round", "rounds")}
    for t in ts.values():
        _same(t["params"], ref["params"])
        _same(t["grads"], ref["grads"])
    for r in (0, 1):
        _same(ts[r, "one_round"]["params"], ts[r, "rounds"]["params"], exact=True)
        _same(ts[r, "one_round"]["grads"], ts[r, "rounds"]["grads"], exact=True)
    _same(ts[0, "one_round"]["grads"], ts[1, "one_round"]["grads"], exact=True)


def test_buckets_leave_during_the_backward_and_a_late_gradient_is_combined_again(runs):
    """Cross-node overlap: buckets are exchanged while the workers still run the backward (nodes of 1 and 2
    workers), and the result equals one process on the union batch. A block reused in two reentrant
    checkpoints grows its gradient after its bucket left: every rank combines the step again from the
    complete gradients (still equal to the reference) and turns overlap off."""
    run = runs["overlap"]
    _ok(run)
    assert run.result(0)["numpy"] is False and run.result(1)["numpy"] is False  # cross-node mode needs no numpy
    for shared in (False, True):
        ref = _deep_reference(shared)
        name = "shared" if shared else "plain"
        t0, t1 = run.tensors(0)[name], run.tensors(1)[name]
        for t in (t0, t1):
            _same(t["params"], ref["params"])
            _same(t["grads"], ref["grads"])
        _same(t0["params"], t1["params"], exact=True)
    for r in (0, 1):
        res = run.result(r)
        assert res["plain"]["buckets"] == 2 and res["plain"]["early"] >= 3, res  # 3 steps: bucket 0 left early
        assert res["plain"]["overlap"] is True, res
        # no buffers: a step's collectives are its buckets alone (the header rides in the first one)
        assert res["plain"]["collectives"] == 3 * res["plain"]["buckets"], res
        assert res["shared"]["overlap"] is False and res["shared"]["early"] >= 1, res


def _deep_reference(shared: bool) -> dict:
    """The overlap scenario's model in one process on the union batch."""
    from tests.multinode import state

    net = make_deep(shared)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches(3, 8):
        opt.zero_grad()
        F.mse_loss(net(x), y).backward()
        opt.step()
    return state(net)


def test_an_explicit_group_smaller_than_the_world(runs):
    """process_group= a group of global ranks 1 and 2 out of 3: torch.distributed names a broadcast's
    source and a send's peer by their global ranks, so wrap() (rank 0's parameters) and the buckets'
    swap must translate; the two nodes train like one process on their union batch, identically."""
    run = runs["subgroup"]
    _ok(run)
    ref = _deep_reference(False)
    t1, t2 = run.tensors(1)["plain"], run.tensors(2)["plain"]
    for t in (t1, t2):
        _same(t["params"], ref["params"])
        _same(t["grads"], ref["grads"])
    _same(t1["params"], t2["params"], exact=True)
    res = run.result(1)["plain"]
    assert res["buckets"] == 2 and res["collectives"] == 3 * res["buckets"], res


def test_buffer_policy_sync_is_global(runs):
    """buffers="sync" with plain BatchNorm: after a training step, every node's running statistics are
    those of one BatchNorm over the union batch (4 shards on 2 nodes)."""
    run = runs["bn_sync_2x2"]
    _ok(run)
    net = make_net()
    x, _ = batches(1, 12)[0]
    net.bn(net.fc1(x))  # train mode: the running statistics of the union batch
    for r in (0, 1):
        t = run.tensors(r)
        _same(t["buffers"], [b for b in net.buffers()])


def test_no_sync_accumulates_then_averages_once(runs):
    run = runs["accumulate"]
    _ok(run)
    from tests.multinode import state

    net = make_net(bn=False)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    data = batches(4, 8)
    for x, y in data[:3]:
        F.mse_loss(net(x), y).backward()
    x, y = data[3]
    F.mse_loss(net(x[:2]), y[:2]).backward()  # the synced micro-batch: one row per node, of 2 workers each
    accumulated = state(net)
    opt.step()
    for x, y in batches(4, 8, seed=3):
        opt.zero_grad()
        F.mse_loss(net(x), y).backward()
        opt.step()
    for r in (0, 1):
        assert run.result(r)["inside"] == 0  # no collective inside no_sync()
        assert "no_sync() in cross-node mode with hooks on the model's parameters" in run.result(r)["hooked"]
        assert run.result(r)["threads_left"] == []  # close() joined the heartbeat thread
        # (and the second model, left open, did not abort the exit: _ok above)
        t = run.tensors(r)
        # the master's .grad waits for the synced backward: zero markers meanwhile (dpool/accumulate.py)
        assert all(g is not None and not g.any() for g in t["grads_inside"])
        _same(t["accumulated"]["grads"], accumulated["grads"])
        # checkpoint on rank 0, close, resume (parameters loaded on rank 0 only): as if never stopped
        _same(t["resumed"]["params"], state(net)["params"])


# ---------------------------------------------------------------------------- faults
FAULTS = {  # name: (world, params, ranks that must survive with which error)
    # the survivors' scripts end with the error (exit status 1) or, with "end", in another way
    "sigkill_mid_step": (2, {"kind": "sigkill", "end": "SystemExit"}, {0: "PeerLostError"}),
    # with buffers the survivor's waits are gloo collectives (ticked), not the buckets' point-to-point swap
    "sigkill_with_buffers": (2, {"kind": "sigkill", "bn": True, "end": "KeyboardInterrupt"}, {0: "PeerLostError"}),
    "exit_between_steps": (2, {"kind": "exit", "where": "before", "end": "exit"}, {0: "PeerLostError"}),
    "sigstop": (2, {"kind": "sigstop"}, {0: "PeerTimeoutError"}),
    # no forward collectives: the backward's header rides in its bucket (two nodes); with buffers it is its own
    "desync": (2, {"kind": "desync"}, {0: "CollectiveDesyncError", 1: "CollectiveDesyncError"}),
    "desync_with_buffers": (2, {"kind": "desync", "bn": True}, {0: "CollectiveDesyncError", 1: "CollectiveDesyncError"}),
    "worker_killed": (2, {"kind": "worker"}, {0: "PeerLostError", 1: "WorkerDiedError"}),
    "sigkill_of_3": (3, {"kind": "sigkill", "victim": 1}, {0: "PeerLostError", 2: "PeerLostError"}),
    # the loss on the workers: the forward waits for it and runs in its round; the backward ran there too
    "worker_killed_loss": (2, {"kind": "worker", "where": "before", "loss": True},
                           {0: "PeerLostError", 1: "WorkerDiedError"}),
    "desync_loss": (2, {"kind": "desync", "loss": True}, {0: "CollectiveDesyncError", 1: "CollectiveDesyncError"}),
}


STATUS = {"raise": 1, "SystemExit": 3, "exit": 4, "KeyboardInterrupt": -signal.SIGINT}


@pytest.fixture(scope="module")
def faults():
    order = ["sigstop", "sigkill_of_3"] + [n for n in FAULTS if n not in ("sigstop", "sigkill_of_3")]  # longest first
    done = run_all({n: ("fault", FAULTS[n][0], FAULTS[n][1], {1: 2.0} if n == "sigstop" else None) for n in order},
                   timeout=90, at_once=3)  # most of a fault run is waiting (a heartbeat, a peer's timeout)
    yield done
    for run in done.values():
        run.cleanup()


@pytest.mark.parametrize("name", list(FAULTS))
def test_peer_faults_end_every_survivor_promptly(faults, name):
    run = faults[name]
    world, params, expect = FAULTS[name]
    victim = params.get("victim", 1)
    t0 = next(run.stamp(r, "T0") for r in range(world) if run.stamp(r, "T0") is not None)
    for r, error in expect.items():
        res = run.result(r)
        assert res["error"] == error, res["message"]
        took = res["at"] - t0
        exit_s = run.ended[r] - run.stamp(r, "EXITING")
        print(f"{name}: rank {r} raised {error} {took:.2f} s after the fault, exited {exit_s:.2f} s later "
              f"with code {run.codes[r]}")
        status = STATUS[params.get("end", "raise")]  # what Python itself exits with, ending that way
        assert run.codes[r] == status, f"exit code {run.codes[r]} (134 = gloo's SIGABRT at teardown)\n{run.errs[r]}"
        assert took < 10 and exit_s < 5, (took, exit_s)  # bounds against 30-minute hangs, not a benchmark
        assert res["workers_alive"] == [], "the survivor's workers must be reaped when it raises"
        assert res["told"] is True, "a failed synchronised call must end the rank's part in the job"
        desync = params["kind"] == "desync"
        if r != victim or desync and r == 0:
            assert res["unchanged"] is True, res["unchanged"]
        if error == "PeerLostError" or error == "PeerTimeoutError":
            assert res["lost_rank"] == victim, res["message"]
            assert f"rank {victim} (" in res["message"] and "pid" in res["message"]
    if name.startswith("worker_killed"):
        assert "WorkerDiedError" in run.result(0)["message"] and "SIGKILL" in run.result(0)["message"]
    if name == "sigstop":
        assert "heartbeat" in run.result(0)["message"]
    if params["kind"] == "desync":
        assert "out of step" in run.result(0)["message"]
    pids = [p for r in range(world) for p in _pids(run, r)]
    assert wait_for(lambda: not any(_alive(p) for p in pids), timeout=15), "leaked worker processes"


def _pids(run: Run, r: int) -> list[int]:
    lines = [ln for ln in run.outs[r].splitlines() if ln.startswith("PIDS ")]
    return json.loads(lines[-1][5:]) if lines else []


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


# ---------------------------------------------------------------------------- a node lost at each collective
# wrap(): the models compared (two all-gathers), rank 0's parameters (a broadcast per dtype); a training step
# with buffers and SyncBatchNorm: the forward's header, rank 0's buffers, SyncBatchNorm's statistics (forward
# and backward), the backward's header, the gradients (a point-to-point swap between two nodes)
_WRAP_AND_STEP = 10


@pytest.fixture(scope="module")
def lost():
    done = run_all({f"at {k}": ("lost_at", 2, {"at": k}, None) for k in range(_WRAP_AND_STEP, 0, -1)},
                   timeout=90, at_once=3)
    yield done
    for run in done.values():
        run.cleanup()


def test_a_node_lost_before_any_collective_is_a_peer_lost_error_naming_it(lost):
    """Rank 1 exits just before its k-th collective, for every collective of wrap() and of a training step
    (chosen by a hook on the one function that starts them); rank 0 starts that collective once rank 1 is
    gone, so gloo refuses it at its start or in its wait. Either way rank 0 raises PeerLostError naming rank 1
    (also a RuntimeError, as gloo's own error is), never gloo's bare RuntimeError."""
    started = lost[f"at {_WRAP_AND_STEP}"].result(0)["started"]  # the last run got furthest: what rank 0 starts
    kinds = ["comparing the models"] * 2 + ["taking rank 0's parameters"] * 2 + [
        "starting a training forward", "taking rank 0's buffers", "combining SyncBatchNorm statistics",
        "starting a backward", "combining SyncBatchNorm statistics", "combining the gradients"]
    assert [d.split(" (")[0] for d in started[:_WRAP_AND_STEP]] == kinds, started  # wrap(), then a whole step
    for k in range(1, _WRAP_AND_STEP + 1):
        run = lost[f"at {k}"]
        assert run.codes[1] == 3, run.errs[1]
        res = run.result(0)
        # it got as far as that collective (whose wait may come after the next one starts: the backward's
        # header is waited for when the first gradient bucket is ready)
        assert res["started"][:k] == started[:k] and len(res["started"]) <= k + 1, (k, res["started"])
        assert res["error"] == "PeerLostError" and res["dpool"], (k, res["message"])
        assert res["lost_rank"] == 1 and "rank 1 (" in res["message"] and "pid" in res["message"], res["message"]
        assert run.codes[0] == 1, run.errs[0]


def test_example_under_torchrun_matches_one_process():
    """The example, through the real launcher: the printed losses equal a single process on the global batch."""
    torchrun = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([torchrun, "--standalone", "--nproc-per-node=2", "examples/train_multinode.py",
                          "--steps", "3", "--check"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "same losses as one process on the global batch" in res.stdout, res.stdout

