"""A dpool worker process: ``dpool_workers.worker`` (the ``workers/`` folder), started by :class:`dpool.pool.Pool`.

Start-up reads a :class:`dpool.protocol.Boot` message from stdin (auth key,
endpoint, index, device, parent pid, limits), then:

* puts itself under the scheduling policy the coordinator chose in
  ``DPOOL_WORKER_SCHED`` (``batch`` or ``other``; see :func:`dpool.policies.worker_sched`)
  and on the CPUs it chose in ``DPOOL_WORKER_CPUS`` (:func:`dpool.policies.worker_cpus`),
  before any thread exists, so every thread it starts inherits both;
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
  ``shutdown`` (:class:`.serve.Server`). Every request is authenticated before it is decoded (see
  :mod:`dpool.protocol`) and answered, with ``failed`` if it raised.

See ``NOTE [ dpool shutdown ]`` in :mod:`dpool.pool` for the whole protocol.
"""
from __future__ import annotations

import ctypes
import dataclasses
import faulthandler
import gc
import os
import select
import signal
import sys
import threading
import time
import warnings
from typing import Any

from dpool import knobs, protocol as P  # torch-free
from dpool.sweep import sweep_cuda_counters  # torch-free


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


def main() -> None:
    boot = P.Boot.unpack(sys.stdin.buffer.read())
    set_scheduling(knobs.raw("DPOOL_WORKER_SCHED") or "other")  # worker_env always sets it
    set_affinity(knobs.raw("DPOOL_WORKER_CPUS"))  # start_worker always sets it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)

    # torch and zmq are imported only now, once this process is placed (their threads inherit the policy and
    # the CPUs above); so is what imports them.
    import torch

    torch.set_num_threads(boot.threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass

    if boot.device.startswith("cuda"):
        # Our backward runs on autograd's device thread, whose first cuBLAS call finds no current
        # context and makes the primary one current itself; the warning it prints says nothing the
        # user can act on (it would reach the coordinator's stderr once per worker).
        warnings.filterwarnings("ignore", message="Attempting to run cuBLAS, but there was no current CUDA context")

    from dpool.transport import attach

    from .serve import Server

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
        Server(ctx, boot, known, control=control).run()
        ctx.term()
        _unlink(boot.shm_dir, known)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    _daemon_loop(ctx, boot, beat, known)


def _daemon_loop(ctx: Any, boot: Any, beat: _Beat, known: set[str]) -> None:
    """A warm worker of ``dpool-workers``: serve one attached client after another."""
    import torch  # (imported by main() already, as the rest)

    from dpool.channel import Channel
    from dpool.transport import attach
    from dpool.transport.cuda_ipc import drop_imports

    from .serve import DAEMON_STOPPING, Server, report_reject

    index = boot.index
    steps_slot = None
    if boot.steps:  # the daemon's live steps-served page (an inherited memfd)
        steps_map = attach(boot.shm_dir, boot.steps)
        steps_slot = memoryview(steps_map.mmap).cast("q")[index:index + 1]
    daemon = Channel(ctx, False, boot.key, boot.max_message_bytes, ident=boot.ident, on_reject=report_reject)
    daemon.connect(boot.endpoint)
    daemon.send(P.Hello(worker=index, pid=os.getpid(), protocol=P.PROTOCOL_VERSION, torch=torch.__version__,
                        python=sys.version.split()[0]))
    while True:
        _, msg = daemon.recv()
        if isinstance(msg, P.Shutdown):
            break
        if not isinstance(msg, P.Serve):
            continue
        try:
            control = attach(boot.shm_dir, msg.control)
            if control.size < 8 * (index + 1):
                raise ValueError(f"it has {control.size} bytes, fewer than this worker's heartbeat slot needs")
        except (OSError, ValueError, TypeError, IndexError) as exc:  # nothing a client sends may end a worker
            daemon.send(P.ServeDone(steps=0, reason=f"refused: cannot map the client's control segment ({exc})"))
            continue
        beat.target(control.u8[: 8 * (index + 1)].view(torch.int64)[index:])
        session = dataclasses.replace(boot, key=msg.key, endpoint=msg.endpoint, ident=msg.ident,
                                      max_message_bytes=msg.max_message_bytes)
        steps, reason = Server(ctx=ctx, session=session, known=known, client_pid=msg.client_pid, steps_slot=steps_slot,
                               control=control, daemon=daemon).run()
        beat.target(None)
        del control
        _unlink(boot.shm_dir, known)
        known.clear()
        gc.collect()  # the replica's tensors and mappings go now, not at some later GC pass
        if boot.device.startswith("cuda"):
            drop_imports()  # a client that died: its arenas' mappings go too
            if reason == "client died":
                sweep_cuda_counters(int(msg.client_pid))
        _trim_heap()  # workers keep their heap while serving (see worker_env); give it back between clients
        daemon.send(P.ServeDone(steps=steps, reason=reason))
        if reason == DAEMON_STOPPING:
            break
    daemon.close()
    ctx.term()
    os._exit(0)


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


if __name__ == "__main__":
    main()
