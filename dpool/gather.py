"""Gather: rebuild one output from the shards' outputs.

Rules (``nn.DataParallel``'s, without its crashes):

* tensors are concatenated along ``dim`` onto the output device; when every
  shard returned a 0-dim tensor they are stacked into a vector, with
  DataParallel's warning;
* ``None`` stays ``None``; tuples, lists, namedtuples, dicts (and dict
  subclasses) and dataclasses are rebuilt element by element;
* any other container is rebuilt as DataParallel does,
  ``type(out)(map(gather, zip(*outputs)))``: tuple and list subclasses,
  HuggingFace's ``DynamicCache`` and any type that iterates over its items and
  can be built from them (see :mod:`dpool.tree`, tag ``"S"``);
* every other value (strings, Python numbers, iterators, objects whose type
  cannot be rebuilt from its items: where DataParallel crashes) comes back as
  a list with one entry per shard.

Gathering is done in two passes over the shards' specs: :func:`tensor_groups`
lists which shard tensors form each output tensor (the autograd bridge
concatenates them), then :func:`build` puts the gathered tensors into place.
"""
from __future__ import annotations

from typing import Any, Iterator

from . import tree as _tree
from .errors import GatherError

__all__ = ["tensor_groups", "build"]


def _kind(spec: Any) -> str:
    return spec[0] if isinstance(spec, list) else "V"


def _mismatch(what: str) -> GatherError:
    return GatherError(f"dpool cannot gather: replicas returned different structures ({what})")


def tensor_groups(specs: list[Any], out: list[list[int]] | None = None) -> list[list[int]]:
    """For each output tensor in traversal order, the tensor index in every shard."""
    if out is None:
        out = []
    kinds = {_kind(s) for s in specs}
    if len(kinds) != 1:
        if "T" in kinds:
            raise _mismatch(f"a tensor in some shards, {sorted(kinds - {'T'})} in others")
        return out  # heterogeneous leaves: returned as a per-shard list
    kind = kinds.pop()
    if kind == "T":
        out.append([s[1] for s in specs])
    elif kind in ("U", "L"):
        lengths = {len(s[1]) for s in specs}
        if len(lengths) != 1:
            raise _mismatch(f"sequences of lengths {sorted(lengths)}")
        for items in zip(*(s[1] for s in specs)):
            tensor_groups(list(items), out)
    elif kind == "S":
        lengths = {len(s[2]) for s in specs}
        if len(lengths) != 1:
            raise _mismatch(f"containers of {sorted(lengths)} items")
        for items in zip(*(s[2] for s in specs)):
            tensor_groups(list(items), out)
    elif kind == "N":
        for items in zip(*(s[2] for s in specs)):
            tensor_groups(list(items), out)
    elif kind in ("D", "C"):
        if any(s[2] != specs[0][2] for s in specs):
            raise _mismatch("dicts with different keys" if kind == "D" else "dataclasses with different fields")
        for items in zip(*(s[3] for s in specs)):
            tensor_groups(list(items), out)
    return out


def build(specs: list[Any], gathered: Iterator[Any]) -> Any:
    """Rebuild the output; ``gathered`` yields the gathered tensors in :func:`tensor_groups` order."""
    kinds = {_kind(s) for s in specs}
    kind = kinds.pop() if len(kinds) == 1 else "mixed"
    if kind == "T":
        return next(gathered)
    if kind == "V" and all(s is None for s in specs):
        return None
    if kind == "U":
        return tuple(build(list(items), gathered) for items in zip(*(s[1] for s in specs)))
    if kind == "L":
        return [build(list(items), gathered) for items in zip(*(s[1] for s in specs))]
    if kind == "S":  # DataParallel's type(out)(map(gather_map, zip(*outputs)))
        tp = _tree.load_type(specs[0][1])
        return tp([build(list(items), gathered) for items in zip(*(s[2] for s in specs))])
    if kind == "N":
        tp = _tree.load_type(specs[0][1])
        return tp(*(build(list(items), gathered) for items in zip(*(s[2] for s in specs))))
    if kind == "D":
        tp = dict if specs[0][1] is None else _tree.load_type(specs[0][1])
        keys = [_tree.unflatten(k, _no_tensor) for k in specs[0][2]]
        values = [build(list(items), gathered) for items in zip(*(s[3] for s in specs))]
        return tp(zip(keys, values))
    if kind == "C":
        tp = _tree.load_type(specs[0][1])
        values = [build(list(items), gathered) for items in zip(*(s[3] for s in specs))]
        return tp(**dict(zip(specs[0][2], values)))
    # Strings, numbers, objects: one entry per shard (DataParallel crashes here).
    return [_tree.unflatten(s, _no_tensor) for s in specs]


def _no_tensor(i: int) -> Any:
    raise GatherError("dpool cannot gather a tensor nested inside a non-container value")
