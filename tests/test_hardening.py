"""Harder faults: shared memory that fills and empties, refusals that are dpool's errors, replayed messages,
and faults during a restart (docs/reliability.md, rows H1-H6)."""
from __future__ import annotations

import copy
import os
import uuid

import pytest
import torch
from torch import nn

import dpool
from tests.helpers import tmpfs

pytestmark = pytest.mark.timeout(240)

ROW = 1024  # float32 features: 4 KiB a row


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 64 MiB tmpfs of its own (root only: elsewhere the test is skipped)."""
    with tmpfs(tmp_path / "shm", "64m") as path:
        yield path
        left = os.listdir(path)
        assert not [n for n in left if n.startswith("dpool-")], left  # nothing of the pool's stays behind


def _step(model, ref, rows: int) -> None:
    """One training step on ``rows`` rows, equal to one process's."""
    x = torch.randn(rows, ROW)
    out, want = model(x), ref(x)
    torch.testing.assert_close(out, want)
    out.pow(2).mean().backward()
    want.pow(2).mean().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
        p.grad = q.grad = None


def _fill(directory: str) -> str:
    """Fill ``directory`` from outside the pool, as another process would: the file that does it."""
    filler = os.path.join(directory, f"filler-{uuid.uuid4().hex}")
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError:  # ENOSPC: full
            pass
    return filler


def test_shared_memory_refusal_counts_only_what_a_call_adds_and_the_pool_recovers(wrap, small_tmpfs):
    torch.manual_seed(0)
    net = nn.Linear(ROW, 8)
    ref = copy.deepcopy(net)
    model = wrap(net, shm_dir=small_tmpfs)
    for _ in range(3):
        _step(model, ref, 256)
    # the disk filled by someone else in the middle of training: the same size needs nothing new
    filler = _fill(small_tmpfs)
    for _ in range(3):
        _step(model, ref, 256)
    with pytest.raises(dpool.SharedMemoryError, match=rf"in {small_tmpfs}.* free"):
        _step(model, ref, 2048)  # growing needs new memory: refused before anything is written
    _step(model, ref, 256)
    os.unlink(filler)  # freed: growing works again
    _step(model, ref, 2048)
    rows, fits = 2048, 2048
    while rows <= 32768:  # grow until refused
        try:
            _step(model, ref, rows)
            fits = rows
        except dpool.SharedMemoryError as exc:
            assert f"in {small_tmpfs}" in str(exc), exc
            break
        rows *= 2
    assert fits < rows <= 32768, (fits, rows)
    for again in (fits, fits // 4, 256, fits):  # after a refusal, every call that fits works again
        _step(model, ref, again)
    model.close()


# ------------------------------------------------------------------------------- faults at any moment
# the end of both chaos scripts: a one-process replay of the steps that succeeded, and how far the master is from it
_REPLAY = """
opt.zero_grad()
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
for j in ok:  # a single-process replay of exactly the steps that succeeded
    x, y = batches[j]
    (ref(x) - y).pow(2).mean().backward()
    ref_opt.step()
    ref_opt.zero_grad()
diff = max(float((p - q).abs().max()) for p, q in zip(net.parameters(), ref.parameters()))
"""

CHAOS = """
import copy, json, os, random, signal, threading, time
import psutil, torch
from torch import nn
import dpool

SECONDS, SEED = {seconds}, {seed}
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()
ref = copy.deepcopy(net)
model = dpool.wrap(net, ["cpu", "cpu"], max_restarts=1000, heartbeat_timeout_s=1.5, startup_timeout_s=15,
                   step_timeout_s=20)
opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
batches = [(torch.randn(6, 8, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)) for _ in range(8)]
me = psutil.Process()
stop = threading.Event()
faults = []


def workers():  # every worker process of ours, the ones starting included
    return [p for p in me.children() if "dpool_workers" in " ".join(p.cmdline()[:3] + p.cmdline()[-2:])]


def chaos():
    rng = random.Random(SEED)
    while not stop.wait(rng.uniform(0.05, 0.9)):
        try:
            victim = rng.choice(workers())
            sig = rng.choice([signal.SIGKILL, signal.SIGKILL, signal.SIGSTOP])
            victim.send_signal(sig)
            faults.append(sig.name)
        except (IndexError, psutil.Error):
            pass


ok, failed, errors, worst = [], 0, set(), 0.0
thread = threading.Thread(target=chaos, daemon=True)
thread.start()
end = time.monotonic() + SECONDS
i = 0
# (on a loaded machine a restart can take most of the time between faults: go on until 5 steps succeeded, or 3x)
while time.monotonic() < end or (len(ok) < 5 and time.monotonic() < end + 2 * SECONDS):
    x, y = batches[i % len(batches)]
    t0 = time.monotonic()
    try:
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
    except (dpool.WorkerDiedError, dpool.WorkerTimeoutError, dpool.WorkerStartError) as exc:
        failed += 1
        errors.add(type(exc).__name__)
        opt.zero_grad()  # (a failed step left the master and its gradients as they were: dropped, and retried)
        worst = max(worst, time.monotonic() - t0)
        continue
    opt.step()
    opt.zero_grad()
    ok.append(i % len(batches))
    i += 1
stop.set()
thread.join()
for p in workers():  # a worker stopped by the last fault
    try:
        p.send_signal(signal.SIGCONT)
    except psutil.Error:
        pass
x, y = batches[0]
for attempt in range(3):  # the pool is usable after it all (a last fault may leave a restart to finish first)
    try:
        (model(x) - y).pow(2).mean().backward()
        break
    except (dpool.WorkerDiedError, dpool.WorkerTimeoutError, dpool.WorkerStartError):
        opt.zero_grad()
else:
    raise AssertionError("the pool did not recover after the faults stopped")
""" + _REPLAY + """restarts = model.stats()["restarts"]
model.close()
print("RESULT " + json.dumps({{"ok": len(ok), "failed": failed, "faults": len(faults), "diff": diff,
                              "restarts": restarts, "errors": sorted(errors), "worst_s": worst}}))
"""


# ------------------------------------------------------------------------------- typed refusals
def test_every_refusal_to_reach_a_pool_is_dpools_and_still_the_builtin_type(tmp_path, monkeypatch):
    from tests.test_daemon import _running_pool

    with pytest.raises(dpool.DpoolValueError, match=r"tcp://127\.0\.0\.1:9.*DPOOL_KEY_FILE") as e:
        monkeypatch.delenv("DPOOL_KEY_FILE", raising=False)
        dpool.wrap(nn.Linear(2, 2), pool="tcp://127.0.0.1:9")
    assert isinstance(e.value, ValueError)
    with pytest.raises(dpool.PoolNotFoundError, match="no dpool-workers pool named 'nosuchpool"):
        dpool.wrap(nn.Linear(2, 2), pool="nosuchpool" + uuid.uuid4().hex[:6])
    key = tmp_path / "key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o644)  # a key others may read
    monkeypatch.setenv("DPOOL_KEY_FILE", str(key))
    with pytest.raises(dpool.PoolPermissionError, match=rf"{key}, must be owned by uid .* mode 0600") as e:
        dpool.wrap(nn.Linear(2, 2), pool="tcp://127.0.0.1:9")
    assert isinstance(e.value, PermissionError)
    if os.geteuid() == 0:  # another user's file (only root can make one)
        key.chmod(0o600)
        os.chown(key, 65534, 65534)
        with pytest.raises(dpool.PoolPermissionError, match=rf"{key}, must be owned by uid"):
            dpool.wrap(nn.Linear(2, 2), pool="tcp://127.0.0.1:9")
    monkeypatch.setenv("DPOOL_KEY_FILE", str(tmp_path / "missing"))
    with pytest.raises(dpool.PoolNotFoundError, match="missing, does not exist"):
        dpool.wrap(nn.Linear(2, 2), pool="tcp://127.0.0.1:9")

    started = _running_pool("--listen", "0")
    name, _ = next(started)
    try:
        from tests.test_daemon import status

        listen = status(name)["listen"]
        wrong = tmp_path / "wrong"
        wrong.write_bytes(os.urandom(32))
        wrong.chmod(0o600)
        monkeypatch.setenv("DPOOL_KEY_FILE", str(wrong))
        with pytest.raises(dpool.AuthError, match=rf"rejected this client's key: the key file DPOOL_KEY_FILE names "
                                                  rf"\({wrong}\)") as e:
            dpool.wrap(nn.Linear(2, 2), pool=listen)
        assert isinstance(e.value, TimeoutError)
        from dpool.daemon_client import pool_dir

        real = pool_dir(name) + "/key"
        monkeypatch.setenv("DPOOL_KEY_FILE", real)
        with dpool.wrap(nn.Linear(2, 2), pool=listen) as model:  # the right key still attaches
            model(torch.randn(4, 2)).sum().backward()
        os.chmod(real, 0o644)  # a key others may read: refused, naming it
        with pytest.raises(dpool.PoolPermissionError, match=rf"the key of pool {name!r}, {real}"):
            dpool.wrap(nn.Linear(2, 2), pool=name)
        os.chmod(real, 0o600)
    finally:
        next(started, None)


# ------------------------------------------------------------------------------- replayed messages
class Relay:
    """A ZeroMQ relay between clients and a daemon that records every frame the clients send: what someone
    watching the traffic would have. Each client connection gets a connection of its own to the daemon."""

    def __init__(self, ctx, daemon: str, front: str) -> None:
        import threading

        import zmq

        self.zmq, self.ctx, self.daemon = zmq, ctx, daemon
        self.front = ctx.socket(zmq.ROUTER)
        self.front.bind(front)
        self.endpoint = self.front.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.recorded: list[bytes] = []
        self._backs: dict[bytes, object] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        zmq = self.zmq
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(50):
                if sock is self.front:
                    ident, *frames = self.front.recv_multipart()
                    back = self._backs.get(ident)
                    if back is None:
                        back = self._backs[ident] = self.ctx.socket(zmq.DEALER)
                        back.setsockopt(zmq.LINGER, 0)
                        back.connect(self.daemon)
                        poller.register(back, zmq.POLLIN)
                    self.recorded.extend(frames)
                    back.send_multipart(frames)
                else:
                    ident = next(i for i, b in self._backs.items() if b is sock)
                    self.front.send_multipart([ident, *sock.recv_multipart()])
        for back in self._backs.values():
            back.close()
        self.front.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if self.endpoint.startswith("ipc://"):  # (libzmq leaves a bound ipc socket's file behind)
            try:
                os.unlink(self.endpoint[len("ipc://"):])
            except FileNotFoundError:
                pass


def _replay(ctx, daemon: str, frames: list[bytes], wait_ms: int = 1500) -> list[bytes]:
    """Send ``frames`` again from a new connection; what came back."""
    import zmq

    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, b"replay" + uuid.uuid4().hex[:6].encode())
    sock.connect(daemon)
    try:
        for f in frames:
            sock.send(f)
        got = []
        while sock.poll(wait_ms):
            got.append(sock.recv())
        return got
    finally:
        sock.close()


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_a_recorded_request_replayed_or_rerouted_has_no_effect_and_no_answer(transport, monkeypatch):
    import zmq

    from dpool import attach as attach_module, daemon_client
    from tests.test_daemon import _running_pool, status

    started = _running_pool("--listen", "0")
    name, _ = next(started)
    ctx = zmq.Context()
    relay = None
    try:
        info = status(name)
        endpoint = info["listen"] if transport == "tcp" else "ipc://" + daemon_client.pool_dir(name) + "/daemon.sock"
        relay = Relay(ctx, endpoint, "tcp://127.0.0.1:0" if transport == "tcp" else
                      f"ipc://{daemon_client.runtime_dir()}/relay-{uuid.uuid4().hex[:6]}.sock")
        real_locate = daemon_client.locate

        def through_relay(pool: str):
            _, key, label = real_locate(name)
            return relay.endpoint, key, label + " (through a relay)"

        for module in (daemon_client, attach_module):  # the client's traffic goes through the relay
            monkeypatch.setattr(module, "locate", through_relay)
        torch.manual_seed(0)
        net = nn.Linear(4, 3)
        ref = copy.deepcopy(net)
        model = dpool.wrap(net, pool=name)
        x = torch.randn(6, 4)
        model(x).sum().backward()
        ref(x).sum().backward()
        challenge_ask, attach = relay.recorded[0], relay.recorded[1]  # (the first connection: challenge, attach)
        pids = [w["pid"] for w in status(name)["workers"]]
        # the attach replayed from another connection, alone and after a challenge of its own
        assert _replay(ctx, endpoint, [attach]) == []
        got = _replay(ctx, endpoint, [challenge_ask, attach])
        assert len(got) == 1  # (only the challenge is answered: a new one, which the replayed attach does not carry)
        model(x).sum().backward()  # the real client trains on, with its lease
        ref(x).sum().backward()
        for p, q in zip(net.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
        model.close()
        assert _replay(ctx, endpoint, [attach]) == []  # and after it left: the pool is not leased to its pid
        monkeypatch.undo()
        after = status(name)
        assert after["client_pid"] is None and after["requests_dropped"] == 3, after
        assert [w["pid"] for w in after["workers"]] == pids and all(w["restarts"] == 0 for w in after["workers"])
        with dpool.wrap(nn.Linear(4, 3), pool=name) as again:  # the next real client attaches
            again(x).sum().backward()
    finally:
        if relay is not None:
            relay.close()
        ctx.term()
        next(started, None)


def test_an_attach_naming_a_missing_control_segment_is_refused_and_no_worker_dies():
    from dpool import protocol as P
    from dpool.daemon_client import request
    from tests.test_daemon import _running_pool, status

    started = _running_pool()
    name, _ = next(started)
    try:
        pids = [w["pid"] for w in status(name)["workers"]]
        ask = P.Attach(os.getpid(), "ipc:///nonexistent", os.urandom(32), ["dpool-0-1-gone-1", 4096],
                       P.PROTOCOL_VERSION, 1 << 20)
        reply = request(name, ask)
        assert not reply.ok and "control segment" in reply.error, reply
        info = status(name)
        assert info["client_pid"] is None and [w["pid"] for w in info["workers"]] == pids
        with dpool.wrap(nn.Linear(4, 3), pool=name) as model:
            model(torch.randn(6, 4)).sum().backward()
    finally:
        next(started, None)


DAEMON_CHAOS = """
import copy, json, os, random, signal, threading, time
import psutil, torch
from torch import nn
import dpool

NAME, SECONDS, SEED = {name!r}, {seconds}, {seed}
daemon = psutil.Process({daemon_pid})
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()
ref = copy.deepcopy(net)
opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
batches = [(torch.randn(6, 8, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)) for _ in range(8)]
stop = threading.Event()
faults = []
FAILURES = (dpool.WorkerDiedError, dpool.WorkerTimeoutError, dpool.WorkerStartError, dpool.PoolBrokenError)


def chaos():
    # a fault at a random moment, once the client made progress since the last one (or 5 s after it): the
    # daemon must replace what a fault hit before a client can attach, which on a loaded machine takes
    # longer than the gap between faults, and then no step would ever run
    rng = random.Random(SEED)
    last, done = time.monotonic(), 0
    while not stop.wait(rng.uniform(0.2, 1.5)):
        if len(ok) == done and time.monotonic() - last < 5:
            continue
        last, done = time.monotonic(), len(ok)
        try:
            victim = rng.choice(daemon.children())
            sig = rng.choice([signal.SIGKILL, signal.SIGSTOP])
            victim.send_signal(sig)
            faults.append(sig.name)
        except (IndexError, psutil.Error):
            pass


def wrap():
    return dpool.wrap(net, pool=NAME, heartbeat_timeout_s=1.5, startup_timeout_s=15, step_timeout_s=20)


ok, failed, worst = [], 0, 0.0
thread = threading.Thread(target=chaos, daemon=True)
thread.start()
model, i, end = None, 0, time.monotonic() + SECONDS
while time.monotonic() < end:
    t0 = time.monotonic()
    try:
        if model is None:
            model = wrap()
        x, y = batches[i % len(batches)]
        (model(x) - y).pow(2).mean().backward()
    except FAILURES:
        failed += 1
        worst = max(worst, time.monotonic() - t0)
        opt.zero_grad()
        if model is not None:
            model.close()
            model = None
        continue
    opt.step()
    opt.zero_grad()
    ok.append(i % len(batches))
    i += 1
stop.set()
thread.join()
for p in daemon.children():
    try:
        p.send_signal(signal.SIGCONT)
    except psutil.Error:
        pass
if model is not None:
    model.close()
for attempt in range(20):  # the daemon pool is usable again once it replaced what the faults hit
    try:
        with wrap() as model:
            x, y = batches[0]
            (model(x) - y).pow(2).mean().backward()
        break
    except FAILURES:
        time.sleep(0.5)
else:
    raise AssertionError("the daemon pool did not recover after the faults stopped")
""" + _REPLAY + """print("RESULT " + json.dumps({{"ok": len(ok), "failed": failed, "faults": len(faults), "diff": diff,
                              "worst_s": worst}}))
"""


def _rounding(steps: int) -> float:
    """How far float64 training may drift from its one-process replay by rounding alone after ``steps`` steps
    (the shards' gradients are summed in another order; momentum carries each difference on): a lost or doubled
    step moves the parameters by about lr × gradient, billions of times more."""
    return 1e-14 * max(steps, 100)


@pytest.mark.timeout(300)
def test_faults_at_any_moment_keep_the_pool_usable_and_nothing_is_lost():
    """Random SIGKILL and SIGSTOP of random workers for 30-40 s, side by side: in two coordinators with
    ``max_restarts`` (the workers being restarted included), and on a dpool-workers pool's workers while a
    client trains (a worker frozen while no client holds it included). Every failed call raises a typed error
    within a bound, the next one runs (after a new ``wrap()`` on the daemon pool, once the daemon replaced the
    worker), and the master equals a one-process replay of exactly the steps that succeeded."""
    from tests.helpers import run_scripts, script_result
    from tests.test_daemon import _running_pool, status

    started = _running_pool()
    name, _ = next(started)
    try:
        scripts = [CHAOS.format(seconds=30, seed=s) for s in (1, 2)]
        scripts.append(DAEMON_CHAOS.format(name=name, seconds=40, seed=3, daemon_pid=status(name)["pid"]))
        embedded_1, embedded_2, attached = (script_result(r) for r in run_scripts(scripts, timeout=240))
        for r in (embedded_1, embedded_2):
            assert r["faults"] >= 20 and r["restarts"] >= 10 and r["ok"] >= 5, r  # (the steps between faults)
            assert r["diff"] < _rounding(r["ok"]), r
            # a failed call's bound: RESTART_TRIES restarts, each within the startup timeout, after the heartbeat's
            assert r["worst_s"] < 3 * 15 + 2 * 1.5 + 10, r
        assert attached["faults"] >= 6 and attached["ok"] >= 5 and attached["failed"] >= 1, attached
        assert attached["diff"] < _rounding(attached["ok"]), attached
        assert attached["worst_s"] < 3 * 15 + 10, attached
        info = status(name)
        assert info["client_pid"] is None and sum(w["restarts"] for w in info["workers"]) >= 3, info
    finally:
        next(started, None)


def test_a_shared_memory_directory_that_does_not_exist_is_a_shared_memory_error(tmp_path):
    """It was a bare FileNotFoundError from os.statvfs, naming neither dpool nor DPOOL_SHM_DIR."""
    missing = str(tmp_path / "no-such-dir")
    with pytest.raises(dpool.SharedMemoryError, match=rf"{missing} cannot be used .*DPOOL_SHM_DIR"):
        dpool.wrap(torch.nn.Linear(3, 2), ["cpu", "cpu"], shm_dir=missing)
