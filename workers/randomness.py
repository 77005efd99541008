"""The random number streams a shard draws from, seeded at each forward from the coordinator's draw.

A forward's random numbers must repeat under the script's seeds and differ between shards, as in
DataParallel's replicas on several GPUs. Each forward carries one draw from the coordinator's generator;
:class:`Streams` seeds, from it and the shard's index:

* torch's default CPU generator, and on a GPU worker the GPU's (every process's starts from the same
  constant, so unseeded GPU workers drew the same dropout masks for their shards);
* each generator the model holds (:func:`dpool.held.walk`: ``self.gen`` for ``torch.randn(...,
  generator=self.gen)``, a ``random.Random``, NumPy's ``Generator``): every worker's copy is in the same state;
* Python's ``random`` and NumPy's global generator, where the model's code uses them (LayerDrop in HF's
  data2vec-audio, MusicGen and VITS draws ``random.uniform`` or ``np.random.uniform``): each worker's was
  seeded by the OS when it started, so such a run did not repeat under ``random.seed`` or
  ``transformers.set_seed``. :func:`global_streams_used` finds them by reading the names the methods of the
  model's classes, and the functions those call, use; a model that uses neither pays nothing per forward.
"""
from __future__ import annotations

import functools
import random
import sys
import types
from typing import Any, Callable

import torch

from dpool.held import seed as seed_generator
from dpool.held import walk
from dpool.patches import code_names, functions_of

__all__ = ["Streams", "global_streams_used"]

_MAX_FUNCTIONS = 2000  # a bound on the functions read
_STEP = 0xBF58476D1CE4E5B9  # between the streams of one shard


class Streams:
    """The streams of one replica: :meth:`seed` before each forward.

    Args:
        model: the replica.
        on_gpu: whether this worker runs on a GPU.
    """

    def __init__(self, model: torch.nn.Module, on_gpu: bool) -> None:
        seeders: list[Callable[[int], Any]] = [torch.default_generator.manual_seed]
        if on_gpu:
            seeders.append(torch.cuda.manual_seed)  # (the same value as the CPU's, as torch.manual_seed does)
        others: list[Callable[[int], Any]] = []
        named = list(model.named_modules())
        others += [functools.partial(seed_generator, g)
                   for _, g in walk([m for _, m in named], [n for n, _ in named]).generators]
        python, numpy = global_streams_used(model)
        if python:
            others.append(random.seed)
        if numpy:  # (the attribute, not sys.modules: NumPy 2 imports numpy.random on first use)
            others.append(functools.partial(_seed_numpy, sys.modules["numpy"].random))
        self._first = seeders
        self._others = others

    def seed(self, value: int) -> None:
        """Seed every stream from ``value`` (the forward's draw mixed with the shard's index)."""
        first = value % (1 << 63)
        for s in self._first:
            s(first)
        for k, s in enumerate(self._others, 1):
            s((value + _STEP * k) % (1 << 63))


def _seed_numpy(numpy_random: Any, value: int) -> None:
    numpy_random.seed(value % (1 << 32))


def global_streams_used(model: torch.nn.Module) -> tuple[bool, bool]:
    """Whether the code of ``model``'s classes (their methods, and the functions those name, two calls
    deep) draws from Python's global ``random`` and from NumPy's global generator."""
    numpy = sys.modules.get("numpy")
    numpy_random = sys.modules.get("numpy.random")
    numpy_state = getattr(getattr(numpy_random, "mtrand", None), "_rand", None)
    classes = {id(c): c for m in model.modules() for c in type(m).__mro__ if c not in (object, torch.nn.Module)}
    todo = [(f, 0) for c in classes.values() for v in list(vars(c).values()) for f in functions_of(v)]
    seen: set[int] = set()
    python = uses_numpy = False
    while todo and len(seen) < _MAX_FUNCTIONS and not (python and uses_numpy):
        fn, depth = todo.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        names = code_names(fn.__code__)
        for name in names:
            value = fn.__globals__.get(name)
            if value is None:  # (a builtin, an attribute's name: and numpy's names are None without numpy)
                continue
            owner = getattr(value, "__self__", None)
            if value is random or owner is random._inst:  # type: ignore[attr-defined]
                python = True
            elif ((numpy is not None and value is numpy and "random" in names)  # (numpy.random loads lazily)
                  or (numpy_random is not None and (value is numpy_random
                                                    or (numpy_state is not None and owner is numpy_state)))):
                uses_numpy = True
            elif isinstance(value, types.FunctionType) and depth < 2:
                todo.append((value, depth + 1))
    return python, uses_numpy
