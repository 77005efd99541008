"""What every transport's regions share: alignment and cached tensor views over their bytes."""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["ALIGN", "align", "Views", "tensor_view", "standalone"]

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


def standalone(storage: Any, device: torch.device, offset: int, dtype: torch.dtype, shape: list[int] | tuple[int, ...],
               strides: list[int] | None = None) -> torch.Tensor:
    """A tensor over bytes ``offset..`` of ``storage`` with its *own* TensorImpl (and version counter).

    Like :func:`dpool.transport.shm.standalone_view`: BatchNorm's in-place update of one buffer must not
    invalidate another tensor saved for backward. Any device: CUDA arenas build their tensors with it, and
    a plain tensor attribute that views a parameter is rebuilt over the parameter's memory with it.
    """
    t = torch.empty(0, dtype=dtype, device=device)
    shape = list(shape)
    if strides is None:
        strides = list(torch.empty(shape, device="meta").stride())
    numel = 1
    for s in shape:
        numel *= s
    if numel == 0:
        return torch.empty(shape, dtype=dtype, device=device)
    return t.set_(storage, offset // dtype.itemsize, shape, strides)
