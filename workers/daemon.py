"""The ``dpool-workers`` daemon: one process that keeps a warm worker pool for training scripts to
attach to (the command line is :mod:`dpool_workers.cli`).

Exit codes of the daemon process: 1 error (workers failed to start), 4 a pool of that name is
already running.

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
ends with the client's ``shutdown`` (``close()``), with the client's ``detach`` (the daemon then
sends its serving workers ``end_serve``: a client cut short while attaching never learned their
names), or when the client process dies: each worker watches the client's pidfd, drops the replica
and its memory, and reports ``serve_done``; the daemon watches the client's pidfd too and frees the
lease. A worker
that dies is respawned and counted in ``status``; one still serving :data:`RELEASE_GRACE_S` after its
client left, or still starting past the startup timeout (frozen, hung), is killed and respawned. Every
client request carries the challenge its connection was given (:class:`dpool.protocol.Challenge`):
a recorded request sent again has no effect and gets no answer. The daemon dies → its workers exit (their
watchdog polls its pidfd) → an attached client sees its workers die and raises
``DaemonLostError``. A crashed daemon's leftovers are removed by the next ``start``.
"""
from __future__ import annotations

import collections
import fcntl
import json
import logging
import mmap
import os
import secrets
import signal
import subprocess
import sys
import time
from importlib.metadata import version
from typing import Any

import zmq

import dpool
from dpool import protocol as P
from dpool.channel import KEY_REJECTED, Channel
from dpool.config import Config
from dpool.daemon_client import POOL_FILES, pool_dir, runtime_dir
from dpool.errors import AuthError
from dpool.launch import join_or_kill, start_worker, visible_device
from dpool.sweep import sweep, sweep_sockets

__all__ = ["Daemon", "EXIT_OK", "EXIT_ERROR", "EXIT_USAGE", "EXIT_NOT_RUNNING", "EXIT_ALREADY_RUNNING"]

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_NOT_RUNNING, EXIT_ALREADY_RUNNING = 0, 1, 2, 3, 4

# A worker still serving this long after its client left is frozen or hung (SIGSTOP, a deadlock): it is replaced.
RELEASE_GRACE_S = 5.0

log = logging.getLogger("dpool.daemon")


def _log_to_stderr() -> None:
    """Every line the daemon writes (its own and its workers' output) carries a timestamp."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def _log_output(label: str, line: str, to_stderr: bool) -> None:
    """A worker's output line, to the daemon's log with a timestamp."""
    log.info("[%s] %s", label, line.rstrip("\n"))


# ---------------------------------------------------------------------------------------- daemon
class _W:
    def __init__(self, index: int, device: str) -> None:
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


class Challenges:
    """The challenges given to client connections: each is accepted once, from the connection it was given to,
    within :attr:`TTL` seconds (see :class:`dpool.protocol.Challenge`). At most :attr:`KEEP` are outstanding;
    the oldest go first."""

    TTL = 30.0
    KEEP = 256

    def __init__(self) -> None:
        self._given: collections.OrderedDict[bytes, tuple[bytes, float]] = collections.OrderedDict()

    def give(self, peer: bytes) -> bytes:
        challenge = secrets.token_bytes(16)
        self._given.pop(peer, None)
        self._given[peer] = (challenge, time.monotonic() + self.TTL)
        while len(self._given) > self.KEEP:
            self._given.popitem(last=False)
        return challenge

    def take(self, peer: bytes, challenge: Any) -> bool:
        """Whether ``challenge`` is the one ``peer`` was given, unused and in time; it is used up either way."""
        given = self._given.pop(peer, None)
        return (given is not None and isinstance(challenge, bytes) and secrets.compare_digest(given[0], challenge)
                and time.monotonic() <= given[1])


# the requests a client makes of a daemon; each must carry its connection's challenge
_REQUESTS = (P.Attach, P.Detach, P.Status, P.Stop)


class Daemon:
    def __init__(self, name: str, devices: list[str], threads: int, listen: str | None = None) -> None:
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
        self.ctx = zmq.Context()
        self.challenges = Challenges()
        self.dropped = 0  # replayed or re-routed requests dropped so far
        self._told_rejected: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self.chan = Channel(self.ctx, True, self.key, 1 << 20, on_reject=self._rejected)
        self.sock = self.chan.sock
        self.sock_path = os.path.join(self.dir, "daemon.sock")
        self.endpoint = "ipc://" + self.sock_path
        self.chan.bind(self.endpoint)
        self.tcp_endpoint: str | None = None
        if listen is not None:  # only when asked (--listen); authenticated like the ipc socket
            try:
                if listen.startswith("tcp://["):
                    self.sock.setsockopt(zmq.IPV6, 1)
                self.sock.bind(listen)
            except zmq.ZMQError as exc:
                log.error("cannot listen on %s: %s", listen, exc)
                raise SystemExit(EXIT_ERROR) from None
            self.tcp_endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()  # the port, if 0 was asked
            log.info("listening on %s (authenticated with the pool key)", self.tcp_endpoint)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.workers = [_W(i, d) for i, d in enumerate(devices)]
        self.client: int | None = None
        self.client_nonce = b""  # the attach nonce of the client's lease: its detach must name it
        self.client_fd = -1
        self.attached_at = 0.0
        self.released_at = 0.0
        self.stopping = False
        self.started_at = time.time()
        self.next_sweep = 0.0
        # Steps served, live: each worker counts its forwards into its int64 slot of this shared page
        # (an memfd inherited by the workers), so `status` is current while a client trains.
        self.steps_fd = os.memfd_create("dpool-steps")
        os.ftruncate(self.steps_fd, 8 * max(1, len(devices)))
        self.steps_map = mmap.mmap(self.steps_fd, 8 * max(1, len(devices)))
        self.steps = memoryview(self.steps_map).cast("q")

    def _rejected(self, peer: bytes, exc: Exception) -> None:
        """A frame that failed a check: logged; a peer whose key is wrong is told so once (a constant, which
        says nothing but that: see :data:`dpool.channel.KEY_REJECTED`), so that its client can say so."""
        log.warning("rejected a message from %r: %s", peer, exc)
        if isinstance(exc, AuthError) and peer and peer not in self._told_rejected:
            self._told_rejected[peer] = None
            while len(self._told_rejected) > Challenges.KEEP:
                self._told_rejected.popitem(last=False)
            try:
                self.sock.send_multipart([peer, KEY_REJECTED], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    # ------------------------------------------------------------------ workers
    def spawn(self, w: _W) -> None:
        w.generation += 1
        w.steps += self.steps[w.index]  # a respawned worker counts from zero in its slot
        self.steps[w.index] = 0
        boot = P.Boot(mode="daemon", key=self.key, endpoint=self.endpoint, index=w.index, ident=w.ident,
                      device=w.device, ppid=os.getpid(), threads=self.threads, shm_dir=self.config.shm_dir, prefix="",
                      control=None, steps=[self.steps_fd, 8 * max(1, len(self.devices))],
                      heartbeat_interval_s=self.config.heartbeat_interval_s,
                      max_message_bytes=self.config.max_message_bytes)
        w.proc, _ = start_worker(boot, self.threads, len(self.devices), [self.steps_fd], f"worker {w.index}",
                                 sink=_log_output)
        w.pidfd = os.pidfd_open(w.proc.pid)
        self.poller.register(w.pidfd, 1)
        w.state, w.started = "starting", time.time()

    def send(self, ident: bytes, msg: Any) -> None:
        self.chan.try_send(msg, ident)  # a client that left no longer needs the answer

    def write_state(self, stopping: bool = False) -> None:
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
            self._replace_stuck()
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

    def _replace_stuck(self) -> None:
        """Kill a worker still busy :data:`RELEASE_GRACE_S` after its client left, or starting for longer than
        the startup timeout (frozen by SIGSTOP, or hung): its exit makes the loop respawn it, so the pool stays
        usable for the next client."""
        for w in self.workers:
            if w.proc is None or w.proc.poll() is not None:
                continue
            late = ((w.state == "busy" and self.client is None
                     and time.monotonic() - self.released_at > RELEASE_GRACE_S)
                    or (w.state == "starting" and time.time() - w.started > self.config.startup_timeout_s))
            if late:
                log.warning("worker %d (pid %d) is still %s long after it should have finished (frozen or hung); "
                            "replacing it", w.index, w.proc.pid, "serving" if w.state == "busy" else "starting")
                w.proc.kill()  # (SIGKILL ends a stopped process too)
                w.state = "replaced"  # its pidfd fires next, and the loop respawns it

    def drain(self) -> None:
        for ident, msg in self.chan.drain():  # authenticated before anything is decoded
            w = next((w for w in self.workers if w.ident == ident), None)
            if w is not None:
                if isinstance(msg, P.Hello):
                    w.state = "idle"
                elif isinstance(msg, P.ServeDone):
                    w.state = "idle"
                    log.info("worker %d detached (%s; %d steps)", w.index, msg.reason, msg.steps)
                continue
            if isinstance(msg, P.Challenge):
                self.send(ident, P.ChallengeDone(challenge=self.challenges.give(ident)))
                continue
            if isinstance(msg, _REQUESTS) and not self.challenges.take(ident, msg.challenge):
                self.dropped += 1  # recorded and sent again, or from another connection: no effect, no answer
                log.warning("dropped a %s request without its connection's challenge from %r (replayed or "
                            "re-routed; %d so far)", msg.op, ident, self.dropped)
                continue
            if isinstance(msg, P.Attach):
                self.attach(ident, msg)
            elif isinstance(msg, P.Detach):
                if msg.pid == self.client and msg.nonce == self.client_nonce:
                    log.info("client %d detached", msg.pid)
                    self.release()
                self.send(ident, P.DetachDone())
            elif isinstance(msg, P.Status):
                self.send(ident, P.StatusDone(info=self.status()))
            elif isinstance(msg, P.Stop):
                self.send(ident, P.StopDone())
                self.stopping = True
            else:  # authenticated, but not a request a daemon serves: say so rather than leave it waiting
                self.send(ident, P.Failed(stage="daemon", module="dpool.errors", qualname="ProtocolError",
                                          message=f"the dpool-workers daemon does not serve {msg.op!r} requests "
                                          f"(it serves attach, detach, status and stop)", traceback=""))

    def attach(self, ident: bytes, msg: Any) -> None:
        def refuse(why: str) -> None:
            self.send(ident, P.AttachDone(ok=False, workers=[], error=why, threads=self.threads,
                                          daemon_pid=os.getpid()))

        if msg.protocol != P.PROTOCOL_VERSION:
            return refuse(f"dpool protocol {msg.protocol} client cannot use a protocol {P.PROTOCOL_VERSION} daemon")
        if self.client is not None:
            return refuse(f"pool {self.name!r} is in use by pid {self.client}; one client at a time "
                          f"(wait for it to finish, or start another pool with dpool-workers start --name OTHER)")
        if not all(w.state == "idle" for w in self.workers):
            return refuse("busy: the workers are still starting or releasing the previous client; retry")
        if not self._control_exists(msg.control):
            return refuse(f"the client's control segment {msg.control!r} does not exist in {self.config.shm_dir} "
                          "(a stale attach, or a client that shares no /dev/shm with this pool)")
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
        self.client, self.client_nonce, self.attached_at = msg.pid, msg.nonce, time.time()
        out = []
        for w in self.workers:
            session_ident = b"a" + w.ident + b"." + secrets.token_hex(8).encode()
            self.send(w.ident, P.Serve(endpoint=msg.endpoint, key=key, ident=session_ident, control=msg.control,
                                       client_pid=msg.pid, max_message_bytes=msg.max_message_bytes))
            w.state = "busy"
            assert w.proc is not None
            out.append([w.index, w.device, w.proc.pid, session_ident])
        self.send(ident, P.AttachDone(ok=True, workers=out, error="", threads=self.threads, daemon_pid=os.getpid()))
        log.info("client %d attached", msg.pid)

    def _control_exists(self, ref: Any) -> bool:
        """Whether the control segment an attach names is there for the workers to map (a plain name in the
        shared-memory directory)."""
        if not (isinstance(ref, list) and len(ref) == 2 and isinstance(ref[0], str) and isinstance(ref[1], int)):
            return False
        name = ref[0]
        if not name or "/" in name or name.startswith("."):
            return False
        try:
            return os.stat(os.path.join(self.config.shm_dir, name)).st_size >= ref[1] > 0
        except OSError:
            return False

    def release(self) -> None:
        """Free the lease: the client detached or died. Its serving workers end its session (a worker
        watches a dead client itself, but not one that detached before it was told their names)."""

        if self.client is not None:
            for w in self.workers:
                if w.state == "busy":
                    self.send(w.ident, P.EndServe(client_pid=self.client))
        if self.client_fd >= 0:
            self.poller.unregister(self.client_fd)
            os.close(self.client_fd)
        self.client, self.client_fd = None, -1
        self.released_at = time.monotonic()
        self.sweep()

    def sweep(self) -> None:
        """Remove segments and socket files of dead clients, every second and when a client goes.

        A client SIGKILLed while attaching, or while it grows a segment, leaves names no worker
        knew of; nobody else would remove them until the next ``wrap()``.
        """
        self.next_sweep = time.monotonic() + 1.0
        for name in sweep(self.config.shm_dir) + sweep_sockets(runtime_dir()):
            log.info("removed %s (its owner died)", name)

    def status(self) -> dict:
        import psutil  # (only here: its import would slow every dpool-workers command)

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
                "requests_dropped": self.dropped,
                "steps_served": sum(w.steps + self.steps[w.index] for w in self.workers) // max(1, len(self.workers)),
                "workers": rows}

    def shutdown(self) -> int:
        if self.client is not None:
            # A client is attached: say so in the state file *before* its workers go, so that the
            # client reports DaemonLostError (not a restartable worker death), then end them now: a serving
            # worker reads the daemon's socket only between its requests, so a shutdown could wait a step.
            log.info("stopping while client %s is attached; its call fails with DaemonLostError", self.client)
            self.write_state(stopping=True)
            for w in self.workers:
                if w.proc is not None and w.state == "busy":
                    w.proc.kill()
        for w in self.workers:
            self.send(w.ident, P.Shutdown())
        join_or_kill([w.proc for w in self.workers if w.proc is not None], 3.0)
        self.chan.close()
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
