"""Cross-node mode: the other nodes' coordinators are alive, and every wait for them is bounded.

gloo cannot abort an operation, waits 30 minutes by default for a peer that stopped, and a
process that caught a gloo error can block in its teardown or abort with SIGABRT (exit code
134) when it exits. dpool bounds all of it, with four things kept here:

* **Heartbeats.** A daemon thread adds 1 to ``<ns>/hb/<rank>`` in the process group's store
  every ``peer_heartbeat_s`` and reads every other rank's counter. A counter that has not moved
  for ``peer_heartbeat_timeout_s`` of *local* monotonic time names a frozen rank (no clock sync).
  A rank is only judged once its counter has moved at all, so a rank still starting is judged
  by ``peer_timeout_s`` alone.
* **The abort key.** The first rank that fails writes ``<ns>/abort`` (who it is, what failed).
  Every other rank reads it within one heartbeat tick, so ranks that are not the dead rank's
  ring neighbours fail fast too, and a local failure is reported on every node with its cause.
* **Bounded waits.** :meth:`Peers.wait` waits for a collective a quarter heartbeat at a time
  (gloo's own bounded wait, or a completion event for NCCL), checking between ticks, instead of
  blocking in it. A point-to-point swap's receive cannot be waited for in ticks (gloo closes the
  connection when such a wait runs out): the main thread blocks in it, the heartbeat thread runs the
  same checks a quarter beat apart, and on a failure ends the wait (a throwaway receive that times out
  makes gloo close the group's connections, so the blocked one raises). It raises
  :class:`~dpool.errors.PeerLostError` for a closed connection or an abort key, and
  :class:`~dpool.errors.PeerTimeoutError` for silence or ``peer_timeout_s``. A lost rank is named:
  the abort key, the ranks' own ``gone`` keys, a dead pid on this host, or a stopped heartbeat.
* **The exit guard.** After a cross-node failure a gloo operation may still be pending, and
  its destructor is what blocks or aborts at exit. :func:`arm_exit_guard` registers an ``atexit``
  handler that closes dpool's pools (reaping their workers), flushes stdio and ends the process
  with ``os._exit`` and the status Python would have given the script's ending: 1 for an uncaught
  exception, the code of ``sys.exit``, ``raise SystemExit`` or ``exit()`` (followed on the main
  thread's outermost frame, :func:`_follow_root`), death by SIGINT for Ctrl-C. ``torchrun`` can then
  restart the job.

Lifecycle: ``start()`` at ``wrap()`` (before the first collective), ``wait()`` around every
collective, ``fail()`` on the first error (publishes the abort key, arms the exit guard),
``stop()`` at ``close()`` (writes this rank's ``gone`` key, ends the thread and waits for it).

Keys live under a namespace per wrap (group name, torchrun restart count, wrap number), so an
agent store that outlives a restarted job never shows a new job the old one's abort key.
"""
from __future__ import annotations

import atexit
import datetime
import logging
import os
import signal
import socket
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import psutil

from .errors import CollectiveDesyncError, PeerLostError, PeerTimeoutError

__all__ = ["Peer", "Peers", "arm_exit_guard"]

log = logging.getLogger("dpool")


@dataclass(frozen=True)
class Peer:
    """Where another node's coordinator runs (exchanged at ``wrap()``)."""

    rank: int
    host: str
    pid: int

    def where(self) -> str:
        return f"rank {self.rank} ({self.host}, pid {self.pid})"


class Peers:
    """Heartbeats, the abort key and bounded waits for one cross-node group.

    Args:
        store: the process group's store (``torch.distributed.Store``).
        namespace: prefix of this wrap's keys.
        rank: this coordinator's rank; size: the number of ranks.
        interval_s: heartbeat period; silence_s: heartbeat timeout; timeout_s: bound on one wait.
    """

    def __init__(self, store: Any, namespace: str, rank: int, size: int, interval_s: float, silence_s: float,
                 timeout_s: float) -> None:
        self.store = store
        self.ns = namespace
        self.rank = rank
        self.size = size
        self.interval_s = interval_s
        self.silence_s = silence_s
        self.timeout_s = timeout_s
        self.me = Peer(rank, socket.gethostname(), os.getpid())
        self.peers: list[Peer] = [Peer(r, "?", -1) for r in range(size)]
        self.peers[rank] = self.me
        now = time.monotonic()
        self._seen: dict[int, tuple[int, float]] = {r: (0, now) for r in range(size) if r != rank}
        self._tick_at = now
        self._abort: str | None = None
        self._store_error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failed = False
        self.timed_waits = False  # gloo on CPU tensors: see wait()
        self._tick = datetime.timedelta(seconds=interval_s / 4)
        self.waited_s = 0.0  # time spent waiting for collectives (the cross-node time a step did not hide)
        # a point-to-point swap blocks the main thread in gloo's receive (see wait()): ``breaker`` ends
        # it; the heartbeat thread calls it when a failure shows before ``_swap_deadline``'s swap is done
        self.breaker: Callable[[], None] | None = None
        self._swap_deadline: float | None = None
        self._broke = False

    # ------------------------------------------------------------------ heartbeat thread
    def start(self) -> None:
        # who this rank is, before its first collective: a rank that loses it during wrap()'s exchange of
        # the same (the first collective) can still name it (see _find_culprit)
        self.store.set(self._key("who", self.rank), f"{self.me.host}\n{self.me.pid}")
        self._beat_once()  # this rank's counter moves before its first collective
        _install_hooks()
        _LIVE.add(self)
        self._thread = threading.Thread(target=self._run, name="dpool-peers", daemon=True)
        self._thread.start()

    def _key(self, *parts: object) -> str:
        return "/".join([self.ns, *map(str, parts)])

    def _beat_once(self) -> None:
        store = self.store
        store.add(self._key("hb", self.rank), 1)
        now = time.monotonic()
        for r, (old, _) in list(self._seen.items()):
            v = int(store.add(self._key("hb", r), 0))
            if v != old:
                self._seen[r] = (v, now)
        if self._abort is None and store.check([self._key("abort")]):
            self._abort = store.get(self._key("abort")).decode(errors="replace")
        self._tick_at = time.monotonic()

    def _run(self) -> None:
        tick = self.interval_s / 4
        beat_at = time.monotonic() + self.interval_s
        while not self._stop.wait(tick):  # a quarter beat: a blocked swap is watched at that pace
            if time.monotonic() >= beat_at:
                beat_at += self.interval_s
                try:
                    self._beat_once()
                except Exception as exc:  # the store is gone (its host died) or refused: a peer-loss signal
                    self._store_error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                    self._watch_swap()
                    return
            self._watch_swap()

    def _watch_swap(self) -> None:
        """End the swap the main thread is blocked in if a failure shows (see :meth:`_wait_swap`)."""
        deadline = self._swap_deadline
        if deadline is None or self._broke or self.breaker is None:
            return
        try:
            self.check("", 0)
            if time.monotonic() <= deadline:
                return
        except (PeerLostError, PeerTimeoutError, CollectiveDesyncError):
            pass
        self._broke = True
        self.breaker()

    @property
    def healthy(self) -> bool:
        """Whether the store answered within the heartbeat timeout (main-thread store calls are safe)."""
        return self._store_error is None and time.monotonic() - self._tick_at < self.silence_s

    # ------------------------------------------------------------------ checks and waits
    def check(self, doing: str, step: int) -> None:
        """Raise if a peer aborted, the store is lost, or a started peer went silent."""
        if self._abort is not None:
            raise self._aborted(doing, step)
        if self._store_error is not None:
            raise PeerLostError(
                f"the process group's store stopped answering ({self._store_error}) while this rank "
                f"({self.me.where()}) was {doing} at step {step}: the rank that hosts it (with "
                f"init_method tcp:// or env://, {self.peers[0].where()}) is probably gone. {_AFTER}",
                rank=0, host=self.peers[0].host, pid=self.peers[0].pid, step=step)
        now = time.monotonic()
        if now - self._tick_at > self.silence_s:
            raise PeerTimeoutError(
                f"the process group's store has not answered for {now - self._tick_at:.1f} s while this rank "
                f"({self.me.where()}) was {doing} at step {step}; the rank that hosts it "
                f"({self.peers[0].where()} under init_method tcp:// or env://) may be frozen. {_AFTER}",
                rank=0, host=self.peers[0].host, pid=self.peers[0].pid, step=step)
        for r, (v, t) in self._seen.items():
            if v > 0 and now - t > self.silence_s:
                p = self.peers[r]
                raise PeerTimeoutError(
                    f"{p.where()} has sent no heartbeat for {now - t:.1f} s (peer_heartbeat_timeout_s="
                    f"{self.silence_s:g}) while this rank ({self.me.where()}) was {doing} at step {step}: it is "
                    f"frozen (stopped, or stuck holding the GIL). {_AFTER}",
                    rank=r, host=p.host, pid=p.pid, step=step)

    def wait(self, work: Any, doing: str, step: int) -> None:
        """Wait for a collective's ``work`` with every liveness check; raise a peer error instead of hanging.

        Checks run every quarter heartbeat. With ``timed_waits`` (gloo on CPU tensors) the wait is gloo's
        own, bounded by that tick: the caller wakes straight from gloo's thread. Otherwise (NCCL, whose
        ``wait()`` only orders streams) a completion callback sets an event: one more thread hand-over
        per collective. ``work`` may also be a point-to-point swap (a tuple
        of works, :meth:`dpool.crossnode.CrossNode.exchange`), which this thread blocks in: see
        :meth:`_wait_swap`.
        """
        start = time.monotonic()
        try:
            if isinstance(work, tuple):
                self._wait_swap(work, doing, step, start + self.timeout_s)
            elif self.timed_waits:
                self._wait_timed(work, doing, step, start + self.timeout_s)
            else:
                self._wait_event(work, doing, step, start + self.timeout_s)
        finally:
            self.waited_s += time.monotonic() - start

    def _wait_swap(self, works: tuple[Any, ...], doing: str, step: int, deadline: float) -> None:
        """Wait in a swap's send, then its receive, on this thread: a receive cannot be waited for in ticks
        (gloo closes the connection when a timed wait on one runs out), and a helper thread that blocked in
        it cost a hand-over per swap (a large part of a probe step, docs/performance.md). Meanwhile the
        heartbeat thread runs this wait's checks a quarter beat apart and, on a failure or at ``deadline``,
        ends the wait with :attr:`breaker`; the error raised then is the one the checks name."""
        self.check(doing, step)  # what is known already: no blocking
        self._broke = False
        self._swap_deadline = deadline
        error: RuntimeError | None = None
        try:
            for w in works:
                w.wait()
        except RuntimeError as exc:  # gloo: "Connection closed by peer", a pair closed by the breaker, ...
            error = exc
        finally:
            self._swap_deadline = None
        if error is None and not self._broke:
            return
        self._tick_checks(doing, step, deadline)  # the abort key, a silent peer or store, peer_timeout_s
        raise self.lost(str(error) if error is not None else "", doing, step) from None

    def _wait_timed(self, work: Any, doing: str, step: int, deadline: float) -> None:
        while True:
            try:
                work.wait(self._tick)
                return
            except RuntimeError:
                if work.is_completed():  # it failed (or completed just after the tick ran out): ask it again
                    try:
                        work.wait()
                        return
                    except RuntimeError as exc:  # gloo: "Connection closed by peer", "Connection reset", ...
                        raise self.lost(str(exc), doing, step) from None
            self._tick_checks(doing, step, deadline)

    def _wait_event(self, work: Any, doing: str, step: int, deadline: float) -> None:
        done = threading.Event()  # set by the backend's thread when the work completes: no polling latency
        work.get_future().add_done_callback(lambda _: done.set())
        while not done.wait(self.interval_s / 4):
            self._tick_checks(doing, step, deadline)
        try:
            work.wait()
        except RuntimeError as exc:
            raise self.lost(str(exc), doing, step) from None

    def _tick_checks(self, doing: str, step: int, deadline: float) -> None:
        self.check(doing, step)
        if time.monotonic() > deadline:
            raise PeerTimeoutError(
                f"a collective between the nodes took longer than peer_timeout_s={self.timeout_s:g} s while "
                f"this rank ({self.me.where()}) was {doing} at step {step}; every rank still beats, so one "
                f"of them is stuck outside dpool (or waits in another collective). {_AFTER}", step=step)

    def _aborted(self, doing: str, step: int) -> PeerLostError | CollectiveDesyncError:
        """The error another rank's abort key means here: that rank's loss, or, where it found the ranks out of
        step, the same :class:`CollectiveDesyncError` (every rank gets it, also one whose own swap it ended)."""
        culprit, reporter, cause = ((self._abort or "").split("\n", 2) + ["", ""])[:3]
        r = int(culprit) if culprit.lstrip("-").isdigit() else -1
        p = self.peers[r] if 0 <= r < self.size else Peer(r, "", -1)
        if culprit == reporter:
            what = f"{p.where()} failed and aborted the job: {cause}"
        else:  # another survivor lost this rank first: name the lost rank, not the one that reported it
            what = f"{cause} (reported by rank {reporter})"
        error = CollectiveDesyncError if cause.startswith(f"{CollectiveDesyncError.__name__} ") else PeerLostError
        return error(f"{what}\n(this rank, {self.me.where()}, was {doing} at step {step}.) {_AFTER}",
                     rank=r, host=p.host, pid=p.pid, step=step)

    def lost(self, gloo: str, doing: str, step: int) -> PeerLostError | CollectiveDesyncError:
        """Name the rank behind a failed collective (in its wait, or at its start): abort key, gone keys, dead pids here, stopped heartbeats."""
        first = _gloo_text(gloo)
        deadline = time.monotonic() + 2 * self.interval_s + 0.2  # let the abort key of the failing rank land
        while True:
            if self._abort is None and self.healthy:  # a rank that failed writes it before it exits
                try:
                    if self.store.check([self._key("abort")]):
                        self._abort = self.store.get(self._key("abort")).decode(errors="replace")
                except Exception:
                    pass
            if self._abort is not None:
                return self._aborted(doing, step)
            culprit, how = self._find_culprit()
            if culprit is not None or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        if culprit is None:
            return PeerLostError(
                f"a collective between the nodes failed while this rank ({self.me.where()}) was {doing} at step "
                f"{step}: another rank closed its connection (gloo: {first}). {_AFTER}", step=step)
        p = self.peers[culprit]
        return PeerLostError(
            f"{p.where()} {how} while this rank ({self.me.where()}) was {doing} at step {step} (gloo: {first}). "
            f"{_AFTER}", rank=culprit, host=p.host, pid=p.pid, step=step)

    def _find_culprit(self) -> tuple[int | None, str]:
        if self.healthy:
            try:
                for p in self.peers:  # not exchanged yet (a loss in wrap()'s first collective): from the store
                    if p.pid < 0 and self.store.check([self._key("who", p.rank)]):
                        host, pid = self.store.get(self._key("who", p.rank)).decode().split("\n")
                        self.peers[p.rank] = Peer(p.rank, host, int(pid))
            except Exception:
                pass
            try:
                for p in self.peers:
                    if p.rank != self.rank and self.store.check([self._key("gone", p.rank)]):
                        why = self.store.get(self._key("gone", p.rank)).decode(errors="replace")
                        return p.rank, why
            except Exception:
                pass
        for p in self.peers:
            if p.rank != self.rank and p.host == self.me.host and p.pid > 0 and not _alive(p.pid):
                return p.rank, "died (its process is gone)"
        now = time.monotonic()
        for r, (v, t) in self._seen.items():
            if v > 0 and now - t > 3 * self.interval_s:
                return r, f"stopped its heartbeat {now - t:.1f} s ago (it died or froze)"
        return None, ""

    # ------------------------------------------------------------------ failure and shutdown
    def fail(self, exc: BaseException, step: int) -> None:
        """This rank failed: tell every other rank at once (unless it only echoes another's abort)."""
        self.failed = True
        if isinstance(exc, PeerLostError) and self._abort is not None:
            return  # another rank's abort: already published
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        lost = getattr(exc, "rank", -1)
        if isinstance(exc, (PeerLostError, PeerTimeoutError)) and lost >= 0:  # the root cause is that rank
            self.publish(text.split(" This rank's workers", 1)[0], culprit=lost)
        else:
            self.publish(f"{type(exc).__name__} at step {step}: {text}")

    def publish(self, cause: str, culprit: int | None = None) -> None:
        """Write the abort key: the rank at fault, this rank, the cause (first writer wins; skipped when
        the store is unreachable)."""
        if not self.healthy:
            return
        try:
            key = self._key("abort")
            if not self.store.check([key]):
                self.store.set(key, f"{self.rank if culprit is None else culprit}\n{self.rank}\n{cause}")
        except Exception as exc:
            log.debug("could not publish the abort key: %s", exc)

    def stop(self, why: str = "closed its dpool model") -> None:
        """End the heartbeat and wait for its thread; leave a ``gone`` note so a rank still waiting names this one.

        The thread must be over before the interpreter finalizes: a daemon thread that comes back
        from a torch call (here a store round trip) during finalization is ended with
        ``pthread_exit`` inside pybind11's ``gil_scoped_release`` destructor, and the process aborts
        ("terminate called without an active exception", exit code 134) after a clean run
        (pytorch/pytorch#38228). A heartbeat stuck in a store that stopped answering is left to the
        exit guard instead.
        """
        if self._stop.is_set():
            return
        self._stop.set()
        _LIVE.discard(self)
        if self.healthy and not self.failed:
            try:
                self.store.set(self._key("gone", self.rank), why)
            except Exception:
                pass
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.interval_s + 1.0)  # one beat: a few store round trips
            if self._thread.is_alive():
                log.debug("dpool: the heartbeat thread is stuck in the process group's store; exit guard armed")
                arm_exit_guard(lambda: None)


def _gloo_text(text: str) -> str:
    """gloo's message without its source location and boilerplate."""
    first = text.strip().splitlines()[0] if text.strip() else "connection lost"
    if first.startswith("[") and "] " in first:
        first = first.split("] ", 1)[1]
    return first.split(". This is typically", 1)[0]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


_AFTER = ("This rank's workers are stopped and its master module and optimizer are unchanged; the process "
          "exits when the script ends (torchrun can restart the job from your last checkpoint).")


# ---------------------------------------------------------------------- process hooks
# _LIVE: the groups of this process's open cross-node models. _GUARD: the exit guard's state. The guard
# ends the process with the exit status the script would have had. "code" is what sys.excepthook and
# sys.exit recorded. "root" is what the main thread's outermost frame saw last (see _follow_root): how
# the script really ended, when that frame could be followed ("traced"). "sigint" stands for an
# uncaught KeyboardInterrupt, which Python ends by killing itself with SIGINT.
_LIVE: "weakref.WeakSet[Peers]" = weakref.WeakSet()
_GUARD: dict[str, Any] = {"hooked": False, "armed": False, "code": 0, "closers": [], "traced": False,
                          "root": None}


def _status(code: Any) -> int:
    """The exit status of ``SystemExit(code)``, as Python computes it."""
    return 0 if code is None else code if isinstance(code, int) else 1


def _install_hooks() -> None:
    """Once per process: an uncaught exception publishes the abort key of every open group (so the
    other nodes name this rank's error instead of a closed connection) and sets the exit code 1;
    ``sys.exit(code)`` records its code for the exit guard."""
    if _GUARD["hooked"]:
        return
    _GUARD["hooked"] = True
    hook = sys.excepthook

    def excepthook(tp: Any, value: Any, tb: Any) -> None:
        _GUARD["code"] = "sigint" if issubclass(tp, KeyboardInterrupt) else 1
        for peers in list(_LIVE):
            if not peers.failed:
                text = str(value).strip().splitlines()[0] if str(value).strip() else ""
                peers.publish(f"its script raised {tp.__name__}: {text}")
        hook(tp, value, tb)

    sys.excepthook = excepthook
    real_exit = sys.exit

    def exit(code: Any = None) -> Any:
        _GUARD["code"] = _status(code)
        return real_exit(code)

    sys.exit = exit


def _untraced(frame: Any, event: str, arg: Any) -> None:
    """The global trace function while the exit guard follows the outermost frame: new frames untraced."""
    return None


def _follow_root() -> None:
    """Follow how the main thread's outermost frame ends, so that the exit guard exits with the status
    Python would have: ``raise SystemExit(main())`` and the ``exit()`` builtin end a script without
    ``sys.exit`` or ``sys.excepthook`` seeing their code.

    The frame reports each exception that reaches it ("exception" events: the last one before the
    interpreter exits is what ended the script) and each line it runs after (the exception was caught
    there and the script went on). Only the main thread can do this, and only when no debugger or
    coverage tool traces it (``sys.gettrace()``); otherwise :func:`_install_hooks`' record stands.
    The cost is one Python call per Python function call from here on, after a failure only.
    """
    if threading.current_thread() is not threading.main_thread() or sys.gettrace() is not None:
        return
    root = sys._getframe()
    while root.f_back is not None:
        root = root.f_back

    def follow(frame: Any, event: str, arg: Any) -> Any:
        if event == "exception":
            tp, value = arg[0], arg[1]
            if issubclass(tp, SystemExit):
                _GUARD["root"] = _status(getattr(value, "code", None))
            else:
                _GUARD["root"] = "sigint" if issubclass(tp, KeyboardInterrupt) else 1
        elif event == "line":
            _GUARD["root"] = None
        return follow

    root.f_trace = follow
    root.f_trace_lines = True
    sys.settrace(_untraced)
    _GUARD["traced"] = True


def arm_exit_guard(closer: Callable[[], None]) -> None:
    """After a cross-node failure: at exit, run ``closer``, flush stdio and ``os._exit`` past gloo's teardown."""
    _install_hooks()
    _GUARD["closers"].append(closer)
    if not _GUARD["armed"]:
        _GUARD["armed"] = True
        _follow_root()
        atexit.register(_exit_now)


def _exit_now() -> None:
    for closer in _GUARD["closers"]:
        try:
            closer()
        except BaseException as exc:  # exiting anyway: say why the close failed
            print(f"dpool: closing a pool at exit failed: {exc}", file=sys.stderr)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    code = _GUARD["code"]
    if _GUARD["traced"] and sys.gettrace() is _untraced:  # the outermost frame was followed to the end
        code = 0 if _GUARD["root"] is None else _GUARD["root"]
    if code == "sigint":  # as Python ends on an uncaught KeyboardInterrupt: killed by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 130
    os._exit(code)
