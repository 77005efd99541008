"""The forward that waits for its loss: a ``gather=False`` training forward sent with its criterion.

With ``gather=False`` a training forward's outputs stay on the workers, and the next thing a step does with
them is ``dpool.criterion(...)(out, target)``. So ``model(x)`` places the shards and builds the forward's
messages (the inputs, flags, seed and parameter versions of that moment) but sends nothing
(:class:`dpool.step.forward.Pending`), and the criterion sends each worker its forward and its loss as one
request: one round per step less, the same numbers.

Lifecycle of a held forward: *pending* (``StepState.pending``), then one of

* *sent with its loss*: its criterion sends both (:meth:`Deferred.forward_and_loss`);
* *ran alone*: any other call on the runtime (another forward, ``out.gather()``, a backward,
  ``worker_states``, a criterion of another output) first runs it in a round of its own
  (:meth:`Deferred.run`), so the workers see every request in the order the program made it;
* *dropped*: ``close()`` drops a forward nothing used, and a parameter changed in place before it ran
  means it cannot run as it was called: its criterion raises :class:`ModelChangedError`; another call
  drops it, and its output raises that error when it is used.

Only for CPU workers, models without buffers (in cross-node mode: whose training forwards exchange
nothing), with grad enabled; ``DPOOL_FORWARD_WITH_LOSS=off`` turns it off. A cross-node training
forward's failure ends the node's part in the job wherever it runs, as in ``model(x)``.

Ctrl-C: the calls a forward's messages tell the workers to release are told again (``Graphs.retell``)
wherever the deferral, the round that sends it, or its dropping is cut; ``tests/test_ctrl_c.py`` cuts
each of them at every point.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence, TypeVar

import torch

from .. import protocol as P
from ..bridge import Host
from ..errors import ModelChangedError
from .forward import EARLIER_FORWARD, Forwards, Pending, Planned
from .hints import names
from .parts import StepParts
from .rounds import Rounds

__all__ = ["Deferred", "changed_since"]

_T = TypeVar("_T")


def changed_since(param_names: Sequence[str], params: Sequence[torch.Tensor], versions: Sequence[int]) -> str:
    """The parameters whose versions moved since ``versions`` were taken, as an error names them ("parameters
    a, b, c and 2 more"); empty if none did."""
    moved = [n for n, p, v in zip(param_names, params, versions) if p._version != v]
    if not moved:
        return ""
    return f"parameter{'s' * (len(moved) > 1)} {names(moved)}"


class Deferred:
    """Running, checking and dropping the held forward (see the module's docstring)."""

    def __init__(self, parts: StepParts, rounds: Rounds, forwards: Forwards) -> None:
        self.state, self.graphs, self.stats, self.master = parts.state, parts.graphs, parts.stats, parts.master
        self.rounds, self.forwards = rounds, forwards

    @staticmethod
    def synced(f: Planned, run: Callable[[], _T]) -> _T:
        """Run a step of the deferred forward ``f``: a failure of a cross-node training forward ends this node's
        part in the job wherever the forward runs, as it does in ``model(x)``."""
        return run() if f.nodes is None else f.nodes.synced(run)

    def run(self, host: Host) -> None:
        """Run the deferred forward in a round of its own."""
        pending = self.state.pending
        assert pending is not None
        self.synced(pending.f, lambda: self._run_alone(host))

    def _run_alone(self, host: Host) -> None:
        pending = self.state.pending
        assert pending is not None
        refused = self.check(pending.f)
        if refused is not None:  # its output, if anything still holds it, raises this when it is used
            handle = pending.f.output()
            if handle is not None:
                handle.call_state.refused = refused
            return
        try:
            self.state.take_pending()
            self.forwards.finish(host, pending.f, self.rounds.request(pending.msgs, "running forward"),
                                 EARLIER_FORWARD)
        except BaseException:
            self.forwards.failed(pending.f)
            raise

    def refuse_changed(self, f: Planned) -> None:
        """Raise if the deferred forward ``f`` can no longer run as it was called (see :meth:`check`)."""
        refused = self.check(f)
        if refused is not None:
            raise ModelChangedError(refused)

    def check(self, f: Planned) -> str | None:
        """Drop the deferred forward ``f`` if it can no longer run as it was called, and raise if the pool cannot
        serve it (a restart lost its segments); return why, if a parameter changed in place since (its
        output raises that when used: the forward would read the new values)."""
        try:
            self.rounds.check_usable()
            if self.graphs.lost(f.call):
                raise RuntimeError("the outputs of this forward are no longer on the workers (restarted)")
            assert f.versions is not None
            changed = changed_since(self.master.param_names, self.master.params, f.versions)
        except BaseException:
            self.forwards.drop(f)
            raise
        if not changed:
            return None
        self.forwards.drop(f)
        return (f"{changed} of the dpool model changed in "
                "place after model(x) and before its outputs were used. With gather=False a training forward waits "
                "for its loss (dpool.criterion) and runs on the workers with it, or at the model's next call, so it "
                "would have read the new values; it did not run. Compute the loss before changing the parameters, "
                "or call the model again after the change (DPOOL_FORWARD_WITH_LOSS=off runs every forward at once).")

    def forward_and_loss(self, host: Host, pending: Pending, msgs: dict[int, P.Message]) -> dict[int, Any]:
        """Send the deferred forward with its loss's ``msgs`` as one request; commit the forward (its failures
        raised as a forward's) and return the loss's replies."""
        f = pending.f
        forward: dict[int, Any] = {}
        loss: dict[int, Any] = {}
        try:
            self.state.take_pending()
            both = {s: P.ForwardCriterion(forward=P.values_of(pending.msgs[s]), criterion=P.values_of(m),
                                          together=m.together)  # type: ignore[attr-defined]
                    for s, m in msgs.items()}
            replies = self.rounds.request(both, "running forward and computing the loss")
            for s, r in replies.items():
                if isinstance(r, P.ForwardCriterionDone):
                    forward[s] = P.inner("forward_done", r.forward)
                    loss[s] = P.inner(r.criterion_op, r.criterion)
                else:  # the forward failed: the loss did not run (nor mapped its targets' segment: see
                    forward[s] = r  # Rounds.raise_failures, which finish calls)
            self.forwards.finish(host, f, forward)
        except BaseException:
            self.forwards.failed(f)
            raise
        self.stats.forward_rounds_saved += 1
        return loss
