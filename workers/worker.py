"""A dpool worker process: ``python -m workers.worker``, started by :class:`dpool.pool.Pool`.

Start-up reads a msgpack map from stdin (auth key, endpoint, index, device,
parent pid, limits), then:

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

import faulthandler
import gc
import os
import select
import signal
import sys
import threading
import time
import traceback
from typing import Any

import msgpack


def _watchdog(ppid: int, on_death: Any) -> None:
    try:
        fd = os.pidfd_open(ppid)
    except ProcessLookupError:
        on_death()
        return
    select.select([fd], [], [])
    on_death()


def _heartbeat(slot: Any, interval: float) -> None:
    while True:
        slot[0] = time.monotonic_ns()
        time.sleep(interval)


def main() -> None:
    boot = msgpack.unpackb(sys.stdin.buffer.read(), raw=False)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)

    import torch

    threads = int(boot["threads"])
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass

    from dpool import protocol as P
    from dpool.shm import attach

    from .replica import Replica

    index = int(boot["index"])
    replica = Replica(index, boot["device"], boot["shm_dir"])

    def on_parent_death() -> None:
        replica.unlink_known()
        os._exit(0)

    if os.getppid() != boot["ppid"]:
        on_parent_death()
    threading.Thread(target=_watchdog, args=(boot["ppid"], on_parent_death), daemon=True, name="dpool-watchdog").start()

    control = attach(boot["shm_dir"], boot["control"])
    replica.remember(control.name)
    beats = control.u8[: 8 * (index + 1)].view(torch.int64)[index:]
    threading.Thread(
        target=_heartbeat, args=(beats, float(boot["config"]["heartbeat_interval_s"])), daemon=True, name="dpool-heartbeat"
    ).start()

    import zmq

    codec = P.Codec(boot["key"], int(boot["config"]["max_message_bytes"]))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, boot["ident"])
    sock.setsockopt(zmq.MAXMSGSIZE, codec.max_bytes + 1024)
    sock.connect(boot["endpoint"])
    seq_out = 0
    seq_in = -1

    def send(msg: P.Message) -> None:
        nonlocal seq_out
        seq_out += 1
        sock.send(codec.encode(msg, seq_out))

    def recv() -> P.Message:
        """The next authenticated message from the coordinator."""
        nonlocal seq_in
        while True:
            frames = sock.recv_multipart(copy=True)
            try:
                seq, msg = codec.decode(frames)
                if seq <= seq_in:
                    raise P.ProtocolError(f"replayed or reordered request (seq {seq} ≤ {seq_in})")
                seq_in = seq
                return msg
            except P.ProtocolError as exc:
                # Not from our coordinator (or corrupted): never decoded further, never answered
                # with data. Logged so that the operator can see it.
                print(f"rejected a control message: {exc}", file=sys.stderr, flush=True)

    replica.collective = _Collective(send, recv)
    send(P.Hello(index, os.getpid(), P.PROTOCOL_VERSION, torch.__version__, sys.version.split()[0]))
    while True:
        msg = recv()
        if isinstance(msg, P.Shutdown):
            break
        try:
            reply = replica.handle(msg)
        except BaseException as exc:  # the model's error travels back as strings
            reply = _failed(replica.stage, exc)
        send(reply)
        replica.after_reply()
        if msg.op == "init":
            # torch's import left ~10^5 objects; freezing them keeps every later GC pass short.
            gc.collect()
            gc.freeze()
    sock.close(linger=0)
    ctx.term()
    replica.unlink_known()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class CollectiveAborted(RuntimeError):
    """Another shard of the same call failed while this one waited in a collective."""


class _Collective:
    """All-reduce through the coordinator, for dpool.SyncBatchNorm (see dpool.sync_batchnorm)."""

    def __init__(self, send: Any, recv: Any) -> None:
        self._send = send
        self._recv = recv
        self.world = 1
        self.seq = 0

    def allreduce(self, t: Any) -> Any:
        import torch

        from dpool import protocol as P

        data = t.detach().to(torch.float64).contiguous()
        self.seq += 1
        self._send(P.AllReduce(self.seq, data.numpy().tobytes()))
        reply = self._recv()
        if not isinstance(reply, P.AllReduceDone) or reply.seq != self.seq:
            raise P.ProtocolError(f"expected allreduce_done {self.seq}, got {reply.op}")
        if reply.abort:
            raise CollectiveAborted("another shard of this call failed while this one waited in SyncBatchNorm")
        return torch.frombuffer(bytearray(reply.data), dtype=torch.float64).to(t.dtype)


def _failed(stage: str, exc: BaseException) -> Any:
    from dpool import protocol as P

    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    tp = type(exc)
    return P.Failed(stage, tp.__module__, tp.__qualname__, str(exc), tb)


if __name__ == "__main__":
    main()
