"""The step plan: a forward like the previous one reuses what that one decided.

Most of a forward's bookkeeping re-derives what the previous forward already decided: the shard sizes,
where each shard's tensors go in its worker's input segment and their metas, the input gradients' sizes,
which parameters are differentiated, the shapes a backward checks, and the bytes counted. All of it
depends only on what :func:`signature` lists. The first forward of a signature builds a :class:`Plan`; a
later one whose signature equals it, field for field, runs the plan: it copies its tensors where the plan
says and sends messages whose fixed fields are the plan's, with this call's number, step, seed and release
list. A signature that differs in any field builds a new plan; no part of an old one is reused.

What is not in the signature is what each forward sends or checks afresh whatever the plan: the tree of
its arguments (non-tensor values included) goes in its own message; the re-sync check
(``Master.touched()``), the bindings, the numerics and the flags run before the signature is taken; and
where a shard's inputs land in its segment depends on the graphs still alive, so a shard whose
``(segment, start)`` is not the plan's gets its metas and views made again (:meth:`Plan.placed_at`).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from ..tensors import Placer, check_tensor, describe, transportable

__all__ = ["FIELDS", "signature", "Plan", "Plans"]

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


class Plan:
    """What a forward of one signature decided, for the next forwards of that signature.

    Args:
        key: the signature.
        k: the number of shards.
        splits: per input tensor its shard sizes (``None``: given whole).
        rg: per input tensor, whether it requires grad.
        layouts: per shard, its tensors' offsets from its start, and the bytes they take.
        gin_sizes: per shard, the bytes of its input gradients.
        diff_idx: the parameters the bridge differentiates (none without grad mode).
        shapes: per shard, its tensors' shapes.
        nbytes: the input bytes of every shard together.
    """

    __slots__ = ("key", "k", "splits", "rg", "layouts", "gin_sizes", "diff_idx", "shapes", "nbytes", "_placed")

    def __init__(self, key: tuple, k: int, splits: list, rg: list[bool], layouts: list[tuple[list, int]],
                 gin_sizes: list[int], diff_idx: list[int], shapes: list[list[torch.Size]], nbytes: int) -> None:
        self.key, self.k, self.splits, self.rg, self.layouts = key, k, splits, rg, layouts
        self.gin_sizes, self.diff_idx, self.shapes, self.nbytes = gin_sizes, diff_idx, shapes, nbytes
        # per shard: (segment, start, metas, destination views) of the latest placement
        self._placed: list[tuple[Any, int, list, list] | None] = [None] * k

    def place(self, s: int, seg: Any, start: int, shard: Sequence[torch.Tensor]) -> list:
        """Copy shard ``s``'s tensors into ``seg`` from ``start``, where the plan lays them out: their metas."""
        placed = self._placed[s]
        if placed is None or placed[0] is not seg or placed[1] != start:
            offs = self.layouts[s][0]
            metas = [describe(t, start + o, r) for o, t, r in zip(offs, shard, self.rg)]
            dests = [seg.views.view(start + o, t.dtype, m.shape) if t.numel() else None
                     for o, t, m in zip(offs, shard, metas)]
            placed = self._placed[s] = (seg, start, metas, dests)
        for d, t in zip(placed[3], shard):
            if d is not None:  # (detached only where autograd would record the copy, as Placer.write)
                d.copy_(t.detach() if t.requires_grad else t)
        return placed[2]

    def forget_placements(self) -> None:
        """Drop the views of the segments (they are being replaced or closed)."""
        self._placed = [None] * self.k


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
        """Forget the plan (the segments it views are gone: a close)."""
        self.plan = None


def layout(shard: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    """Offsets of ``shard``'s tensors laid out back to back, and the bytes they take."""
    placer = Placer()
    return [placer.reserve(t) for t in shard], placer.offset
