"""How replica buffer updates reach the master: the ``buffers=`` policy of :func:`dpool.wrap`.

Every forward starts each replica from the master's buffers. After every shard succeeded:

``"first"`` (default, DataParallel's)
    the first shard's buffers are copied to the master; the other shards' updates are dropped.
``"average"``
    floating-point buffers become the mean of the shards' buffers, weighted by shard size;
    integer buffers (``num_batches_tracked``) come from the first shard.
``"sync"``
    BatchNorm running statistics become exactly those of one BatchNorm over the *whole* batch:
    each shard's batch mean and variance are recovered from its momentum update, combined with
    the between-shard term, and the momentum update is applied once. Other floating-point
    buffers are averaged as in ``"average"``. (With :func:`dpool.convert_sync_batchnorm` every
    shard already sees full-batch statistics, and all three policies agree.)
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from .errors import DpoolValueError
from .transport import tensor_view

__all__ = ["POLICIES", "BufferCommit"]

POLICIES = ("first", "average", "sync")


class BufferCommit:
    """Commits replica buffers to the master after a successful forward."""

    def __init__(self, policy: str, module: nn.Module, buffers: list[torch.Tensor], offsets: list[int],
                 master_views: list[torch.Tensor]) -> None:
        if policy not in POLICIES:
            raise DpoolValueError(f"buffers={policy!r}: choose one of {', '.join(POLICIES)}")
        self.policy = policy
        self.buffers = buffers
        self.offsets = offsets
        self.master_views = master_views
        index = {id(b): i for i, b in enumerate(buffers)}
        # (module, running_mean idx, running_var idx, num_batches_tracked idx or None), in modules() order
        self.batchnorms: list[tuple[nn.modules.batchnorm._BatchNorm, int, int, int | None]] = []
        for m in module.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None:
                nbt = index.get(id(m.num_batches_tracked)) if m.num_batches_tracked is not None else None
                self.batchnorms.append((m, index[id(m.running_mean)], index[id(m.running_var)], nbt))

    @property
    def needs_counts(self) -> bool:
        """Whether workers must report how many values each BatchNorm normalised."""
        return self.policy == "sync" and bool(self.batchnorms)

    def slot_views(self, u8: torch.Tensor) -> list[torch.Tensor]:
        return [tensor_view(u8, off, b.dtype, b.shape) for b, off in zip(self.buffers, self.offsets)]

    def commit(self, master_bytes: torch.Tensor, first_bytes: torch.Tensor, slots: Sequence[list[torch.Tensor]],
               sizes: Sequence[int], counts: Sequence[list[int]], training: Sequence[bool]) -> None:
        """Write the shards' buffer updates to the master.

        Args:
            slots: per shard, views of its private buffers.
            sizes: per shard, its number of rows (weights for ``"average"``).
            counts: per shard, values normalised by each BatchNorm (``"sync"`` only).
            training: per BatchNorm, whether it was in training mode for this forward.
        """
        if self.policy == "first" or len(slots) == 1:
            master_bytes.copy_(first_bytes)
            return
        dev = master_bytes.device
        if any(sl and sl[0].device != dev for sl in slots):  # replicas on other GPUs
            slots = [[t.to(dev) for t in sl] for sl in slots]
        total = float(sum(sizes))
        done: set[int] = set()
        if self.policy == "sync":
            for j, (bn, im, iv, inb) in enumerate(self.batchnorms):
                if not training[j]:
                    continue
                self._sync_bn(bn, im, iv, inb, slots, [c[j] for c in counts])
                done.update((im, iv) if inb is None else (im, iv, inb))
        for i, master in enumerate(self.master_views):
            if i in done:
                continue
            if master.is_floating_point() or master.is_complex():
                acc = slots[0][i] * (sizes[0] / total)
                for s in range(1, len(slots)):
                    acc.add_(slots[s][i], alpha=sizes[s] / total)
                master.copy_(acc)
            else:
                master.copy_(slots[0][i])

    def _sync_bn(self, bn: nn.modules.batchnorm._BatchNorm, im: int, iv: int, inb: int | None,
                 slots: Sequence[list[torch.Tensor]], counts: list[int]) -> None:
        old_mean = self.master_views[im].double()
        old_var = self.master_views[iv].double()
        if bn.momentum is None:  # cumulative moving average: factor 1 / num_batches_tracked
            assert inb is not None
            f = 1.0 / float(slots[0][inb])
        else:
            f = bn.momentum
        c = torch.tensor(counts, dtype=torch.float64, device=old_mean.device)
        means = torch.stack([(s[im].double() - (1 - f) * old_mean) / f for s in slots])
        var_unbiased = torch.stack([(s[iv].double() - (1 - f) * old_var) / f for s in slots])
        var_biased = var_unbiased * ((c - 1) / c).view(-1, 1)
        n = c.sum()
        w = (c / n).view(-1, 1)
        mean = (w * means).sum(0)
        var = (w * (var_biased + (means - mean) ** 2)).sum(0) * (n / (n - 1))
        self.master_views[im].copy_((1 - f) * old_mean + f * mean)
        self.master_views[iv].copy_((1 - f) * old_var + f * var)
        if inb is not None:
            self.master_views[inb].copy_(slots[0][inb])
