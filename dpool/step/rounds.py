"""Rounds and their failures: one request to the workers, the restart policy, errors raised as the user's.

A dead or hung worker is restarted while ``max_restarts`` lasts (the call that met it still raises, and
the next one runs on the restarted pool), or else breaks the pool. Either way the master is untouched.
"""
from __future__ import annotations

import logging
import sys
from typing import Any, Callable, Mapping

import cloudpickle

from .. import protocol as P
from ..errors import PoolBrokenError, WorkerDiedError, WorkerStartError, WorkerTimeoutError, remote_error
from . import hints
from .replicas import ReplicaSet
from .parts import StepParts

__all__ = ["Rounds"]

log = logging.getLogger("dpool")

# How many times one call tries a restart that faults keep cutting short before it raises; the restart goes on at
# the next call (a call's wait stays bounded while faults come faster than workers start).
RESTART_TRIES = 3


class _RestartGoesOn(Exception):
    """Faults kept cutting a restart short: the next call goes on with it. ``fault``: the latest one."""

    def __init__(self, fault: BaseException) -> None:
        super().__init__(str(fault))
        self.fault = fault


class Rounds:
    """Requests to the workers, with the restart policy and the failures of their replies."""

    def __init__(self, parts: StepParts, replicas: ReplicaSet) -> None:
        self.setup, self.state, self.pool, self.io, self.graphs = parts.setup, parts.state, parts.pool, parts.io, \
            parts.graphs
        self.stats, self.master, self.replicas = parts.stats, parts.master, replicas

    def unsent(self) -> None:
        """Building a round's messages failed: forget the segments made for it (no worker will map them)."""
        self.io.rollback()
        self.pool.unlink_segments()

    def fetch(self, make: Callable[[int, Any], P.Message], role: str, needs: Mapping[int, int], stage: str,
              where: str) -> dict[int, Any]:
        """A round that fetches what did not fit in a reply: worker ``s``'s ``role`` segment grown to
        ``needs[s]`` bytes and named in its message ``make(s, ref)``; the replies, failures raised."""
        try:
            msgs = {s: make(s, self.io.ensure(s, role, n).ref()) for s, n in needs.items()}
        except BaseException:
            self.unsent()
            raise
        replies = self.request(msgs, stage)
        self.settle(replies, where)
        return replies

    def settle(self, replies: Mapping[int, Any], where: str) -> None:
        """The end of every round: the names of the segments its messages named go (each worker mapped them,
        or failed), then the first failure is raised as the user's (``where`` names the round in it)."""
        self.pool.unlink_segments()
        self.raise_failures(replies, where)

    def call_all(self, fn: Any) -> list[Any]:
        """Run ``fn(replica)`` in every worker: their results, in worker order."""
        self.check_usable()
        self.state.slots.bump("a function ran on the replicas")  # fn may run anything, a backward included
        return list(self.call(range(self.setup.n), fn).values())

    def call(self, indices: Any, fn: Any) -> dict[int, Any]:
        """Run ``fn(replica)`` in the workers ``indices``: their results."""
        payload = cloudpickle.dumps(fn)
        replies = self.request({i: P.Call(fn=payload) for i in indices}, "running a function")
        self.raise_failures(replies, "worker_states")
        return {i: cloudpickle.loads(replies[i].result) for i in indices}

    def inspect(self) -> list[tuple[int, int]]:
        """Per worker: the graphs it keeps for us, and its resident memory in bytes (one round trip)."""
        n = self.setup.n
        try:
            release = self.graphs.collect(self.io.release)
            replies = self.request({i: P.Inspect(release=release) for i in range(n)}, "reporting its state")
        except BaseException:
            self.graphs.retell()
            raise
        self.raise_failures(replies, "stats")
        return [(replies[i].graphs, replies[i].rss) for i in range(n)]

    def request(self, msgs: Mapping[int, P.Message], stage: str) -> dict[int, Any]:
        """``pool.request`` that, on a dead or hung worker, restarts it (``max_restarts``) or breaks the pool."""
        pool, state = self.pool, self.state
        sent = pool.rounds_sent
        self.io.commit()  # the segments made for these messages are named in them
        try:
            return self._lost_contexts(pool.request(msgs, stage))
        except BaseException as exc:
            if pool.rounds_sent == sent:
                # Cut short while sending (Ctrl-C): some workers may never see the segments these messages
                # name, and the next request unlinks every name. Those workers start over with new ones.
                for w in msgs:
                    self.io.reset(w)
            if not isinstance(exc, (WorkerDiedError, WorkerTimeoutError)):
                raise
            dead = getattr(exc, "workers", None) or [exc.worker]
            if state.restarts_left < len(dead):
                pool.break_pool(str(exc))
                hints.amend(exc, hints.broken())
                raise
            state.begin_restart(dead, len(dead))  # (first: from here on a Ctrl-C leaves it to the next call)
            try:
                self._restart_after(exc, dead)
            except _RestartGoesOn as later:
                hints.amend(exc, hints.restart_goes_on(state.restarting or dead, state.restarts_left))
                raise exc from later.fault
            except Exception as again:
                pool.break_pool(str(again))
                hints.amend(exc, hints.restart_failed(again))
                raise exc from again
            except BaseException as cut:  # Ctrl-C: the next call finishes the restart (check_usable)
                note = hints.cut_restart(dead, str(exc).splitlines()[0])
                if sys.version_info >= (3, 11):
                    cut.add_note(note)
                else:
                    log.warning("%s", note)
                raise
            raise

    def _restart_after(self, exc: WorkerDiedError | WorkerTimeoutError, dead: list[int]) -> None:
        """Restart the workers ``dead`` that ``exc`` reports, and say so in ``exc`` (its caller raises it)."""
        state = self.state
        self.stats.restarts += len(dead)
        log.warning("%s; restarting worker(s) %s (%d restart(s) left)", str(exc).split("\n", 1)[0], dead,
                    state.restarts_left)
        lost = hints.lost_held() if state.workers_hold else ""  # (ReplicaSet.restart says so to the markers)
        dead = self._restart(dead)
        exc.restarted = True  # type: ignore[union-attr]
        hints.amend(exc, hints.restarted(dead, state.restarts_left, lost))

    def _restart(self, dead: list[int]) -> list[int]:
        """Restart the workers ``dead``, and those that fail while it runs (another worker dies, a new one is
        killed while it starts, or hangs), while restarts are left: each failure costs a restart per worker.
        Returns every worker restarted."""
        state = self.state
        for attempt in range(1, RESTART_TRIES + 1):
            try:
                self.replicas.restart(dead, self._call_once)
                return dead
            except (WorkerDiedError, WorkerTimeoutError, WorkerStartError) as again:
                failed = list(getattr(again, "workers", None) or ([getattr(again, "worker")] if getattr(again, "worker", -1) >= 0
                                                                   else []))
                if not failed or state.restarts_left < len(failed):
                    raise
                dead = sorted(set(dead) | set(failed))
                state.begin_restart(dead, len(failed))
                self.stats.restarts += len(failed)
                log.warning("%s, while restarting; restarting worker(s) %s (%d restart(s) left)",
                            str(again).split("\n", 1)[0], dead, state.restarts_left)
                if attempt == RESTART_TRIES:
                    raise _RestartGoesOn(again) from again
        raise AssertionError("unreachable")

    def _call_once(self, indices: Any, fn: Any) -> dict[int, Any]:
        """:meth:`call` without the restart policy: a restart's own rounds (a failure there restarts the
        restart, see :meth:`_restart`)."""
        payload = cloudpickle.dumps(fn)
        replies = self._lost_contexts(self.pool.request({i: P.Call(fn=payload) for i in indices},
                                                        "running a function"))
        self.raise_failures(replies, "worker_states")
        return {i: cloudpickle.loads(replies[i].result) for i in indices}

    def _lost_contexts(self, replies: dict[int, Any]) -> dict[int, Any]:
        """Raise :class:`WorkerDiedError` for workers whose CUDA context a sticky error destroyed (they exit)."""
        pool = self.pool
        if not pool.exiting:  # filled by the pool when a CONTEXT_LOST reply arrives
            return replies
        lost = sorted(i for i in replies if i in pool.exiting)
        if not lost:
            return replies
        w, r = pool.workers[lost[0]], replies[lost[0]]
        also = f" (also worker(s) {lost[1:]})" if len(lost) > 1 else ""
        raise WorkerDiedError(hints.lost_context(w.where(), also, r, pool.progress.step),
                              worker=lost[0], device=w.device, pid=w.pid, step=pool.progress.step, workers=lost)

    def check_usable(self) -> None:
        """Raise if the pool cannot serve a call; first finish a restart that a Ctrl-C cut short."""
        self.pool.check_usable()
        dead = self.state.restarting
        if dead is not None:
            log.warning("finishing the restart of worker(s) %s that an earlier call left unfinished", dead)
            try:
                self._restart(dead)
            except _RestartGoesOn as later:  # faults go on: so does the restart, at the next call
                fault = later.fault
                hints.amend(fault, hints.restart_goes_on(self.state.restarting or dead, self.state.restarts_left))
                raise fault from None
            except Exception as exc:
                self.state.end_restart()  # (nothing left to finish: the pool is broken)
                self.pool.break_pool(f"restarting worker(s) {dead} failed: {exc!r}")
                raise PoolBrokenError(hints.finish_failed(dead, exc)) from exc

    def raise_failures(self, replies: Mapping[int, Any], where: str) -> None:
        """Raise the error of the first shard that failed as the user's (see :func:`dpool.errors.remote_error`)."""
        failed = sorted((i, r) for i, r in replies.items() if isinstance(r, P.Failed))
        if not failed:
            return
        for i, _ in failed:  # it may have failed before mapping the segments its request named, whose names
            self.io.reset(i)  # are unlinked by now: it gets new ones next time (see dpool.regions)
        # Shards released from a collective because another failed are not the cause: report the cause.
        causes = [(i, r) for i, r in failed if r.qualname != "CollectiveAborted"] or failed
        i, r = causes[0]
        w = self.pool.workers[i]
        master = self.master
        empty = [n for n, b in zip(master.buffer_names, master.buffers) if not b.numel()]
        message = hints.worker_failure(message=r.message, qualname=r.qualname, rows=self.state.last_rows,
                                       buffer_names=master.buffer_names, empty_buffers=empty,
                                       devices=self.setup.devices, cuda=self.setup.cuda)
        # raised without a local name: a local would tie the exception to this frame's locals (the
        # I/O segments among them) in a cycle that only the GC frees
        raise remote_error(r.module, r.qualname, message, r.traceback, worker=i, device=w.device, pid=w.pid,
                           step=self.pool.progress.step, where=f"{where} (shard {i})")
