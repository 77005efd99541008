"""What a model's modules hold besides parameters, buffers and submodules, found to follow it.

A module's plain attributes travel to the workers by value, pickled with the model. One process, and
DataParallel's replicas (``replicate`` copies each module's ``__dict__`` shallowly, so they share every
object with the master), see an object the model holds change in place after ``wrap()``:
``model.config.output_hidden_states = True``, ``self.scales[0] = 2.0``, ``self.masks["causal"].fill_(0)``,
``self.views = [self.lin.weight.detach()]`` stepped by the optimizer. The workers' copies would not, and
would silently compute with the old values.

:func:`walk` goes through every module's attributes, and from there through what pickling sends by value:
lists, tuples, dicts and sets, objects pickled as their ``__dict__`` (plain classes, dataclasses, HF's
``PretrainedConfig``, ``SimpleNamespace``) and modules that are not registered as submodules. It returns
the mutable containers among them with a copy of each (:attr:`Held.containers`, :attr:`Held.copies`: one
list comparison in C, ``==`` with identity first, tells that one changed), and every tensor it met with
where it is held (:attr:`Held.tensors`: their version counters tell an in-place change, and a tensor that
views a parameter is kept viewing it). The training loop's objects (an optimizer, a scheduler, a
gradient scaler) are not walked and travel as a :class:`LeftBehind`. Not followed, and said in
docs/semantics.md: objects with pickling of their own (``__getstate__``, ``__reduce__``, ``__slots__``), NumPy arrays
changed in place, and what lies beyond :data:`LIMIT` entries or :data:`DEPTH` levels, which
:attr:`Held.skipped` names for a warning.
"""
from __future__ import annotations

import random
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from .errors import UnsupportedError

__all__ = ["Held", "walk", "get", "seed", "stays_behind", "LeftBehind", "LIMIT", "DEPTH"]

LIMIT = 50_000  # entries of containers followed in all (compared before each forward: ~9 ns each)
DEPTH = 6  # levels below a module's attribute

# a module's own bookkeeping, followed otherwise (registration hooks, the hooks' keys)
_MODULE_KEYS = frozenset(torch.nn.Module().__dict__) - {"training"}
_ATOMS = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.memory_format,
          torch.layout, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.ModuleType,
          types.CodeType, range, slice, type(Ellipsis))
_DEFAULT_GETSTATE = getattr(object, "__getstate__", None)

# The training loop's objects, which a model sometimes holds (``self.opt = Adam(self.parameters())``, a
# scheduler, a GradScaler). They change at every step, and a scheduler pickles as its __dict__, optimizer
# and all: followed, the model was shipped again before every forward, with the optimizer's state tensors
# by value (a step took over ten times as long with Adam). They stay with the coordinator:
# the workers get a LeftBehind in their place, which raises if forward() uses it.
_TRAINING_LOOP = tuple(t for t in (torch.optim.Optimizer, getattr(torch.optim.lr_scheduler, "LRScheduler", None),
                                   torch.optim.lr_scheduler.ReduceLROnPlateau, getattr(torch.amp, "GradScaler", None),
                                   getattr(getattr(torch.cuda, "amp", None), "GradScaler", None))  # (torch < 2.3)
                       if isinstance(t, type))


def stays_behind(obj: Any) -> bool:
    """Whether ``obj`` is one of the training loop's objects, which the workers do not get (see LeftBehind)."""
    return isinstance(obj, _TRAINING_LOOP)


class LeftBehind:
    """What a worker's replica holds in place of an optimizer, learning-rate scheduler or gradient scaler the
    model holds. A copy would not follow the training loop's steps; using this raises, naming the object."""

    __slots__ = ("what",)

    def __init__(self, what: str) -> None:
        self.what = what

    def __reduce__(self) -> tuple:
        return LeftBehind, (self.what,)

    def __repr__(self) -> str:
        return f"<{self.what}: left with dpool's coordinator>"

    def __getattr__(self, name: str) -> Any:
        raise UnsupportedError(
            f"the model holds {self.what}, which stays with dpool's coordinator (a worker's copy would not "
            f"follow the training loop's steps), and the replica's forward used it (.{name}). Pass what "
            "forward() needs from it (the learning rate, the step) as an argument of forward().")


@dataclass
class Held:
    """What :func:`walk` found.

    Attributes:
        containers: the mutable containers held (lists, dicts, sets, and the ``__dict__`` of held objects).
        copies: a shallow copy of each, taken by :func:`walk`.
        names: where each container is (``model.encoder.config``).
        tensors: ``(name, holder, key, tensor)`` for every tensor met, with ``holder[key] is tensor``; a
            module's own tensor attributes included (``holder`` is its ``__dict__``).
        skipped: where the walk stopped at :data:`LIMIT` or :data:`DEPTH`.
        generators: ``(name, generator)`` for every random number generator held: a ``torch.Generator``
            (``self.gen = torch.Generator().manual_seed(0)``, for ``torch.randn(..., generator=self.gen)``),
            a ``random.Random``, NumPy's ``Generator`` and ``RandomState``. Each worker holds a copy in
            the same state, which it seeds per shard at each forward (:func:`seed`).
    """

    containers: list[Any] = field(default_factory=list)
    copies: list[Any] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    tensors: list[tuple[str, Any, Any, torch.Tensor]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    generators: list[tuple[str, Any]] = field(default_factory=list)

    def changed(self) -> list[str]:
        """The containers that differ from their copies (an entry added, removed or replaced by another object)."""
        return [name for name, live, copy in zip(self.names, self.containers, self.copies) if _differs(live, copy)]


def _differs(live: Any, copy: Any) -> bool:
    if isinstance(copy, dict):
        return live.keys() != copy.keys() or any(live[k] is not v for k, v in copy.items())
    if isinstance(copy, list):
        return len(live) != len(copy) or any(a is not b for a, b in zip(live, copy))
    return live != copy  # a set: its members by hash and ==


def _pickled_as_dict(obj: Any) -> bool:
    """Whether pickle sends ``obj`` as its class and its ``__dict__`` (nothing of its own decides what goes)."""
    cls = type(obj)
    if cls is types.SimpleNamespace:
        return True
    return (cls.__reduce_ex__ is object.__reduce_ex__ and cls.__reduce__ is object.__reduce__
            and getattr(cls, "__getstate__", None) is _DEFAULT_GETSTATE and not hasattr(cls, "__slots__")
            and isinstance(getattr(obj, "__dict__", None), dict))


def _children(obj: Any) -> tuple[Any, Any, list[tuple[Any, Any]], str] | None:
    """``(live container or None, its copy, (key, value) pairs, how a key is written)`` for an object the walk
    goes into, else None. A tuple's or frozenset's members are walked, but the container cannot change."""
    if isinstance(obj, dict):
        return obj, dict(obj), list(obj.items()), "[{!r}]"
    if isinstance(obj, list):
        return obj, list(obj), list(enumerate(obj)), "[{!r}]"
    if isinstance(obj, tuple):
        return None, None, list(enumerate(obj)), "[{!r}]"
    if isinstance(obj, (set, frozenset)):
        return (obj if isinstance(obj, set) else None), set(obj), [(None, v) for v in obj], ""
    if _pickled_as_dict(obj):
        d = obj.__dict__
        return d, dict(d), list(d.items()), ".{}"
    return None


def unsent(module: torch.nn.Module) -> frozenset[str]:
    """The attributes of ``module`` that pickling it does not send: those its ``__getstate__`` drops or sends as
    ``None`` (``nn.Module`` drops ``_compiled_call_impl``; a LightningModule sends ``_trainer`` as ``None``). A
    replica never sees them, so their changes are not followed. (A value it sends changed, a copy say, is
    followed as any other: the replica gets what ``__getstate__`` makes of the new value.)"""
    d = module.__dict__
    if type(module).__getstate__ is torch.nn.Module.__getstate__:
        return _COMPILED if "_compiled_call_impl" in d else _NOTHING
    try:
        state = module.__getstate__()
    except Exception:  # (pickling it will say what is wrong)
        return _NOTHING
    if not isinstance(state, dict):
        return _NOTHING
    return frozenset(k for k, v in d.items() if k not in state or (state[k] is None and v is not None))


_COMPILED = frozenset({"_compiled_call_impl"})
_NOTHING: frozenset[str] = frozenset()


def walk(modules: Sequence[torch.nn.Module], where: Sequence[str]) -> Held:
    """Walk what ``modules`` (every module of the model, named ``where``) hold, as the module docstring says."""
    held = Held()
    seen = {id(m) for m in modules}  # a registered submodule: its attributes are compared as a module's
    stack: list[tuple[str, Any, Any, Any, int]] = []
    for m, name in zip(reversed(modules), reversed(where)):
        d, skip = m.__dict__, unsent(m)
        stack.extend((f"{name}.{k}", d, k, v, 0) for k, v in reversed(d.items())
                     if k not in _MODULE_KEYS and k not in skip)
    entries = 0
    while stack:
        name, holder, key, obj, depth = stack.pop()
        if isinstance(obj, torch.Tensor):
            held.tensors.append((name, holder, key, obj))
            continue
        if _is_generator(obj):
            if id(obj) not in seen:
                seen.add(id(obj))
                held.generators.append((name, obj))
            continue
        if isinstance(obj, _ATOMS) or id(obj) in seen or stays_behind(obj):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            entries = _module(held=held, module=obj, name=name, depth=depth, seen=seen, stack=stack, entries=entries)
            continue
        found = _children(obj)
        if found is None:
            continue
        live, copy, items, style = found
        if depth >= DEPTH or entries + len(items) > LIMIT:
            held.skipped.append(name)
            continue
        entries += len(items)
        if live is not None:
            held.containers.append(live)
            held.copies.append(copy)
            held.names.append(name)
        if isinstance(obj, (set, frozenset)):  # (no key: the tensor is found through a list of its own)
            stack.extend((name + "{...}", [v], 0, v, depth + 1) for _, v in items)
            continue
        inner = obj.__dict__ if style == ".{}" else obj  # where obj[key] is
        stack.extend((name + style.format(k), inner, k, v, depth + 1) for k, v in reversed(items))
    return held


def _module(held: Held, module: torch.nn.Module, name: str, depth: int, seen: set[int], stack: list,
            entries: int) -> int:
    """Walk a module held but not registered as a submodule (``self.teacher = [resnet]``, kept out of
    ``parameters()``): it is pickled whole, by value. Its modules' attributes, parameters, buffers and
    submodules are followed, named as in its ``named_parameters()``; its hooks are not."""
    for sub_name, sub in module.named_modules():
        if sub is not module and id(sub) in seen:  # (a module of the model: followed as such)
            continue
        seen.add(id(sub))
        at = name + (f".{sub_name}" if sub_name else "")
        dicts = (sub.__dict__, sub._parameters, sub._buffers, sub._modules)
        if entries + sum(map(len, dicts)) > LIMIT:
            held.skipped.append(at)
            continue
        entries += sum(map(len, dicts))
        for d in dicts:
            held.containers.append(d)
            held.copies.append(dict(d))
            held.names.append(at)
        for d in (sub._parameters, sub._buffers):
            stack.extend((f"{at}.{k}", d, k, t, depth + 1) for k, t in d.items() if t is not None)
        skip = unsent(sub)
        stack.extend((f"{at}.{k}", sub.__dict__, k, v, depth + 1) for k, v in sub.__dict__.items()
                     if k not in _MODULE_KEYS and k not in skip)
    return entries


def _is_generator(obj: Any) -> bool:
    if isinstance(obj, (torch.Generator, random.Random)):
        return True
    numpy_random = sys.modules.get("numpy.random")  # (not imported here: a model that holds one imported it)
    return numpy_random is not None and isinstance(obj, (numpy_random.Generator, numpy_random.RandomState))


def seed(generator: Any, value: int) -> None:
    """Seed one of :attr:`Held.generators` with ``value`` (< 2**63), in place."""
    if isinstance(generator, torch.Generator):
        generator.manual_seed(value)
    elif isinstance(generator, random.Random):
        generator.seed(value)
    elif hasattr(generator, "bit_generator"):  # NumPy's Generator: a new state of its kind of bit generator
        generator.bit_generator.state = type(generator.bit_generator)(value).state
    else:  # NumPy's RandomState
        generator.seed(value % (1 << 32))


def get(holder: Any, key: Any) -> Any:
    """``holder[key]``, or None when it is gone (a list that got shorter, a dict entry deleted)."""
    try:
        return holder[key]
    except (KeyError, IndexError, TypeError):
        return None
