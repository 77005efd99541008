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

__all__ = ["even_sizes", "weighted_sizes", "plan", "Balancer"]


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
        else:  # one call for all the views (k narrows cost four times as much)
            for s, view in enumerate(torch.split_with_sizes(t, sizes, dim)):
                out[s].append(view)
    return out


class Balancer:
    """Each worker's share of the batch: fixed ``weights``, measured (``balance="auto"``), or even.

    ``"auto"`` keeps an exponential moving average of each worker's seconds per row in forward and
    backward, and gives it a share inversely proportional to their sum (a slower device gets fewer rows).
    """

    def __init__(self, n: int, weights: Sequence[float] | None = None, balance: str | None = None) -> None:
        if weights is not None:
            if len(weights) != n or any(not w > 0 for w in weights):
                raise DpoolValueError(f"shard_weights needs {n} positive numbers (one per worker), got {weights!r}")
            if balance is not None:
                raise DpoolValueError("give either shard_weights or balance='auto', not both")
        if balance not in (None, "auto"):
            raise DpoolValueError(f"balance={balance!r}: the only balancing mode is 'auto'")
        self._weights = [float(w) for w in weights] if weights is not None else None
        self.measuring = balance == "auto"
        self._rates = [[0.0, 0.0] for _ in range(n)]  # EMA seconds per row: forward, backward

    def observe(self, phase: int, busy: Sequence[float], rows: Sequence[int]) -> None:
        """The time each shard's handler took in ``phase`` (0 forward, 1 backward) for its ``rows``."""
        if not self.measuring:
            return
        for w, (b, r) in enumerate(zip(busy, rows)):
            rate = b / max(r, 1)
            old = self._rates[w][phase]
            self._rates[w][phase] = rate if old == 0.0 else 0.7 * old + 0.3 * rate

    def weights(self) -> list[float] | None:
        """The shares to split by, or ``None`` for even shards."""
        if self._weights is not None:
            return self._weights
        if self.measuring and all(r[0] > 0 for r in self._rates):
            return [1.0 / (r[0] + r[1]) for r in self._rates]
        return None
