"""Worker processes and the request/reply rounds between them and the coordinator.

::

    coordinator (training script)                          worker k  (dpool_workers.worker)
    ─────────────────────────────                          ────────────────────────────────────
    Pool.__init__
      runtime dir 0700, key = 32 random bytes
      ROUTER bind ipc://<dir>/<prefix>.sock
      launcher.start (Spawn: Popen ×N ── stdin: boot ──>   watchdog thread (pidfd of the parent)
                      Lease: see dpool.attach)
      pidfd_open(worker)                                   heartbeat thread → control segment
                  <────────────── hello ────────────────   DEALER connect
    request(init) ──────────── init ──────────────────>   unpickle model, map segments
                  <────────────── init_done ────────────
    request(forward/backward/...)  (one round = one message to each chosen worker, then wait)
                  ──────────── forward ───────────────>
                  <────────────── forward_done | failed

NOTE [ dpool shutdown ]
=======================
*Who ends what.* The coordinator owns every worker it spawned. ``Pool.close()``
asks its launcher to end them: :class:`~dpool.launch.Spawn` sends ``shutdown``
to each worker, waits ``shutdown_timeout_s`` on them, then SIGKILLs the rest
and reaps them; :class:`~dpool.attach.Lease` tells a daemon's workers to drop
our replica and gives the lease back. ``close()`` returns only when every
worker has been joined (or handed back). It is idempotent and safe to call
from another thread: it kills the workers first, which wakes a waiting round,
and only touches the socket when no round is running.

*A pool nobody closed* (a model dropped, a notebook cell run again) is reaped by a
``weakref.finalize`` (:func:`_reap`), when the pool is garbage and at interpreter exit:
names unlinked, a daemon's workers told to drop our replica and the lease freed
(:meth:`~dpool.launch.Launcher.abandon`), our own workers killed, their pidfds closed; a
segment's kept fd closes with the segment. The finalizer's arguments must never lead
back to the pool, or the pool is never garbage: the channel's reject callback holds it
weakly, and the runtime's segment factory holds the pool, not the runtime.

*Why no step blocks forever.* Every wait in :meth:`Pool.request` is a
``zmq.Poller`` poll on the socket *and* every worker's pidfd, with a timeout:

1. a worker that exits (killed, segfault, ``os._exit``) makes its pidfd
   readable: ``WorkerDiedError`` at once (process-exit sentinel);
2. a worker whose heartbeat thread has not written its slot in the control
   segment for ``heartbeat_timeout_s`` (outside the round that loads the
   model, which may legitimately hold the GIL for long) is hung while
   holding the GIL or frozen: its stacks are dumped (SIGUSR1 →
   faulthandler), it is killed,
   ``WorkerTimeoutError`` (a ZeroMQ heartbeat would not see this, since
   libzmq's I/O thread keeps answering);
3. a round that outlives ``step_timeout_s`` (the round that loads the model:
   ``startup_timeout_s``): ``WorkerTimeoutError``.

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

NOTE [ spinning through short rounds ]
======================================
A coordinator that sleeps in the poll for a round pays twice when the round is short: the reply
must wake it (on a virtual machine, an interrupt to a halted vCPU), and what it runs next runs on
a core that went idle. On the 2-core VM of the benchmarks a single process's loss and optimizer
step took about twice as long after a short sleep as when run straight on, and hardly longer after
the same time spent yielding (docs/performance.md). So when the same stage's previous round took at most
:data:`SPIN_ROUNDS_UP_TO_S`, :meth:`Pool._wait` first polls without blocking, calling
``sched_yield`` between polls, until the previous round's time plus ``spin_s`` has passed; then it
sleeps in the poll as before. Yielding hands the core to any thread that can run there (a
worker's, on a machine without a core to spare), so the spin takes only time nobody else wants.
The probe step got faster with it, with one worker and with two. Longer rounds (the mlp's) never
spin: spinning through their last part competed with the workers (docs/performance.md). ``spin_s``
comes from ``DPOOL_WAIT_SPIN_US`` (see :func:`dpool.policies.wait_spin`); the deadlines, exit sentinels and heartbeats are checked as before,
since a spin ends by itself within ``SPIN_ROUNDS_UP_TO_S + spin_s``.

*Sockets.* See :mod:`dpool.channel`: LINGER is 0, so ``close()`` never waits
on undelivered messages; ROUTER_MANDATORY plus SNDTIMEO turn a send to a
vanished or stalled worker into an error instead of a silent drop.
"""
from __future__ import annotations

import functools
import logging
import os
import secrets
import select
import signal
import threading
import time
import warnings
import weakref
from typing import Any, Callable, Mapping, Sequence

import psutil
import torch
import zmq

from . import protocol as P
from .attach import Lease
from .channel import Channel
from .transport.events import CudaEvents
from .collectives import AllReduceHub
from .config import Config
from .daemon_client import runtime_dir
from .errors import ForkedChildError, PoolBrokenError, ProtocolError, WorkerStartError, WorkerTimeoutError
from .launch import Launcher, Spawn, Worker, show_output
from .progress import Progress
from .sweep import sweep_sockets
from .transport import cuda_ipc, new_region
from .transport.shm import Segment, segment_prefix

__all__ = ["Pool"]

log = logging.getLogger("dpool")

# Rounds that took at most this long last time (per stage: forward, backward, ...) are waited for by
# spinning; longer ones by sleeping in the poll (NOTE [ spinning through short rounds ]).
SPIN_ROUNDS_UP_TO_S = 1e-3

# What a worker sends outside any request of a round: its first word, and its answer to a shutdown told.
# Everything else names the request it was sent for (``re``): replies, collectives, bucket reports.
_UNASKED = (P.Hello, P.ServeDone)


def _call_weakly(method: weakref.WeakMethod, *args: Any) -> None:
    """Call ``method`` if its object is still alive (a callback that must not keep the object alive)."""
    bound = method()
    if bound is not None:
        bound(*args)


class Pool:
    """N long-lived worker processes, and the rounds of messages exchanged with them.

    Args:
        devices: one device string per worker (``"cpu"``, ``"cuda:i"``).
        config: limits and timeouts.
        threads: torch intra-op threads for each worker.
        attach: the name of a ``dpool-workers`` pool whose workers to lease (see :mod:`dpool.attach`),
            or ``None`` to spawn our own (:class:`dpool.launch.Spawn`).
        reply_together, spin_s: how rounds are waited for (:mod:`dpool.policies`, and the NOTEs above).
        async_replies: GPU workers reply before their GPU ran a forward's kernels, with an event of ours our
            streams wait on (unverified; NOTE [ CUDA ownership ] in :mod:`dpool.transport.cuda_ipc`).
        across: combines SyncBatchNorm's statistics with other nodes' (cross-node mode), or ``None``.
        progress: the step counter its errors name (the runtime's; a new one if ``None``).
    """

    def __init__(self, devices: Sequence[str], config: Config, threads: int, attach: str | None = None,
                 reply_together: bool = False, spin_s: float = 0.0, async_replies: bool = False,
                 across: Callable | None = None, progress: Progress | None = None) -> None:
        self.launcher: Launcher = Lease(attach) if attach is not None else Spawn()
        self.devices = list(devices)
        self.events = CudaEvents(self.devices, async_replies)  # (NOTE [ CUDA ownership ])
        self._gpus = any(d.startswith("cuda") for d in self.devices)
        self.config = config
        self.threads = threads
        self.prefix = segment_prefix()
        self.owner_pid = os.getpid()  # a forked child that inherited this pool must not use or close it
        self.progress = progress if progress is not None else Progress()  # (the step its errors name)
        self._broken: str | None = None
        self._closed = False  # close() began (see close())
        self._close_done = False
        self._lock = threading.RLock()
        self._in_round = False
        self._segments: list[Segment] = []
        self._seg_counter = 0
        self._generation = 0
        self._round: set[int] = set()
        self.exiting: set[int] = set()  # workers that replied CONTEXT_LOST and are exiting
        self._hub = AllReduceHub()
        self._hub.across = across
        # Set for a backward round whose buckets are exchanged as they complete (dpool.crossnode):
        # called with (worker index, call, bucket) from inside the round's wait.
        self.on_bucket: Callable[[int, int, int], None] | None = None
        self.key = secrets.token_bytes(32)
        # the number of the latest request sent to each worker: only the reply that names it (its ``re``) is
        # that request's; a reply owed to a round that Ctrl-C or a failed send abandoned is dropped
        self._asked = [-1] * len(self.devices)
        self.rounds_sent = 0  # rounds whose every request left (a cut round may have reached only some workers)
        # the latest round's timestamps (time.monotonic(), the clock the workers' replies use too): when
        # its first request left, and when each worker's reply was read (see dpool.stats.Stats.split_round)
        self.sent_at = 0.0
        self.arrived = [0.0] * len(self.devices)
        self.reply_together = reply_together  # (and the number of the latest such round:)
        self._together_round = 0
        self._rounds_at = 8 * len(self.devices)  # byte offset of those round slots in the control segment
        self.spin_s = spin_s  # (and each stage's latest round time: NOTE [ spinning through short rounds ])
        self._took: dict[str, float] = {}
        self.rounds_spun = 0  # rounds whose last reply a spin caught
        self.workers = [Worker(i, d) for i, d in enumerate(self.devices)]
        self._by_ident: dict[bytes, int] = {}  # routing identity → worker index (checked against workers)
        self._ctx = zmq.Context()
        # (the channel is among the finalizer's arguments below, so what it holds must not hold the pool:
        # a bound method here kept every dropped pool, and its workers, alive until the interpreter exited)
        self.chan = Channel(self._ctx, True, self.key, config.max_message_bytes, send_timeout_ms=5000,
                            on_reject=functools.partial(_call_weakly, weakref.WeakMethod(self._rejected)))
        rdir = runtime_dir()
        sweep_sockets(rdir)  # socket files of coordinators that died without cleaning up
        self.sock_path = os.path.join(rdir, self.prefix + ".sock")
        self.endpoint = "ipc://" + self.sock_path
        self._poller = zmq.Poller()
        self.inherited_fds: list[int] = []  # what spawned workers inherit: the control segment, the master's
        # Runs at GC of an unreferenced pool and at interpreter exit; holds no reference to self.
        self._finalizer = weakref.finalize(self, _reap, self.owner_pid, self.workers, self._segments,
                                          self.sock_path, self.chan, self._ctx, self.launcher)
        try:
            self.chan.bind(self.endpoint)
            self._poller.register(self.chan.sock, zmq.POLLIN)
            # Heartbeat slots: one int64 (CLOCK_MONOTONIC ns) per worker, passed to workers by fd; then one
            # int64 per worker, the latest round it finished when asked to reply together (see together()).
            self.control = self.new_segment(self._rounds_at + 8 * max(1, len(self.devices)), min_size=4096,
                                            keep_fd=True)
            if self.launcher.spawns:
                self.control.unlink()  # our own workers map it by inherited fd
            self.control.u8[: 8 * len(self.devices)].view(torch.int64).fill_(time.monotonic_ns())
            self._beats = memoryview(self.control.mmap).cast("q")  # plain ints: no tensor op per check
        except BaseException:
            self.close()
            raise

    @property
    def hub(self) -> AllReduceHub:
        """The collectives hub of the rounds (SyncBatchNorm's all-reduce)."""
        return self._hub

    @property
    def rejected(self) -> int:
        """Control messages dropped by authentication or validation."""
        return self.chan.rejected

    def _rejected(self, peer: bytes, exc: ProtocolError) -> None:
        # Never decoded further and never answered: a foreign or corrupted message must not be able to
        # break the pool. Counted, and reported the first few times.
        if self.chan.rejected <= 3:
            warnings.warn(f"dpool dropped a control message from {peer!r}: {exc}", RuntimeWarning, stacklevel=5)

    def rekey(self, key: bytes) -> None:
        """Authenticate with ``key`` from now on (a leased pool's session key)."""
        self.key = key
        self.chan.rekey(key)

    # ------------------------------------------------------------------ start
    def start(self, fds: Sequence[int] = ()) -> None:
        """Start every worker through the launcher, passing it ``fds`` (plus the control segment), and wait for its hello."""
        self.pass_fds(fds)
        try:
            self.launcher.start(self)
            t0 = time.monotonic()
            self._await_hello({w.index for w in self.workers})
            self.control.unlink()
            # Connected peers keep their connections; the name is only needed to connect. Removing it now
            # leaves nothing behind however this process ends (a kernel manager's killpg included).
            _unlink_socket(self.sock_path)
            log.info("%s %d worker(s) on %s (pids %s) in %.2f s", self.launcher.verb, len(self.workers), self.devices,
                     [w.pid for w in self.workers], time.monotonic() - t0)
        except BaseException:
            self.close()
            raise

    def pass_fds(self, fds: Sequence[int]) -> None:
        """The fds (besides the control segment's) that workers spawned from now on inherit."""
        assert self.control is not None and self.control.fd is not None
        self.inherited_fds = [self.control.fd, *fds]

    def watch(self, w: Worker) -> None:
        """Follow ``w``'s process (``w.pid``) through a pidfd: its exit wakes every wait of a round."""
        w.pidfd = os.pidfd_open(w.pid)  # readable once it exits (zombie or not)
        self._poller.register(w.pidfd, zmq.POLLIN)

    def respawn(self, indices: Sequence[int]) -> None:
        """Replace the (dead or hung) workers ``indices`` by fresh processes; they still need ``init``.

        Cut short (a Ctrl-C), it can run again for the same ``indices``: each worker there, old or half
        started, is forgotten (killed and reaped) before its replacement starts, and the socket file goes.
        """
        # A fresh name to connect to (the first one was removed once every worker had connected).
        self.sock_path = os.path.join(os.path.dirname(self.sock_path), f"{self.prefix}-r{self._generation + 1}.sock")
        self.endpoint = "ipc://" + self.sock_path
        try:
            self.chan.bind(self.endpoint)
            for idx in indices:
                old = self.workers[idx]
                self._forget(old)
                self._generation += 1
                w = Worker(idx, old.device, self._generation)
                self.workers[idx] = w
                self.exiting.discard(idx)
                self._asked[idx] = -1
                self._beats[idx] = time.monotonic_ns()
                self.launcher.respawn(self, w)
            self._await_hello(set(indices))
        finally:
            _unlink_socket(self.sock_path)

    def _forget(self, w: Worker) -> None:
        """Kill and reap ``w`` and release everything we held for it."""
        self.kill(w)
        self.events.forget(w.index)
        if w.pidfd is not None:
            try:
                self._poller.unregister(w.pidfd)
            except KeyError:
                pass
            fd, w.pidfd = w.pidfd, None  # forgotten first: never closed twice (see Lease._give_back)
            os.close(fd)
        for t in w.threads:
            t.join(timeout=2.0)
        self.chan.forget(w.ident)

    def kill(self, w: Worker) -> None:
        """Kill and reap one of our workers (no-op for a daemon's), releasing its CUDA IPC counters."""
        _kill(w)

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

    def unlink_segments(self) -> None:
        """Unlink every segment name; called once every worker has mapped them."""
        for seg in self._segments:
            seg.unlink()
        self._segments[:] = [s for s in self._segments if s.linked]

    def _await_hello(self, waiting: set[int]) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        while waiting:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                idx = min(waiting)
                raise WorkerStartError(f"{self.workers[idx].where()} did not connect within startup_timeout="
                                       f"{self.config.startup_timeout_s:g}s; raise DPOOL_STARTUP_TIMEOUT on a slow "
                                       "machine", workers=sorted(waiting))
            events = dict(self._poller.poll(int(min(remaining, 0.5) * 1000) + 1))
            self._check_exits(events, stage="starting")
            if self.chan.sock in events:
                for idx, msg in self.drain():
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
    def together(self, k: int) -> list:
        """The ``together`` field of a forward or backward round of ``k`` shards: ``[]`` (each worker replies
        as soon as it is done), or ``[round, k, offset]`` (see :data:`dpool.protocol.TOGETHER_WAIT_S`)."""
        if not self.reply_together or k < 2:
            return []
        self._together_round += 1
        return [self._together_round, k, self._rounds_at]

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

    def request(self, msgs: Mapping[int, P.Message], stage: str, loading: bool = False) -> dict[int, Any]:
        """Send one message to each chosen worker and wait for all replies.

        ``loading=True`` is the round that loads the model: ``startup_timeout_s`` bounds it, and
        heartbeats are not judged, since unpickling, imports and opening CUDA IPC handles may hold
        a worker's GIL for seconds (seen: 3 s in ``cudaIpcOpenEventHandle`` on a loaded H100
        machine). Other rounds: ``step_timeout_s`` and heartbeats.

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
            self._hub.begin(len(msgs))
            try:
                if self._gpus:
                    self.events.before_request()
                self.sent_at = time.monotonic()
                for idx, msg in msgs.items():
                    self._send(idx, msg)
                self.rounds_sent += 1
                replies = self._wait(set(msgs), stage, loading)
                if self._gpus:
                    self.events.after_replies(replies)
                return replies
            # On WorkerDiedError / WorkerTimeoutError the caller either respawns the worker
            # (max_restarts) or calls break_pool(). KeyboardInterrupt and friends leave the pool
            # usable: replies still owed are dropped when they come (see _asked). Either way, workers
            # waiting in a collective of this round are released (and later ones by _take).
            except BaseException:
                self._hub.abort(self._reply)
                raise
            finally:
                self._in_round = False
                if self._closed:
                    self._close_sockets()

    def _send(self, idx: int, msg: P.Message) -> None:
        w = self.workers[idx]
        seq = self._asked[idx] = self.chan.next_seq()  # before the send: an exception may cut it anywhere
        try:
            self.chan.send(msg, w.ident, seq=seq)
        except zmq.ZMQError as exc:
            raise self.launcher.death(self, w, f"sending {msg.op}", (), f" (send failed: {exc})") from None

    def tell(self, w: Worker, msg: P.Message) -> bool:
        """Send ``msg`` to ``w`` outside a round, without blocking or raising; whether it was sent."""
        if self._in_round:
            return False
        return self.chan.try_send(msg, w.ident)

    def _reply(self, idx: int, msg: P.Message, re: int | None = None) -> None:
        """Answer worker ``idx`` within its request ``re`` (default: its latest), without blocking or raising."""
        # a worker that is gone is reported by its exit sentinel
        self.chan.try_send(msg, self.workers[idx].ident, self._asked[idx] if re is None else re)

    def drain(self) -> list[tuple[int, P.Message]]:
        """Every message from a current worker queued now (replies owed to abandoned rounds are dropped)."""
        out: list[tuple[int, P.Message]] = []
        while True:
            got = self._take()
            if got is None:
                return out
            out.append(got)

    def _take(self) -> tuple[int, P.Message] | None:
        """The next queued message from a current worker, or ``None`` when none is queued."""
        while True:
            got = self.chan.recv_nowait()
            if got is None:
                return None
            ident, msg = got
            idx = self._index_of(ident)
            if idx < 0:
                # authenticated but from no current worker (a replaced one's last words): dropped
                self.chan.rejected += 1
                self._rejected(ident, ProtocolError(f"message from unknown peer {ident!r}"))
                continue
            if isinstance(msg, P.Output):  # an attached worker's prints: shown as spawned workers' are
                show_output(f"dpool worker {idx}", msg.text, msg.stream == 2)
                continue
            if self.chan.last_re != self._asked[idx] and not isinstance(msg, _UNASKED):
                # sent for a request of a round abandoned since (Ctrl-C, another worker's failure): a reply is
                # dropped; a worker that waits in a collective of that request is released
                if isinstance(msg, P.AllReduce):
                    self._reply(idx, P.AllReduceDone(seq=msg.seq, data=b"", abort=True), self.chan.last_re)
                continue
            return idx, msg

    def _index_of(self, ident: bytes) -> int:
        idx = self._by_ident.get(ident)
        if idx is not None and self.workers[idx].ident == ident:
            return idx
        for w in self.workers:  # a new worker (or a respawned one's new identity)
            if w.ident == ident:
                self._by_ident[ident] = w.index
                return w.index
        return -1

    def _wait(self, need: set[int], stage: str, loading: bool = False) -> dict[int, Any]:
        replies: dict[int, Any] = {}
        timeout = self.config.startup_timeout_s if loading else self.config.step_timeout_s
        start = time.monotonic()
        deadline = start + timeout
        hb_timeout_ns = int(self.config.heartbeat_timeout_s * 1e9)
        tick = max(0.01, min(self.config.heartbeat_interval_s, self.config.heartbeat_timeout_s / 4))
        spin_to, spun = 0.0, False  # spin (yielding) until then before sleeping in the poll
        if self.spin_s and not loading:
            took = self._took.get(stage, 0.0)
            if took <= SPIN_ROUNDS_UP_TO_S:
                spin_to = self.sent_at + took + self.spin_s
        while need:
            if self._closed:  # close() from another thread: it killed the workers, which woke us
                raise PoolBrokenError(f"the pool was closed (from another thread) while {stage} at step {self.progress.step}")
            now = time.monotonic()
            if now >= deadline:
                idx = min(need)
                w = self.workers[idx]
                self._dump_and_kill(w)
                if loading:
                    what = (f"{w.where()} did not finish {stage} within startup_timeout={timeout:g}s; the worker's "
                            "stacks were dumped to stderr above and it was killed. Raise DPOOL_STARTUP_TIMEOUT "
                            "(or startup_timeout_s) if loading this model legitimately takes longer.")
                else:
                    what = (f"step {self.progress.step} exceeded step_timeout={timeout:g}s on {w.where()} while {stage}; "
                            "the worker's stacks were dumped to stderr above and it was killed. "
                            "Raise DPOOL_STEP_TIMEOUT if steps are legitimately this slow.")
                raise WorkerTimeoutError(what, worker=idx, device=w.device, pid=w.pid, step=self.progress.step)
            events = self._spin(spin_to) if now < spin_to else {}
            spun = bool(events)
            if not spun:
                events = dict(self._poller.poll(int(min(deadline - now, tick) * 1000) + 1))
            if self.chan.sock in events:
                # Read until every reply is in, not until the queue is empty: that last, failed
                # receive costs as much as a reply. What stays queued (a late print, a message of
                # a worker outside this round) is read by the next round. A worker's messages
                # arrive in order, so none it sent before its reply is left behind.
                while need:
                    got = self._take()
                    if got is None:
                        break
                    idx, msg = got
                    if isinstance(msg, P.AllReduce):
                        self._hub.offer(idx, msg, self._reply)
                        continue
                    if isinstance(msg, P.BucketReady):
                        if self.on_bucket is not None and idx in self._round:
                            self.on_bucket(idx, msg.call, msg.bucket)
                        continue
                    if idx in need:
                        replies[idx] = msg
                        self.arrived[idx] = time.monotonic()
                        need.discard(idx)
                        if isinstance(msg, P.Failed):
                            self._hub.abort(self._reply)
                            if msg.stage.endswith(P.CONTEXT_LOST):
                                self.exiting.add(idx)  # its exit is announced: not a death to report
            self._check_exits(events, stage=stage)
            if need and not loading:  # see request(): no heartbeats while the model loads
                now_ns = time.monotonic_ns()
                for idx in need:
                    silent = now_ns - self._beats[idx]
                    if silent > hb_timeout_ns:
                        w = self.workers[idx]
                        self._dump_and_kill(w)
                        raise WorkerTimeoutError(
                            f"{w.where()} unresponsive while {stage} at step {self.progress.step}: no heartbeat for "
                            f"{silent / 1e9:.1f}s (heartbeat_timeout={self.config.heartbeat_timeout_s:g}s). It is "
                            "stuck holding the GIL or frozen; its stacks were dumped to stderr above and it was "
                            "killed.", worker=idx, device=w.device, pid=w.pid, step=self.progress.step)
        if spun:  # only a spin sets it
            self.rounds_spun += 1
        if replies and not loading:
            self._took[stage] = max(self.arrived[i] for i in replies) - self.sent_at
        return replies

    def _spin(self, until: float) -> dict:
        """Poll without blocking, yielding the core between polls, until an event or ``until``."""
        poll, clock, yield_ = self._poller.poll, time.monotonic, os.sched_yield
        while True:
            events = poll(0)
            if events or clock() >= until:
                return dict(events)
            yield_()

    def _dying_together(self, window: float = 0.05, limit: float = 1.0) -> list[Worker]:
        """The live workers whose processes have ended, once deaths stop coming: each new one waits
        ``window`` seconds more (at most ``limit`` in all), so that one error names every worker of a kill
        sent to them all. (On a loaded machine, the last of three workers SIGKILLed together ended a
        good part of ``window`` after the first.)"""
        fds = {w.pidfd: w for w in self.workers if w.alive and w.pidfd is not None}
        dead: list[Worker] = []
        end = time.monotonic() + limit
        wait = window
        while fds and wait > 0:
            time.sleep(wait)
            readable, _, _ = select.select(list(fds), [], [], 0)
            if not readable:
                break
            dead += [fds.pop(fd) for fd in readable]
            wait = min(window, end - time.monotonic())
        return sorted(dead, key=lambda w: w.index)

    def _check_exits(self, events: dict, stage: str) -> None:
        if len(events) == (self.chan.sock in events):  # no pidfd fired (the common case: only replies)
            return
        for idx in self.exiting:  # announced exits (CONTEXT_LOST): reaped here, not reported
            w = self.workers[idx]
            if w.alive and events.get(w.pidfd):
                w.alive = False
                w.reap()
        dead = [w for w in self.workers if w.alive and events.get(w.pidfd)]
        if not dead:
            return
        dead = self._dying_together()
        if self._closed:
            raise PoolBrokenError(f"the pool was closed (from another thread) while {stage} at step {self.progress.step}")
        if not dead:
            return
        for w in dead:
            w.alive = False
            w.reap()
        raise self.launcher.death(self, dead[0], stage, dead[1:], "")

    def _dump_and_kill(self, w: Worker) -> None:
        try:
            os.kill(w.pid, signal.SIGCONT)
            os.kill(w.pid, signal.SIGUSR1)  # faulthandler dumps every thread's stack
            self.launcher.kill_hung(w)
        except ProcessLookupError:
            pass

    def exited(self, w: Worker) -> bool:
        """Whether ``w``'s process has exited (without waiting)."""
        if w.pidfd is not None:
            return bool(select.select([w.pidfd], [], [], 0)[0])
        return not psutil.pid_exists(w.pid)

    def break_pool(self, reason: str) -> None:
        """Mark the pool broken (every later call raises at once) and end the workers."""
        if self._broken is None:
            self._broken = reason.split("\n", 1)[0]
        self.launcher.end(self, grace=0.0)

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        """End the workers and free every resource. Idempotent; returns when all workers are joined.

        ``_closed`` is set first (a round in another thread stops at it); every step after it is
        idempotent, so a close cut short (Ctrl-C while it waits for the workers) is finished by the next
        one, which returns early only once ``_close_done``.
        """
        if self._close_done:
            return
        self._closed = True
        if os.getpid() != self.owner_pid:
            # A forked child's copy: the workers, the socket file and the segments are the parent's, and a
            # ZeroMQ context must not be used after fork. Drop it without touching any of them.
            self._finalizer.detach()
            self._close_done = True
            return
        log.info("closing the pool of %d worker(s)", len(self.workers))
        self.launcher.end(self, grace=0.0 if self._in_round else self.config.shutdown_timeout_s)
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
        self._close_done = True

    def _close_sockets(self) -> None:
        """Release the fds a round polls: pidfds, the socket, the control segment's fd."""
        for w in self.workers:
            _close_pidfd(w)
        for seg in self._segments:
            seg.close_fd()
        self._segments.clear()
        control = getattr(self, "control", None)
        if control is not None:  # unlinked at start, so no longer in _segments: its fd is closed here
            control.close_fd()
            self._beats = None  # type: ignore[assignment]  # the last view of the control mapping: it is unmapped with the segment
            self.control = None
        if not self.chan.closed:
            self.chan.close()
            self._ctx.term()
            _unlink_socket(self.sock_path)

    @property
    def broken(self) -> str | None:
        return self._broken


def _kill(w: Worker) -> None:
    w.kill()
    if w.exports and w.proc is not None:  # our child is gone: its CUDA IPC counters are ours to release, once
        cuda_ipc.release(w.exports)


def _reap(owner: int, workers: list[Worker], segments: list[Segment], sock_path: str, chan: Channel,
          ctx: Any, launcher: Launcher) -> None:  # pragma: no cover
    """GC / interpreter-exit cleanup of a pool nobody closed."""
    if os.getpid() != owner:
        return  # a forked child's exit: the workers, segments and socket belong to the parent
    # Names first: a host that kills us right after a graceful shutdown request (a Jupyter kernel
    # manager does) must find nothing left, and the workers can no longer remove them once killed.
    _unlink_socket(sock_path)
    for seg in segments:
        seg.unlink()
    launcher.abandon(chan, workers)  # a daemon's workers: told to drop our replica, and the lease freed
    for w in workers:
        _kill(w)
        _close_pidfd(w)  # (a pool dropped mid-run: the process goes on, and must not keep them)
    if not chan.closed:  # no ResourceWarning for a pool nobody closed
        chan.close(linger_ms=0 if launcher.spawns else 1000)  # (a daemon's workers must get the shutdown)
        ctx.term()


def _close_pidfd(w: Worker) -> None:
    """Close ``w``'s pidfd if it has one, forgetting it first: a close cut short (Ctrl-C) and run again
    never closes the number twice (by then it may be another file's)."""
    fd, w.pidfd = w.pidfd, None
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


def _unlink_socket(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
