"""Single-process references that the tests compare dpool against.

``full_batch`` is the plain single-process run. ``per_shard`` emulates
``nn.DataParallel`` in one process: each shard runs on the same module
starting from the same buffers, outputs are concatenated, buffer updates are
kept from the first shard only. For models without batch-coupled layers the
two agree; with BatchNorm in training mode only ``per_shard`` is DataParallel's
semantics.
"""
from __future__ import annotations

from typing import Any

import torch

from dpool.scatter import even_sizes


def split(obj: Any, sizes: list[int], dim: int = 0) -> list[Any]:
    if isinstance(obj, torch.Tensor):
        if obj.dim() <= dim:
            return [obj] * len(sizes)
        return list(obj.split(sizes, dim))
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return [type(obj)(*p) for p in zip(*(split(x, sizes, dim) for x in obj))]
    if isinstance(obj, (tuple, list)):
        return [type(obj)(p) for p in zip(*(split(x, sizes, dim) for x in obj))] if obj else [obj] * len(sizes)
    if isinstance(obj, dict):
        if not obj:
            return [type(obj)() for _ in sizes]
        keys = list(obj)
        parts = [split(obj[k], sizes, dim) for k in keys]
        return [type(obj)(zip(keys, p)) for p in zip(*parts)]
    return [obj] * len(sizes)


def cat(outs: list[Any], dim: int = 0) -> Any:
    o = outs[0]
    if isinstance(o, torch.Tensor):
        return torch.cat(outs, dim)
    if o is None:
        return None
    if isinstance(o, tuple) and hasattr(o, "_fields"):
        return type(o)(*(cat(list(x), dim) for x in zip(*outs)))
    if isinstance(o, (tuple, list)):
        return type(o)(cat(list(x), dim) for x in zip(*outs))
    if isinstance(o, dict):
        return type(o)((k, cat([x[k] for x in outs], dim)) for k in o)
    return list(outs)


def per_shard(module: torch.nn.Module, args: tuple, kwargs: dict, n_workers: int, batch: int, dim: int = 0) -> Any:
    k = min(n_workers, batch)
    sizes = even_sizes(batch, k)
    arg_parts = split(args, sizes, dim)
    kw_parts = split(kwargs, sizes, dim)
    start = {n: b.detach().clone() for n, b in module.named_buffers()}
    params = dict(module.named_parameters())
    outs = []
    for s in range(k):
        if s == 0:  # the first shard updates the module's own buffers
            outs.append(module(*arg_parts[s], **kw_parts[s]))
        else:  # the others start from the same buffers, and their updates are dropped
            bufs = {n: b.clone() for n, b in start.items()}
            outs.append(torch.func.functional_call(module, {**params, **bufs}, arg_parts[s], kw_parts[s]))
    return cat(outs, dim)
