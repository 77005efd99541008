"""A dpool worker process: ``dpool_workers.worker`` (the ``workers/`` folder), started by :class:`dpool.pool.Pool`.

Start-up reads a :class:`dpool.protocol.Boot` message from stdin (auth key,
endpoint, index, device, parent pid, limits), then:

* puts itself under the scheduling policy the coordinator chose in
  ``DPOOL_WORKER_SCHED`` (``batch`` or ``other``; see ``worker_env`` in
  :mod:`dpool.launch`) and on the CPUs it chose in ``DPOOL_WORKER_CPUS``
  (see ``worker_cpus`` there), before any thread exists, so every thread it
  starts inherits both;
* ignores SIGINT (Ctrl-C belongs to the coordinator) and registers
  faulthandler on SIGUSR1 (the coordinator dumps our stacks before killing a
  hung worker) and on fatal signals;
* starts a *watchdog* thread that polls the coordinator's pidfd and exits the
  process (after unlinking segment names it knows) the moment the coordinator
  dies;
* starts a *heartbeat* thread that writes CLOCK_MONOTONIC into this worker's
  slot of the control segment every ``heartbeat_interval_s``; a main thread
  stuck holding the GIL starves it, which is what the coordinator detects;
* connects a DEALER socket and serves requests one at a time until
  ``shutdown``. Every request is authenticated before it is decoded (see
  :mod:`dpool.protocol`) and answered, with ``failed`` if it raised.

See ``NOTE [ dpool shutdown ]`` in :mod:`dpool.pool` for the whole protocol.
"""
from __future__ import annotations

import ctypes
import faulthandler
import gc
import io
import os
import select
import signal
import sys
import threading
import time
from typing import Any

from dpool import knobs  # torch-free


def set_scheduling(policy: str) -> None:
    """Run this thread, and every thread it starts from now on, under ``policy`` (``"batch"`` or ``"other"``).

    ``SCHED_BATCH`` is the normal priority without wake-up preemption: a worker woken by its
    request takes a free core or waits for the next tick instead of preempting the coordinator
    mid-send or another worker mid-compute (why and when: :func:`dpool.policies.worker_sched`).
    """
    if policy == "batch" and hasattr(os, "SCHED_BATCH"):
        try:
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        except OSError as exc:  # a sandbox that forbids it: the worker is only less quick to wake
            print(f"dpool worker: SCHED_BATCH not applied ({exc}); running under the default policy",
                  file=sys.stderr)


def set_affinity(cpus: str) -> None:
    """Bind this thread, and every thread it starts from now on, to the logical CPUs ``cpus`` (``"0,1"``;
    ``""``: leave it where it is). The coordinator chose them (:func:`dpool.policies.worker_cpus`)."""
    if not cpus:
        return
    try:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    except (OSError, ValueError) as exc:  # a sandbox that forbids it, or CPUs gone: only less quick
        print(f"dpool worker: not bound to CPUs {cpus} ({exc}); running wherever Linux puts it", file=sys.stderr)


def _watchdog(ppid: int, on_death: Any) -> None:
    try:
        fd = os.pidfd_open(ppid)
    except ProcessLookupError:
        on_death()
        return
    select.select([fd], [], [])
    on_death()


def _trim_heap() -> None:
    """Return free heap memory to the kernel (glibc's ``malloc_trim``); a no-op elsewhere."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


class _Beat:
    """The heartbeat target: this worker's slot in the current client's control segment (or none)."""

    slot: Any = None

    def target(self, slot: Any) -> None:
        """Beat into ``slot`` from now on, starting at once (not after the thread's next sleep)."""
        if slot is not None:
            slot[0] = time.monotonic_ns()
        self.slot = slot


def _heartbeat(beat: _Beat, interval: float) -> None:
    while True:
        slot = beat.slot
        if slot is not None:
            slot[0] = time.monotonic_ns()
        time.sleep(interval)


class _ToClient(io.TextIOBase):
    """``sys.stdout``/``sys.stderr`` of an attached worker: what the replica prints goes to the client.

    Complete lines (and whatever ``flush()`` finds) are sent as ``output`` messages, which the client
    shows labelled with the worker index, as it shows an embedded worker's pipes. Only the serving
    thread sends (ZeroMQ sockets are not thread-safe): other threads' writes, and anything written
    to file descriptors 1 and 2 directly (faulthandler, C code), go to the daemon's log as before.
    """

    _CHUNK = 1 << 20  # characters per message, far below the message size limit

    def __init__(self, send: Any, fallback: Any) -> None:
        self._send, self.fallback = send, fallback
        self._owner = threading.get_ident()
        self._buf = ""

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        if threading.get_ident() != self._owner:
            return self.fallback.write(s)
        self._buf += s
        if "\n" in self._buf:
            text, _, self._buf = self._buf.rpartition("\n")
            self._emit(text + "\n")
        return len(s)

    def flush(self) -> None:
        if self._buf and threading.get_ident() == self._owner:
            text, self._buf = self._buf, ""
            self._emit(text)

    def _emit(self, text: str) -> None:
        for i in range(0, len(text), self._CHUNK):
            try:
                self._send(text[i : i + self._CHUNK])
            except Exception:  # the session is ending: keep the text in the log
                self.fallback.write(text[i:])
                return


class ClientGone(Exception):
    """The attached client's session is over (daemon mode): its process died, or the daemon ended it
    (``end_serve``, ``shutdown``). Drop its replica and go back to the daemon. ``args[0]``: why."""


def main() -> None:
    from dpool import protocol as P  # torch-free

    boot = P.Boot.unpack(sys.stdin.buffer.read())
    set_scheduling(knobs.raw("DPOOL_WORKER_SCHED") or "other")  # worker_env always sets it
    set_affinity(knobs.raw("DPOOL_WORKER_CPUS"))  # start_worker always sets it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)

    import torch

    torch.set_num_threads(boot.threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass

    if boot.device.startswith("cuda"):
        import warnings

        # Our backward runs on autograd's device thread, whose first cuBLAS call finds no current
        # context and makes the primary one current itself; the warning it prints says nothing the
        # user can act on (it would reach the coordinator's stderr once per worker).
        warnings.filterwarnings("ignore", message="Attempting to run cuBLAS, but there was no current CUDA context")

    from dpool.transport import attach

    from . import replica as _replica  # noqa: F401

    index = boot.index
    known: set[str] = set()

    def on_parent_death() -> None:
        _unlink(boot.shm_dir, known)
        if boot.prefix:  # names the coordinator made that we never saw (it died while growing one)
            _unlink_prefix(boot.shm_dir, boot.prefix)
            endpoint = boot.endpoint
            if endpoint.startswith("ipc://"):
                _unlink(os.path.dirname(endpoint[6:]), {os.path.basename(endpoint[6:])})
        if boot.device.startswith("cuda"):
            from dpool.sweep import sweep_cuda_counters

            sweep_cuda_counters(boot.ppid)
        os._exit(0)

    if os.getppid() != boot.ppid:
        on_parent_death()
    threading.Thread(target=_watchdog, args=(boot.ppid, on_parent_death), daemon=True, name="dpool-watchdog").start()
    beat = _Beat()
    threading.Thread(target=_heartbeat, args=(beat, boot.heartbeat_interval_s), daemon=True,
                     name="dpool-heartbeat").start()
    # torch's import left ~10^5 objects; freezing them keeps every later GC pass short.
    gc.collect()
    gc.freeze()

    import zmq

    ctx = zmq.Context()
    if boot.mode != "daemon":
        control = attach(boot.shm_dir, boot.control)
        beat.target(control.u8[: 8 * (index + 1)].view(torch.int64)[index:])
        _serve(ctx, boot, known, None, control=control)
        ctx.term()
        _unlink(boot.shm_dir, known)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    _daemon_loop(ctx, boot, beat, known)


def _daemon_loop(ctx: Any, boot: Any, beat: _Beat, known: set[str]) -> None:
    """A warm worker of ``dpool-workers``: serve one attached client after another."""
    import dataclasses

    import torch

    from dpool import protocol as P
    from dpool.channel import Channel
    from dpool.transport import attach

    index = boot.index
    steps_slot = None
    if boot.steps:  # the daemon's live steps-served page (an inherited memfd)
        steps_map = attach(boot.shm_dir, boot.steps)
        steps_slot = memoryview(steps_map.mmap).cast("q")[index:index + 1]
    daemon = Channel(ctx, False, boot.key, boot.max_message_bytes, ident=boot.ident, on_reject=_report_reject)
    daemon.connect(boot.endpoint)
    daemon.send(P.Hello(index, os.getpid(), P.PROTOCOL_VERSION, torch.__version__, sys.version.split()[0]))
    while True:
        _, msg = daemon.recv()
        if isinstance(msg, P.Shutdown):
            break
        if not isinstance(msg, P.Serve):
            continue
        control = attach(boot.shm_dir, msg.control)
        beat.target(control.u8[: 8 * (index + 1)].view(torch.int64)[index:])
        session = dataclasses.replace(boot, key=msg.key, endpoint=msg.endpoint, ident=msg.ident,
                                      max_message_bytes=msg.max_message_bytes)
        steps, reason = _serve(ctx, session, known, msg.client_pid, steps_slot, control, daemon)
        beat.target(None)
        del control
        _unlink(boot.shm_dir, known)
        known.clear()
        gc.collect()  # the replica's tensors and mappings go now, not at some later GC pass
        if boot.device.startswith("cuda"):
            from dpool.transport.cuda_ipc import drop_imports

            drop_imports()  # a client that died: its arenas' mappings go too
            if reason == "client died":
                from dpool.sweep import sweep_cuda_counters

                sweep_cuda_counters(int(msg.client_pid))
        _trim_heap()  # workers keep their heap while serving (see worker_env); give it back between clients
        daemon.send(P.ServeDone(steps, reason))
        if reason == _DAEMON_STOPPING:
            break
    daemon.close()
    ctx.term()
    os._exit(0)


def _report_reject(peer: bytes, exc: Exception) -> None:
    # Not from our coordinator or daemon (or corrupted): never decoded further, never answered.
    # Logged so that the operator can see it.
    print(f"rejected a control message: {exc}", file=sys.stderr, flush=True)


def _unlink_prefix(shm_dir: str, prefix: str) -> None:
    """Unlink every segment of the dead coordinator's pool (``<prefix>-<n>``), known to us or not."""
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return
    _unlink(shm_dir, {n for n in names if n.startswith(prefix + "-")})


def _unlink(shm_dir: str, names: set[str]) -> None:
    for name in names:
        if not name.startswith("fd:"):
            try:
                os.unlink(os.path.join(shm_dir, name))
            except OSError:
                pass


_DAEMON_STOPPING = "daemon stopping"


def _daemon_says(daemon: Any, client_pid: int) -> None:
    """Read what the daemon sent a serving worker; raise :class:`ClientGone` if it ends the session."""
    from dpool import protocol as P

    while (got := daemon.recv_nowait()) is not None:
        msg = got[1]
        if isinstance(msg, P.EndServe) and msg.client_pid == client_pid:
            raise ClientGone("client detached")
        if isinstance(msg, P.Shutdown):
            raise ClientGone(_DAEMON_STOPPING)


def _serve(ctx: Any, session: Any, known: set[str], client_pid: int | None,
           steps_slot: Any = None, control: Any = None, daemon: Any = None) -> tuple[int, str]:
    """Serve one coordinator (``session``: a :class:`dpool.protocol.Boot`) until ``shutdown``
    (or, attached to a daemon, until its process dies or the daemon's ``daemon`` channel ends the
    session). ``control``: the coordinator's control segment (heartbeats, then the rounds each worker
    finished: see :func:`_reply_together`).

    Returns:
        (requests served, why it ended)
    """
    import torch
    import zmq

    from dpool import protocol as P
    from dpool.channel import Channel

    from .replica import Replica, cuda_stream

    replica = Replica(session.index, session.device, session.shm_dir)
    replica.known = known
    chan = Channel(ctx, False, session.key, session.max_message_bytes, ident=session.ident,
                   on_reject=_report_reject)
    chan.connect(session.endpoint)
    poller = None
    client_fd = None
    if client_pid is not None:
        try:
            client_fd = os.pidfd_open(client_pid)
        except ProcessLookupError:
            chan.close()
            return 0, "client gone before attach"
        poller = zmq.Poller()
        poller.register(chan.sock, zmq.POLLIN)
        poller.register(client_fd, zmq.POLLIN)
        if daemon is not None:
            poller.register(daemon.sock, zmq.POLLIN)
    served = 0

    # Everything sent while serving a request names it (``re``, see dpool.protocol): its reply, and the
    # collectives and reports on its way. So the coordinator can tell what belongs to a request it
    # abandoned (Ctrl-C, another worker's failure) from what belongs to its current one.
    serving = [0]

    def send(msg: P.Message, flags: int = 0) -> None:
        chan.send(msg, None, flags, re=serving[0])

    def recv() -> P.Message:
        """The next authenticated message from the coordinator."""
        if poller is None:
            return chan.recv()[1]
        while True:
            got = chan.recv_nowait()
            if got is not None:
                return got[1]
            events = dict(poller.poll())
            if events.get(client_fd):
                raise ClientGone("client died")
            if daemon is not None and events.get(daemon.sock):
                _daemon_says(daemon, client_pid)

    # int64 slots of the control segment: each worker's latest round when asked to reply together
    rounds = memoryview(control.mmap).cast("q") if control is not None else None
    replica.collective = collective = _Collective(send, recv, chan, serving)
    replica.notify = send  # bucket_ready reports during a backward (cross-node overlap)
    on_gpu = session.device.startswith("cuda")
    from dpool.gpu import sticky_error
    from dpool.transport.cuda_ipc import drop_imports

    reason = "shutdown"
    linger = 0
    saved = sys.stdout, sys.stderr
    try:
        send(P.Hello(replica.index, os.getpid(), P.PROTOCOL_VERSION, torch.__version__, sys.version.split()[0]))
        if client_pid is not None:  # attached: our pipes go to the daemon's log, so prints travel to the client
            sys.stdout = _ToClient(lambda text: send(P.Output(1, text), zmq.NOBLOCK), saved[0])
            sys.stderr = _ToClient(lambda text: send(P.Output(2, text), zmq.NOBLOCK), saved[1])
        while True:
            if collective.pending is not None:  # a request that arrived while a collective waited
                serving[0], msg = collective.pending
                collective.pending = None
            else:
                msg = recv()
                serving[0] = chan.last_seq
            if isinstance(msg, P.AllReduceDone):  # for a collective that a newer request ended: nobody waits
                continue
            if isinstance(msg, P.Shutdown):
                if client_pid is not None and on_gpu:
                    # A daemon's worker outlives its client: it gives the client's GPU memory back (its
                    # imports, see NOTE [ CUDA ownership ] in dpool.transport.cuda_ipc) before the client frees it.
                    del replica
                    drop_imports()
                    send(P.ServeDone(served, "shutdown"))
                    linger = 2000
                break
            try:
                reply = replica.handle(msg)
                if on_gpu:  # our GPU work is done before the coordinator reads it (NOTE [ CUDA ownership ])
                    replica.stage += " (waiting for its CUDA work)"
                    cuda_stream().synchronize()
            except ClientGone:
                raise
            except BaseException as exc:  # the model's error travels back as strings
                stage = replica.stage.replace(" (waiting for its CUDA work)", "")
                if on_gpu and sticky_error(exc):
                    _cuda_context_lost(replica, exc, lambda e=exc: send(_failed(stage + P.CONTEXT_LOST, e)), ctx)
                reply = _failed(stage, exc)
            if rounds is not None and getattr(msg, "together", None):
                _reply_together(rounds, replica.index, msg.together,
                                P.TOGETHER_WAIT_S if not isinstance(reply, P.Failed) else 0.0)
            send(reply)
            if msg.op in ("forward", "forward_criterion"):
                served += 1
                if steps_slot is not None:
                    steps_slot[0] += 1
            replica.after_reply()
    except ClientGone as gone:
        reason = gone.args[0]
    finally:
        if sys.stdout is not saved[0]:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
            sys.stdout, sys.stderr = saved
        chan.sock.close(linger=linger)
        if rounds is not None:
            rounds.release()  # the daemon unmaps the segment between clients
        if client_fd is not None:
            os.close(client_fd)
    return served, reason


def _reply_together(rounds: Any, index: int, together: list, limit: float) -> None:
    """Mark round ``together[0]`` done for this worker, then wait (on this worker's own core) until the
    round's ``together[1]`` shards all marked it, at most ``limit`` seconds (0 for a failed request). The
    replies then reach the coordinator together, and it wakes once per round (see
    :data:`dpool.protocol.TOGETHER_WAIT_S`).

    Only an optimisation: a peer that is slow, dead or hung just ends the wait at its bound.
    """
    rnd, shards, offset = together
    base = offset // 8
    if not (isinstance(rnd, int) and isinstance(shards, int) and isinstance(offset, int)
            and 0 <= base and index < shards and base + shards <= len(rounds)):
        return  # not a round this segment can hold (a coordinator bug): reply at once
    rounds[base + index] = rnd
    if limit <= 0:
        return
    deadline = time.monotonic() + limit
    peers = range(base, base + shards)
    while time.monotonic() < deadline:
        for j in peers:
            if rounds[j] < rnd:
                break
        else:
            return


class CollectiveAborted(RuntimeError):
    """Another shard of the same call failed, or the coordinator abandoned the call, while this one waited
    in a collective."""


class _Collective:
    """All-reduce through the coordinator, for dpool.SyncBatchNorm (see dpool.sync_batchnorm).

    While it waits for the sum, a new request may come instead: the coordinator abandoned the request
    being served (Ctrl-C, another worker's failure) and moved on. The collective then ends with
    :class:`CollectiveAborted` and keeps that request in :attr:`pending` for the serving loop. An
    answer to a collective of an earlier, abandoned request (it names that request) is skipped.
    """

    def __init__(self, send: Any, recv: Any, chan: Any, serving: list) -> None:
        self._send = send
        self._recv = recv
        self._chan = chan
        self._serving = serving
        self.world = 1
        self.seq = 0
        self.pending: tuple[int, Any] | None = None

    def allreduce(self, t: Any) -> Any:
        import torch

        from dpool import protocol as P
        from dpool.tensors import from_bytes, to_bytes

        data = t.detach().to(torch.float64).contiguous()
        self.seq += 1
        self._send(P.AllReduce(self.seq, to_bytes(data)))
        while True:
            reply = self._recv()
            if not isinstance(reply, P.AllReduceDone):
                self.pending = self._chan.last_seq, reply
                raise CollectiveAborted("the coordinator abandoned this call (Ctrl-C, or a failure elsewhere) "
                                        "while this shard waited in SyncBatchNorm")
            if self._chan.last_re == self._serving[0]:
                break
        if reply.seq != self.seq:
            raise P.ProtocolError(f"expected allreduce_done {self.seq}, got {reply.seq}")
        if reply.abort:
            raise CollectiveAborted("another shard of this call failed while this one waited in SyncBatchNorm")
        return from_bytes(reply.data, torch.float64).to(device=t.device, dtype=t.dtype)


def _cuda_context_lost(replica: Any, exc: BaseException, reply: Any, ctx: Any) -> None:
    """A sticky CUDA error (device-side assert, illegal address): this process's GPU context is unusable.

    The worker replies with the error (marked ``CONTEXT_LOST``), flushes the reply and exits, so that
    the coordinator treats it as dead (restarted under ``max_restarts``) instead of keeping a worker
    that fails every later step.
    """
    print(f"dpool worker {replica.index} (pid {os.getpid()}): CUDA error while {replica.stage}: "
          f"{str(exc).strip().splitlines()[0]}\nThe CUDA context of this worker is lost; it exits.",
          file=sys.stderr, flush=True)
    try:
        reply()
        ctx.destroy(linger=2000)  # the reply leaves before we do
    finally:
        os._exit(70)


def _failed(stage: str, exc: BaseException) -> Any:
    from dpool import protocol as P

    return P.Failed.of(stage, exc)


if __name__ == "__main__":
    main()
