"""The replica's backward: a shard's graph backpropagated, its parameter gradients into the worker's slot.

Parameter gradients go to the gradient slot in one of two ways, chosen at ``init``:

* as autograd finishes each one: a post-accumulate hook copies it there (or adds a second accumulation to
  it) and drops ``.grad`` (:meth:`BackwardHandlers._to_slot_hook`). GPU workers, cross-node pools and models
  of over :data:`BULK_GRAD_COPY_MAX` bytes of parameters. In cross-node mode with overlap the hook also
  tells the :class:`~.buckets.BucketReporter`;
* after the backward, all in one ``torch._foreach_copy_`` (the other CPU workers): no Python call per
  parameter, at the price of holding every gradient until the backward ends (at most
  ``BULK_GRAD_COPY_MAX`` bytes more).

Under ``no_sync()`` (``hold``) the gradients stay in the slot (and sparse ones in ``.grad``), accumulating,
until a backward without hold.
"""
from __future__ import annotations

import contextlib
import sys
import time
import weakref
from typing import Any, Callable

import torch

from dpool import protocol as P
from dpool.sync_batchnorm import _set_collective
from dpool.tensors import Placer, read
from dpool.transport.shm import Mapped

__all__ = ["BackwardHandlers", "Call", "NO_GRAPH", "NotSpeculable", "BULK_GRAD_COPY_MAX"]

# Largest model (bytes of parameters) whose gradients a CPU worker copies to its slot in one pass after the
# backward instead of one hook call per parameter as each is accumulated (see the module's docstring).
BULK_GRAD_COPY_MAX = 64 << 20

_BACKWARD_TWICE = (
    "Trying to backward through the graph a second time (or directly access saved tensors after they have "
    "already been freed). Specify retain_graph=True if you need to backward through the graph a second time.")


class Call:
    """A forward's graph the coordinator may still backpropagate through."""

    __slots__ = ("outputs", "leaves", "world", "out", "n_out")

    def __init__(self, outputs: list[torch.Tensor], leaves: list[torch.Tensor | None], world: int,
                 out: Any = None) -> None:
        self.outputs = outputs  # the output tensors, then any losses computed on them (criterion)
        self.leaves = leaves
        self.world = world
        self.out = out  # the structured output, for criterion (gather=False)
        self.n_out = len(outputs)


# The call of a backward that only adds the gradients the worker holds (P.HELD_ONLY): no outputs, no leaves.
NO_GRAPH = Call([], [], 0)


class NotSpeculable(Exception):
    """A speculative backward (see ``LossHandlers._speculate``) made sparse gradients: left to the backward round."""


def _run_backward(roots: list[torch.Tensor], grads: list[torch.Tensor], retain_graph: bool) -> None:
    """``torch.autograd.backward(roots, grads, retain_graph=retain_graph)`` without its argument checks.

    The shapes and dtypes were checked by the coordinator's autograd. Skipping
    ``_make_grads`` also skips its lazy import of sympy, which costs over a
    second on a worker's first backward.
    """
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    if engine is None:  # pragma: no cover - other torch versions
        torch.autograd.backward(roots, grads, retain_graph=retain_graph)
        return
    engine.run_backward(tuple(roots), tuple(grads), retain_graph, False, (), allow_unreachable=True, accumulate_grad=True)


def _graph_kept() -> Any:
    """Around a backward that keeps the graph for dpool's own sake (a speculative one, which the backward round
    may run again; outputs kept here, which several nodes of the coordinator's graph may backpropagate in one
    backward, a round each), not because the script asked: a model compiled with AOTAutograd (``inductor``,
    ``aot_eager``) that donates its saved buffers refuses such a backward, so it runs without donating them.
    (Only where Dynamo is loaded: a compiled model brings it.)"""
    config = sys.modules.get("torch._functorch.config")
    return config.patch(donated_buffer=False) if config is not None else contextlib.nullcontext()


def _own_sparse_grads(params: list[torch.Tensor]) -> None:
    """Give each sparse ``.grad`` memory of its own. An embedding's sparse gradient views its indices (the
    input shard, in the ``in`` segment) and the gradient of its output (the ``gout`` segment, when it is the
    model's output): held across steps under ``no_sync()``, it changed when the coordinator placed the next
    step's shards there. (Coalescing an uncoalesced tensor makes new indices and values.)"""
    for p in params:
        g = p.grad
        if g is not None and g.is_sparse:
            p.grad = g.coalesce() if not g.is_coalesced() else g.clone()


class BackwardHandlers:
    """The backward requests of :class:`~.replica.Replica` (see the module's docstring)."""

    params: list[torch.nn.Parameter]
    grad_views: list[torch.Tensor]
    buffer_views: list[torch.Tensor]
    calls: dict[int, Call]
    unfetched_sparse: dict[int, list[tuple[int, torch.Tensor, torch.Tensor]]]
    on_gpu: bool
    stage: str
    notify: Callable[[P.Message], None] | None

    def _to_slot_hook(self, i: int) -> Callable[[torch.Tensor], None]:
        """Parameter ``i``'s post-accumulate hook: its gradient into the slot (and its bucket's count).

        The hook holds the replica weakly: parameter → hook → replica → parameter would be a cycle that
        keeps a detached client's model (and its mapped memory) alive until the garbage collector runs.
        """
        slot = self.grad_views[i]
        ref = weakref.ref(self)

        def hook(p: torch.Tensor) -> None:
            me: Any = ref()
            if me is None or not me._to_slot:  # create_graph, or autograd run by the model itself: .grad stays
                return
            g = p.grad
            if g is None or g.is_sparse:  # sparse gradients are collected after the backward
                return
            if me._written[i]:
                slot.add_(g)  # a second accumulation (no_sync, a parameter reused across checkpoints)
            else:
                slot.copy_(g)
                me._written[i] = 1
            p.grad = None
            me.buckets.landed(i, me.notify)

        return hook

    def backward(self, msg: P.Backward) -> P.Message:
        self.stage = f"running backward at step {msg.step}"
        t0 = time.monotonic()
        roots, grads = [], []
        if msg.call == P.HELD_ONLY:  # no shard of this batch: only the gradients held since no_sync() join it
            call, giseg = NO_GRAPH, None
        else:
            found = self.calls.get(msg.call)
            if found is None:
                raise RuntimeError(_BACKWARD_TWICE)
            call = found
            gseg = self._seg("gout", msg.grads)
            giseg = self._seg("gin", msg.input_grads)
            for t, meta in zip(call.outputs, msg.grad_tensors):
                if meta is not None and t is not None and t.requires_grad:
                    roots.append(t)
                    grads.append(read(gseg.views, meta))
        if msg.drop and self._holding:  # the loop cleared the master's gradients during no_sync()
            for i, flag in enumerate(msg.drop):
                if flag:
                    self.params[i].grad = None
                    self._written[i] = 0
        versions = self._buffer_versions()
        own = self._backward_flags(msg.requires_grad)
        try:
            if msg.keep_as and giseg is not None:
                done = self._backward_create_graph(msg=msg, call=call, roots=roots, grads=grads, giseg=giseg, t0=t0)
            else:
                done = self._backward(call_id=msg.call, call=call, roots=roots, grads=grads, giseg=giseg,
                                      gin_size=msg.input_grads[1], hold=msg.hold, sparse_ref=msg.sparse, t0=t0,
                                      retain_graph=msg.retain_graph)
        finally:
            self._backward_flags(own)
        if versions:
            self._put_back_assigned()  # (a hook assigned one: into its view, before the counters are read)
            done.buffers = self._changed_buffers(versions)
        return done

    def _buffer_versions(self) -> list[int]:
        """The buffers' version counters: a backward hook that updates one in place moves its counter (the
        refresh before a forward writes the views' memory through another tensor, which moves none)."""
        return [b._version for b in self.buffer_views]

    def _changed_buffers(self, versions: list[int]) -> list[int]:
        return [i for i, (b, v) in enumerate(zip(self.buffer_views, versions)) if b._version != v]

    def _backward_flags(self, flags: bytes) -> bytes:
        """Give the parameters ``flags`` (one process accumulates into those that require grad when the backward
        runs); returns what to give back afterwards. The slots are left alone: the next forward's flags decide
        which hold zeros."""
        if not flags or flags == self._flags_now:
            return self._flags_now
        before, self._flags_now = self._flags_now, flags
        for p, flag in zip(self.params, flags):
            p.requires_grad_(bool(flag))
        return before

    def _backward(self, call_id: int, call: Call, roots: list[torch.Tensor], grads: list[torch.Tensor],
                  giseg: Mapped | None, gin_size: int, hold: bool, sparse_ref: list, t0: float,
                  speculative: bool = False, retain_graph: bool = True) -> P.BackwardDone:
        """Backpropagate ``grads`` from ``roots``: parameter gradients into the slot (or held, ``hold``), input
        gradients into ``giseg`` (``gin_size`` bytes). ``speculative`` (a criterion's seed): no bucket reports,
        and sparse gradients raise :class:`NotSpeculable` instead of being written. ``retain_graph``: keep the
        graph for another backward (a speculative one always does: the backward round may run it again)."""
        if not self._holding:  # a fresh accumulation (a failed backward's partial one is dropped too)
            for p in self.params:
                p.grad = None
            self._written = bytearray(len(self.params))
        report = bool(self.buckets) and bool(roots) and not hold and not self.on_gpu and not speculative
        if report:  # count each bucket's parameters that take a gradient in this backward
            self.buckets.start(call_id, [p.requires_grad for p in self.params])
        if roots:
            self._enter_collective(call.world)
            self._to_slot = True
            try:
                with _graph_kept() if speculative or call.out is not None else contextlib.nullcontext():
                    _run_backward(roots, grads, retain_graph)
            finally:
                self._to_slot = False
                self.buckets.stop()
                _set_collective(None)
        mask = bytearray(len(self.params))
        sparse: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self._holding = hold  # no_sync: gradients stay here, accumulating, until a backward without hold
        if hold:  # (dense gradients went to the slot; sparse ones stay in .grad)
            _own_sparse_grads(self.params)
        else:
            self._to_slots(mask, sparse, speculative)
        smetas: list[Any] = []
        sparse_need = 0
        if sparse:
            smetas, sparse_need = self._write_sparse(sparse, sparse_ref)
            if sparse_need:
                self.unfetched_sparse[call_id] = sparse
        metas = self._input_grads(call, giseg, gin_size)
        self.stage = "idle"
        self._sync()
        return P.BackwardDone(call=call_id, param_mask=bytes(mask), input_grads=metas, busy=time.monotonic() - t0,
                              sparse=smetas, sparse_need=sparse_need, late=report and self.buckets.late, started=t0)

    def _to_slots(self, mask: bytearray, sparse: list, speculative: bool) -> None:
        """What is still in ``.grad`` goes to the slot (all of it when no hook copied as it came); sparse
        gradients to ``sparse``; ``mask`` says which parameters brought one (2: sparse)."""
        views, written = self.grad_views, self._written
        copy_to: list[torch.Tensor] = []
        copy_from: list[torch.Tensor] = []
        add_to: list[torch.Tensor] = []
        add_from: list[torch.Tensor] = []
        zero: list[torch.Tensor] = []
        for i, p in enumerate(self.params):
            if not p.requires_grad:
                continue
            g = p.grad
            if g is None:
                if written[i]:
                    mask[i] = 1
                else:
                    zero.append(views[i])
                continue
            p.grad = None
            if g.is_sparse:  # nn.Embedding(sparse=True): indices and values travel
                if speculative:
                    raise NotSpeculable()
                g = g.coalesce()
                sparse.append((i, g.indices(), g.values()))
                mask[i] = 2
                continue
            if written[i]:  # the hook took an earlier accumulation of this backward
                add_to.append(views[i])
                add_from.append(g)
            else:
                copy_to.append(views[i])
                copy_from.append(g)
            mask[i] = 1
        if copy_to:
            torch._foreach_copy_(copy_to, copy_from)
        if add_to:
            torch._foreach_add_(add_to, add_from)
        if zero:
            torch._foreach_zero_(zero)

    @staticmethod
    def _input_grads(call: Call, giseg: Mapped | None, gin_size: int) -> list[Any]:
        """The input leaves' gradients, into the ``gin`` segment: their metas."""
        placer = Placer()
        metas: list[Any] = []
        for leaf in call.leaves:
            if leaf is None or leaf.grad is None:
                metas.append(None)
                continue
            off = placer.reserve(leaf.grad)
            if giseg is None or placer.offset > gin_size:
                raise RuntimeError("input-gradient segment too small (coordinator bug)")
            metas.append(Placer.write(giseg.views, off, leaf.grad))
            leaf.grad = None
        return metas

    def _backward_create_graph(self, msg: P.Backward, call: Call, roots: list[torch.Tensor],
                               grads: list[torch.Tensor], giseg: Mapped, t0: float) -> P.Message:
        """``backward(create_graph=True)``: gradients that are themselves differentiable.

        The gradients' graph is kept as call ``msg.keep_as`` (see :class:`dpool.protocol.Backward`);
        the incoming gradients become leaves of it (copied: their segment is reused next step).
        """
        gleaves = [g.clone().requires_grad_(True) for g in grads]
        wanted = [p for p in self.params if p.requires_grad]
        inputs = [leaf for leaf in call.leaves if leaf is not None]
        results: list[Any] = [None] * (len(wanted) + len(inputs))
        if roots:
            self._enter_collective(call.world)
            try:
                with torch.enable_grad():
                    results = list(torch.autograd.grad(roots, wanted + inputs, gleaves, retain_graph=True,
                                                       create_graph=True, allow_unused=True))
            finally:
                _set_collective(None)
        held = self._take_held()
        mask = bytearray(len(self.params))
        k = 0
        for i, p in enumerate(self.params):
            if not p.requires_grad:
                continue
            r = results[k]
            k += 1
            if r is not None and r.is_sparse:
                raise RuntimeError("dpool does not support create_graph=True with sparse gradients")
            if held[i]:
                if r is not None:
                    self.grad_views[i].add_(r.detach())
                mask[i] = 1
            elif r is None:
                self.grad_views[i].zero_()
            else:
                self.grad_views[i].copy_(r.detach())
                mask[i] = 1
        placer = Placer()
        metas: list[Any] = []
        it = iter(results[len(wanted):])
        for leaf in call.leaves:
            r = next(it) if leaf is not None else None
            if r is None:
                metas.append(None)
                continue
            off = placer.reserve(r)
            if placer.offset > msg.input_grads[1]:
                raise RuntimeError("input-gradient segment too small (coordinator bug)")
            metas.append(Placer.write(giseg.views, off, r.detach()))
        self.calls[msg.keep_as] = Call(results, gleaves + list(call.leaves), call.world)
        self.stage = "idle"
        return P.BackwardDone(call=msg.call, param_mask=bytes(mask), input_grads=metas, busy=time.monotonic() - t0,
                              sparse=[], sparse_need=0, late=False, started=t0)

    def _take_held(self) -> bytearray:
        """no_sync() sums: in ``.grad``, or in the slot where a hook took them. Into the slot, where a
        create_graph backward's gradients add to them, as one process adds to ``.grad``: per parameter,
        whether its slot holds one."""
        held = self._written if self._holding else bytearray(len(self.params))
        if self._holding:
            for i, p in enumerate(self.params):
                g, p.grad = p.grad, None
                if g is None:
                    continue
                if g.is_sparse:
                    raise RuntimeError("dpool does not support create_graph=True after no_sync() with sparse "
                                       "gradients")
                if held[i]:
                    self.grad_views[i].add_(g)
                else:
                    self.grad_views[i].copy_(g)
                    held[i] = 1
        self._holding = False
        self._written = bytearray(len(self.params))
        return held

    def _write_sparse(self, sparse: list[tuple[int, torch.Tensor, torch.Tensor]], ref: list) -> tuple[list, int]:
        """Write sparse gradients into the segment ``ref``; (metas, 0), or ([], bytes needed) if too small."""
        placer = Placer()
        offs = [(placer.reserve(ix), placer.reserve(v)) for _, ix, v in sparse]
        if placer.offset > ref[1]:
            return [], placer.offset
        seg = self._seg("sparse", ref)
        return [[i, Placer.write(seg.views, oi, ix), Placer.write(seg.views, ov, v)]
                for (i, ix, v), (oi, ov) in zip(sparse, offs)], 0

    def fetch_sparse(self, msg: P.FetchSparse) -> P.Message:
        metas, need = self._write_sparse(self.unfetched_sparse.pop(msg.call), msg.sparse)
        if need:
            raise RuntimeError("sparse-gradient segment still too small (coordinator bug)")
        return P.FetchSparseDone(call=msg.call, sparse=metas)

    # set by Replica (see there)
    _holding: bool
    _to_slot: bool
    _written: bytearray
    _flags_now: bytes
    buckets: Any
    _seg: Callable[..., Mapped]
    _enter_collective: Callable[[int], None]
    _put_back_assigned: Callable[[], None]
    _sync: Callable[[], None]
