"""The loss on the workers, coordinator side: the criterion round, its speculative backward, and the gather
of outputs kept on the workers (see :mod:`dpool.loss` for what the workers compute).

When the gradient ``loss.backward()`` will give each shard's loss can be told at the loss, the workers
also run that backward in the same round (a *speculative* backward): ``loss.backward()`` then finds the
gradients in the slots and needs no round of its own (:class:`dpool.loss.Speculation`). The result is used
only under the slot generation it was made in (:class:`dpool.step.state.SlotGen`).
"""
from __future__ import annotations

import functools
from typing import Any, Sequence

import torch

from .. import protocol as P, scatter as _scatter, tree as _tree
from ..bridge import Bridge, CallState, Host
from ..errors import DpoolValueError
from ..loss import ShardedOutput, Speculation, Unrun, build_output, combine, criterion as Criterion, predict_seed
from ..tensors import dtype_name, meta_nbytes
from .backward import Backwards, params_changed
from .deferred import Deferred
from .forward import Forwards, loss_dtype, out_shapes
from .plan import Placements, shapes_of
from .replicas import ReplicaSet
from .rounds import Rounds
from .parts import StepParts

__all__ = ["LossRound"]

_GONE = "the outputs of this forward are no longer on the workers (released or restarted)"


class LossRound:
    """The criterion round and what follows from it (see the module's docstring)."""

    def __init__(self, parts: StepParts, replicas: ReplicaSet, rounds: Rounds, forwards: Forwards,
                 deferred: Deferred, backwards: Backwards) -> None:
        self.setup, self.state, self.pool, self.io, self.graphs = parts.setup, parts.state, parts.pool, parts.io, \
            parts.graphs
        self.stats, self.balancer, self.master, self.replicas, self.rounds = parts.stats, parts.balancer, \
            parts.master, replicas, rounds
        self.forwards, self.deferred, self.backwards = forwards, deferred, backwards
        self.targets = Placements(parts.setup.n)  # each shard's targets, where they went last

    def criterion(self, host: Host, handle: ShardedOutput, crit: Criterion, targets: tuple) -> torch.Tensor:
        """Compute ``crit`` on every shard of ``handle``; the full-batch loss (see :meth:`dpool.step.Runtime.criterion`)."""
        call_state = handle.call_state
        pending = self.state.pending
        if pending is not None and pending.f.output() is not handle:
            self.deferred.run(host)  # (another forward's: it runs first, in its own round)
            pending = None
        if pending is not None:  # the forward and this loss go to the workers together
            self.deferred.synced(pending.f, functools.partial(self.deferred.refuse_changed, pending.f))
        else:
            self.rounds.check_usable()
            if isinstance(call_state, Unrun):
                call_state.check()
        fn = crit.payload()  # (the loss may have changed since the last step)
        ran = self._ran(call_state) if pending is None else None
        tensors: list[torch.Tensor] = []
        spec = _tree.flatten(tuple(targets), tensors)
        k, rows = call_state.k, call_state.rows
        shards = self._target_shards(tensors, k, rows)
        if ran is not None:
            dtype = loss_dtype(ran.metas)
            assert handle.specs is not None  # (filled in with its call state)
            shapes = out_shapes(ran.metas, handle.specs)
            differentiable = any(ran.differentiable)
        else:  # the forward has not run: the previous forward's, checked against this one's once it ran
            dtype, last_shapes, last_rows = self.state.last_out
            shapes = last_shapes if last_rows == rows else [None] * k
            differentiable = True
        params = self.master.params
        param_idx = [i for i, p in enumerate(params) if p.requires_grad]  # the loss's autograd inputs
        guess = None
        if (crit.backward_with_loss and torch.is_grad_enabled() and (handle.diff_inputs or param_idx)
                and differentiable):
            guess = predict_seed(crit=crit, targets=tuple(targets),
                                 shard_targets=lambda: [_tree.unflatten(spec, sh.__getitem__) for sh in shards],
                                 output_shapes=lambda: shapes, dtype=dtype, device=self.setup.output_device)
        speculate = self._speculates(crit, guess)
        flags = bytes(p.requires_grad for p in params)  # the early backward's; checked again at backward
        if speculate:
            self.state.slots.bump("speculative backward")  # the workers write their slots in this round
        together = self.pool.together(k)
        try:
            msgs, spans = self._messages(call_state=call_state, fn=fn, spec=spec, shards=shards,
                                         guess=guess if speculate else None, dtype=dtype, flags=flags,
                                         together=together)
        except BaseException:
            self.rounds.unsent()
            if pending is not None:  # (its segments were rolled back with these: it can no longer run)
                self.forwards.drop(pending.f)
            raise
        for s, span in enumerate(spans):  # the loss graph may save the targets: kept until the call is released
            self.io.keep(s, (call_state.call, "targets", id(span[0]), span[1]), span)
        if pending is not None:
            replies = self.deferred.synced(pending.f, lambda: self.deferred.forward_and_loss(host, pending, msgs))
            done_state = handle.call_state
            assert isinstance(done_state, CallState)  # (the forward ran: finish() filled it in)
            real = loss_dtype(done_state.metas)
            if real != dtype:  # predicted from the previous forward: a guess made with it cannot be used
                dtype, guess = real, None
        else:
            replies = self.rounds.request(msgs, "computing the loss")
        self.rounds.settle(replies, "criterion")
        done = [replies[s] for s in range(k)]
        if guess is not None:
            self._settle(crit, guess, done, speculate, flags)
        return combine(runtime=host, handle=handle, replies=done, dtype=dtype, reduction=crit.reduction, guess=guess,
                       crit=crit, param_idx=param_idx)

    def _ran(self, call_state: CallState | Unrun) -> CallState:
        """The call state of outputs kept on the workers, whose forward ran; raises if they are gone (a forward
        that never ran was dropped: :meth:`Unrun.check` says why, for a changed parameter)."""
        if isinstance(call_state, Unrun):
            call_state.check()
        if isinstance(call_state, Unrun) or not self.graphs.kept(call_state.call):
            raise RuntimeError(_GONE)
        return call_state

    def _target_shards(self, tensors: list[torch.Tensor], k: int, rows: list[int]) -> list[list[Any]]:
        """The targets split over the workers like the inputs, row for row."""
        dim = self.setup.dim
        for t in tensors:
            if t.dim() > dim and t.size(dim) != sum(rows):
                raise DpoolValueError(
                    f"dpool.criterion: a target has {t.size(dim)} rows along dim {dim}, but the model's "
                    f"inputs had {sum(rows)} (shards of {rows} rows). Targets are split over the workers like the "
                    "inputs, row for row. If the model flattens its output (logits.view(-1, V)), pass the target "
                    "with one row per input row and flatten it in the loss (a subclass of the loss, as in "
                    "docs/features.md), or compute the loss on out.gather().")
        return _scatter.shard_views(tensors, [rows if t.dim() > dim else None for t in tensors], k, dim)

    def _speculates(self, crit: Criterion, guess: Speculation | None) -> bool:
        """Whether the workers run the loss's backward in its round."""
        state, allowed = self.state, crit.speculation.allows()
        return (guess is not None and allowed and self.replicas.speculable and not self.setup.cuda
                and not state.no_sync and not state.workers_hold)

    def _messages(self, call_state: CallState | Unrun, fn: bytes, spec: Any, shards: list[list[Any]],
                  guess: Speculation | None,
                  dtype: torch.dtype, flags: bytes, together: list) -> tuple[dict[int, P.Message], list]:
        """Each shard's targets placed after its inputs, and its message (with the speculated seed); the
        targets' spans."""
        io, pool = self.io, self.pool
        seed, seed_dtype = (guess.seed, dtype_name(dtype)) if guess is not None else (b"", "")
        msgs: dict[int, P.Message] = {}
        spans = []
        for s in range(call_state.k):
            metas, seg, start, need = self.targets.place(s, shards[s], functools.partial(io.input_region, s),
                                                         shapes_of(shards[s]))
            spans.append((seg, start, start + need))
            gin = io.ensure(s, "gin", call_state.gin_sizes[s]).ref() if guess is not None else [None, 0]
            msgs[s] = P.Criterion(call=call_state.call, fn=fn, tree=spec, tensors=metas, inputs=seg.ref(), seed=seed,
                                  seed_dtype=seed_dtype, input_grads=gin, step=pool.progress.step, requires_grad=flags,
                                  together=together)
        return msgs, spans

    def _settle(self, crit: Criterion, guess: Speculation, done: list[Any], speculate: bool, flags: bytes) -> None:
        """Record whether the speculative backward ran, and with the denominators predicted (the seed depends
        on them): only then may ``loss.backward()`` use it."""
        matched = guess.matches([r.denom for r in done])
        ran = speculate and all(r.backward for r in done) and matched
        crit.speculation.settle(guess, matched, self.state.slots.token() if ran else None, done, flags)

    def backward_speculated(self, call_state: CallState, guess: Speculation, hit: bool, crit: Criterion,
                            param_idx: Sequence[int]) -> list[torch.Tensor | None] | None:
        """The gradients of a criterion's loss whose backward the workers ran with it, or ``None``: run the
        backward round instead (see :meth:`dpool.step.Runtime.backward_speculated`)."""
        self.rounds.check_usable()  # (first: finishing a cut restart changes the slots and loses the graphs)
        crit.speculation.backpropagated(guess, hit)
        params = self.master.params
        if (not hit or guess.replies is None or not self.state.slots.valid(guess.gen) or self.state.no_sync
                or torch.is_grad_enabled() or self.graphs.lost(call_state.call) or params_changed(call_state)
                or guess.flags != bytes(p.requires_grad for p in params)):
            return None
        replies = guess.replies
        k = call_state.k
        replicas = self.replicas
        assert replicas.reducer is not None
        param_grads = replicas.reducer.reduce([replicas.memory.grad_slots[s] for s in range(k)],
                                              [r.param_mask for r in replies], call_state.fseq)
        self.backwards.commit_buffers(self.backwards.changed_buffers(replies), k, call_state.rows)
        self.state.slots.bump("speculative backward used")
        busy = [r.busy for r in replies]
        self.stats.backward(busy, k * guess.dtype.itemsize,
                            sum(end - start for _, start, end, _ in replicas.layout.param_groups) * k)
        self.stats.backward_rounds_saved += 1
        self.stats.no_round("backward")
        self.balancer.observe(1, busy, call_state.rows)
        input_grads = call_state.input_grads([r.input_grads for r in replies])
        self.backwards.gate_hooks(param_grads, param_idx)
        return input_grads + [param_grads[i] for i in param_idx]

    def gather_kept(self, handle: ShardedOutput) -> Any:
        """Gather outputs kept on the workers, through the autograd bridge."""
        self.rounds.check_usable()
        call_state = self._ran(handle.call_state)
        sizes = {s: sum(meta_nbytes(m) for m in call_state.metas[s]) or 64 for s in range(call_state.k)}
        replies = self.rounds.fetch(lambda s, ref: P.Fetch(call=call_state.call, outputs=ref), "out", sizes,
                                    "returning outputs", "gather")
        call_state.metas = [replies[s].tensors for s in range(call_state.k)]
        self.stats.bytes["outputs"] += sum(meta_nbytes(m) for ms in call_state.metas for m in ms)
        call_state.outs = [self.io.segment(s, "out") for s in range(call_state.k)]
        params = self.master.params
        idx = [i for i, p in enumerate(params) if p.requires_grad]
        grad_inputs = handle.diff_inputs + [params[i] for i in idx]
        if torch.is_grad_enabled() and grad_inputs and any(call_state.differentiable):
            gathered = Bridge.apply(call_state, idx, *grad_inputs)
            call_state.ctx.handle = handle  # the gathered output's graph keeps the outputs on the workers alive
            call_state.ctx = None
            if not isinstance(gathered, tuple):
                gathered = (gathered,)
        else:
            gathered = call_state.gather()
        return build_output(handle, list(gathered))
