"""Worker processes and the request/reply rounds between them and the coordinator.

::

    coordinator (training script)                          worker k  (dpool_workers.worker)
    ─────────────────────────────                          ────────────────────────────────────
    Pool.__init__
      runtime dir 0700, key = 32 random bytes
      ROUTER bind ipc://<dir>/<prefix>.sock
      Popen ×N ── stdin: key, endpoint, index, device ──>  watchdog thread (pidfd of the parent)
      pidfd_open(worker)                                   heartbeat thread → control segment
                  <────────────── hello ────────────────   DEALER connect
    request(init) ──────────── init ──────────────────>   unpickle model, map segments
                  <────────────── init_done ────────────
    request(forward/backward/...)  (one round = one message to each chosen worker, then wait)
                  ──────────── forward ───────────────>
                  <────────────── forward_done | failed

NOTE [ dpool shutdown ]
=======================
*Who ends what.* The coordinator owns every worker. ``Pool.close()`` sends
``shutdown`` to each worker, waits ``shutdown_timeout_s`` on the workers'
pidfds, then SIGKILLs the rest and reaps them; it returns only when every
worker has been joined. It is idempotent, registered with ``atexit`` (through
a weakref, so an unreferenced pool is closed by the GC too) and safe to call
from another thread: it kills the workers first, which wakes a waiting round,
and only touches the socket when no round is running.

*Why no step blocks forever.* Every wait in :meth:`Pool.request` is a
``zmq.Poller`` poll on the socket *and* every worker's pidfd, with a timeout:

1. a worker that exits (killed, segfault, ``os._exit``) makes its pidfd
   readable: ``WorkerDiedError`` at once (process-exit sentinel);
2. a worker whose heartbeat thread has not written its slot in the control
   segment for ``heartbeat_timeout_s`` is hung while holding the GIL or
   frozen: its stacks are dumped (SIGUSR1 → faulthandler), it is killed,
   ``WorkerTimeoutError`` (a ZeroMQ heartbeat would not see this, since
   libzmq's I/O thread keeps answering);
3. a round that outlives ``step_timeout_s``: ``WorkerTimeoutError``.

Any of these *breaks* the pool: the other workers are killed, and every later
call raises :class:`~dpool.errors.PoolBrokenError` at once. An exception
raised by the model inside a worker does not break the pool.

*When the coordinator dies.* Each worker's watchdog thread polls the
coordinator's pidfd; when it becomes readable the worker unlinks any segment
name it knows of and calls ``os._exit``, within milliseconds. Workers ignore
SIGINT, so Ctrl-C in a terminal reaches only the coordinator, which then
closes the pool.

*Shared memory.* See :mod:`dpool.transport.shm`: names are unlinked as soon as every
worker has mapped them, so no crash leaves a name behind, and ``wrap()``
sweeps names whose owner pid is dead.

*Sockets.* LINGER is 0 on every socket, so ``close()`` never waits on
undelivered messages; ROUTER_MANDATORY plus SNDTIMEO turn a send to a
vanished or stalled worker into an error instead of a silent drop.
"""
from __future__ import annotations

import collections
import logging
import os
import secrets
import select
import signal
import subprocess
import sys
import threading
import time
import warnings
import weakref
from typing import Any, Sequence

import msgpack
import psutil
import torch
import zmq

from . import protocol as P
from .config import Config
from .errors import (
    DaemonLostError,
    ForkedChildError,
    PoolBrokenError,
    ProtocolError,
    WorkerDiedError,
    WorkerStartError,
    WorkerTimeoutError,
)
from .tensors import from_bytes, to_bytes
from .daemon_client import locate, read_pool, request, runtime_dir
from .launch import WORKER_MALLOC_KEEP, visible_device, worker_command, worker_env, worker_package_dir  # noqa: F401
from .sweep import sweep_sockets
from .transport import cuda_ipc, new_region
from .transport.shm import Segment, segment_prefix

__all__ = ["Pool", "runtime_dir", "worker_command", "worker_env"]

log = logging.getLogger("dpool")

_STDERR_TAIL = 40






def _signal_name(returncode: int) -> str | None:
    if returncode < 0:
        try:
            return signal.Signals(-returncode).name
        except ValueError:
            return f"signal {-returncode}"
    return None


class _Worker:
    __slots__ = ("index", "device", "proc", "pidfd", "pid", "stderr_tail", "threads", "alive", "seq_in", "ident",
                 "exports")

    def __init__(self, index: int, device: str, generation: int = 0) -> None:
        self.index = index
        # A respawned worker gets a new identity: replies are matched to the current process only.
        self.ident = b"w%d.%d" % (index, generation)
        self.device = device
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=_STDERR_TAIL)
        self.threads: list[threading.Thread] = []
        self.alive = True
        self.seq_in = -1
        self.exports: list = []  # CUDA IPC reference-counter slots this process imported (see dpool.transport.cuda_ipc)

    def where(self) -> str:
        return f"worker {self.index} ({self.device}, pid {self.pid})"


def _show(label: str, text: str, to_stderr: bool) -> None:
    """Write a worker's output to ours, each line labelled with the worker index."""
    out = sys.stderr if to_stderr else sys.stdout
    try:
        out.write("".join(f"[{label}] {line}\n" for line in text.rstrip("\n").split("\n")))
        out.flush()
    except Exception:  # interpreter shutting down, closed capture, ...
        pass


def _pump(stream: Any, label: str, tail: collections.deque | None, to_stderr: bool) -> None:
    """Copy an embedded worker's output pipe to ours, line by line."""
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace")
        if tail is not None:
            tail.append(line)
        _show(label, line, to_stderr)
    stream.close()


class Pool:
    """N long-lived worker processes, and the rounds of messages exchanged with them.

    Args:
        devices: one device string per worker (``"cpu"``).
        config: limits and timeouts.
        threads: torch intra-op threads for each worker.
    """

    def __init__(self, devices: Sequence[str], config: Config, threads: int, attach: str | None = None) -> None:
        self.attach = attach  # name of a dpool-workers pool to borrow workers from, or None: spawn our own
        self.daemon_pid = -1
        self.devices = list(devices)
        # Per GPU of ours: the interprocess event recorded before each request (NOTE [ CUDA ownership ])
        self._events: dict[int, Any] = {}
        self.config = config
        self.threads = threads
        self.prefix = segment_prefix()
        self.owner_pid = os.getpid()  # a forked child that inherited this pool must not use or close it
        self.step = 0
        self._broken: str | None = None
        self._closed = False
        self._lock = threading.RLock()
        self._in_round = False
        self._segments: list[Segment] = []
        self._seg_counter = 0
        self.rejected = 0  # control messages dropped by authentication or validation
        self._generation = 0
        self._round: set[int] = set()
        self._round_aborted = False
        self.exiting: set[int] = set()  # workers that replied CONTEXT_LOST and are exiting
        self._collectives: dict[int, dict[int, bytes]] = {}
        self._key = secrets.token_bytes(32)
        self.codec = P.Codec(self._key, config.max_message_bytes)
        self._seq_out = 0
        self._pending = [0] * len(self.devices)
        self.workers = [_Worker(i, d) for i, d in enumerate(self.devices)]
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.SNDTIMEO, 5000)
        self._sock.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes + 1024)
        rdir = runtime_dir()
        sweep_sockets(rdir)  # socket files of coordinators that died without cleaning up
        self.sock_path = os.path.join(rdir, self.prefix + ".sock")
        self.endpoint = "ipc://" + self.sock_path
        self._poller = zmq.Poller()
        self._pass_fds: list[int] = []
        # Runs at GC of an unreferenced pool and at interpreter exit; holds no reference to self.
        self._finalizer = weakref.finalize(self, _reap, self.owner_pid, self.workers, self._segments,
                                          self.sock_path, self._sock, self._ctx)
        try:
            self._sock.bind(self.endpoint)
            os.chmod(self.sock_path, 0o600)
            self._poller.register(self._sock, zmq.POLLIN)
            # Heartbeat slots: one int64 (CLOCK_MONOTONIC ns) per worker, passed to workers by fd.
            self.control = self.new_segment(8 * max(1, len(self.devices)), min_size=4096, keep_fd=True)
            if attach is None:
                self.control.unlink()  # our own workers map it by inherited fd
            self.control.u8[: 8 * len(self.devices)].view(torch.int64).fill_(time.monotonic_ns())
            self._beats = memoryview(self.control.mmap).cast("q")  # plain ints: no tensor op per check
        except BaseException:
            self.close()
            raise

    def start(self, fds: Sequence[int] = ()) -> None:
        """Spawn every worker, passing it ``fds`` (plus the control segment), and wait for its hello."""
        assert self.control.fd is not None
        self._pass_fds = [self.control.fd, *fds]
        try:
            if self.attach is not None:
                self._attach_daemon()
            else:
                for w in self.workers:
                    self._spawn(w)
            t0 = time.monotonic()
            self._await_hello({w.index for w in self.workers})
            self.control.unlink()
            # Connected peers keep their connections; the name is only needed to connect. Removing it now
            # leaves nothing behind however this process ends (a kernel manager's killpg included).
            _unlink_socket(self.sock_path)
            log.info("%s %d worker(s) on %s (pids %s) in %.2f s", "attached" if self.attach else "started",
                     len(self.workers), self.devices, [w.pid for w in self.workers], time.monotonic() - t0)
        except BaseException:
            self.close()
            raise

    def pass_fds(self, fds: Sequence[int]) -> None:
        """The fds (besides the control segment's) that workers spawned from now on inherit."""
        assert self.control is not None and self.control.fd is not None
        self._pass_fds = [self.control.fd, *fds]

    def _attach_daemon(self) -> None:
        """Borrow the warm workers of the ``dpool-workers`` pool ``self.attach`` (see workers/daemon.py)."""

        name = self.attach
        assert name is not None
        endpoint, pool_key, _ = locate(name)
        if endpoint.startswith("tcp://"):
            # The workers reach us the way we reach the daemon: over TCP, on loopback. The session
            # socket is authenticated like every other (a peer without the session key is dropped).
            self._sock.bind("tcp://127.0.0.1:0")
            session_endpoint = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        else:
            session_endpoint = self.endpoint
        nonce = secrets.token_bytes(32)
        self._key = P.session_key(pool_key, nonce)  # the daemon derives the same key; it is never sent
        self.codec = P.Codec(self._key, self.config.max_message_bytes)
        deadline = time.monotonic() + self.config.startup_timeout_s
        ask = P.Attach(os.getpid(), session_endpoint, nonce, self.control.ref(), P.PROTOCOL_VERSION,
                              self.config.max_message_bytes)
        while True:
            reply = request(name, ask, timeout=5.0)
            if reply.ok:
                break
            if reply.error.startswith("busy") and time.monotonic() < deadline:
                time.sleep(0.05)  # the previous client's workers are still releasing its memory
                continue
            raise WorkerStartError(f"cannot attach to dpool-workers pool {name!r}: {reply.error}")
        self.daemon_pid = reply.daemon_pid
        try:
            self._daemon_fd = os.pidfd_open(self.daemon_pid)  # readable once it exits (zombie or not)
        except ProcessLookupError:
            raise WorkerStartError(
                f"dpool-workers pool {name!r} answered from daemon pid {self.daemon_pid}, which this process "
                "cannot see: a client must share the pool's host, process IDs and /dev/shm"
            ) from None
        self.threads = reply.threads
        for idx, _device, pid, ident in reply.workers:  # devices: ours, translated from the pool's state
            w = self.workers[idx]
            w.pid, w.ident, w.proc = pid, ident, None
            w.pidfd = os.pidfd_open(pid)
            self._poller.register(w.pidfd, zmq.POLLIN)

    def respawn(self, indices: Sequence[int]) -> None:
        """Replace the (dead or hung) workers ``indices`` by fresh processes; they still need ``init``."""
        # A fresh name to connect to (the first one was removed once every worker had connected).
        self.sock_path = os.path.join(os.path.dirname(self.sock_path), f"{self.prefix}-r{self._generation + 1}.sock")
        self.endpoint = "ipc://" + self.sock_path
        self._sock.bind(self.endpoint)
        os.chmod(self.sock_path, 0o600)
        for idx in indices:
            old = self.workers[idx]
            self._reap_one(old)
            self._generation += 1
            w = _Worker(idx, old.device, self._generation)
            self.workers[idx] = w
            self.exiting.discard(idx)
            self._pending[idx] = 0
            self._beats[idx] = time.monotonic_ns()
            self._spawn(w)
        try:
            self._await_hello(set(indices))
        finally:
            _unlink_socket(self.sock_path)

    def _reap_one(self, w: _Worker) -> None:
        _kill_and_join(w)
        fd = getattr(w, "pidfd", None)
        if fd is not None:
            try:
                self._poller.unregister(fd)
            except KeyError:
                pass
            os.close(fd)
            w.pidfd = None
        for t in w.threads:
            t.join(timeout=2.0)

    # ------------------------------------------------------------------ start
    def new_segment(self, size: int, min_size: int = 1 << 20, keep_fd: bool = False, device: str = "cpu",
                    owner: int | None = None) -> Any:
        """Create a segment of at least ``size`` bytes, tracked for unlinking on close.

        On a GPU ``device`` it is a :class:`dpool.transport.cuda_ipc.Arena` there, exported to worker ``owner``
        (``None``: to each worker that :meth:`~dpool.transport.cuda_ipc.Arena.ref` names).
        """
        size = max(size, min_size)
        size = 1 << (size - 1).bit_length()  # grow in powers of two
        self._seg_counter += 1  # names are never reused: workers cache mappings by name
        region = new_region(torch.device(device), self.config.shm_dir, f"{self.prefix}-{self._seg_counter}", size,
                            self.workers[owner] if owner is not None else None, keep_fd=keep_fd)
        if isinstance(region, Segment):  # a name in /dev/shm, unlinked at close (a GPU arena has none)
            self._segments.append(region)
        return region

    def event_handle(self, idx: int) -> bytes | None:
        """The IPC handle of the event worker ``idx`` waits on before it reads what we wrote (``None`` on CPU).

        One interprocess event per GPU of ours, recorded on that GPU's current stream before every
        request. Cross-device copies into an arena on that GPU are ordered with its current stream
        (torch's copy_ synchronises both devices' current streams), so the one event covers them.
        """
        dev = self.devices[idx]
        if not dev.startswith("cuda"):
            return None
        d = int(dev.split(":")[1])
        event = self._events.get(d)
        if event is None:
            with torch.cuda.device(d):
                event = self._events[d] = torch.cuda.Event(interprocess=True)
                event.record(torch.cuda.current_stream(d))
        return event.ipc_handle()

    def unlink_segments(self) -> None:
        """Unlink every segment name; called once every worker has mapped them."""
        for seg in self._segments:
            seg.unlink()
        self._segments[:] = [s for s in self._segments if s.linked]

    def _spawn(self, w: _Worker) -> None:
        env = worker_env(self.threads)
        env.setdefault("PYTHONUNBUFFERED", "1")
        device = w.device
        if device.startswith("cuda"):  # the worker sees only its own GPU, as cuda:0
            env["CUDA_VISIBLE_DEVICES"] = visible_device(int(device.split(":")[1]))
            device = "cuda:0"
        w.proc = subprocess.Popen(
            worker_command(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            close_fds=True,
            pass_fds=self._pass_fds,
        )
        w.pid = w.proc.pid
        w.pidfd = os.pidfd_open(w.pid)
        self._poller.register(w.pidfd, zmq.POLLIN)
        label = f"dpool worker {w.index}"
        for stream, tail, err in ((w.proc.stdout, None, False), (w.proc.stderr, w.stderr_tail, True)):
            t = threading.Thread(target=_pump, args=(stream, label, tail, err), name=f"{label} output", daemon=True)
            t.start()
            w.threads.append(t)
        boot = {
            "key": self._key,
            "endpoint": self.endpoint,
            "index": w.index,
            "ident": w.ident,
            "device": device,
            "ppid": os.getpid(),
            "threads": self.threads,
            "shm_dir": self.config.shm_dir,
            "prefix": self.prefix,  # on our death the worker removes every name with it (segments, socket)
            "control": self.control.fd_ref(),
            "config": self.config.for_worker(),
        }
        assert w.proc.stdin is not None
        try:
            w.proc.stdin.write(msgpack.packb(boot, use_bin_type=True))
            w.proc.stdin.close()
        except BrokenPipeError:
            pass  # it died at start: reported by _await_hello with its stderr

    def _await_hello(self, waiting: set[int]) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        while waiting:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                idx = min(waiting)
                raise WorkerStartError(
                    f"{self.workers[idx].where()} did not connect within startup_timeout="
                    f"{self.config.startup_timeout_s:g}s; raise DPOOL_STARTUP_TIMEOUT on a slow machine"
                )
            events = dict(self._poller.poll(int(min(remaining, 0.5) * 1000) + 1))
            self._check_exits(events, stage="starting")
            if self._sock in events:
                for idx, msg in self._drain():
                    if idx not in waiting:
                        continue
                    if not isinstance(msg, P.Hello):
                        raise WorkerStartError(f"{self.workers[idx].where()} sent {msg.op!r} instead of hello")
                    self._beats[idx] = time.monotonic_ns()  # heartbeat deadlines start at the hello
                    if msg.protocol != P.PROTOCOL_VERSION:
                        raise ProtocolError(
                            f"worker {idx} speaks dpool protocol {msg.protocol}, coordinator {P.PROTOCOL_VERSION}"
                        )
                    waiting.discard(idx)

    # ------------------------------------------------------------------ rounds
    def check_usable(self) -> None:
        if os.getpid() != self.owner_pid:
            raise ForkedChildError(
                f"a dpool model cannot be used in a forked child process (this is pid {os.getpid()}; the pool "
                f"belongs to pid {self.owner_pid}). DataLoader workers and os.fork() children inherit the wrapped "
                "model but not its worker processes: call the model in the parent, give the child "
                "dpool.unwrap(model) (or a copy of it), or use DataLoader(multiprocessing_context='spawn')."
            )
        if self._closed and self._broken is None:
            raise PoolBrokenError(
                "this dpool pool is closed; wrap the module again, or use dpool.unwrap(model) to run it directly"
            )
        if self._broken is not None:
            raise PoolBrokenError(
                f"this dpool pool is broken by an earlier failure ({self._broken}); its workers are gone. "
                "The master module is intact: dpool.unwrap(model) returns it, and dpool.wrap() it again "
                "for a new pool."
            )

    def request(self, msgs: dict[int, P.Message], stage: str, timeout: float | None = None) -> dict[int, P.Message]:
        """Send one message to each chosen worker and wait for all replies.

        Returns:
            worker index → reply (``Failed`` replies included; the caller raises).

        Raises:
            WorkerDiedError, WorkerTimeoutError: the pool is broken first.
            PoolBrokenError: the pool was already broken or closed.
        """
        self.check_usable()
        with self._lock:
            self._in_round = True
            self._round = set(msgs)
            self._round_aborted = False
            self._collectives = {}
            try:
                for d, event in self._events.items():  # workers' streams wait for what we queued so far
                    event.record(torch.cuda.current_stream(d))
                for idx, msg in msgs.items():
                    self._send(idx, msg)
                return self._wait(set(msgs), stage, timeout if timeout is not None else self.config.step_timeout_s)
            # On WorkerDiedError / WorkerTimeoutError the caller either respawns the worker
            # (max_restarts) or calls break_pool(). KeyboardInterrupt and friends leave the pool
            # usable: replies still owed are discarded later (see _pending).
            finally:
                self._in_round = False
                if self._closed:
                    self._close_sockets()

    def _send(self, idx: int, msg: P.Message) -> None:
        w = self.workers[idx]
        self._seq_out += 1
        frame = self.codec.encode(msg, self._seq_out)
        try:
            self._sock.send(w.ident, zmq.SNDMORE)
            self._sock.send(frame)
        except zmq.ZMQError as exc:
            self._raise_dead(w, f"sending {msg.op}", detail=f" (send failed: {exc})")
        self._pending[idx] += 1

    def _drain(self) -> list[tuple[int, P.Message]]:
        out = []
        sock = self._sock
        while sock.get(zmq.EVENTS) & zmq.POLLIN:
            frames = sock.recv_multipart(zmq.NOBLOCK, copy=True)
            ident, body = frames[0], frames[1:]
            idx = self._index_of(ident)
            try:
                if idx < 0:
                    raise ProtocolError(f"message from unknown peer {ident!r}")
                seq, msg = self.codec.decode(body)
                w = self.workers[idx]
                if seq <= w.seq_in:
                    raise ProtocolError(f"replayed or reordered message (seq {seq} ≤ {w.seq_in})")
            except ProtocolError as exc:
                # Never decoded further and never answered: a foreign or corrupted message must not be
                # able to break the pool. Counted, and reported once per kind.
                self.rejected += 1
                if self.rejected <= 3:
                    warnings.warn(f"dpool dropped a control message from {ident!r}: {exc}", RuntimeWarning, stacklevel=2)
                continue
            w.seq_in = seq
            if isinstance(msg, P.Output):  # an attached worker's prints: shown as embedded workers' are
                _show(f"dpool worker {idx}", msg.text, msg.stream == 2)
                continue
            if not isinstance(msg, (P.Hello, P.AllReduce)):
                # A reply. Every reply settles one request, wherever it is read: a reply owed by an
                # abandoned round (a failed send to another worker, Ctrl-C) is dropped here, and the
                # reply to the current request is the one that brings the count to zero.
                self._pending[idx] -= 1
                if self._pending[idx] > 0:
                    continue
            out.append((idx, msg))
        return out

    # ------------------------------------------------------------------ collectives
    def _allreduce(self, idx: int, msg: P.AllReduce) -> None:
        """Hub of the workers' all-reduces (SyncBatchNorm): sum once every shard of the round sent its part."""
        if self._round_aborted:
            self._reply_collective(idx, P.AllReduceDone(msg.seq, b"", True))
            return
        parts = self._collectives.setdefault(msg.seq, {})
        parts[idx] = msg.data
        if len(parts) < len(self._round):
            return
        del self._collectives[msg.seq]
        sizes = {len(d) for d in parts.values()}
        if len(sizes) != 1 or next(iter(sizes)) % 8:
            self._abort_collectives()
            return
        total = torch.zeros(next(iter(sizes)) // 8, dtype=torch.float64)
        for d in parts.values():
            total += from_bytes(d, torch.float64)
        data = to_bytes(total)
        for w in parts:
            self._reply_collective(w, P.AllReduceDone(msg.seq, data, False))

    def _abort_collectives(self) -> None:
        """A shard failed: release every worker blocked in a collective of this round."""
        self._round_aborted = True
        for seq, parts in self._collectives.items():
            for w in parts:
                self._reply_collective(w, P.AllReduceDone(seq, b"", True))
        self._collectives.clear()

    def _reply_collective(self, idx: int, msg: P.Message) -> None:
        self._seq_out += 1
        try:
            self._sock.send_multipart([self.workers[idx].ident, self.codec.encode(msg, self._seq_out)], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the worker is gone; its death is reported by the exit sentinel

    def _index_of(self, ident: bytes) -> int:
        for w in self.workers:
            if w.ident == ident:
                return w.index
        return -1

    def _wait(self, need: set[int], stage: str, timeout: float) -> dict[int, P.Message]:
        replies: dict[int, P.Message] = {}
        start = time.monotonic()
        deadline = start + timeout
        hb_timeout_ns = int(self.config.heartbeat_timeout_s * 1e9)
        tick = max(0.01, min(self.config.heartbeat_interval_s, self.config.heartbeat_timeout_s / 4))
        while need:
            if self._closed:  # close() from another thread: it killed the workers, which woke us
                raise PoolBrokenError(f"the pool was closed (from another thread) while {stage} at step {self.step}")
            now = time.monotonic()
            if now >= deadline:
                idx = min(need)
                w = self.workers[idx]
                self._dump_and_kill(w)
                raise WorkerTimeoutError(
                    f"step {self.step} exceeded step_timeout={timeout:g}s on {w.where()} while {stage}; "
                    "the worker's stacks were dumped to stderr above and it was killed. "
                    "Raise DPOOL_STEP_TIMEOUT if steps are legitimately this slow.",
                    worker=idx, device=w.device, pid=w.pid, step=self.step,
                )
            events = dict(self._poller.poll(int(min(deadline - now, tick) * 1000) + 1))
            if self._sock in events:
                for idx, msg in self._drain():
                    if isinstance(msg, P.AllReduce):
                        self._allreduce(idx, msg)
                        continue
                    if idx in need:
                        replies[idx] = msg
                        need.discard(idx)
                        if isinstance(msg, P.Failed):
                            self._abort_collectives()
                            if msg.stage.endswith(P.CONTEXT_LOST):
                                self.exiting.add(idx)  # its exit is announced: not a death to report
            self._check_exits(events, stage=stage)
            if need:
                now_ns = time.monotonic_ns()
                for idx in need:
                    silent = now_ns - self._beats[idx]
                    if silent > hb_timeout_ns:
                        w = self.workers[idx]
                        self._dump_and_kill(w)
                        raise WorkerTimeoutError(
                            f"{w.where()} unresponsive while {stage} at step {self.step}: no heartbeat for "
                            f"{silent / 1e9:.1f}s (heartbeat_timeout={self.config.heartbeat_timeout_s:g}s). It is "
                            "stuck holding the GIL or frozen; its stacks were dumped to stderr above and it was "
                            "killed.",
                            worker=idx, device=w.device, pid=w.pid, step=self.step,
                        )
        return replies

    def _check_exits(self, events: dict, stage: str) -> None:
        for idx in self.exiting:  # announced exits (CONTEXT_LOST): reaped here, not reported
            w = self.workers[idx]
            if w.alive and events.get(w.pidfd):
                w.alive = False
                if w.proc is not None:
                    w.proc.wait()
        dead = [w for w in self.workers if w.alive and events.get(w.pidfd)]
        if not dead:
            return
        time.sleep(0.05)  # let simultaneous deaths land, so one error names them all
        if self._closed:
            raise PoolBrokenError(f"the pool was closed (from another thread) while {stage} at step {self.step}")
        readable, _, _ = select.select([w.pidfd for w in self.workers if w.alive], [], [], 0)
        dead = [w for w in self.workers if w.alive and w.pidfd in readable]
        if not dead:
            return
        for w in dead:
            w.alive = False
            if w.proc is not None:
                w.proc.wait()
        self._raise_dead(dead[0], stage, others=dead[1:])

    def _raise_dead(self, w: _Worker, stage: str, others: Sequence[_Worker] = (), detail: str = "") -> None:
        if w.proc is None:  # a daemon's worker: not our child, so no exit status
            fd = getattr(self, "_daemon_fd", None)
            if (fd is not None and select.select([fd], [], [], 0.2)[0]) or self._daemon_stopping():
                raise DaemonLostError(
                    f"the dpool-workers daemon of pool {self.attach!r} (pid {self.daemon_pid}) is gone or was "
                    f"stopped: {w.where()} "
                    f"exited while {stage} at step {self.step}. The master module is unchanged (dpool.unwrap(model) "
                    f"returns it); start the pool again (dpool-workers start --name {self.attach}) and wrap again."
                )
            raise WorkerDiedError(
                f"{w.where()} of dpool-workers pool {self.attach!r} died while {stage} at step {self.step}; the "
                f"daemon restarts it (see dpool-workers status --name {self.attach}).",
                worker=w.index, device=w.device, pid=w.pid, step=self.step,
                workers=[w.index] + [o.index for o in others],
            )
        if w.proc.poll() is None:
            try:
                w.proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
        rc = w.proc.returncode
        sig = _signal_name(rc) if rc is not None else None
        how = f"was killed by {sig}" if sig else f"exited with code {rc}"
        hint = ""
        if sig == "SIGKILL":
            hint = " A SIGKILL nobody sent on purpose is usually the out-of-memory killer: check dmesg and memory limits."
        elif sig in ("SIGSEGV", "SIGBUS", "SIGILL", "SIGABRT"):
            hint = " The worker crashed in native code; its faulthandler traceback (stderr) follows."
        elif rc == 0:
            hint = " The model code (or a library) exited the process, e.g. sys.exit() in forward."
        if stage == "starting":
            for t in w.threads:
                t.join(timeout=1.0)
        tail = "".join(w.stderr_tail).rstrip()
        text = f"{w.where()} {how} while {stage} at step {self.step}{detail}.{hint}"
        if others:
            text += " Also dead: " + ", ".join(f"{o.where()} ({_signal_name(o.proc.returncode) or 'exit ' + str(o.proc.returncode)})" for o in others) + "."
        if tail:
            text += "\n--- last stderr of worker %d ---\n%s" % (w.index, tail[-4000:])
        cls = WorkerStartError if stage == "starting" else WorkerDiedError
        if cls is WorkerStartError:
            raise WorkerStartError(text)
        raise WorkerDiedError(
            text, worker=w.index, device=w.device, pid=w.pid, step=self.step, exitcode=rc if rc is not None and rc >= 0 else None,
            signal_name=sig, workers=[w.index] + [o.index for o in others],
        )

    def _daemon_stopping(self) -> bool:
        """Whether our daemon is stopping (it says so in its state file before it ends our workers) or gone."""
        if self.attach is None or self.attach.startswith("tcp://"):
            return False  # a TCP client may not see the pool's directory: the pidfd alone tells
        try:
            state, _ = read_pool(self.attach)
        except (OSError, ValueError):
            return True  # no daemon holds the pool's lock any more
        return bool(state.get("stopping")) or state.get("pid") != self.daemon_pid

    def _dump_and_kill(self, w: _Worker) -> None:
        try:
            os.kill(w.pid, signal.SIGCONT)
            os.kill(w.pid, signal.SIGUSR1)  # faulthandler dumps every thread's stack
            if w.proc is not None:
                try:
                    w.proc.wait(timeout=0.3)
                except subprocess.TimeoutExpired:
                    pass
                w.proc.kill()
            else:  # a daemon's worker: the daemon reaps and respawns it
                time.sleep(0.3)
                os.kill(w.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def break_pool(self, reason: str) -> None:
        """Mark the pool broken (every later call raises at once) and kill the workers."""
        if self._broken is None:
            self._broken = reason.split("\n", 1)[0]
        self._terminate_workers(grace=0.0)

    # ------------------------------------------------------------------ close
    def _terminate_workers(self, grace: float) -> None:
        if self.attach is not None:
            self._detach_daemon()
            return
        if grace > 0:
            for w in self.workers:
                if w.alive and getattr(w, "proc", None) is not None and w.proc.poll() is None and not self._in_round:
                    try:
                        self._sock.send_multipart([w.ident, self.codec.encode(P.Shutdown(), self._seq_out + 1)], zmq.NOBLOCK)
                        self._seq_out += 1
                    except zmq.ZMQError:
                        pass
            deadline = time.monotonic() + grace
            for w in self.workers:
                if getattr(w, "proc", None) is None:
                    continue
                try:
                    w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        for w in self.workers:
            _kill_and_join(w)

    def _detach_daemon(self) -> None:
        """Give the daemon's workers back: each drops our replica and memory; then the lease is freed."""
        told = set()
        for w in self.workers:
            if w.alive and getattr(w, "pidfd", None) is not None and not self._in_round:
                try:
                    self._sock.send_multipart([w.ident, self.codec.encode(P.Shutdown(), self._seq_out + 1)], zmq.NOBLOCK)
                    self._seq_out += 1
                    told.add(w.index)
                except zmq.ZMQError:
                    pass
            w.alive = False
        if any(w.exports for w in self.workers):
            self._settle_cuda_exports(told)
        try:
            assert self.attach is not None
            request(self.attach, P.Detach(os.getpid()), timeout=2.0)
        except Exception:
            pass  # the daemon is gone, or will notice our exit through our pidfd

    def _settle_cuda_exports(self, told: set[int]) -> None:
        """Our GPU arenas' IPC counters held by daemon workers (see NOTE [ CUDA ownership ] in dpool.transport.cuda_ipc).

        A worker told to shut down frees its imports, then answers ``serve_done``: its slots are back at
        zero. The slots of a worker that died first are ours to release. A worker that neither answers
        nor exits keeps its slots, so the memory it may still map is never reused.
        """
        waiting = {i for i in told if self.workers[i].exports}
        deadline = time.monotonic() + self.config.shutdown_timeout_s
        while waiting and time.monotonic() < deadline:
            if not self._sock.poll(50):
                waiting -= {i for i in waiting if self._exited(self.workers[i])}
                continue
            for idx, msg in self._drain():
                if isinstance(msg, P.ServeDone) and idx in waiting:
                    waiting.discard(idx)
                    self.workers[idx].exports.clear()  # freed by the worker itself
        for w in self.workers:
            if not w.exports:
                continue
            if self._exited(w):
                cuda_ipc.release(w.exports)
            else:
                log.warning("%s did not give back its CUDA mappings of this process's memory within %gs; that memory "
                            "stays allocated until this process exits", w.where(), self.config.shutdown_timeout_s)
                w.exports.clear()
        torch.cuda.ipc_collect()  # arenas freed while a worker still mapped them (grown regions) go now

    @staticmethod
    def _exited(w: _Worker) -> bool:
        fd = getattr(w, "pidfd", None)
        if fd is not None:
            return bool(select.select([fd], [], [], 0)[0])
        return not psutil.pid_exists(w.pid)

    def close(self) -> None:
        """End the workers and free every resource. Idempotent; returns when all workers are joined."""
        if self._closed:
            return
        self._closed = True
        if os.getpid() == self.owner_pid:
            log.info("closing the pool of %d worker(s)", len(self.workers))
        if os.getpid() != self.owner_pid:
            # A forked child's copy: the workers, the socket file and the segments are the parent's, and a
            # ZeroMQ context must not be used after fork. Drop it without touching any of them.
            self._finalizer.detach()
            return
        self._terminate_workers(grace=0.0 if self._in_round else self.config.shutdown_timeout_s)
        for w in self.workers:
            for t in w.threads:
                t.join(timeout=2.0)
        for seg in self._segments:
            seg.unlink()
        if not self._in_round:
            # A round running in another thread still polls the pidfds and the socket: it releases
            # them itself when it ends (see request()).
            self._close_sockets()
        self._finalizer.detach()

    def _close_sockets(self) -> None:
        """Release the fds a round polls: pidfds, the socket, the control segment's fd."""
        for w in self.workers:
            fd = getattr(w, "pidfd", None)
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
                w.pidfd = None
        for seg in self._segments:
            seg.close_fd()
        self._segments.clear()
        control = getattr(self, "control", None)
        if control is not None:  # unlinked at start, so no longer in _segments: its fd is closed here
            control.close_fd()
            self._beats = None  # the last view of the control mapping: it is unmapped with the segment
            self.control = None
        fd = getattr(self, "_daemon_fd", None)
        if fd is not None:
            os.close(fd)
            self._daemon_fd = None
        if not self._sock.closed:
            self._sock.close(linger=0)
            self._ctx.term()
            try:
                os.unlink(self.sock_path)
            except FileNotFoundError:
                pass

    @property
    def broken(self) -> str | None:
        return self._broken


def _kill_and_join(w: _Worker) -> None:
    """SIGKILL a worker (waking it first if it is stopped) and reap it; no-op if already gone."""
    proc = getattr(w, "proc", None)
    if proc is not None:
        if proc.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            proc.kill()
        proc.wait()
    w.alive = False
    if w.exports and proc is not None:  # our child is gone: its CUDA IPC counters are ours to release, once
        cuda_ipc.release(w.exports)


def _reap(owner: int, workers: list[_Worker], segments: list[Segment], sock_path: str, sock: Any,
          ctx: Any) -> None:  # pragma: no cover
    """GC / interpreter-exit cleanup of a pool nobody closed."""
    if os.getpid() != owner:
        return  # a forked child's exit: the workers, segments and socket belong to the parent
    # Names first: a host that kills us right after a graceful shutdown request (a Jupyter kernel
    # manager does) must find nothing left, and the workers can no longer remove them once killed.
    _unlink_socket(sock_path)
    for seg in segments:
        seg.unlink()
    for w in workers:
        _kill_and_join(w)
    if not sock.closed:  # no ResourceWarning for a pool nobody closed
        sock.close(linger=0)
        ctx.term()


def _unlink_socket(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
