"""Where the master's parameters and buffers lie in the shared parameter segment.

Parameters come first, grouped by dtype so that one dtype's gradients form one
dense range (summed across workers in a single op), then buffers. A parameter
keeps its own memory format (``channels_last`` stays ``channels_last``); its
gradient slot uses the same strides; buffers are laid out row-major. Each group
starts 64-byte aligned. Workers' state segments use the same offsets: the
parameter range holds that worker's gradients, the buffer range its private
buffers.
"""
from __future__ import annotations

import torch

from .tensors import dense_strides, dtype_name, nbytes
from .transport import align

__all__ = ["Layout"]


class Layout:
    """Offsets of ``params`` then ``buffers`` in one segment.

    Attributes:
        param_offsets, buffer_offsets: byte offset of each tensor.
        param_groups: ``(dtype, start, end, [param indices])`` per dtype.
        buffer_range: ``(start, end)`` of all buffers, or ``None``.
        size: total bytes.
    """

    def __init__(self, params: list[torch.Tensor], buffers: list[torch.Tensor]) -> None:
        off = 0
        self.param_offsets = [0] * len(params)
        self.param_groups: list[tuple[torch.dtype, int, int, list[int]]] = []
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, p in enumerate(params):
            dtype_name(p.dtype)
            by_dtype.setdefault(p.dtype, []).append(i)
        for dtype, idxs in by_dtype.items():
            start = off = align(off)
            for i in idxs:
                self.param_offsets[i] = off
                off += nbytes(params[i])
            self.param_groups.append((dtype, start, off, idxs))
        off = align(off)
        b_start = off
        self.buffer_offsets = []
        for b in buffers:
            dtype_name(b.dtype)
            off = align(off)  # buffers of mixed dtypes: keep each naturally aligned
            self.buffer_offsets.append(off)
            off += nbytes(b)
        self.buffer_range = (b_start, off) if buffers else None
        self.size = max(align(off), 64)

    @staticmethod
    def wire(tensors: list[torch.Tensor], offsets: list[int], with_grad: bool) -> list:
        if with_grad:  # parameters keep their memory format (strides, or None for row-major)
            return [[dtype_name(t.dtype), list(t.shape), o, t.requires_grad, dense_strides(t)]
                    for t, o in zip(tensors, offsets)]
        return [[dtype_name(t.dtype), list(t.shape), o] for t, o in zip(tensors, offsets)]
