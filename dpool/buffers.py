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

In cross-node mode ``"average"`` and ``"sync"`` are global: each node packs its shards'
row-weighted buffer sums and BatchNorm moments into one float64 vector, the nodes sum it
(``across``), and every node writes the same result. The master is only written after that
all-reduce succeeded. (``"first"`` takes rank 0's buffers before every training forward; see
:mod:`dpool.crossnode`.)
"""
from __future__ import annotations

from typing import Callable, Sequence

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
               sizes: Sequence[int], counts: Sequence[list[int]], training: Sequence[bool],
               across: Callable[[torch.Tensor], None] | None = None) -> None:
        """Write the shards' buffer updates to the master.

        Args:
            slots: per shard, views of its private buffers.
            sizes: per shard, its number of rows (weights for ``"average"``).
            counts: per shard, values normalised by each BatchNorm (``"sync"`` only).
            training: per BatchNorm, whether it was in training mode for this forward.
            across: cross-node mode: sums a float64 vector with the other nodes' in place.
        """
        if across is not None and self.policy != "first":
            self._commit_across(slots, sizes, counts, training, across)
            return
        if self.policy == "first" or len(slots) == 1:
            master_bytes.copy_(first_bytes)
            return
        dev = master_bytes.device
        if any(sl and sl[0].device != dev for sl in slots):  # replicas on other GPUs
            slots = [[t.to(dev) for t in sl] for sl in slots]
        done: set[int] = set()
        if self.policy == "sync":
            for j, (bn, im, iv, inb) in enumerate(self.batchnorms):
                if not training[j]:
                    continue
                self._sync_bn(bn=bn, im=im, iv=iv, inb=inb, slots=slots, counts=[c[j] for c in counts])
                done.update((im, iv) if inb is None else (im, iv, inb))
        for i in range(len(self.master_views)):
            if i not in done:
                self._mean_of_shards(i, slots, sizes)

    def _mean_of_shards(self, i: int, slots: Sequence[list[torch.Tensor]], sizes: Sequence[int]) -> None:
        """Buffer ``i`` of the master := the row-weighted mean of the shards' (floating point), else the first's."""
        master = self.master_views[i]
        if not (master.is_floating_point() or master.is_complex()):
            master.copy_(slots[0][i])
            return
        total = float(sum(sizes))
        acc = slots[0][i].to(master.device) * (sizes[0] / total)
        for s in range(1, len(slots)):
            acc.add_(slots[s][i].to(master.device), alpha=sizes[s] / total)
        master.copy_(acc)

    def commit_changed(self, changed: Sequence[int], master_bytes: torch.Tensor, first_bytes: torch.Tensor,
                       slots: Sequence[list[torch.Tensor]], sizes: Sequence[int] | None) -> None:
        """Write what a backward changed in the shards' buffers (a module's backward hook; a forward run again
        by ``torch.utils.checkpoint``). ``changed``: the buffers whose version counters moved.

        Under ``"first"`` every buffer of the first shard is copied, as after a forward, since some
        updates move no counter: BatchNorm's kernel updates its running statistics in place without one
        (its ``num_batches_tracked``, updated in Python, does move). Under ``"average"`` and ``"sync"`` the
        changed buffers only: the row-weighted mean of the shards' floating-point ones, the first shard's
        others; the rest keep what the forward's commit gave them (``"sync"``'s exact statistics).
        ``sizes``: the shards' rows (``None``: the first shard's, as for a higher-order backward).
        """
        if self.policy == "first" or len(slots) == 1 or sizes is None:
            master_bytes.copy_(first_bytes)
            return
        for i in sorted(set(changed)):
            self._mean_of_shards(i, slots, sizes)

    def _shard_moments(self, bn: nn.modules.batchnorm._BatchNorm, im: int, iv: int, inb: int | None,
                       slots: Sequence[list[torch.Tensor]], counts: list[int]
                       ) -> tuple[float, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each shard's batch mean and biased variance, recovered from its momentum update of the master's
        statistics: ``(momentum factor, counts, means, biased variances)``, in float64."""
        old_mean = self.master_views[im].double()
        old_var = self.master_views[iv].double()
        if bn.momentum is None:  # cumulative moving average: factor 1 / num_batches_tracked
            assert inb is not None
            f = 1.0 / float(slots[0][inb])
        else:
            f = bn.momentum
        c = torch.tensor([float(x) for x in counts], dtype=torch.float64, device=old_mean.device)
        means = torch.stack([(s[im].double() - (1 - f) * old_mean) / f for s in slots])
        var_unbiased = torch.stack([(s[iv].double() - (1 - f) * old_var) / f for s in slots])
        return f, c, means, var_unbiased * ((c - 1) / c).view(-1, 1)

    def _sync_bn(self, bn: nn.modules.batchnorm._BatchNorm, im: int, iv: int, inb: int | None,
                 slots: Sequence[list[torch.Tensor]], counts: list[int]) -> None:
        f, c, means, var_biased = self._shard_moments(bn=bn, im=im, iv=iv, inb=inb, slots=slots, counts=counts)
        old_mean = self.master_views[im].double()
        old_var = self.master_views[iv].double()
        n = c.sum()
        w = (c / n).view(-1, 1)
        mean = (w * means).sum(0)
        var = (w * (var_biased + (means - mean) ** 2)).sum(0) * (n / (n - 1))
        self.master_views[im].copy_((1 - f) * old_mean + f * mean)
        self.master_views[iv].copy_((1 - f) * old_var + f * var)
        if inb is not None:
            self.master_views[inb].copy_(slots[0][inb])

    def _commit_across(self, slots: Sequence[list[torch.Tensor]], sizes: Sequence[int], counts: Sequence[list[int]],
                       training: Sequence[bool], across: Callable[[torch.Tensor], None]) -> None:
        """``"average"`` and ``"sync"`` over every shard of every node: sums, one all-reduce, then the master."""
        dev = self.master_views[0].device if self.master_views else torch.device("cpu")
        slots = [[t.to(dev) for t in sl] for sl in slots]
        parts: list[torch.Tensor] = [torch.tensor([float(sum(sizes))], dtype=torch.float64, device=dev)]
        bns: list[tuple[int, nn.modules.batchnorm._BatchNorm, int, int, int | None, float]] = []
        done: set[int] = set()
        if self.policy == "sync":
            for j, (bn, im, iv, inb) in enumerate(self.batchnorms):
                if not training[j]:
                    continue
                f, c, means, var_b = self._shard_moments(bn=bn, im=im, iv=iv, inb=inb, slots=slots,
                                                         counts=[c[j] for c in counts])
                cw = c.view(-1, 1)
                parts += [c.sum().view(1), (cw * means).sum(0), (cw * (var_b + means ** 2)).sum(0)]
                bns.append((len(parts) - 3, bn, im, iv, inb, f))
                done.update((im, iv) if inb is None else (im, iv, inb))
        floats = []
        for i, master in enumerate(self.master_views):
            if i in done or not master.is_floating_point():
                continue
            acc = slots[0][i].double().reshape(-1) * sizes[0]
            for s in range(1, len(slots)):
                acc.add_(slots[s][i].double().reshape(-1), alpha=sizes[s])
            parts.append(acc)
            floats.append((len(parts) - 1, i))
        vec = torch.cat(parts)
        across(vec)  # may raise: the master is untouched until here
        bounds = [0]
        for p in parts:
            bounds.append(bounds[-1] + p.numel())
        piece = [vec[bounds[k]:bounds[k + 1]] for k in range(len(parts))]
        rows = piece[0][0]
        for k, bn, im, iv, inb, f in bns:
            n = piece[k][0]
            mean = piece[k + 1] / n
            var = (piece[k + 2] / n - mean ** 2) * (n / (n - 1))
            old_mean, old_var = self.master_views[im].double(), self.master_views[iv].double()
            self.master_views[im].copy_((1 - f) * old_mean + f * mean)
            self.master_views[iv].copy_((1 - f) * old_var + f * var)
            if inb is not None:
                self.master_views[inb].copy_(slots[0][inb])
        for k, i in floats:
            self.master_views[i].copy_((piece[k] / rows).view(self.master_views[i].shape))
        for i, master in enumerate(self.master_views):
            if i not in done and not master.is_floating_point():
                master.copy_(slots[0][i])  # num_batches_tracked and other integer buffers: the first shard's
