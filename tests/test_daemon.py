"""The dpool-workers daemon, driven through its real CLI in subprocesses."""
from __future__ import annotations

import copy
import json
import os
import re
import signal
import stat
import subprocess
import sys
import uuid

import psutil
import pytest
import torch

import dpool
from tests.conftest import wait_for
from tests.helpers import PYPATH, ROOT, run_script, run_scripts, running, script_result

pytestmark = pytest.mark.slow


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=PYPATH)
    return subprocess.run([sys.executable, "-m", "dpool_workers.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def status(name: str) -> dict:
    res = cli("status", "--name", name, "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def all_pids(name: str) -> list[int]:
    info = status(name)
    return [info["pid"]] + [w["pid"] for w in info["workers"]]


def _running_pool(*start_args: str):
    """Start a pool (2 CPU workers); yield (name, start's output); stop it and check every process is gone."""
    name = "t" + uuid.uuid4().hex[:8]
    res = cli("start", "--name", name, "--device-ids", "cpu,cpu", *start_args)
    assert res.returncode == 0, res.stderr
    pids = all_pids(name)
    yield name, res
    cli("stop", "--name", name)
    assert wait_for(lambda: not any(running(p) for p in pids), timeout=10), "daemon or workers left"


def _idle(name: str) -> bool:
    """Whether the pool answers, has no client, and all its workers are idle (within 10 s)."""
    def check() -> bool:
        res = cli("status", "--name", name, "--json")
        if res.returncode != 0:
            return False
        info = json.loads(res.stdout)
        return info["client_pid"] is None and all(w["state"] == "idle" for w in info["workers"])

    return wait_for(check, timeout=10, interval=0.2)


@pytest.fixture(scope="module")
def _shared_pool():
    """The module's one pool for :func:`pool_name`: {"name", "stop"} while one runs."""
    held: dict = {}
    yield held
    if held:
        held["stop"]()


@pytest.fixture
def pool_name(_shared_pool):
    """A started pool (2 CPU workers), shared by the tests that leave it idle, as a daemon serves script
    after script for its users (and a start costs 2.4 s here). After a test that leaves it otherwise
    (a client still attached, a worker not back, no answer) it is stopped, checked gone, and the next
    test gets a new one. The last one is stopped, and checked gone, after the module."""
    if not _shared_pool:
        started = _running_pool()
        name, _ = next(started)
        _shared_pool.update(name=name, stop=lambda: next(started, None))
    yield _shared_pool["name"]
    if not _idle(_shared_pool["name"]):
        stop = _shared_pool.pop("stop")
        _shared_pool.clear()  # (first: a stop that finds a process left fails this test, not every next one)
        stop()


TRAIN = """
import json, os, sys, torch, dpool
from tests import models
net = models.make("cnn")
model = dpool.wrap(net{kw})
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
for step, n in enumerate([11, 7, 9]):
    (x,), _ = models.batch("cnn", n, seed=step)
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
model.close()
print("STATE " + json.dumps([t.tolist() for t in net.state_dict().values()]))
"""


def _final_state(res: subprocess.CompletedProcess) -> list:
    assert res.returncode == 0, res.stderr
    return json.loads([l for l in res.stdout.splitlines() if l.startswith("STATE ")][-1][6:])


def test_attached_training_equals_embedded_and_status(pool_name):
    # the embedded run beside the first attached one (the daemon serves one client at a time)
    embedded, attached = map(_final_state, run_scripts([TRAIN.format(kw=', ["cpu", "cpu"]'),
                                                        TRAIN.format(kw=f', pool={pool_name!r}')]))
    via_env = _final_state(run_script(TRAIN.format(kw=""), env={"DPOOL_POOL": pool_name}))  # no code change
    assert attached == embedded == via_env  # bit for bit
    info = status(pool_name)
    assert info["client_pid"] is None and info["steps_served"] >= 6
    assert [w["state"] for w in info["workers"]] == ["idle", "idle"]
    assert all(w["rss_bytes"] > 0 and w["uptime_s"] > 0 for w in info["workers"])
    human = cli("status", "--name", pool_name)
    assert human.returncode == 0 and "idle" in human.stdout and "steps served" in human.stdout


PATCHED = """
import torch, dpool, warnings
from torch import nn
warnings.simplefilter("error")
if {patch}:  # a library patched at run time: the daemon's workers run it in this session only
    nn.Tanh.forward = lambda self, x: torch.tanh(x) * 2
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
x = torch.randn(8, 4)
with torch.no_grad():
    expected = net(x)
    model = dpool.wrap(net, pool={pool!r})
    torch.testing.assert_close(model(x), expected)
model.close()
print("OK")
"""


def test_a_sessions_patched_code_stays_in_that_session(pool_name):
    """The daemon's workers outlive a session: a library patched by one session must be patched in the
    workers for it (as in one process), and be the library's own code again for the next."""
    for patch in (True, False):
        res = run_script(PATCHED.format(patch=patch, pool=pool_name))
        assert res.returncode == 0 and "OK" in res.stdout, (patch, res.stderr[-3000:])


def test_attached_workers_prints_reach_the_client_labelled(pool_name):
    code = f"""
    import sys, torch, dpool

    class Chatty(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(5, 2)
        def forward(self, x):
            print("In model: input size", tuple(x.shape))
            print("partial", end="")
            print(" line", flush=True)
            print("to stderr", file=sys.stderr)
            return self.lin(x)

    with dpool.wrap(Chatty(), pool={pool_name!r}) as model:
        model(torch.randn(30, 5)).sum().backward()
    print("done")
    """
    res = run_script(code)
    assert res.returncode == 0, res.stderr
    for i in (0, 1):
        assert f"[dpool worker {i}] In model: input size (15, 5)" in res.stdout
        assert f"[dpool worker {i}] partial line" in res.stdout
        assert f"[dpool worker {i}] to stderr" in res.stderr
    assert res.stdout.rstrip().endswith("done")


def test_files_are_private_and_no_tcp_listener(pool_name):
    from dpool.daemon_client import pool_dir

    d = pool_dir(pool_name)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(os.path.join(d, "key")).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.join(d, "daemon.sock")).st_mode) == 0o600
    for pid in all_pids(pool_name):
        assert not [c for c in psutil.Process(pid).net_connections(kind="inet")], "a TCP/UDP socket is open"


@pytest.fixture
def tcp_pool():
    """A pool started with ``--listen 0``: (name, tcp endpoint, key file)."""
    from dpool.daemon_client import pool_dir

    for name, res in _running_pool("--listen", "0"):
        endpoint = status(name)["listen"]
        assert "listening on " + endpoint in res.stderr
        yield name, endpoint, os.path.join(pool_dir(name), "key")


def test_tcp_listener_only_when_asked_on_loopback_and_authenticated(tcp_pool, tmp_path):
    name, endpoint, key_file = tcp_pool
    host, port = endpoint[len("tcp://"):].rsplit(":", 1)
    assert host == "127.0.0.1"
    info = status(name)
    listening = [c for c in psutil.Process(info["pid"]).net_connections(kind="inet") if c.status == "LISTEN"]
    assert [(c.laddr.ip, c.laddr.port) for c in listening] == [("127.0.0.1", int(port))]
    for w in info["workers"]:
        assert not psutil.Process(w["pid"]).net_connections(kind="inet")
    # Training over the TCP attach equals an embedded pool bit for bit (the two run side by side).
    embedded, over_tcp = map(_final_state, run_scripts([TRAIN.format(kw=', ["cpu", "cpu"]'),
                                                        TRAIN.format(kw=f", pool={endpoint!r}")],
                                                       env={"DPOOL_KEY_FILE": key_file}))
    assert over_tcp == embedded
    # No key: a clear error before anything is sent. A wrong key: nothing decoded, and the client is told
    # the key was rejected (dpool.AuthError), naming the key file. (Side by side too.)
    wrong = tmp_path / "wrong.key"
    wrong.write_bytes(os.urandom(32))
    wrong.chmod(0o600)
    attempt = f"import os\nos.environ['DPOOL_KEY_FILE'] = {{key!r}}\nimport dpool, torch\ndpool.wrap(torch.nn.Linear(2, 2), pool={endpoint!r})"
    no_key, wrong_key = run_scripts([attempt.format(key=""), attempt.format(key=str(wrong))])
    assert no_key.returncode != 0 and "DPOOL_KEY_FILE" in no_key.stderr
    assert wrong_key.returncode != 0 and "KeyRejectedError" in wrong_key.stderr and str(wrong) in wrong_key.stderr
    assert status(name)["client_pid"] is None


def test_listen_argument_parsing():
    from dpool_workers.cli import parse_listen

    assert parse_listen("0") == "tcp://127.0.0.1:0"  # loopback unless a host is given
    assert parse_listen("10.0.0.5:7000") == "tcp://10.0.0.5:7000"
    assert parse_listen("[::1]:0") == "tcp://[::1]:0"
    for bad in ("x", "1:99999", "host:"):
        with pytest.raises(ValueError, match="PORT or HOST:PORT"):
            parse_listen(bad)
    res = cli("start", "--name", "t" + uuid.uuid4().hex[:8], "--listen", "nope")
    assert res.returncode == 2 and "PORT or HOST:PORT" in res.stderr


def test_relay_on_the_tcp_path_never_sees_the_model_or_a_key(tcp_pool, monkeypatch):
    """A process without the key that sits between client and daemon (it took the port the client
    was given, and forwards to the real one) sees only authenticated requests and replies: no session
    key, no model. Training still works, since the workers connect to the client directly."""
    import threading

    import zmq

    from dpool import protocol as P
    from dpool.daemon_client import read_key_file

    name, endpoint, key_file = tcp_pool
    monkeypatch.setenv("DPOOL_KEY_FILE", key_file)
    ctx = zmq.Context()
    front = ctx.socket(zmq.ROUTER)
    front.setsockopt(zmq.LINGER, 0)
    port = front.bind_to_random_port("tcp://127.0.0.1")
    backs: dict[bytes, zmq.Socket] = {}  # one upstream connection per client connection
    seen: list[bytes] = []
    done = threading.Event()

    def relay() -> None:
        poller = zmq.Poller()
        poller.register(front, zmq.POLLIN)
        while not done.is_set():
            events = dict(poller.poll(50))
            if front in events:
                ident, *frames = front.recv_multipart()
                seen.extend(frames)
                if ident not in backs:
                    backs[ident] = ctx.socket(zmq.DEALER)
                    backs[ident].setsockopt(zmq.LINGER, 0)
                    backs[ident].connect(endpoint)
                    poller.register(backs[ident], zmq.POLLIN)
                backs[ident].send_multipart(frames)
            for ident, back in backs.items():
                if back in events:
                    frames = back.recv_multipart()
                    seen.extend(frames)
                    front.send_multipart([ident, *frames])

    t = threading.Thread(target=relay)
    t.start()
    marker = "model-secret-" + uuid.uuid4().hex
    net = torch.nn.Linear(2, 2)
    net.secret = marker
    try:
        with dpool.wrap(net, pool=f"tcp://127.0.0.1:{port}") as model:
            model(torch.randn(6, 2)).sum().backward()
        assert net.weight.grad is not None
    finally:
        done.set()
        t.join()
        front.close()
        for back in backs.values():
            back.close()
        ctx.term()
    pool_key = read_key_file(key_file)
    msgs = [P.Codec(pool_key).decode([f])[2] for f in seen]  # all of it authenticated with the pool key
    attach = [m for m in msgs if isinstance(m, P.Attach)]
    assert len(attach) == 1 and any(isinstance(m, P.AttachDone) and m.ok for m in msgs)
    session = P.session_key(pool_key, attach[0].nonce)
    assert not any(session in f or marker.encode() in f for f in seen)


def test_second_start_is_refused(pool_name):
    res = cli("start", "--name", pool_name)
    assert res.returncode == 4 and "already running" in res.stderr


def test_stop_and_status_of_a_missing_pool():
    res = cli("status", "--name", "nosuchpool")
    assert res.returncode == 3 and "no dpool-workers pool named 'nosuchpool'" in res.stderr
    assert cli("stop", "--name", "nosuchpool").returncode == 3


HOLD = """
import sys, time, torch, dpool
model = dpool.wrap(torch.nn.Linear(4, 4), pool={name!r})
model(torch.randn(4, 4)).sum().backward()
print("ATTACHED", flush=True)
{then}
"""


def test_one_client_at_a_time_and_clean_handover_after_sigkill(pool_name):
    holder = subprocess.Popen([sys.executable, "-c", HOLD.format(name=pool_name, then="time.sleep(60)")],
                              stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=PYPATH))
    try:
        assert holder.stdout.readline().strip() == "ATTACHED"
        with pytest.raises(dpool.WorkerStartError, match=f"in use by pid {holder.pid}"):
            dpool.wrap(torch.nn.Linear(4, 4), pool=pool_name)
        assert status(pool_name)["client_pid"] == holder.pid
        holder.kill()  # SIGKILL: the daemon must reclaim everything by itself
        holder.wait()
        assert wait_for(lambda: status(pool_name)["client_pid"] is None
                        and all(w["state"] == "idle" for w in status(pool_name)["workers"]), timeout=5)
    finally:
        holder.kill()
        holder.wait()
    with dpool.wrap(torch.nn.Linear(4, 4), pool=pool_name) as model:  # ready for the next script
        model(torch.randn(6, 4)).sum().backward()


def test_a_model_dropped_without_close_gives_the_lease_back(pool_name):
    """A notebook cell that runs `model = dpool.wrap(net, pool=...)` again drops the previous model
    without close(). Its lease used to stay taken until the interpreter exited ("in use by pid <this
    one>"), its workers serving a session nobody used. Now the dropped pool tells the workers to drop its
    replica and frees the lease when it is collected, and the next wrap() attaches."""
    import gc

    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    ref = copy.deepcopy(net)
    for _ in range(3):
        model = dpool.wrap(net, pool=pool_name)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)  # (torch's optimizer keeps a cycle: gc is needed)
        x = torch.randn(6, 6)
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        assert status(pool_name)["client_pid"] == os.getpid()
        del model, opt
        gc.collect()
        assert wait_for(lambda: status(pool_name)["client_pid"] is None
                        and all(w["state"] == "idle" for w in status(pool_name)["workers"]), timeout=5)
        ref(x).sum().backward()
        with torch.no_grad():
            for p in ref.parameters():
                p -= 0.1 * p.grad
                p.grad = None
    for p, r in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p, r)


def test_memory_does_not_grow_across_attach_cycles(pool_name):
    def rss() -> list[int]:
        return [w["rss_bytes"] for w in status(pool_name)["workers"]]

    net = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])  # 4 MiB of parameters
    x = torch.randn(64, 512)
    samples = []
    for cycle in range(6):
        with dpool.wrap(net, pool=pool_name) as model:
            model(x).sum().backward()
        assert wait_for(lambda: all(w["state"] == "idle" for w in status(pool_name)["workers"]), timeout=5)
        samples.append(rss())
    growth = [b - a for a, b in zip(samples[1], samples[-1])]
    assert max(growth) < 32 * 2**20, f"worker RSS grew by {growth} bytes over 4 attach/detach cycles"


def test_heap_kept_while_serving_is_given_back_on_detach(pool_name):
    """Workers keep freed memory while a client trains (see worker_env), and trim it between clients."""
    from tests.test_semantics import BigActivation

    def rss() -> list[int]:
        return [w["rss_bytes"] for w in status(pool_name)["workers"]]

    with dpool.wrap(torch.nn.Linear(4, 4), pool=pool_name) as model:
        model(torch.randn(8, 4)).sum().backward()
    assert wait_for(lambda: all(w["state"] == "idle" for w in status(pool_name)["workers"]), timeout=5)
    idle = rss()
    with dpool.wrap(BigActivation(), pool=pool_name) as model:
        for _ in range(3):
            model(torch.randn(8, 4)).sum().backward()
        serving = rss()
    assert wait_for(lambda: all(w["state"] == "idle" for w in status(pool_name)["workers"]), timeout=5)
    after = rss()
    assert all(s - i > 40 * 2**20 for s, i in zip(serving, idle)), (idle, serving)  # 48 MiB kept while serving
    assert all(a - i < 16 * 2**20 for a, i in zip(after, idle)), (idle, serving, after)


def test_worker_dying_inside_the_daemon(pool_name):
    restarts = status(pool_name)["workers"][1]["restarts"]
    model = dpool.wrap(torch.nn.Linear(4, 4), pool=pool_name)
    victim = model.pids[1]
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(dpool.WorkerDiedError, match=f"pid {victim}.*daemon restarts it"):
        model(torch.randn(8, 4))
    model.close()
    assert wait_for(lambda: all(w["state"] == "idle" for w in status(pool_name)["workers"]), timeout=30)
    info = status(pool_name)
    assert info["workers"][1]["restarts"] == restarts + 1 and info["workers"][1]["pid"] != victim
    with dpool.wrap(torch.nn.Linear(4, 4), pool=pool_name) as again:  # the client can carry on
        again(torch.randn(8, 4)).sum().backward()


def test_foreign_key_is_rejected_before_decoding_and_unserved_ops_get_an_error(pool_name, tmp_path):
    import zmq

    from dpool import protocol as P
    from dpool.daemon_client import read_pool

    canary = tmp_path / "canary"

    class Canary:
        def __reduce__(self):
            return (open, (str(canary), "w"))

    import pickle

    state, _ = read_pool(pool_name)
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(state["endpoint"])
    wrong = P.Codec(b"w" * 32)
    s.send(wrong.encode(P.Call(pickle.dumps(Canary())), 1))  # wrong key
    s.send(b"\x00" * 32 + pickle.dumps(Canary()))  # no key at all
    from dpool.channel import KEY_REJECTED

    # nothing decoded; the only answer is the constant that says the key was wrong, once per connection
    assert s.poll(2000) and s.recv_multipart() == [KEY_REJECTED]
    assert not s.poll(500), "the daemon answered an unauthenticated peer with more than the key's rejection"
    s.close()
    ctx.term()
    assert not canary.exists()
    assert status(pool_name)["client_pid"] is None  # and it is still serving
    # an authenticated op that a daemon does not serve is answered with an error, not silence
    from dpool.daemon_client import request

    with pytest.raises(dpool.ProtocolError, match=r"does not serve 'inspect' requests"):
        request(pool_name, P.Inspect([]), timeout=10)
    assert status(pool_name)["client_pid"] is None


def test_daemon_killed_mid_step_then_restart_cleans_up():
    name = "t" + uuid.uuid4().hex[:8]
    try:
        _daemon_killed_mid_step(name)
    finally:  # whatever failed above, no daemon may outlive the test
        cli("stop", "--name", name)


def _daemon_killed_mid_step(name: str) -> None:
    assert cli("start", "--name", name, "--device-ids", "cpu,cpu").returncode == 0
    pids = all_pids(name)
    code = f"""
    import os, signal, threading, time, torch, dpool
    from tests.helpers import snapshot, assert_unchanged

    class Slow(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
        def forward(self, x):
            time.sleep(5)
            return self.lin(x)

    net = Slow()
    model = dpool.wrap(net, pool={name!r})
    before = snapshot(net)
    threading.Timer(0.5, lambda: os.kill({pids[0]}, signal.SIGKILL)).start()
    t = time.monotonic()
    try:
        model(torch.randn(4, 4))
    except dpool.DaemonLostError as e:
        assert_unchanged(before, snapshot(net))
        print("LOST", round(time.monotonic() - t, 2), str(e).splitlines()[0])
    """
    res = run_script(code)
    assert res.returncode == 0, res.stderr
    line = [l for l in res.stdout.splitlines() if l.startswith("LOST")][0]
    assert "daemon of pool" in line and "is gone" in line and float(line.split()[1]) < 5
    assert wait_for(lambda: not any(running(p) for p in pids), timeout=10)
    # the crashed daemon left its state file behind; the next start cleans up and works
    assert cli("start", "--name", name, "--device-ids", "cpu").returncode == 0
    pids = all_pids(name)
    with dpool.wrap(torch.nn.Linear(4, 4), pool=name) as model:
        model(torch.randn(4, 4)).sum().backward()
    assert cli("stop", "--name", name).returncode == 0
    assert wait_for(lambda: not any(running(p) for p in pids), timeout=10)


def test_list_version_and_status_without_name(tmp_path):
    """Anchors: docker ps, systemctl. A private runtime dir makes this pool the only one."""
    env = dict(os.environ, PYTHONPATH=PYPATH, XDG_RUNTIME_DIR=str(tmp_path))

    def run(*args):
        return subprocess.run([sys.executable, "-m", "dpool_workers.cli", *args], capture_output=True, text=True,
                              timeout=120, env=env, cwd=ROOT)

    with open(os.path.join(ROOT, "pyproject.toml")) as f:  # (tomllib is Python 3.11's)
        version = re.search(r'^version = "([^"]+)"$', f.read(), re.M).group(1)  # type: ignore[union-attr]
    assert dpool.__version__ == version
    assert run("--version").stdout.strip() == f"dpool-workers {version}"
    assert run("status").returncode == 3 and json.loads(run("list", "--json").stdout) == []
    assert run("start", "--name", "solo", "--device-ids", "cpu").returncode == 0
    try:
        pools = json.loads(run("list", "--json").stdout)
        assert [(p["name"], p["devices"], p["state"], p["client_pid"]) for p in pools] == [("solo", ["cpu"], "idle",
                                                                                               None)]
        assert pools[0]["uptime_s"] >= 0 and "solo" in run("list").stdout
        res = run("status", "--json")  # no --name: the one running pool
        assert res.returncode == 0 and json.loads(res.stdout)["name"] == "solo"
        pid = json.loads(res.stdout)["pid"]
    finally:
        assert run("stop").returncode == 0  # no --name either
    assert wait_for(lambda: not running(pid), timeout=10)


def test_steps_served_is_live_and_the_log_is_timestamped(pool_name):
    import re

    from dpool.daemon_client import pool_dir

    before = status(pool_name)["steps_served"]
    with dpool.wrap(torch.nn.Linear(4, 4), pool=pool_name) as model:
        for _ in range(3):
            model(torch.randn(4, 4)).sum().backward()
        info = status(pool_name)  # while the client is still attached
        assert info["client_pid"] == os.getpid() and info["steps_served"] == before + 3
        print("from the replica", flush=True)
    assert wait_for(lambda: status(pool_name)["client_pid"] is None, timeout=10)
    with open(os.path.join(pool_dir(pool_name), "daemon.log")) as f:
        lines = [l for l in f.read().splitlines() if l.strip()]
    stamp = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")
    assert lines and all(stamp.match(l) for l in lines), [l for l in lines if not stamp.match(l)][:5]
    text = "\n".join(lines)
    assert "starting 2 worker(s)" in text and "ready: 2 worker(s)" in text
    assert f"client {os.getpid()} attached" in text and f"client {os.getpid()} detached" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_gpu_device_ids_without_a_gpu_are_a_usage_error():
    """`--device-ids 0,0` follows wrap()'s rules (dpool.devices): no GPU here, so exit 2 and say why."""
    name = "t" + uuid.uuid4().hex[:8]
    res = cli("start", "--name", name, "--device-ids", "0,0")
    assert res.returncode == 2 and "name GPUs, but torch sees none" in res.stderr, res.stderr
    assert cli("status", "--name", name).returncode == 3  # nothing was started
    from dpool.daemon_client import runtime_dir

    assert not os.path.exists(os.path.join(runtime_dir(), "pools", name))  # nor created
    res = cli("start", "--name", name, "--device-ids", "cpu,tpu")
    assert res.returncode == 2 and "'tpu' is not a device" in res.stderr, res.stderr


ATTACH_CUT = """
import copy, gc, json, time, torch, dpool
from torch import nn
from dpool import attach, daemon_client, pool
from tests.helpers import CtrlC

torch.manual_seed(0)
net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
ref = copy.deepcopy(net)
wrap = lambda: dpool.wrap(net, pool={name!r}, startup_timeout_s=10)
positions = CtrlC.positions([attach.Lease.start, daemon_client.request, pool.Pool.start], lambda: wrap().close())
bad, missed = [], 0
for code, offset in positions:
    with CtrlC(code, offset) as cut:
        try:
            wrap().close()  # (reached only if the Ctrl-C came in close())
        except KeyboardInterrupt:
            pass
    missed += not cut.hit
    gc.collect()
    t = time.monotonic()
    try:
        m = wrap()
        y = torch.randn(6, 4, dtype=torch.float64)
        same = torch.allclose(m(y), ref(y), rtol=1e-12, atol=1e-12)
        m.close()
        if not same:
            bad.append([code.co_name, offset, "wrong numbers"])
    except Exception as e:
        bad.append([code.co_name, offset, f"{{type(e).__name__}}: {{str(e)[:200]}}"])
    if time.monotonic() - t > 5:  # a wrap that waited for busy workers (attach takes ~0.1 s)
        bad.append([code.co_name, offset, f"the next wrap took {{time.monotonic() - t:.1f}} s"])
print("RESULT " + json.dumps({{"positions": len(positions), "missed": missed, "bad": bad}}))
"""


@pytest.mark.timeout(300)
def test_ctrl_c_anywhere_while_attaching_leaves_the_pool_free_for_the_next_wrap(pool_name):
    # Ctrl-C after the daemon granted the lease and before the client had its reply: the client could not
    # tell the workers (it never learned their names) and lived on, so they served its silent session and
    # the daemon refused every later attach as busy until the process exited (a notebook's kernel).
    r = script_result(run_script(ATTACH_CUT.format(name=pool_name), timeout=240))
    assert r["positions"] > 30 and r["missed"] == 0, r
    assert r["bad"] == [], r["bad"][:5]
    info = status(pool_name)
    assert info["client_pid"] is None and [w["state"] for w in info["workers"]] == ["idle", "idle"]


CLOSE_CUT = """
import gc, json, torch, dpool
from torch import nn
from dpool import attach, pool, replicate, step, wrapper
from tests.conftest import dpool_segments, dpool_sockets, open_fds
from tests.helpers import CtrlC


def shared(t):
    with open("/proc/self/maps") as f:
        spans = [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in f if "dpool" in line]
    return any(lo <= t.data_ptr() < hi for lo, hi in spans)


def make():
    net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    m = dpool.wrap(net, pool={name!r})
    m(torch.randn(6, 4, dtype=torch.float64)).sum().backward()
    return net, m


fns = [wrapper.DataParallel.close, step.Runtime.close, replicate.Master.close, pool.Pool.close,
       pool.Pool._close_sockets, attach.Lease.end, attach.Lease._give_back]
net, m = make()
positions = CtrlC.positions(fns, m.close)
fds, segments, sockets = open_fds(), dpool_segments(), dpool_sockets()
bad, missed = [], 0
for code, offset in positions:
    net, m = make()  # (attaching again also shows that the cut close gave the pool back)
    with CtrlC(code, offset) as cut:
        try:
            m.close()
        except KeyboardInterrupt:
            pass
    missed += not cut.hit
    try:
        m.close()  # finishes what the cut one left
    except Exception as e:
        bad.append([code.co_name, offset, f"second close: {{type(e).__name__}}: {{e}}"])
    left = {{"fds": {{k: v for k, v in open_fds().items() if fds.get(k) != v}},
            "segments": sorted(dpool_segments() - segments), "sockets": sorted(dpool_sockets() - sockets),
            "shared": [n for n, t in list(net.named_parameters()) + list(net.named_buffers()) if shared(t)]}}
    if any(left.values()):
        bad.append([code.co_name, offset, left])
        fds = open_fds()
    del m
    gc.collect()
print("RESULT " + json.dumps({{"positions": len(positions), "missed": missed, "bad": bad}}))
"""


@pytest.mark.timeout(200)
def test_ctrl_c_anywhere_in_close_is_finished_by_the_next_close(pool_name):
    # close() marked itself done before its work (DataParallel dropped its runtime, the runtime set its
    # flag): cut there, the next close() did nothing, and the master's parameters stayed in the shared
    # mapping with its fd open for the process's life; cut between closing the daemon's pidfd and
    # forgetting it, the next close() closed that number again (EBADF, or another file's fd) and stopped.
    # Attached, so that each of the ~50 cuts costs an attach (~0.1 s), not a worker start-up.
    r = script_result(run_script(CLOSE_CUT.format(name=pool_name), timeout=180))
    assert r["positions"] > 40 and r["missed"] == 0, r
    assert r["bad"] == [], r["bad"][:5]
    info = status(pool_name)
    assert info["client_pid"] is None and [w["state"] for w in info["workers"]] == ["idle", "idle"]


SECOND_WRAP = """
import json, os, torch, dpool
from tests.test_daemon import status
net1, net2 = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
first = dpool.wrap(net1, pool={name!r})
x = torch.randn(6, 4)
try:
    dpool.wrap(net2, pool={name!r})
    refused = None
except dpool.WorkerStartError as e:
    refused = str(e)
holder = status({name!r})["client_pid"]
with torch.no_grad():
    same = torch.equal(first(x), net1(x))
first.close()
print("RESULT " + json.dumps({{"refused": refused, "holder": holder, "me": os.getpid(), "same": same}}))
"""


def test_a_second_wrap_refused_by_a_pool_in_use_leaves_the_first_attached(pool_name):
    # The refused attach gave back a lease by pid, its own process's: the daemon freed the first model's
    # lease (status showed no client while it trained), and since the daemon ends the workers' session on
    # a detach, the first model broke. A detach now names its lease by the attach's nonce.
    r = script_result(run_script(SECOND_WRAP.format(name=pool_name)))
    assert r["refused"] is not None and f"in use by pid {r['me']}" in r["refused"], r
    assert r["holder"] == r["me"] and r["same"] is True, r
    info = status(pool_name)
    assert info["client_pid"] is None and [w["state"] for w in info["workers"]] == ["idle", "idle"]
