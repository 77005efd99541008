"""``dpool-workers``: a daemon that keeps warm worker pools for training scripts to attach to.

::

    dpool-workers start  [--name NAME] [--device-ids cpu,cpu] [--threads N] [--foreground] [--listen [HOST:]PORT]
    dpool-workers list   [--json]
    dpool-workers status [--name NAME] [--json]          (no --name: the one running pool)
    dpool-workers stop   [--name NAME] [--timeout S]     (no --name: the one running pool)
    dpool-workers --version

Exit codes: 0 success; 1 error (e.g. start failed, daemon unresponsive); 2 usage error;
3 no pool of that name is running (status, stop); 4 a pool of that name is already running (start).

Files (``<runtime dir>/pools/<name>/``, directory 0700): ``lock`` (held with ``flock`` by the
daemon for its whole life), ``key`` (0600: 32 random bytes; every message to the daemon is
authenticated with it before anything is decoded), ``daemon.sock`` (the ``ipc://`` endpoint,
0600), ``state.json`` (pid, devices, version; written when every worker is ready) and
``daemon.log``. No TCP listener is opened unless ``--listen`` asks for one; it then binds to
127.0.0.1 unless a host is given, and speaks the same authenticated protocol: a client attaches
with ``pool="tcp://HOST:PORT"`` and ``DPOOL_KEY_FILE`` naming a copy of the pool key. Session
keys are derived from the pool key and a client nonce, never sent, so a process that takes over
the port first learns nothing that lets it receive the model. Tensors still go through shared
memory, so client and workers must share a host (and ``/dev/shm``) either way.

Lifecycle. The daemon spawns one worker per device (``dpool_workers.worker`` in daemon
mode) and waits for their hello. A client (``dpool.wrap(net, pool=NAME)``) sends an
authenticated ``attach`` with its pid, its own socket endpoint and a fresh nonce
(both sides derive the session key from it); the daemon grants a lease (one client at a time; a second gets an error naming the holder's
pid) and tells every worker to connect to the client directly, so steps run exactly as in an
embedded pool; what a replica prints travels to the client as ``output`` messages. The session
ends with the client's ``shutdown`` (``close()``), or when the client
process dies: each worker watches the client's pidfd, drops the replica and its memory, and
reports ``serve_done``; the daemon watches the client's pidfd too and frees the lease. A worker
that dies is respawned and counted in ``status``. The daemon dies → its workers exit (their
watchdog polls its pidfd) → an attached client sees its workers die and raises
``DaemonLostError``. A crashed daemon's leftovers are removed by the next ``start``.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import logging
import mmap
import os
import threading
import secrets
import signal
import subprocess
import sys
import time
from typing import Any

from dpool.daemon_client import POOL_FILES, lock_held, pool_dir, read_pool, request

__all__ = ["main", "parse_listen"]

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_NOT_RUNNING, EXIT_ALREADY_RUNNING = 0, 1, 2, 3, 4

log = logging.getLogger("dpool.daemon")


def _log_to_stderr() -> None:
    """Every line the daemon writes (its own and its workers' output) carries a timestamp."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def _pump(stream: Any, label: str) -> None:
    """Copy a worker's output to the daemon's log, line by line, with timestamps."""
    for raw in iter(stream.readline, b""):
        log.info("[%s] %s", label, raw.decode(errors="replace").rstrip("\n"))
    stream.close()


def parse_listen(text: str) -> str:
    """``PORT`` or ``HOST:PORT`` (HOST defaults to 127.0.0.1) → a ``tcp://`` endpoint."""
    host, _, port = text.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"--listen {text!r}: expected PORT or HOST:PORT (PORT 0 picks a free port)")
    return f"tcp://[{host}]:{int(port)}" if ":" in host else f"tcp://{host}:{int(port)}"


# ---------------------------------------------------------------------------------------- daemon
class _W:
    def __init__(self, index: int, device: str) -> None:
        from dpool._launch import visible_device

        self.index, self.device = index, device
        # a GPU worker's CUDA_VISIBLE_DEVICES entry: clients translate it into their own numbering
        self.visible = visible_device(int(device.split(":")[1])) if device.startswith("cuda") else None
        self.proc: subprocess.Popen | None = None
        self.pidfd = -1
        self.state = "starting"
        self.started = time.time()
        self.restarts = 0
        self.generation = 0
        self.steps = 0

    @property
    def ident(self) -> bytes:
        return b"w%d.%d" % (self.index, self.generation)


class Daemon:
    def __init__(self, name: str, devices: list[str], threads: int, listen: str | None = None) -> None:
        import zmq

        from dpool import protocol as P
        from dpool.config import Config
        from dpool._sweep import sweep

        _log_to_stderr()
        self.name, self.devices, self.threads = name, devices, threads
        self.dir = pool_dir(name, create=True)
        self.lock_fd = os.open(os.path.join(self.dir, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SystemExit(EXIT_ALREADY_RUNNING) from None
        for stale in ("state.json", "daemon.sock", "key"):  # a crashed daemon's leftovers
            try:
                os.unlink(os.path.join(self.dir, stale))
            except FileNotFoundError:
                pass
        self.config = Config()
        sweep(self.config.shm_dir)
        self.key = secrets.token_bytes(32)
        fd = os.open(os.path.join(self.dir, "key"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, self.key)
        os.close(fd)
        self.codec = P.Codec(self.key)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
        self.sock_path = os.path.join(self.dir, "daemon.sock")
        self.endpoint = "ipc://" + self.sock_path
        self.sock.bind(self.endpoint)
        os.chmod(self.sock_path, 0o600)
        self.tcp_endpoint: str | None = None
        if listen is not None:  # only when asked (--listen); authenticated like the ipc socket
            try:
                if listen.startswith("tcp://["):
                    self.sock.setsockopt(zmq.IPV6, 1)
                self.sock.bind(listen)
            except zmq.ZMQError as exc:
                log.error("cannot listen on %s: %s", listen, exc)
                raise SystemExit(EXIT_ERROR) from None
            self.tcp_endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
            log.info("listening on %s (authenticated with the pool key)", self.tcp_endpoint)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.workers = [_W(i, d) for i, d in enumerate(devices)]
        self.seq = 0
        self.seen: dict[bytes, int] = {}
        self.client: int | None = None
        self.client_fd = -1
        self.attached_at = 0.0
        self.stopping = False
        self.started_at = time.time()
        self.next_sweep = 0.0
        # Steps served, live: each worker counts its forwards into its int64 slot of this shared page
        # (an memfd inherited by the workers), so `status` is current while a client trains.
        self.steps_fd = os.memfd_create("dpool-steps")
        os.ftruncate(self.steps_fd, 8 * max(1, len(devices)))
        self.steps_map = mmap.mmap(self.steps_fd, 8 * max(1, len(devices)))
        self.steps = memoryview(self.steps_map).cast("q")

    # ------------------------------------------------------------------ workers
    def spawn(self, w: _W) -> None:
        import msgpack

        from dpool._launch import worker_command, worker_env

        w.generation += 1
        w.steps += self.steps[w.index]  # a respawned worker counts from zero in its slot
        self.steps[w.index] = 0
        env = worker_env(self.threads)
        env.setdefault("PYTHONUNBUFFERED", "1")  # worker output reaches the log as it is written
        device = w.device
        if w.visible is not None:  # a GPU worker sees only its own GPU, as cuda:0 (as embedded ones do)
            env["CUDA_VISIBLE_DEVICES"] = w.visible
            device = "cuda:0"
        w.proc = subprocess.Popen(worker_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, env=env, pass_fds=[self.steps_fd])
        for stream in (w.proc.stdout, w.proc.stderr):
            threading.Thread(target=_pump, args=(stream, f"worker {w.index}"), daemon=True).start()
        w.pidfd = os.pidfd_open(w.proc.pid)
        self.poller.register(w.pidfd, 1)
        w.state, w.started = "starting", time.time()
        boot = {"mode": "daemon", "key": self.key, "endpoint": self.endpoint, "ident": w.ident, "index": w.index,
                "device": device, "ppid": os.getpid(), "threads": self.threads, "shm_dir": self.config.shm_dir,
                "config": self.config.for_worker(), "steps": [self.steps_fd, 8 * max(1, len(self.devices))]}
        assert w.proc.stdin is not None
        w.proc.stdin.write(msgpack.packb(boot, use_bin_type=True))
        w.proc.stdin.close()

    def send(self, ident: bytes, msg: Any) -> None:
        import zmq

        self.seq += 1
        try:
            self.sock.send_multipart([ident, self.codec.encode(msg, self.seq)], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def write_state(self, stopping: bool = False) -> None:
        from importlib.metadata import version

        import dpool

        state = {"name": self.name, "pid": os.getpid(), "endpoint": self.endpoint, "listen": self.tcp_endpoint,
                 "devices": self.devices, "visible": [w.visible for w in self.workers],
                 "threads": self.threads, "dpool": dpool.__version__, "torch": version("torch"),
                 "started": self.started_at, "stopping": stopping}
        tmp = os.path.join(self.dir, "state.json.tmp")
        with open(tmp, "w") as f:
            json.dump(state, f)
        os.replace(tmp, os.path.join(self.dir, "state.json"))

    # ------------------------------------------------------------------ loop
    def run(self) -> int:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        signal.signal(signal.SIGINT, lambda *_: setattr(self, "stopping", True))
        log.info("pool %r: starting %d worker(s) on %s (daemon pid %d)", self.name, len(self.workers),
                 ",".join(self.devices), os.getpid())
        for w in self.workers:
            self.spawn(w)
        ready_written = False
        while not self.stopping:
            events = dict(self.poller.poll(200))
            for w in self.workers:
                if events.get(w.pidfd):
                    self.poller.unregister(w.pidfd)
                    os.close(w.pidfd)
                    assert w.proc is not None
                    w.proc.wait()
                    if self.stopping:
                        continue
                    log.warning("worker %d (pid %d) exited (%s); restarting it", w.index, w.proc.pid, w.proc.returncode)
                    w.restarts += 1
                    self.spawn(w)
            if self.client_fd >= 0 and events.get(self.client_fd):
                log.info("client %s died; freeing the pool", self.client)
                self.release()
            if events.get(self.sock):
                self.drain()
            if time.monotonic() >= self.next_sweep:
                self.sweep()
            if not ready_written and all(w.state == "idle" for w in self.workers):
                self.write_state()
                ready_written = True
                log.info("pool %r ready: %d worker(s) on %s (pids %s)", self.name, len(self.workers),
                         ",".join(self.devices), [w.proc.pid for w in self.workers if w.proc is not None])
        rc = self.shutdown()
        # Everything is released explicitly above; skipping the interpreter's teardown (a second with
        # torch loaded) lets `dpool-workers stop` return as soon as the pool is gone.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)

    def drain(self) -> None:
        import zmq

        from dpool import protocol as P

        while self.sock.get(zmq.EVENTS) & zmq.POLLIN:
            frames = self.sock.recv_multipart()
            ident, body = frames[0], frames[1:]
            try:
                seq, msg = self.codec.decode(body)  # authenticated before anything is decoded
                if seq <= self.seen.get(ident, -1):
                    raise P.ProtocolError("replayed message")
                self.seen[ident] = seq
            except P.ProtocolError as exc:
                log.warning("rejected a message from %r: %s", ident, exc)
                continue
            w = next((w for w in self.workers if w.ident == ident), None)
            if w is not None:
                if isinstance(msg, P.Hello):
                    w.state = "idle"
                elif isinstance(msg, P.ServeDone):
                    w.state = "idle"
                    log.info("worker %d detached (%s; %d steps)", w.index, msg.reason, msg.steps)
                continue
            if isinstance(msg, P.Attach):
                self.attach(ident, msg)
            elif isinstance(msg, P.Detach):
                if msg.pid == self.client:
                    log.info("client %d detached", msg.pid)
                    self.release()
                self.send(ident, P.DetachDone())
            elif isinstance(msg, P.Status):
                self.send(ident, P.StatusDone(self.status()))
            elif isinstance(msg, P.Stop):
                self.send(ident, P.StopDone())
                self.stopping = True
            else:  # authenticated, but not a request a daemon serves: say so rather than leave it waiting
                self.send(ident, P.Failed("daemon", "dpool.errors", "ProtocolError",
                                          f"the dpool-workers daemon does not serve {msg.op!r} requests "
                                          f"(it serves attach, detach, status and stop)", ""))

    def attach(self, ident: bytes, msg: Any) -> None:
        from dpool import protocol as P

        def refuse(why: str) -> None:
            self.send(ident, P.AttachDone(False, [], why, self.threads, os.getpid()))

        if msg.protocol != P.PROTOCOL_VERSION:
            return refuse(f"dpool protocol {msg.protocol} client cannot use a protocol {P.PROTOCOL_VERSION} daemon")
        if self.client is not None:
            return refuse(f"pool {self.name!r} is in use by pid {self.client}; one client at a time "
                          f"(wait for it to finish, or start another pool with dpool-workers start --name OTHER)")
        if not all(w.state == "idle" for w in self.workers):
            return refuse("busy: the workers are still starting or releasing the previous client; retry")
        try:
            self.client_fd = os.pidfd_open(msg.pid)
        except ProcessLookupError:
            return refuse("the client process is gone")
        try:
            key = P.session_key(self.key, msg.nonce)
        except P.ProtocolError as exc:
            os.close(self.client_fd)
            self.client_fd = -1
            return refuse(str(exc))
        self.poller.register(self.client_fd, 1)
        self.client, self.attached_at = msg.pid, time.time()
        out = []
        for w in self.workers:
            session_ident = b"a" + w.ident + b"." + secrets.token_hex(8).encode()
            self.send(w.ident, P.Serve(msg.endpoint, key, session_ident, msg.control, msg.pid,
                                        msg.max_message_bytes))
            w.state = "busy"
            assert w.proc is not None
            out.append([w.index, w.device, w.proc.pid, session_ident])
        self.send(ident, P.AttachDone(True, out, "", self.threads, os.getpid()))
        log.info("client %d attached", msg.pid)

    def release(self) -> None:
        if self.client_fd >= 0:
            self.poller.unregister(self.client_fd)
            os.close(self.client_fd)
        self.client, self.client_fd = None, -1
        self.sweep()

    def sweep(self) -> None:
        """Remove segments and socket files of dead clients, every second and when a client goes.

        A client SIGKILLed while attaching, or while it grows a segment, leaves names no worker
        knew of; nobody else would remove them until the next ``wrap()``.
        """
        from dpool.daemon_client import runtime_dir
        from dpool._sweep import sweep, sweep_sockets

        self.next_sweep = time.monotonic() + 1.0
        for name in sweep(self.config.shm_dir) + sweep_sockets(runtime_dir()):
            log.info("removed %s (its owner died)", name)

    def status(self) -> dict:
        import psutil

        rows = []
        for w in self.workers:
            pid = w.proc.pid if w.proc else -1
            try:
                rss = psutil.Process(pid).memory_info().rss
            except psutil.Error:
                rss = 0
            rows.append({"index": w.index, "device": w.device, "visible": w.visible, "pid": pid, "state": w.state, "rss_bytes": rss,
                         "uptime_s": round(time.time() - w.started, 1), "restarts": w.restarts})
        return {"name": self.name, "pid": os.getpid(), "client_pid": self.client, "listen": self.tcp_endpoint,
                "steps_served": sum(w.steps + self.steps[w.index] for w in self.workers) // max(1, len(self.workers)),
                "workers": rows}

    def shutdown(self) -> int:
        from dpool import protocol as P

        if self.client is not None:
            # A client is attached: say so in the state file *before* its workers go, so that the
            # client reports DaemonLostError (not a restartable worker death), then end them now:
            # a serving worker does not read the daemon's socket, so a shutdown would only wait.
            log.info("stopping while client %s is attached; its call fails with DaemonLostError", self.client)
            self.write_state(stopping=True)
            for w in self.workers:
                if w.proc is not None and w.state == "busy":
                    w.proc.kill()
        for w in self.workers:
            self.send(w.ident, P.Shutdown())
        deadline = time.time() + 3
        for w in self.workers:
            if w.proc is None:
                continue
            try:
                w.proc.wait(timeout=max(0.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
        self.sock.close(linger=0)
        self.ctx.term()
        # A clean stop leaves nothing: the pool's directory goes (a crash keeps it, log included).
        for f in POOL_FILES:
            try:
                os.unlink(os.path.join(self.dir, f))
            except FileNotFoundError:
                pass
        log.info("pool %r stopped", self.name)
        os.close(self.lock_fd)
        try:
            os.rmdir(self.dir)
        except OSError:
            pass
        return EXIT_OK


# ---------------------------------------------------------------------------------------- CLI
def _devices(text: str | None) -> list[str]:
    parts = [t.strip() for t in (text or "").split(",") if t.strip()]
    if parts and all(p == "cpu" for p in parts):
        return parts  # without importing torch here (seconds): the daemon process imports it anyway
    from dpool.devices import parse_devices

    if not text:
        return parse_devices(None)
    return parse_devices([int(t) if t.strip().isdigit() else t.strip() for t in text.split(",")])


def cmd_start(a: argparse.Namespace) -> int:
    try:
        listen = parse_listen(a.listen) if a.listen is not None else None
    except ValueError as exc:
        print(f"dpool-workers: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:  # wrap()'s rules (dpool.devices), before anything is created
        devices = _devices(a.device_ids)
        if any(d != "cpu" for d in devices):
            from dpool.devices import check_devices

            check_devices(devices)
    except (ValueError, TypeError) as exc:  # DpoolValueError, DpoolTypeError
        print(f"dpool-workers: {exc}", file=sys.stderr)
        return EXIT_USAGE
    path = pool_dir(a.name, create=True)
    if lock_held(path):
        pid = "?"
        try:
            pid = json.load(open(os.path.join(path, "state.json")))["pid"]
        except Exception:
            pass
        print(f"dpool-workers: a pool named {a.name!r} is already running (pid {pid}); "
              f"stop it with: dpool-workers stop --name {a.name}", file=sys.stderr)
        return EXIT_ALREADY_RUNNING
    import psutil

    threads = a.threads or max(1, (psutil.cpu_count(logical=False) or 1) // len(devices))
    for stale in ("state.json", "daemon.sock", "key"):  # a crashed daemon's leftovers (no daemon holds the lock)
        try:
            os.unlink(os.path.join(path, stale))
        except FileNotFoundError:
            pass
    if a.foreground:
        return Daemon(a.name, devices, threads, listen).run()
    from dpool._launch import worker_command

    log = open(os.path.join(path, "daemon.log"), "ab")
    extra = ["--listen", a.listen] if a.listen is not None else []
    proc = subprocess.Popen([*worker_command("daemon"), "start", "--name", a.name, "--device-ids",
                             ",".join(devices), "--threads", str(threads), "--foreground", *extra],
                            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    deadline = time.time() + a.timeout
    state_path = os.path.join(path, "state.json")
    shown = -1
    while time.time() < deadline:
        if proc.poll() is not None:
            print(f"dpool-workers: the daemon exited with code {proc.returncode} while starting; "
                  f"see {os.path.join(path, 'daemon.log')}", file=sys.stderr)
            return EXIT_ALREADY_RUNNING if proc.returncode == EXIT_ALREADY_RUNNING else EXIT_ERROR
        if _state_pid(state_path) == proc.pid:
            where = ""
            if listen is not None:
                with open(state_path) as f:
                    where = f"; listening on {json.load(f)['listen']} (clients need DPOOL_KEY_FILE={path}/key)"
            print(f"dpool-workers: pool {a.name!r} ready: {len(devices)} workers on {','.join(devices)} "
                  f"(daemon pid {proc.pid}){where}", file=sys.stderr)
            return EXIT_OK
        elapsed = int(time.time() - (deadline - a.timeout))
        if elapsed != shown:
            print(f"dpool-workers: starting {len(devices)} workers… {elapsed}s", file=sys.stderr, flush=True)
            shown = elapsed
        time.sleep(0.05)
    proc.kill()
    print(f"dpool-workers: workers not ready within {a.timeout:g}s; see {path}/daemon.log", file=sys.stderr)
    return EXIT_ERROR


def _state_pid(path: str) -> int:
    try:
        with open(path) as f:
            return int(json.load(f)["pid"])
    except (OSError, ValueError, KeyError):
        return -1


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dpool")
    except PackageNotFoundError:  # a source checkout used without installing it
        import dpool

        return dpool.__version__


def running_pools() -> list[str]:
    """Names of this user's pools whose daemon is alive (holds the pool's lock)."""
    from dpool.daemon_client import runtime_dir

    base = os.path.join(runtime_dir(), "pools")
    try:
        names = sorted(os.listdir(base))
    except FileNotFoundError:
        return []
    return [n for n in names if lock_held(os.path.join(base, n))]


def cmd_list(a: argparse.Namespace) -> int:
    from dpool import protocol as P

    rows = []
    for name in running_pools():
        row: dict[str, Any] = {"name": name, "devices": [], "state": "unresponsive", "client_pid": None,
                               "uptime_s": None, "pid": None}
        try:
            state, _ = read_pool(name)
            row["devices"], row["pid"] = state["devices"], state["pid"]
            row["uptime_s"] = round(time.time() - state["started"], 1)
            info = request(name, P.Status(), timeout=2.0).info
            states = {w["state"] for w in info["workers"]}
            row["client_pid"] = info["client_pid"]
            row["state"] = ("attached" if info["client_pid"] is not None
                            else "idle" if states == {"idle"} else ",".join(sorted(states)))
        except (OSError, ValueError, TimeoutError):
            pass  # starting (no state file yet) or not answering: shown as unresponsive
        rows.append(row)
    if a.json:
        print(json.dumps(rows))
        return EXIT_OK
    print(f"{'name':<16} {'devices':<24} {'state':<12} {'client':>8} {'uptime s':>9}")
    for r in rows:
        print(f"{r['name']:<16} {','.join(r['devices']):<24} {r['state']:<12} {str(r['client_pid'] or '-'):>8} "
              f"{r['uptime_s'] if r['uptime_s'] is not None else '-':>9}")
    return EXIT_OK


def cmd_status(a: argparse.Namespace) -> int:
    from dpool import protocol as P

    try:
        reply = request(a.name, P.Status(), timeout=a.timeout)
    except FileNotFoundError as exc:
        print(f"dpool-workers: {exc}", file=sys.stderr)
        return EXIT_NOT_RUNNING
    except TimeoutError as exc:
        print(f"dpool-workers: {exc}", file=sys.stderr)
        return EXIT_ERROR
    info = reply.info
    if a.json:
        print(json.dumps(info))
        return EXIT_OK
    client = info["client_pid"] if info["client_pid"] is not None else "none"
    listening = f", listening on {info['listen']}" if info.get("listen") else ""
    print(f"pool {info['name']} (daemon pid {info['pid']}): client {client}, steps served {info['steps_served']}"
          f"{listening}")
    print(f"{'index':>5} {'device':>6} {'pid':>8} {'state':>8} {'rss MiB':>8} {'uptime s':>9} {'restarts':>8}")
    for w in info["workers"]:
        print(f"{w['index']:>5} {w['device']:>6} {w['pid']:>8} {w['state']:>8} {w['rss_bytes'] / 2**20:>8.1f} "
              f"{w['uptime_s']:>9.1f} {w['restarts']:>8}")
    return EXIT_OK


def cmd_stop(a: argparse.Namespace) -> int:
    from dpool import protocol as P

    path = pool_dir(a.name)
    try:
        state, _ = read_pool(a.name)
    except FileNotFoundError as exc:
        print(f"dpool-workers: {exc}", file=sys.stderr)
        return EXIT_NOT_RUNNING
    pid = state["pid"]
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return EXIT_NOT_RUNNING
    import select

    try:
        try:
            request(a.name, P.Stop(), timeout=min(2.0, a.timeout))
        except (TimeoutError, FileNotFoundError):
            pass
        for sig in (None, signal.SIGTERM, signal.SIGKILL):  # graceful, then escalate
            if sig is not None:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    break
            if select.select([fd], [], [], a.timeout * (0.8 if sig is None else 0.5))[0]:
                break
    finally:
        os.close(fd)
    if not lock_held(path):  # in case the daemon had to be killed: remove what it left
        for f in POOL_FILES:
            try:
                os.unlink(os.path.join(path, f))
            except FileNotFoundError:
                pass
        try:
            os.rmdir(path)
        except OSError:
            pass
    print(f"dpool-workers: pool {a.name!r} stopped", file=sys.stderr)
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dpool-workers", description="Warm dpool worker pools that training "
                                 "scripts attach to with dpool.wrap(net, pool=NAME) or DPOOL_POOL=NAME.",
                                 epilog="exit codes: 0 ok, 1 error, 2 usage, 3 not running, 4 already running")
    ap.add_argument("--version", action="version", version=f"dpool-workers {_version()}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("start", help="start a pool and wait until every worker is ready")
    s.add_argument("--name", default="default")
    s.add_argument("--device-ids", help="comma-separated: cpu,cpu or GPU indices such as 0,1 or 0,0 (two workers on "
                   "GPU 0); default: one CPU worker per physical core")
    s.add_argument("--threads", type=int, default=0, help="torch threads per worker (default: cores / workers)")
    s.add_argument("--foreground", action="store_true", help="run the daemon in this process")
    s.add_argument("--listen", metavar="[HOST:]PORT",
                   help="also accept clients over TCP (HOST defaults to 127.0.0.1; PORT 0 picks a free one). "
                        "Authenticated with the pool key; clients attach with pool='tcp://HOST:PORT' and "
                        "DPOOL_KEY_FILE. Off by default: without it no TCP socket is opened")
    s.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the workers")
    s.set_defaults(func=cmd_start)
    ls = sub.add_parser("list", help="every running pool of this user: name, devices, state, client, uptime")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_list)
    st = sub.add_parser("status", help="show the workers, the attached client and the steps served")
    st.add_argument("--name", default=None, help="default: the one running pool")
    st.add_argument("--json", action="store_true")
    st.add_argument("--timeout", type=float, default=5.0)
    st.set_defaults(func=cmd_status)
    sp = sub.add_parser("stop", help="stop a pool (graceful, then SIGTERM, then SIGKILL)")
    sp.add_argument("--name", default=None, help="default: the one running pool")
    sp.add_argument("--timeout", type=float, default=10.0)
    sp.set_defaults(func=cmd_stop)
    a = ap.parse_args(argv)
    if getattr(a, "name", "") is None:  # status / stop without --name: the one running pool, if just one runs
        names = running_pools()
        if len(names) != 1:
            print("dpool-workers: " + (f"{len(names)} pools are running ({', '.join(names)}); name one with --name"
                                       if names else "no pool is running"), file=sys.stderr)
            return EXIT_USAGE if names else EXIT_NOT_RUNNING
        a.name = names[0]
    try:
        return a.func(a)
    except (ValueError, PermissionError) as exc:
        print(f"dpool-workers: {exc}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
