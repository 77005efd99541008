"""The loss on the workers, replica side: a shard's loss on outputs kept here (``gather=False``), the deferred
forward sent with it, and the loss's backward run right after it when the coordinator could tell its seed
(see :mod:`dpool.loss` and :mod:`dpool.step.loss_round`)."""
from __future__ import annotations

import time
from typing import Any, Callable

import torch

from dpool import protocol as P, tree as _tree
from dpool.loss import split_loss
from dpool.tensors import DTYPES, from_bytes, read
from dpool.transport.shm import Mapped

from .replica_backward import Call

__all__ = ["LossHandlers"]


class LossHandlers:
    """The loss requests of :class:`~.replica.Replica`."""

    def forward_criterion(self, msg: P.ForwardCriterion) -> P.Message:
        """A deferred forward and its loss (:mod:`dpool.step.deferred`): the forward's failure is the
        request's; the loss's is reported beside the forward's reply, which the coordinator commits first."""
        done = self.forward(P.inner("forward", msg.forward))  # (a kept forward's: its outputs stay here)
        try:
            loss = self.criterion(P.inner("criterion", msg.criterion))
        except Exception as exc:
            stage, self.stage = self.stage, "idle"
            return P.ForwardCriterionDone(forward=P.values_of(done), criterion_op="failed",
                                          criterion=P.values_of(P.Failed.of(stage, exc)))
        return P.ForwardCriterionDone(forward=P.values_of(done), criterion_op="criterion_done",
                                      criterion=P.values_of(loss))

    def criterion(self, msg: P.Criterion) -> P.Message:
        self.stage = "computing the loss"
        call = self.calls.get(msg.call)
        if call is None or call.out is None:
            raise RuntimeError("the outputs of this call are no longer kept on the worker (released)")
        inp = self._seg("in", msg.inputs)
        # mapped now, whether or not the backward runs with the loss: its name is unlinked after this round
        gin = self._seg("gin", msg.input_grads) if msg.seed else None
        tensors = [read(inp.views, m) for m in msg.tensors]
        args = _tree.unflatten(msg.tree, tensors.__getitem__)
        loss_fn = _tree.load_type(msg.fn)  # cached: the same criterion is sent every step
        with torch.set_grad_enabled(any(t.requires_grad for t in call.outputs)):
            total, denom = split_loss(loss_fn, call.out, args, self._reduced)
        call.outputs.append(total)
        versions = self._buffer_versions()
        done = self._speculate(msg, call, total, gin) if gin is not None else None
        if done is not None and versions:
            self._put_back_assigned()
        self.stage = "idle"
        if done is None:
            return P.CriterionDone(call=msg.call, index=len(call.outputs) - 1, value=float(total.detach()),
                                   denom=float(denom), backward=False, param_mask=b"", input_grads=[], busy=0.0)
        return P.CriterionDone(call=msg.call, index=len(call.outputs) - 1, value=float(total.detach()),
                               denom=float(denom), backward=True, param_mask=done.param_mask,
                               input_grads=done.input_grads, busy=done.busy,
                               buffers=self._changed_buffers(versions) if versions else [])

    def _speculate(self, msg: P.Criterion, call: Call, total: torch.Tensor, gin: Mapped) -> P.BackwardDone | None:
        """The backward of the shard loss ``total`` with the coordinator's ``msg.seed``, run now, exactly as
        the :class:`~dpool.protocol.Backward` that ``loss.backward()`` would send; ``None`` when it does not
        run or fails (the coordinator then sends that backward: its error, if any, is reported there)."""
        if self._holding or not total.requires_grad:  # no_sync gradients held here: never mixed into
            return None
        seed = from_bytes(msg.seed, DTYPES[msg.seed_dtype]).reshape(())
        if self.on_gpu:
            seed = seed.to(self.device)
        self.stage = f"running backward at step {msg.step} (right after the loss)"
        own = self._backward_flags(msg.requires_grad)
        try:
            return self._backward(call_id=msg.call, call=call, roots=[total], grads=[seed], giseg=gin,
                                  gin_size=msg.input_grads[1], hold=False, sparse_ref=[None, 0], t0=time.monotonic(),
                                  speculative=True)
        except Exception:  # sparse gradients (NotSpeculable) or the model's error: a fresh start next time
            for p in self.params:
                p.grad = None
            for leaf in call.leaves:
                if leaf is not None:
                    leaf.grad = None
            self._written = bytearray(len(self.params))
            self._holding = False
            return None
        finally:
            self._backward_flags(own)

    # set by Replica and BackwardHandlers (see there)
    stage: str
    device: str
    on_gpu: bool
    params: list[torch.nn.Parameter]
    calls: dict[int, Call]
    _reduced: dict
    _holding: bool
    _written: bytearray
    forward: Callable[[Any], P.Message]
    _seg: Callable[..., Mapped]
    _buffer_versions: Callable[[], list[int]]
    _changed_buffers: Callable[[list[int]], list[int]]
    _backward_flags: Callable[[bytes], bytes]
    _backward: Callable[..., P.BackwardDone]
    _put_back_assigned: Callable[[], None]
