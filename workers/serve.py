"""The worker's serving loop: receive a request, dispatch it to the replica, reply.

:class:`Server` serves one coordinator: an embedded worker's for its life, a daemon's worker one attached
client after another (:mod:`.worker` makes a server per session). Replies of a round may wait for each
other (:func:`reply_together`), and SyncBatchNorm's all-reduce goes through the coordinator mid-request
(:class:`Collective`).
"""
from __future__ import annotations

import io
import os
import sys
import threading
import time
from typing import Any

import torch
import zmq

from dpool import protocol as P
from dpool.channel import Channel
from dpool.gpu import sticky_error
from dpool.tensors import from_bytes, to_bytes
from dpool.transport.cuda_ipc import drop_imports

from .replica import Replica, cuda_stream

__all__ = ["Server", "ClientGone", "CollectiveAborted", "Collective", "reply_together", "report_reject",
           "daemon_says", "DAEMON_STOPPING"]


class ClientGone(Exception):
    """The attached client's session is over (daemon mode): its process died, or the daemon ended it
    (``end_serve``, ``shutdown``). Drop its replica and go back to the daemon. ``args[0]``: why."""


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


def report_reject(peer: bytes, exc: Exception) -> None:
    # Not from our coordinator or daemon (or corrupted): never decoded further, never answered.
    # Logged so that the operator can see it.
    print(f"rejected a control message: {exc}", file=sys.stderr, flush=True)


DAEMON_STOPPING = "daemon stopping"
# With DPOOL_CUDA_ASYNC_REPLIES a GPU worker replies to these before its GPU ran them: what it wrote is read
# on the coordinator's streams, after they waited on its reply event. Every other reply waits for our
# stream: a backward's is the step's end, where a CUDA error of this step's kernels must surface before its
# gradients reach the master; a loss's and a call's carry values read on the host.
ASYNC_REPLIES = ("forward", "fetch")


def daemon_says(daemon: Any, client_pid: int) -> None:
    """Read what the daemon sent a serving worker; raise :class:`ClientGone` if it ends the session."""
    while (got := daemon.recv_nowait()) is not None:
        msg = got[1]
        if isinstance(msg, P.EndServe) and msg.client_pid == client_pid:
            raise ClientGone("client detached")
        if isinstance(msg, P.Shutdown):
            raise ClientGone(DAEMON_STOPPING)



class Server:
    """Serves one coordinator (``session``: a :class:`dpool.protocol.Boot`) until ``shutdown`` or, attached to a
    daemon, until the client's process dies or the daemon's ``daemon`` channel ends the session.

    Args:
        ctx: the ZeroMQ context.
        session: whom to serve, and with which key.
        known: the names of the segments this worker mapped (it unlinks them if its parent dies).
        client_pid: the attached client's pid (daemon mode), watched through a pidfd.
        steps_slot: the daemon's live count of the steps this worker served.
        control: the coordinator's control segment (heartbeats, then the rounds each worker finished: see
            :func:`reply_together`).
        daemon: the channel to the daemon (daemon mode).
    """

    def __init__(self, ctx: Any, session: Any, known: set[str], client_pid: int | None = None,
                 steps_slot: Any = None, control: Any = None, daemon: Any = None) -> None:
        self.ctx, self.session, self.client_pid = ctx, session, client_pid
        self.steps_slot, self.daemon = steps_slot, daemon
        self.replica: Replica | None = Replica(session.index, session.device, session.shm_dir)
        self.replica.known = known
        self.chan = Channel(ctx, False, session.key, session.max_message_bytes, ident=session.ident,
                            on_reject=report_reject)
        self.poller: Any = None
        self.client_fd: int | None = None
        # Everything sent while serving a request names it (``re``, see dpool.protocol): its reply, and the
        # collectives and reports on its way. So the coordinator can tell what belongs to a request it
        # abandoned (Ctrl-C, another worker's failure) from what belongs to its current one.
        self.serving = [0]
        # int64 slots of the control segment: each worker's latest round when asked to reply together
        self.rounds = memoryview(control.mmap).cast("q") if control is not None else None
        self.collective = Collective(self.send, self.recv, self.chan, self.serving)
        self.replica.collective = self.collective
        self.replica.notify = self.send  # bucket_ready reports during a backward (cross-node overlap)
        self.on_gpu = session.device.startswith("cuda")
        self.served = 0

    def send(self, msg: P.Message, flags: int = 0) -> None:
        self.chan.send(msg, None, flags, re=self.serving[0])

    def recv(self) -> P.Message:
        """The next authenticated message from the coordinator."""
        if self.poller is None:
            return self.chan.recv()[1]
        while True:
            got = self.chan.recv_nowait()
            if got is not None:
                return got[1]
            events = dict(self.poller.poll())
            if events.get(self.client_fd):
                raise ClientGone("client died")
            if self.daemon is not None and events.get(self.daemon.sock):
                daemon_says(self.daemon, self.client_pid)

    def _connect(self) -> bool:
        """Connect to the coordinator, and watch an attached client's process; ``False``: it is gone."""
        self.chan.connect(self.session.endpoint)
        if self.client_pid is None:
            return True
        try:
            self.client_fd = os.pidfd_open(self.client_pid)
        except ProcessLookupError:
            self.chan.close()
            return False
        self.poller = zmq.Poller()
        self.poller.register(self.chan.sock, zmq.POLLIN)
        self.poller.register(self.client_fd, zmq.POLLIN)
        if self.daemon is not None:
            self.poller.register(self.daemon.sock, zmq.POLLIN)
        return True

    def run(self) -> tuple[int, str]:
        """Serve until the session ends.

        Returns:
            (requests served, why it ended)
        """
        if not self._connect():
            return 0, "client gone before attach"
        reason = "shutdown"
        linger = 0
        saved = sys.stdout, sys.stderr
        try:
            assert self.replica is not None
            self.send(P.Hello(worker=self.replica.index, pid=os.getpid(), protocol=P.PROTOCOL_VERSION,
                              torch=torch.__version__, python=sys.version.split()[0]))
            if self.client_pid is not None:  # attached: our pipes go to the daemon's log, so prints travel
                sys.stdout = _ToClient(lambda text: self.send(P.Output(stream=1, text=text), zmq.NOBLOCK), saved[0])
                sys.stderr = _ToClient(lambda text: self.send(P.Output(stream=2, text=text), zmq.NOBLOCK), saved[1])
            linger = self._loop()
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
            self.chan.sock.close(linger=linger)
            if self.rounds is not None:
                self.rounds.release()  # the daemon unmaps the segment between clients
            if self.client_fd is not None:
                os.close(self.client_fd)
            self.replica = None  # (it refers to this server: its send is the replica's notify)
        return self.served, reason

    def _loop(self) -> int:
        """Receive, dispatch and reply until ``shutdown``: the linger its socket closes with."""
        collective = self.collective
        while True:
            if collective.pending is not None:  # a request that arrived while a collective waited
                self.serving[0], msg = collective.pending
                collective.pending = None
            else:
                msg = self.recv()
                self.serving[0] = self.chan.last_seq
            if isinstance(msg, P.AllReduceDone):  # for a collective that a newer request ended: nobody waits
                continue
            if isinstance(msg, P.Shutdown):
                return self._shutdown()
            reply = self._handle(msg)
            replica = self.replica
            assert replica is not None
            if self.rounds is not None and getattr(msg, "together", None):
                reply_together(self.rounds, replica.index, msg.together,
                               P.TOGETHER_WAIT_S if not isinstance(reply, P.Failed) else 0.0)
            self.send(reply)
            if msg.op in ("forward", "forward_criterion"):
                self.served += 1
                if self.steps_slot is not None:
                    self.steps_slot[0] += 1
            replica.after_reply()

    def _handle(self, msg: P.Message) -> P.Message:
        """One request's reply: the replica's, or its error as strings (the model's error travels back)."""
        replica = self.replica
        assert replica is not None
        try:
            reply = replica.handle(msg)
            if self.on_gpu:  # the coordinator reads our GPU work only once it is done (NOTE [ CUDA ownership ])
                if replica.reply_event is not None and msg.op in ASYNC_REPLIES:
                    replica.reply_event.record(cuda_stream())  # (its streams wait on it: no host wait here)
                else:
                    replica.stage += " (waiting for its CUDA work)"
                    cuda_stream().synchronize()
            return reply
        except ClientGone:
            raise
        except BaseException as exc:
            stage = replica.stage.replace(" (waiting for its CUDA work)", "")
            if replica.reply_event is not None and self.on_gpu and sticky_error(exc):
                stage += (" (or the kernels of an earlier forward: with DPOOL_CUDA_ASYNC_REPLIES=1 a forward's "
                          "reply does not wait for them)")
            if self.on_gpu and sticky_error(exc):
                _cuda_context_lost(replica, exc, lambda e=exc: self.send(P.Failed.of(stage + P.CONTEXT_LOST, e)),
                                   self.ctx)
            return P.Failed.of(stage, exc)

    def _shutdown(self) -> int:
        """The coordinator ends the session: the linger its socket closes with."""
        if self.client_pid is not None and self.on_gpu:
            # A daemon's worker outlives its client: it gives the client's GPU memory back (its imports, see
            # NOTE [ CUDA ownership ] in dpool.transport.cuda_ipc) before the client frees it.
            self.replica = None
            self.collective.pending = None
            drop_imports()
            self.send(P.ServeDone(steps=self.served, reason="shutdown"))
            return 2000
        return 0


def reply_together(rounds: Any, index: int, together: list, limit: float) -> None:
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


class Collective:
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
        data = t.detach().to(torch.float64).contiguous()
        self.seq += 1
        self._send(P.AllReduce(seq=self.seq, data=to_bytes(data)))
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
