"""The step plan: a forward like the previous one reuses what that one decided.

Most of a forward's bookkeeping re-derives what the previous forward already decided: the shard sizes,
where each shard's tensors go in its worker's input segment and their metas, the input gradients' sizes,
which parameters are differentiated, the shapes a backward checks, and the bytes counted. All of it
depends only on what :func:`signature` lists. The first forward of a signature builds a :class:`Plan`; a
later one whose signature equals it, field for field, runs the plan: it copies its tensors where the plan
says and sends messages whose fixed fields are the plan's, with this call's number, step, seed and release
list. A signature that differs in any field builds a new plan; no part of an old one is reused.

What each forward sends or checks afresh, whatever the plan: its own tree of arguments goes in its message
(the signature compares trees with ``==``, so ``1``, ``1.0`` and ``True`` are alike there, and nothing the
plan holds depends on those values); the re-sync check
(``Master.touched()``), the bindings, the numerics and the flags run before the signature is taken; and
where a shard's inputs land in its segment depends on the graphs still alive, so a shard whose
``(segment, start)`` is not the plan's gets its metas and views made again (:class:`Placements`, which
also keeps the latest placement of each shard's targets and output gradients).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..tensors import Placer, check_tensor, describe, transportable

__all__ = ["FIELDS", "signature", "Plan", "Plans", "Placements", "shapes_of"]

# The signature's fields, in the order signature() returns them, and why each is there.
FIELDS = (
    # the (args, kwargs) tree: which leaves are tensors, and in what order the plan's lists index them
    "structure",
    # per input tensor its dtype, device and shape, and whether it requires grad under this grad mode:
    # the shard sizes, each tensor's offset and meta, the bytes, which inputs are differentiable
    "tensors",
    # grad mode and inference mode: a graph kept or not, the parameters differentiated, the versions recorded
    "grad",
    "inference",
    # the workers' autocast (device type, dtype, cache), sent in the message
    "autocast",
    # every submodule's train/eval flag, sent in the message
    "training",
    # every parameter's requires_grad: sent, and which parameters the bridge differentiates
    "requires_grad",
    # the replicas' version: moved by every shipping (wrap, a re-sync after a change to the model: a new
    # parameter, submodule, attribute or hook, which Master.touched() sees) and by every restart
    "model",
    # the shares the batch is split by (balance= weights, or "auto"'s latest measure; None: even shards)
    "shares",
    # buffers travel with the forward (the model has buffers, under the buffer policy of wrap())
    "buffers",
    # inside no_sync(): the backward that follows holds its gradients on the workers
    "no_sync",
    # cross-node: the nodes take part in this forward (a synced call) or not
    "synced",
)


def signature(spec: Any, tensors: Sequence[torch.Tensor], grad: bool, autocast: list | None, training: bytes,
              requires_grad: bytes, model: int, shares: Sequence[float] | None, buffers: bool, no_sync: bool,
              synced: bool) -> tuple:
    """This forward's signature (see :data:`FIELDS`). Raises ``TypeError`` for an input dpool cannot
    transport, as the shard plan did (a tensor's kind is checked at every forward, plan or not)."""
    for i, t in enumerate(tensors):
        if not transportable(t):
            check_tensor(t, f"input tensor {i}")
    return (spec, tuple([(t.dtype, t.device, t.shape, grad and t.requires_grad) for t in tensors]), grad,
            torch.is_inference_mode_enabled(), autocast, training, requires_grad, model,
            None if shares is None else tuple(shares), buffers, no_sync, synced)


@dataclass(slots=True, kw_only=True, eq=False)
class Plan:
    """What a forward of one signature decided, for the next forwards of that signature.

    Args:
        key: the signature.
        k: the number of shards.
        splits: per input tensor its shard sizes (``None``: given whole).
        rg: per input tensor, whether it requires grad.
        needs: per shard, the bytes its tensors take in its input segment.
        gin_sizes: per shard, the bytes of its input gradients.
        diff_idx: the parameters the bridge differentiates (none without grad mode).
        shapes: per shard, its tensors' shapes.
        nbytes: the input bytes of every shard together.
    """

    key: tuple
    k: int
    splits: list
    rg: list[bool]
    needs: list[int]
    gin_sizes: list[int]
    diff_idx: list[int]
    shapes: list[list[torch.Size]]
    nbytes: int
    inputs: Placements = field(init=False)  # the shards' inputs (their dtypes and shapes are the signature's)

    def __post_init__(self) -> None:
        self.inputs = Placements(self.k)


class Placements:
    """Per shard, the latest placement of some of its tensors in a segment (its inputs, its targets, its
    output gradients): their layout, metas and the views they are copied into, made again when the
    tensors' dtypes and shapes (``key``), the segment or the start differ."""

    __slots__ = ("_placed",)

    def __init__(self, k: int) -> None:
        # per shard: (key, offsets, bytes, segment, start, metas, destination views)
        self._placed: list[tuple | None] = [None] * k

    def place(self, s: int, tensors: Sequence[torch.Tensor | None], region: Callable[[int], tuple[Any, int]],
              key: Any = None, rg: Sequence[bool] | None = None) -> tuple[list, Any, int, int]:
        """Copy shard ``s``'s ``tensors`` (``None`` stays ``None``) into the segment ``region(bytes)`` gives,
        from the start it gives: ``(metas, segment, start, bytes)``. ``key`` stands for the tensors' dtypes
        and shapes (:func:`shapes_of` when the caller knows no better); ``rg`` is sent in the metas."""
        placed = self._placed[s]
        if placed is not None and placed[0] == key:
            offs, need = placed[1], placed[2]
        else:
            placed = None
            placer = Placer()
            offs = [placer.reserve(t) if t is not None else None for t in tensors]
            need = placer.offset
        seg, start = region(need)
        if placed is None or placed[3] is not seg or placed[4] != start:
            flags = rg if rg is not None else [False] * len(tensors)
            metas = [describe(t, start + o, r) if t is not None and o is not None else None
                     for o, t, r in zip(offs, tensors, flags)]
            dests = [seg.views.view(start + o, t.dtype, m.shape) if m is not None and t is not None and t.numel()
                     else None for o, t, m in zip(offs, tensors, metas)]
            placed = self._placed[s] = (key, offs, need, seg, start, metas, dests)
        for d, t in zip(placed[6], tensors):
            if d is not None:  # (detached only where autograd would record the copy, as Placer.write)
                d.copy_(t.detach() if t.requires_grad else t)  # type: ignore[union-attr]
        return placed[5], seg, start, need

    def clear(self) -> None:
        """Forget every placement (the segments they view are gone: a close)."""
        self._placed = [None] * len(self._placed)


def shapes_of(tensors: Sequence[torch.Tensor | None]) -> tuple:
    """The key of :meth:`Placements.place` for ``tensors``: their dtypes and shapes."""
    return tuple([None if t is None else (t.dtype, t.shape) for t in tensors])


class Plans:
    """The latest plan; ``counts`` (``Stats.plan``) says how often a forward ran one (``hits``) or built one
    (``rebuilds``), and why the latest was built (``last_rebuild``: the first field of the signature that
    differed)."""

    __slots__ = ("plan", "counts")

    def __init__(self, counts: dict) -> None:
        self.plan: Plan | None = None
        self.counts = counts

    def get(self, key: tuple) -> Plan | None:
        """The plan of signature ``key``, or ``None`` (the caller builds one, then :meth:`keep`)."""
        plan = self.plan
        if plan is not None and plan.key == key:
            self.counts["hits"] += 1
            return plan
        return None

    def keep(self, plan: Plan) -> None:
        """``plan`` was built for a forward whose signature no plan had: it is the latest now."""
        old = self.plan
        self.counts["last_rebuild"] = "first forward" if old is None else next(
            (name for name, a, b in zip(FIELDS, old.key, plan.key) if a != b), "signature")
        self.counts["rebuilds"] += 1
        self.plan = plan

    def clear(self) -> None:
        """Forget the plan and its placements (they view the input segments, which are gone: a close)."""
        if self.plan is not None:
            self.plan.inputs.clear()
        self.plan = None


def need(shard: Sequence[torch.Tensor]) -> int:
    """The bytes ``shard``'s tensors take laid out back to back."""
    placer = Placer()
    for t in shard:
        placer.reserve(t)
    return placer.offset
