"""Run-time patches of the model's code, repeated in the workers.

A script that patches a library before training (``LlamaAttention.forward = my_forward``,
``modeling_llama.apply_rotary_pos_emb = fused_rope``, ``F.gelu = my_gelu``: what Liger Kernel, Unsloth
and many research scripts do) changes what the model computes in its own process, so in DataParallel's
replicas too. dpool's workers are other processes: they import the library as it is on disk, and would
silently compute with the unpatched code.

:func:`code_refs` lists what the model's code reads when it runs: the attributes of the classes in its
modules' MROs (methods, properties, class constants) that the code it runs names, from ``forward`` on, and the functions, classes and module attributes
those methods, and the functions they call, name as globals (two calls deep), and the entries of the
mappings of functions they name as globals (a :class:`Registry`: HF's ``ALL_ATTENTION_FUNCTIONS``, to
which ``AttentionInterface.register`` adds; an entry missing in the workers is sent too, as the config
names it). :func:`fingerprints`
describes each without pickling it: a function by its module, qualified name, code name and first line
(a patch made with ``functools.wraps`` copies the first two, not the others), a constant by its ``repr``.
After shipping the model, the coordinator (``Runtime._follow_patches``) compares its fingerprints with
each worker's, which :func:`fingerprints_at` reads by address (so that nothing is imported to look), and
sends what differs (not what the workers lack: their code cannot be using it), pickled with :func:`pickle_patch`
(a function from the script by value, one from an importable module by reference), for the worker to set
with :func:`apply`. What still differs after that (a patch that cannot be pickled) is named in a warning.
Classes and functions of the training script itself (``__main__``) travel by value with the model already.
"""
from __future__ import annotations

import io
import pickle
import sys
import types
from collections.abc import Mapping
from typing import Any, Iterable

import cloudpickle
import torch

__all__ = ["Registry", "functions_of", "code_names", "code_refs", "fingerprints", "addresses", "fingerprints_at", "value_of", "name_of",
           "pickle_patch", "apply", "instrumentation", "MISSING"]

_CONSTANTS = (bool, int, float, str, bytes, type(None))
_CALLABLES = (types.FunctionType, types.BuiltinFunctionType, types.MethodDescriptorType,
              types.WrapperDescriptorType, type)
_MAX_FUNCTIONS = 4000  # a bound on the walk through globals (a large model's classes reach ~1000)
_MAX_ENTRIES = 1000  # a bound on the entries read of one registry


class Registry:
    """A mapping of functions the model's code reads by key from a module global, as a registry (HF's
    ``ALL_ATTENTION_FUNCTIONS``, to which ``AttentionInterface.register("mine", fn)`` adds, and whose key
    the config names; ``LOSS_MAPPING``; ``ROPE_INIT_FUNCTIONS``): its entries are patched like attributes.
    It pickles as its address, so that a worker finds its own."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name
        self.mapping: Any = getattr(sys.modules.get(module), name, None)

    def __reduce__(self) -> tuple:
        return Registry, (self.module, self.name)


def functions_of(value: Any) -> list[types.FunctionType]:
    """The Python functions behind a class attribute (a method, a static or class method, a property)."""
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, property):
        return [f for f in (value.fget, value.fset) if isinstance(f, types.FunctionType)]
    return [value] if isinstance(value, types.FunctionType) else []


def code_names(code: types.CodeType) -> set[str]:
    """The global and attribute names ``code`` and the functions nested in it use."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= code_names(const)
    return names


def _importable(owner: Any) -> bool:
    """Whether a worker finds ``owner`` (a module, or a class) by its name, as pickle does by reference."""
    if isinstance(owner, types.ModuleType):
        return owner.__name__ != "__main__" and sys.modules.get(owner.__name__) is owner
    found: Any = sys.modules.get(getattr(owner, "__module__", None) or "")
    if found is None or owner.__module__ == "__main__":
        return False
    for part in owner.__qualname__.split("."):
        found = getattr(found, part, None)
    return found is owner


def name_of(owner: Any, name: str) -> str:
    """``owner.name`` written out: ``torch.nn.modules.activation.Tanh.forward``."""
    if isinstance(owner, types.ModuleType):
        return f"{owner.__name__}.{name}"
    if isinstance(owner, Registry):
        return f"{owner.module}.{owner.name}[{name!r}]"
    return f"{owner.__module__}.{owner.__qualname__}.{name}"


def _inner_functions(fn: types.FunctionType) -> list[types.FunctionType]:
    """The functions a decorated ``fn`` calls: its ``__wrapped__``, and the functions in its closure."""
    found = [getattr(fn, "__wrapped__", None)]
    for cell in fn.__closure__ or ():
        try:
            found.append(cell.cell_contents)
        except ValueError:  # (an empty cell)
            pass
    return [f for f in found if isinstance(f, types.FunctionType)]


# Where the model's code starts when it runs: a module's call path, and what unpickling a replica runs
_ENTRIES = ("forward", "__call__", "_call_impl", "_wrapped_call_impl", "__getattr__", "__setstate__")


def code_refs(model: torch.nn.Module) -> list[tuple[Any, str]]:
    """``(owner, name)`` for what ``model``'s code reads at run time: a class or module, and an attribute.

    A class attribute counts when the code that runs names it: the walk starts at :data:`_ENTRIES` and
    follows the names each function uses, so that a method no forward reaches (``nn.Module.compile``, which
    names ``torch.compile``, which Lightning replaces at import) is not followed.
    """
    refs: dict[tuple[int, str], tuple[Any, str]] = {}
    classes = {id(c): c for m in model.modules() for c in type(m).__mro__ if c is not object}
    attributes: dict[str, list[tuple[type, Any]]] = {}
    for cls in classes.values():
        for name, value in list(vars(cls).items()):
            if not name.startswith("__") or name in _ENTRIES:
                attributes.setdefault(name, []).append((cls, value))
    todo: list[types.FunctionType] = []
    depth: dict[int, int] = {}
    reached: set[str] = set()

    def reach(names: Iterable[str]) -> None:
        for name in names:
            if name in reached or name not in attributes:
                continue
            reached.add(name)
            for cls, value in attributes[name]:
                functions = functions_of(value)
                if (functions or isinstance(value, _CONSTANTS)) and _importable(cls):
                    refs[id(cls), name] = (cls, name)
                for f in functions:
                    if id(f) not in depth:
                        depth[id(f)] = 0
                        todo.append(f)

    reach(_ENTRIES)
    seen: set[int] = set()
    while todo and len(seen) < _MAX_FUNCTIONS:
        fn = todo.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        for inner in _inner_functions(fn):  # what a decorator wraps runs too
            if id(inner) not in depth:
                depth[id(inner)] = depth[id(fn)]
                todo.append(inner)
        module = sys.modules.get(fn.__globals__.get("__name__", ""))
        names = code_names(fn.__code__)
        reach(names)
        for name in names:
            value = fn.__globals__.get(name)
            if isinstance(value, types.ModuleType):  # `F.gelu`: the module's attributes this code names
                members = vars(value) if _importable(value) else {}  # (not getattr: a lazy module would import)
                for attr in names:
                    if isinstance(members.get(attr), _CALLABLES):
                        refs.setdefault((id(value), attr), (value, attr))
            elif (isinstance(value, Mapping) and module is not None and _importable(module)
                    and len(value) <= _MAX_ENTRIES):
                registry = Registry(module.__name__, name)
                if registry.mapping is value:
                    for key, entry in list(value.items()):
                        if isinstance(key, str) and isinstance(entry, _CALLABLES):
                            refs.setdefault((id(value), key), (registry, key))
            elif isinstance(value, _CALLABLES) and module is not None and _importable(module):
                refs.setdefault((id(module), name), (module, name))
                if isinstance(value, types.FunctionType) and depth[id(fn)] < 2 and id(value) not in depth:
                    depth[id(value)] = depth[id(fn)] + 1
                    todo.append(value)
    return list(refs.values())


def _fingerprint(value: Any) -> Any:
    if isinstance(value, (staticmethod, classmethod)):
        return (type(value).__name__, _fingerprint(value.__func__))
    if isinstance(value, property):
        return ("property", _fingerprint(value.fget), _fingerprint(value.fset))
    if isinstance(value, types.FunctionType):
        code = value.__code__
        # (not the file: cloudpickle renames a function it rebuilt by value "<dynamic-code>")
        return ("function", value.__module__, value.__qualname__, code.co_name, code.co_firstlineno)
    if isinstance(value, _CONSTANTS):
        return ("value", repr(value))  # (a nan is not equal to itself)
    if isinstance(value, _CALLABLES):
        return ("callable", getattr(value, "__module__", None), getattr(value, "__qualname__", None))
    return ("object", type(value).__module__, type(value).__qualname__)


# torch's own instrumentation, which torch installs in any process that uses the feature (torch.compile
# patches Module.__init__ and __setstate__ to tag modules): repeating it would only import the compiler
# into workers that do not compile
_INSTRUMENTATION = ("torch._dynamo.",)


def instrumentation(fingerprint: Any) -> bool:
    """Whether a :func:`fingerprints` entry is torch's own instrumentation (:data:`_INSTRUMENTATION`)."""
    return fingerprint[0] == "function" and str(fingerprint[1]).startswith(_INSTRUMENTATION)


def value_of(owner: Any, name: str) -> Any:
    """``owner.name`` as the code finds it (a class's own attribute, not an inherited one)."""
    try:
        if isinstance(owner, Registry):
            return owner.mapping[name] if owner.mapping is not None and name in owner.mapping else _MISSING
        return vars(owner).get(name, _MISSING) if isinstance(owner, type) else getattr(owner, name, _MISSING)
    except Exception:  # (a module whose __getattr__ fails)
        return _MISSING


def addresses(refs: Iterable[tuple[Any, str]]) -> list[tuple[str, str, str]]:
    """``refs`` by name: ``(module, qualified name of the class or "", attribute)``."""
    return [(owner.__name__, "", name) if isinstance(owner, types.ModuleType)
            else (owner.module, f"[{owner.name}]", name) if isinstance(owner, Registry)
            else (owner.__module__, owner.__qualname__, name) for owner, name in refs]


def _resolve(module: str, qualname: str) -> Any:
    """The module or class at that address in this process, or None where its module is not imported
    (then no code here uses it, and importing it only to look would cost seconds for a large library)."""
    found: Any = sys.modules.get(module)
    if qualname.startswith("["):  # a registry: the module's global of that name
        return None if found is None else Registry(module, qualname[1:-1])
    for part in qualname.split(".") if qualname else ():
        found = getattr(found, part, None)
    return found


def fingerprints(refs: Iterable[tuple[Any, str]], _replica: Any = None) -> list[Any]:
    """What each ``(owner, name)`` holds in this process, described without pickling it."""
    return [_fingerprint(value_of(owner, name)) for owner, name in refs]


def fingerprints_at(places: Iterable[tuple[str, str, str]], _replica: Any = None) -> list[Any]:
    """:func:`fingerprints` of :func:`addresses` (what a worker runs: the coordinator's objects would
    import their modules here when unpickled)."""
    result = []
    for module, qualname, name in places:
        owner = _resolve(module, qualname)
        result.append(MISSING if owner is None else _fingerprint(value_of(owner, name)))
    return result


class _Pickler(cloudpickle.Pickler):
    """Pickles the given functions by value, where pickle would name them (by reference)."""

    def __init__(self, file: io.BytesIO, by_value: set[int]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._by_value = by_value

    def reducer_override(self, obj: Any) -> Any:
        if id(obj) in self._by_value and hasattr(self, "_dynamic_function_reduce"):
            return self._dynamic_function_reduce(obj)
        return super().reducer_override(obj)


def pickle_patch(owner: Any, name: str, value: Any) -> bytes:
    """``(owner, name, value)`` pickled for :func:`apply`. A function that names the very place it patches
    (``functools.wraps`` copied the original's module and qualified name) goes by value: by reference, a
    worker would find its own, unpatched, original there."""
    by_value = set()
    for f in functions_of(value):
        if f"{f.__module__}.{f.__qualname__}" == name_of(owner, name):
            by_value.add(id(f))
    buf = io.BytesIO()
    _Pickler(buf, by_value).dump((owner, name, value))
    return buf.getvalue()


def apply(patches: list[bytes], _replica: Any = None) -> None:
    """Set each ``owner.name = value`` of :func:`pickle_patch` in this (worker) process."""
    for data in patches:
        owner, name, value = pickle.loads(data)
        if isinstance(owner, Registry):
            owner.mapping[name] = value
        else:
            setattr(owner, name, value)


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()
MISSING = _fingerprint(_MISSING)  # what :func:`fingerprints` says of a name this process lacks
