"""Encoding nested Python structures with tensor placeholders (msgpack-friendly).

A structure becomes a *spec* plus a flat list of tensors:

=====================  ======================================
value                  spec
=====================  ======================================
tensor                 ``["T", index]``
None/bool/int/float/   the value itself
str/bytes
tuple / list           ``["U", [items]]`` / ``["L", [items]]``
namedtuple             ``["N", pickled type, [items]]``
dict (and subclasses)  ``["D", pickled type or None, [keys], [values]]``
dataclass instance     ``["C", pickled type, [names], [values]]``
other sequence or      ``["S", pickled type, [items]]`` (outputs only: see below)
iterable container
anything else          ``["P", cloudpickle bytes]``
=====================  ======================================

Outputs (``flatten(..., output=True)``) follow ``nn.DataParallel``'s gather, which
rebuilds every other type as ``type(out)(map(gather, zip(*outputs)))``: a tuple
or list subclass, HuggingFace's ``DynamicCache`` or any container that iterates
over its items and can be built from them becomes ``"S"``, its items gathered
one by one. An object whose type cannot be rebuilt from its own items (where
DataParallel would crash), an iterator, a string or a number stays ``"P"``
and comes back as one entry per shard. Inputs are never split that way: like
DataParallel's scatter, other objects go whole to every shard.

The same spec describes every shard of a scattered input, so it is encoded
once per call. Types are pickled by reference (or by value for ``__main__``)
and cached.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import cloudpickle
import torch
from torch.nn.utils.rnn import PackedSequence

from .errors import DpoolTypeError

__all__ = ["flatten", "unflatten"]

_SCALARS = (type(None), bool, int, float, str, bytes)
_TYPE_CACHE: dict[type, bytes] = {}
_LOAD_CACHE: dict[bytes, Any] = {}
_LOAD_CACHE_SIZE = 256
_I64 = 2**63


def _type_bytes(tp: type) -> bytes:
    b = _TYPE_CACHE.get(tp)
    if b is None:
        b = _TYPE_CACHE[tp] = cloudpickle.dumps(tp)
    return b


def load_type(b: bytes) -> Any:
    """The object pickled as ``b`` (output types, a criterion), unpickled once while it stays in use."""
    tp = _LOAD_CACHE.get(b)
    if tp is None:
        if len(_LOAD_CACHE) >= _LOAD_CACHE_SIZE:  # a criterion changed every step must not pile up
            del _LOAD_CACHE[next(iter(_LOAD_CACHE))]
        tp = _LOAD_CACHE[b] = cloudpickle.loads(b)
    return tp


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields") and hasattr(obj, "_asdict")


def _plain_dataclass(obj: Any) -> bool:
    return (dataclasses.is_dataclass(obj) and not isinstance(obj, type)
            and all(f.init for f in dataclasses.fields(obj)))


def _rebuildable_items(obj: Any) -> list | None:
    """The items of a container that ``type(obj)(items)`` rebuilds, as DataParallel's gather would; else None."""
    tp = type(obj)
    if not hasattr(tp, "__iter__") or isinstance(obj, (str, bytes, bytearray, memoryview)):
        return None
    try:
        it = iter(obj)
        if it is obj:  # an iterator or a generator: iterating would consume it
            return None
        items = list(it)
        tp(items)  # the rebuild the coordinator will do, tried once here on this shard's own items
    except Exception:
        return None
    return items


def flatten(obj: Any, tensors: list[torch.Tensor], output: bool = False) -> Any:
    """Return the spec of ``obj``; its tensors are appended to ``tensors``.

    ``output=True`` encodes a model's output, whose other containers are rebuilt as
    DataParallel's gather does (the ``"S"`` rule above).
    """
    tp = type(obj)
    if tp in _SCALARS:
        if tp is int and not -_I64 <= obj < _I64:
            return ["P", cloudpickle.dumps(obj)]
        return obj
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return ["T", len(tensors) - 1]
    if tp is tuple:
        return ["U", [flatten(x, tensors, output) for x in obj]]
    if tp is list:
        return ["L", [flatten(x, tensors, output) for x in obj]]
    if _is_namedtuple(obj):
        if not output and isinstance(obj, PackedSequence):
            raise DpoolTypeError(
                "a PackedSequence cannot be split into shards (its rows are interleaved by time step): pass the "
                "padded batch and its lengths to the model and pack inside forward, as PyTorch's FAQ says for "
                "DataParallel (pack_padded_sequence in forward, then pad_packed_sequence(..., total_length=T))"
            )
        return ["N", _type_bytes(tp), [flatten(x, tensors, output) for x in obj]]
    if isinstance(obj, dict):
        keys = list(obj.keys())
        return ["D", None if tp is dict else _type_bytes(tp),
                [flatten(k, tensors) for k in keys], [flatten(obj[k], tensors, output) for k in keys]]
    if _plain_dataclass(obj):
        names = [f.name for f in dataclasses.fields(obj)]
        return ["C", _type_bytes(tp), names, [flatten(getattr(obj, n), tensors, output) for n in names]]
    if output:
        items = _rebuildable_items(obj)
        if items is not None:
            return ["S", _type_bytes(tp), [flatten(x, tensors, output) for x in items]]
    return ["P", cloudpickle.dumps(obj)]


def unflatten(spec: Any, tensor: Callable[[int], Any]) -> Any:
    """Rebuild a structure from its spec; ``tensor(i)`` supplies the i-th tensor."""
    if not isinstance(spec, list):
        return spec
    tag = spec[0]
    if tag == "T":
        return tensor(spec[1])
    if tag == "U":
        return tuple(unflatten(x, tensor) for x in spec[1])
    if tag == "L":
        return [unflatten(x, tensor) for x in spec[1]]
    if tag == "N":
        return load_type(spec[1])(*(unflatten(x, tensor) for x in spec[2]))
    if tag == "D":
        tp = dict if spec[1] is None else load_type(spec[1])
        return tp((unflatten(k, tensor), unflatten(v, tensor)) for k, v in zip(spec[2], spec[3]))
    if tag == "C":
        return load_type(spec[1])(**{n: unflatten(v, tensor) for n, v in zip(spec[2], spec[3])})
    if tag == "S":
        return load_type(spec[1])([unflatten(x, tensor) for x in spec[2]])
    if tag == "P":
        return cloudpickle.loads(spec[1])
    raise ValueError(f"unknown structure tag {tag!r}")
