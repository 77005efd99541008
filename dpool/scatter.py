"""Scatter: split the call's arguments into shards, one per worker.

Rules (``nn.DataParallel``'s, with its sharp edges fixed):

* Every tensor with more than ``dim`` dimensions is split along ``dim``.
* Shards are as even as possible: sizes differ by at most one and no shard is
  empty (``chunk`` would turn 9 rows on 4 devices into 3, 3, 3). A batch
  smaller than the worker count uses fewer workers.
* Tensors with ``dim`` or fewer dimensions (e.g. 0-dim) and every non-tensor
  value are given whole to every shard. Each worker decodes its own copy, so
  shards never share a mutable object.
* With no splittable tensor at all, the module runs once, on worker 0.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from .tensors import check_tensor
from .errors import DpoolValueError

__all__ = ["even_sizes", "weighted_sizes", "plan"]


def even_sizes(n: int, k: int) -> list[int]:
    """``n`` rows in ``k`` shards whose sizes differ by at most one."""
    base, extra = divmod(n, k)
    return [base + 1 if i < extra else base for i in range(k)]


def weighted_sizes(n: int, weights: Sequence[float]) -> list[int]:
    """``n`` rows split in proportion to ``weights`` (largest remainder), each shard ≥ 1."""
    k = len(weights)
    total = float(sum(weights))
    raw = [n * w / total for w in weights]
    sizes = [max(1, int(r)) for r in raw]
    while sum(sizes) > n:
        i = max(range(k), key=lambda j: (sizes[j] - raw[j], sizes[j]))
        if sizes[i] <= 1:
            break
        sizes[i] -= 1
    while sum(sizes) < n:
        i = max(range(k), key=lambda j: raw[j] - sizes[j])
        sizes[i] += 1
    return sizes


def plan(
    tensors: list[torch.Tensor], n_workers: int, dim: int, weights: Sequence[float] | None = None
) -> tuple[int, list[list[int] | None]]:
    """Decide the shard count and, per tensor, its split sizes (``None``: give it whole).

    Raises:
        ValueError: on an empty batch.
        TypeError: on a tensor dpool cannot transport.
    """
    splits: list[list[int] | None] = []
    lengths = []
    for i, t in enumerate(tensors):
        check_tensor(t, f"input tensor {i}")
        if t.dim() > dim:
            lengths.append(t.size(dim))
    if not lengths:
        return 1, [None] * len(tensors)
    smallest = min(lengths)
    if smallest == 0:
        raise DpoolValueError(
            f"dpool cannot scatter an empty batch: an input tensor has size 0 along dim {dim}. "
            "Skip empty batches (e.g. DataLoader(drop_last=True)) or call the module directly."
        )
    k = min(n_workers, smallest)
    if weights is not None and k == n_workers:
        cut = lambda n: weighted_sizes(n, weights)  # noqa: E731
    else:
        cut = lambda n: even_sizes(n, k)  # noqa: E731
    for t in tensors:
        splits.append(cut(t.size(dim)) if t.dim() > dim else None)
    return k, splits


def shard_views(tensors: list[torch.Tensor], splits: list[list[int] | None], k: int, dim: int) -> list[list[Any]]:
    """Per shard, the list of tensors (views, no copy) it receives."""
    out: list[list[Any]] = [[] for _ in range(k)]
    for t, sizes in zip(tensors, splits):
        if sizes is None:
            for s in range(k):
                out[s].append(t)
        else:
            start = 0
            for s, n in enumerate(sizes):
                out[s].append(t.narrow(dim, start, n))
                start += n
    return out
