"""Tensor metadata for the wire: dtypes by name, supported kinds, placing tensors in segments.

A tensor travels as a meta ``[dtype name, shape, byte offset, requires_grad]``;
its bytes are copied with ``Tensor.copy_`` into a view of a shared segment.
No dtype ever goes through numpy (numpy has no bfloat16 or float8), so every
dtype round-trips bitwise. Non-contiguous, expanded (stride 0) and
``channels_last`` tensors arrive with the same values, shape and dtype, in
contiguous (row-major) layout.
"""
from __future__ import annotations

from typing import Any

import torch

from .errors import DpoolTypeError
from .protocol import TensorMeta
from .transport import align

__all__ = ["DTYPES", "dtype_name", "check_tensor", "transportable", "nbytes", "Placer", "to_bytes", "from_bytes", "dense_strides", "describe"]

_CANDIDATES = [
    "float32", "float64", "float16", "bfloat16", "complex32", "complex64", "complex128",
    "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64", "bool",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
]
DTYPES: dict[str, torch.dtype] = {n: getattr(torch, n) for n in _CANDIDATES if isinstance(getattr(torch, n, None), torch.dtype)}
_NAMES: dict[torch.dtype, str] = {d: n for n, d in DTYPES.items()}


def dense_strides(t: torch.Tensor) -> list[int] | None:
    """``t``'s strides if it is dense but not row-major (``channels_last``, a transposed weight), else None.

    A dense tensor covers exactly ``numel`` elements with no gaps or overlaps, so it can live in
    ``numel`` bytes of a segment with its own strides; anything else is laid out row-major.
    """
    if t.dim() == 0 or t.stride() == torch.empty(t.shape, device="meta").stride():
        return None  # row-major, size-1 dimensions' strides included
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1)
    expect = 1
    for st, sz in dims:
        if st != expect:
            return None
        expect *= sz
    return list(t.stride())


def to_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of a CPU tensor, without numpy (which a plain ``pip install dpool`` may lack)."""
    out = bytearray(t.numel() * t.element_size())
    if out:
        torch.frombuffer(out, dtype=t.dtype).copy_(t.reshape(-1))
    return bytes(out)


def from_bytes(data: bytes, dtype: torch.dtype) -> torch.Tensor:
    """A 1-d tensor (its own memory) holding ``data``; the inverse of :func:`to_bytes`."""
    if not data:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype)


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise DpoolTypeError(
            f"dpool cannot transport tensors of dtype {dtype}; supported dtypes: {', '.join(DTYPES)}"
        ) from None


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def transportable(t: torch.Tensor) -> bool:
    """Whether dpool can move ``t`` through shared memory (quantized dtypes are not in ``_NAMES``)."""
    return type(t) in _PLAIN and t.layout == torch.strided and t.dtype in _NAMES and not (t.is_nested or t.is_meta)


def check_tensor(t: torch.Tensor, what: str) -> None:
    """Raise ``TypeError`` for tensors dpool cannot move through shared memory."""
    if transportable(t):
        return
    if t.layout != torch.strided:
        raise DpoolTypeError(f"{what}: dpool only transports dense (strided) tensors, got layout {t.layout}; "
                        "call .to_dense() first")
    if t.is_nested:
        raise DpoolTypeError(f"{what}: nested tensors are not supported by dpool; pad them into a dense tensor")
    if t.is_quantized:
        raise DpoolTypeError(f"{what}: quantized tensors are not supported by dpool; dequantize() them first")
    if t.device.type == "meta":
        raise DpoolTypeError(f"{what}: meta tensors have no data for dpool to transport; materialize them first (e.g. module.to_empty(device=\"cpu\") and initialize)")
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise DpoolTypeError(f"{what}: tensor subclass {type(t).__name__} is not supported by dpool; "
                        "pass a plain torch.Tensor (e.g. via .as_subclass(torch.Tensor))")
    dtype_name(t.dtype)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Placer:
    """Lays tensors out back to back (64-byte aligned) and writes them into a segment."""

    __slots__ = ("offset",)

    def __init__(self, start: int = 0) -> None:
        self.offset = start

    def reserve(self, t: torch.Tensor) -> int:
        off = self.offset
        self.offset = align(off + nbytes(t))
        return off

    @staticmethod
    def write(views: Any, offset: int, t: torch.Tensor, requires_grad: bool = False) -> TensorMeta:
        """Copy ``t`` into the segment whose view cache is ``views``; return its meta."""
        meta = describe(t, offset, requires_grad)
        if t.numel():  # (detached only where autograd would record the copy: an op less for most tensors)
            views.view(offset, t.dtype, meta.shape).copy_(t.detach() if t.requires_grad else t)
        return meta


def describe(t: torch.Tensor, offset: int = 0, requires_grad: bool = False) -> TensorMeta:
    """The meta of ``t`` placed at ``offset`` (what :meth:`Placer.write` returns, without the copy: a kept
    output's, which stays where it is)."""
    return TensorMeta(dtype_name(t.dtype), list(t.shape), offset, bool(requires_grad))


def read(views: Any, meta: TensorMeta) -> torch.Tensor:
    """A view (no copy) of the tensor ``meta`` describes, from a segment's view cache."""
    name, shape, offset, _ = meta
    return views.view(offset, DTYPES[name], shape)


def meta_nbytes(meta: TensorMeta) -> int:
    name, shape, _, _ = meta
    n = DTYPES[name].itemsize
    for s in shape:
        n *= s
    return n
