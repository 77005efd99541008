"""Gradient reduction: the workers' gradient slots → the master's parameter gradients.

Each worker's backward writes its parameter gradients into its *gradient slot*,
laid out like the master's parameters (:class:`dpool.layout.Layout`): one dense
range per dtype group. Reducing is one sum per group over the shards that ran,
on the master's device (DataParallel's ``reduce_add``), then a view per
parameter in its own memory format. Sparse gradients (``nn.Embedding(sparse=True)``)
are summed as sparse tensors, as DataParallel's reduce does.

:class:`Reducer` is the seam: a reducer that also combines the groups across
nodes (an all-reduce over ``torch.distributed``) overrides :meth:`Reducer.across`,
which receives every group's local sum, in a fixed order, before any parameter
sees a gradient.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .layout import Layout

__all__ = ["Reducer", "sum_sparse"]


class Reducer:
    """Sums dense gradient slots, one op per dtype group.

    Args:
        layout: where each parameter's gradient lies in a slot.
        params: the master's parameters (shapes, element sizes).
        strides: each parameter's memory-format strides (``None``: row-major).
        device: where the sum is made and the gradients live (the master's device).
    """

    def __init__(self, layout: Layout, params: Sequence[torch.Tensor], strides: Sequence[Sequence[int] | None],
                 device: torch.device) -> None:
        self.layout = layout
        self.params = list(params)
        self.strides = list(strides)
        self.device = device

    def reduce(self, slots: Sequence[Sequence[torch.Tensor]], used: Sequence[bytes]) -> list[torch.Tensor | None]:
        """The master's gradients, summed over shards.

        Args:
            slots: per shard that ran, its gradient slot's view of each dtype group.
            used: per shard, one byte per parameter: 1 where the shard produced a gradient.

        Returns:
            one gradient per parameter; ``None`` for a parameter no shard produced a gradient for.
        """
        mask = bytearray(len(self.params))
        for m in used:
            for i, b in enumerate(m):
                if b == 1:
                    mask[i] = 1
        groups = [g for g, (_, _, _, idxs) in enumerate(self.layout.param_groups) if any(mask[i] for i in idxs)]
        totals = self.across([self._sum([s[g] for s in slots]) for g in groups], groups)
        grads: list[torch.Tensor | None] = [None] * len(self.params)
        for g, total in zip(groups, totals):
            _, start, _, idxs = self.layout.param_groups[g]
            for i in idxs:
                if mask[i]:
                    p = self.params[i]
                    a = (self.layout.param_offsets[i] - start) // p.element_size()
                    st = self.strides[i]  # the gradient in the parameter's memory format
                    grads[i] = total.as_strided(p.shape, st, a) if st else total[a:a + p.numel()].view(p.shape)
        return grads

    def _sum(self, views: list[torch.Tensor]) -> torch.Tensor:
        """One group's sum over shards, in new memory on :attr:`device` (the slots are reused next step)."""
        views = [v.to(self.device) for v in views]  # replicas on other GPUs: summed on the master's (no-op here)
        total = torch.add(views[0], views[1]) if len(views) > 1 else views[0].clone()
        for v in views[2:]:
            total.add_(v)
        return total

    def across(self, totals: list[torch.Tensor], groups: list[int]) -> list[torch.Tensor]:
        """Combine this process's group sums with other processes' (none here: returned as they are).

        Args:
            totals: the local sum of each group in ``groups``, to be combined in place or replaced.
            groups: the indices (into ``layout.param_groups``) of the groups that have gradients.
        """
        return totals


def sum_sparse(grads: list[torch.Tensor | None], parts: Sequence[tuple[int, torch.Tensor, torch.Tensor]],
               params: Sequence[torch.Tensor], device: torch.device) -> None:
    """Add sparse gradient ``parts`` (parameter index, indices, values) into ``grads``, in place."""
    for i, indices, values in parts:
        part = torch.sparse_coo_tensor(indices.to(device, copy=True), values.to(device, copy=True),
                                       params[i].shape, check_invariants=False)
        g = grads[i]
        grads[i] = part if g is None else g + part
