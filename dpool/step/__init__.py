"""One training step, coordinator side: :class:`Runtime` and the stages it composes.

Read the code in this order: ``runtime`` (the facade) → ``forward`` → ``deferred`` → ``loss_round`` →
``backward``, then what they share: ``plan`` (what a forward like the last one reuses) → ``rounds``
(requests, restarts, the end of every round) → ``replicas`` (binding, shipping, worker memory) → ``parts``
(what every stage is made from) → ``follow`` (the user's process) → ``state`` (the step's state and its
named transitions) → ``hints`` (error text).

``CUT_POINTS`` lists every function of this package that runs during a step (a forward, a loss on the
workers, a backward, and the restart a round that met a dead worker runs). Each was reviewed for a Ctrl-C at any point: ``tests/test_ctrl_c.py`` cuts the
ones that hold a ``try`` at every offset, and ``tests/test_shape.py`` fails when a step runs a function
of this package that is not listed, so a new one cannot escape that review.
"""
from __future__ import annotations

from . import backward as _backward, deferred as _deferred, follow as _follow, forward as _forward
from . import loss_round as _loss_round, replicas as _replicas, rounds as _rounds, runtime as _runtime
from . import plan as _plan, state as _state
from .runtime import Runtime

__all__ = ["Runtime", "CUT_POINTS"]

CUT_POINTS = (
    _runtime.Runtime.forward, _runtime.Runtime.criterion, _runtime.Runtime.backward,
    _runtime.Runtime.backward_speculated, _runtime.Runtime.gather_kept, _runtime.Runtime.call_workers,
    _runtime.Runtime.params, _runtime.Runtime.dim, _runtime.Runtime.n, _runtime.Runtime.output_device,
    _runtime.Runtime.no_sync,
    _forward.Forwards.run, _forward.Forwards._follow, _forward.Forwards._plan, _forward.Forwards._flags, _forward.Forwards._begin_across,
    _forward.Forwards._reserve, _forward.Forwards._messages, _forward.Forwards._defers, _forward.Forwards.drop,
    _forward.Forwards.failed, _forward.Forwards.finish, _forward.Forwards._call_state,
    _forward.Forwards._gather_or_keep, _forward.Forwards._commit, _forward.Planned.__init__, _forward.Planned.rows,
    _forward.Planned.output, _forward.Pending.__init__,
    _forward.Planned.diff_inputs, _forward.out_shapes,
    _forward.loss_dtype,
    _plan.signature, _plan.need, _plan.shapes_of, _plan.Plan.__init__, _plan.Plan.__post_init__, _plan.Placements.__init__,
    _plan.Placements.place, _plan.Plans.get,
    _plan.Plans.keep, _backward._at_start,
    _deferred.Deferred.synced, _deferred.Deferred.run, _deferred.Deferred._run_alone,
    _deferred.Deferred.refuse_changed, _deferred.Deferred.check, _deferred.Deferred.forward_and_loss,
    _deferred.changed_since,
    _loss_round.LossRound.criterion, _loss_round.LossRound._ran, _loss_round.LossRound._target_shards, _loss_round.LossRound._speculates,
    _loss_round.LossRound._messages, _loss_round.LossRound._settle, _loss_round.LossRound.backward_speculated,
    _loss_round.LossRound.gather_kept,
    _backward.Backwards.holds, _backward.Backwards.run, _backward.Backwards._skipped,
    _backward.Backwards.check_params, _backward.Backwards.gate_hooks, _backward.Backwards._messages,
    _backward.Backwards.round, _backward.Backwards._send, _backward.Backwards._reduce,
    _backward.Backwards.commit_buffers, _backward.Backwards.changed_buffers, _backward.params_changed,
    _rounds.Rounds.unsent, _rounds.Rounds.fetch, _rounds.Rounds.settle, _rounds.Rounds.call, _rounds.Rounds.call_all, _rounds.Rounds.request,
    _rounds.Rounds._lost_contexts, _rounds.Rounds.check_usable, _rounds.Rounds.raise_failures,
    _rounds.Rounds._restart_after,
    _replicas.ReplicaSet.push, _replicas.ReplicaSet.commit_rebound, _replicas.ReplicaSet.restart,
    _replicas.ReplicaSet.init_workers, _replicas.ReplicaSet._new_memory, _replicas.ReplicaSet._arena,
    _replicas.ReplicaSet.rebuild, _replicas.ReplicaSet._params_ref, _replicas.ReplicaSet._follow_patches,
    _follow.in_transform, _follow.in_dual_level, _follow.follow_numerics, _follow.follow_backend_flags,
    _follow.Notices.new, _follow.Notices.attributes,
    _state.StepState.draw_seed, _state.StepState.begin_forward, _state.StepState.begin_across,
    _state.StepState.kept_outputs, _state.StepState.defer, _state.StepState.take_pending,
    _state.StepState.drop_pending, _state.StepState.begin_restart, _state.StepState.end_restart,
    _state.StepState.forget_sent, _state.StepState.sent_requires_grad_flags, _state.StepState.sent_numerics_values,
    _state.StepState.sent_backend_flags, _state.StepState.hold, _state.StepState.release, _state.SlotGen.bump, _state.SlotGen.token, _state.SlotGen.valid,
)
