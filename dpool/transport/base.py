"""What every transport's regions share: alignment and cached tensor views over their bytes."""
from __future__ import annotations

import torch

__all__ = ["ALIGN", "align", "Views", "tensor_view"]

ALIGN = 64


def align(n: int) -> int:
    """``n`` rounded up to :data:`ALIGN` bytes (every tensor in a region starts aligned)."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


_MAX_CACHED_VIEWS = 1024


class Views:
    """Caches tensor views of a segment by (offset, dtype, shape).

    A training loop asks for the same views every step; building one costs three
    tensor ops, so the hot path reuses them instead.
    """

    __slots__ = ("u8", "_cache")

    def __init__(self, u8: torch.Tensor) -> None:
        self.u8 = u8
        self._cache: dict[tuple, torch.Tensor] = {}

    def view(self, offset: int, dtype: torch.dtype, shape: list[int] | tuple[int, ...]) -> torch.Tensor:
        key = (offset, dtype, tuple(shape))
        v = self._cache.get(key)
        if v is None:
            if len(self._cache) >= _MAX_CACHED_VIEWS:
                self._cache.clear()
            v = self._cache[key] = tensor_view(self.u8, offset, dtype, shape)
        return v


def tensor_view(u8: torch.Tensor, offset: int, dtype: torch.dtype, shape: list[int] | tuple[int, ...]) -> torch.Tensor:
    """A tensor of ``dtype``/``shape`` over bytes ``[offset, offset + nbytes)`` of ``u8``."""
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * dtype.itemsize
    return u8[offset : offset + nbytes].view(dtype).view(shape)
