"""Leasing the warm workers of a ``dpool-workers`` daemon: the second :class:`~dpool.launch.Launcher`.

::

    coordinator (Pool + Lease)             daemon (workers/daemon.py)          its worker k
    ───────────────────────────            ──────────────────────────          ─────────────
    attach(pid, endpoint, nonce, ...) ───▶  derive the session key
                                            serve(endpoint, key, ...) ───────▶  connect to our endpoint
                  ◀── attach_done(workers: index, device, pid, ident)
                  ◀──────────────────────────── hello ─────────────────────────
    ... rounds, as with our own workers ...
    shutdown ─────────────────────────────────────────────────────────────────▶ drop the replica
                  ◀──────────────────────────── serve_done (GPU: imports freed)
    detach(pid) ──────────────────────────▶  the lease is free

The session key is derived on both sides from the pool's key and a nonce and is
never sent. The workers are the daemon's children, not ours: we watch them
through pidfds, and the daemon reaps and restarts them.
"""
from __future__ import annotations

import logging
import os
import secrets
import select
import signal
import time
from typing import Any, Sequence

import torch

from . import protocol as P
from .daemon_client import locate, read_pool, request
from .errors import DaemonLostError, DpoolError, UnsupportedError, WorkerDiedError, WorkerStartError
from .launch import Launcher, Pool, Worker
from .transport import cuda_ipc


__all__ = ["Lease"]

log = logging.getLogger("dpool")


class Lease(Launcher):
    """Borrow the workers of the ``dpool-workers`` pool ``name`` (a pool name, or ``tcp://HOST:PORT``)."""

    verb = "attached"
    spawns = False

    def __init__(self, name: str) -> None:
        self.name = name
        self.daemon_pid = -1
        self.daemon_fd: int | None = None  # readable once the daemon exits
        self.nonce: bytes | None = None  # the attach's, from before it is sent: the lease to give back

    def start(self, pool: "Pool") -> None:
        endpoint, pool_key, _ = locate(self.name)
        if endpoint.startswith("tcp://"):
            # The workers reach us the way we reach the daemon: over TCP, on loopback. The session
            # socket is authenticated like every other (a peer without the session key is dropped).
            session_endpoint = pool.chan.bind("tcp://127.0.0.1:0")
        else:
            session_endpoint = pool.endpoint
        nonce = self.nonce = secrets.token_bytes(32)
        pool.rekey(P.session_key(pool_key, nonce))  # the daemon derives the same key; it is never sent
        deadline = time.monotonic() + pool.config.startup_timeout_s
        ask = P.Attach(pid=os.getpid(), endpoint=session_endpoint, nonce=nonce, control=pool.control.ref(),
                       protocol=P.PROTOCOL_VERSION, max_message_bytes=pool.config.max_message_bytes)
        while True:
            reply = request(self.name, ask, timeout=5.0)
            if reply.ok:
                break
            if reply.error.startswith("busy") and time.monotonic() < deadline:
                time.sleep(0.05)  # the previous client's workers are still releasing its memory
                continue
            raise WorkerStartError(f"cannot attach to dpool-workers pool {self.name!r}: {reply.error}")
        self.daemon_pid = reply.daemon_pid
        try:
            self.daemon_fd = os.pidfd_open(self.daemon_pid)
        except ProcessLookupError:
            raise WorkerStartError(
                f"dpool-workers pool {self.name!r} answered from daemon pid {self.daemon_pid}, which this process "
                "cannot see: a client must share the pool's host, process IDs and /dev/shm"
            ) from None
        pool.threads = reply.threads
        for idx, _device, pid, ident in reply.workers:  # devices: ours, translated from the pool's state
            w = pool.workers[idx]
            w.pid, w.ident = pid, ident
            pool.watch(w)

    def respawn(self, pool: "Pool", w: Worker) -> None:
        raise UnsupportedError("the dpool-workers daemon restarts its workers; a leased pool does not respawn them")

    def end(self, pool: "Pool", grace: float) -> None:
        """Give the workers back: each drops our replica and memory; then the lease is freed."""
        told = set()
        for w in pool.workers:
            if w.alive and w.pidfd is not None and pool.tell(w, P.Shutdown()):
                told.add(w.index)
            w.alive = False
        if any(w.exports for w in pool.workers):
            self._settle_cuda_exports(pool, told)
        self._give_back()

    def abandon(self, chan: Any, workers: Sequence[Worker]) -> None:
        """:meth:`end` for a pool nobody closed: the workers told to drop our replica, the lease freed. A
        lease kept until this process exits would refuse the next ``wrap()`` (a notebook cell run again)."""
        for w in workers:
            if w.alive and w.ident:
                chan.try_send(P.Shutdown(), w.ident)
            w.alive = False
        self._give_back()

    def _give_back(self) -> None:
        """Free the lease at the daemon, and stop watching it."""
        try:
            if self.nonce is not None:  # (asked for one, granted or not: a Ctrl-C may have cut the answer)
                request(self.name, P.Detach(pid=os.getpid(), nonce=self.nonce), timeout=2.0)
        except Exception:
            pass  # the daemon is gone, or will notice our exit through our pidfd
        if self.daemon_fd is not None:
            # forgotten before it is closed: a close cut short here (Ctrl-C) and run again must never close
            # the number a second time (by then it may be another file's)
            fd, self.daemon_fd = self.daemon_fd, None
            os.close(fd)

    def _settle_cuda_exports(self, pool: "Pool", told: set[int]) -> None:
        """Our GPU arenas' IPC counters held by the workers (see NOTE [ CUDA ownership ] in dpool.transport.cuda_ipc).

        A worker told to shut down frees its imports, then answers ``serve_done``: its slots are back at
        zero. The slots of a worker that died first are ours to release. A worker that neither answers
        nor exits keeps its slots, so the memory it may still map is never reused.
        """
        waiting = {i for i in told if pool.workers[i].exports}
        deadline = time.monotonic() + pool.config.shutdown_timeout_s
        while waiting and time.monotonic() < deadline:
            if not pool.chan.poll(50):
                waiting -= {i for i in waiting if pool.exited(pool.workers[i])}
                continue
            for idx, msg in pool.drain():
                if isinstance(msg, P.ServeDone) and idx in waiting:
                    waiting.discard(idx)
                    pool.workers[idx].exports.clear()  # freed by the worker itself
        for w in pool.workers:
            if not w.exports:
                continue
            if pool.exited(w):
                cuda_ipc.release(w.exports)
            else:
                log.warning("%s did not give back its CUDA mappings of this process's memory within %gs; that memory "
                            "stays allocated until this process exits", w.where(), pool.config.shutdown_timeout_s)
                w.exports.clear()
        torch.cuda.ipc_collect()  # arenas freed while a worker still mapped them (grown regions) go now

    def kill_hung(self, w: Worker) -> None:
        time.sleep(0.3)  # the dump is written before it dies; the daemon reaps and respawns it
        try:
            os.kill(w.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def death(self, pool: "Pool", w: Worker, stage: str, others: Sequence[Worker], detail: str) -> DpoolError:
        fd = self.daemon_fd
        if (fd is not None and select.select([fd], [], [], 0.2)[0]) or self._daemon_stopping():
            return DaemonLostError(
                f"the dpool-workers daemon of pool {self.name!r} (pid {self.daemon_pid}) is gone or was "
                f"stopped: {w.where()} exited while {stage} at step {pool.progress.step}. The master module is unchanged "
                f"(dpool.unwrap(model) returns it); start the pool again (dpool-workers start --name {self.name}) "
                "and wrap again."
            )
        return WorkerDiedError(
            f"{w.where()} of dpool-workers pool {self.name!r} died while {stage} at step {pool.progress.step}{detail}; the "
            f"daemon restarts it (see dpool-workers status --name {self.name}).",
            worker=w.index, device=w.device, pid=w.pid, step=pool.progress.step,
            workers=[w.index] + [o.index for o in others],
        )

    def _daemon_stopping(self) -> bool:
        """Whether our daemon is stopping (it says so in its state file before it ends our workers) or gone."""
        if self.name.startswith("tcp://"):
            return False  # a TCP client may not see the pool's directory: the pidfd alone tells
        try:
            state, _ = read_pool(self.name)
        except (OSError, ValueError):
            return True  # no daemon holds the pool's lock any more
        return bool(state.get("stopping")) or state.get("pid") != self.daemon_pid
