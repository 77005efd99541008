"""The master module's side of replication: its tensors in shared memory, and the model shipped once.

nn.DataParallel replicates the module on every forward. dpool does it once:

* :meth:`Master.bind` lays the master's parameters and buffers out in one
  shared region (:class:`dpool.layout.Layout`) and rebinds them there
  (``p.data = view``). Replicas build their tensors over the same memory, so
  the optimizer's in-place updates reach every worker with no copy.
* :meth:`Master.pickle` pickles the module with every parameter and buffer
  replaced by a reference (``persistent_id``): what travels is the module's
  structure, never tensor data. A parametrized submodule, which torch refuses
  to pickle, travels as its original class and is parametrized again on the
  worker (``_Pickler.reducer_override``).
* Changes after ``wrap()`` are noticed: a replaced tensor (``p.data = t``,
  ``load_state_dict(assign=True)``) is copied back into shared memory before
  the next forward (:meth:`Master.check_bindings`); a new parameter, buffer or
  submodule sets :attr:`Master.changed` through torch's registration hooks;
  any other attribute assigned (``module.scale = 2``, ``dropout.p = 0``) and
  any forward or backward hook added or removed is found by comparing the
  modules' attributes (identity, or ``==``) before each forward (:meth:`Master.touched`), the
  objects they hold (a config, a list, a dict: :mod:`dpool.held`) with copies of them, and a tensor kept
  as a plain attribute or in such an object and changed in place by its version counter.
  In each of these cases the coordinator ships the model again, as
  DataParallel's per-forward replication would pick the change up.
* A plain tensor attribute, or a tensor the model holds in a list, dict or object, that views a
  parameter's or buffer's memory (``self.w_t = self.lin.weight.detach().t()``) keeps viewing it: bind and
  unbind move it with its base, and it travels as a reference to that memory,
  so the optimizer's steps reach it as they reach the parameter
  (:meth:`Master._read_tensor_attributes`).
* :meth:`Master.unbind` gives every tensor private memory again, so the
  module outlives the pool.
* A function a library made at run time (a hook HF transformers installs, a closure) travels as its
  code and closure and is rebuilt over the worker's import of its module (``_reduce_library_closure``),
  so that its globals are its module's, as in one process, not copies.
"""
from __future__ import annotations

import importlib
import io
import itertools
import pickle
import sys
import types
import warnings
import weakref
from typing import Any, Callable

import cloudpickle
import torch
from cloudpickle import cloudpickle as _cloudpickle_internals
from torch.nn.modules import module as _module_hooks
from torch.nn.utils import parametrize as _parametrize
from torch.utils.hooks import RemovableHandle

from . import held as _held
from . import sync_batchnorm as _sync_bn
from .errors import DpoolValueError, ModelChangedError, UnpicklableModelError, UnsupportedError
from .layout import Layout
from .patches import code_names
from .tensors import dense_strides, dtype_name
from .transport.base import standalone

__all__ = ["Master"]


# Where a worker keeps the new values of parameters its forward rebound (``p.data = ...``) until the
# coordinator takes them (dpool.protocol.ForwardDone.rebound): an entry of the replica's __dict__.
REBOUND = "_dpool_rebound"


def take_rebound(replica: torch.nn.Module) -> dict[int, torch.Tensor]:
    """Run in a worker (``Coordinator._call``): the new values of the parameters its last forward rebound,
    by index, on the CPU; the worker forgets them."""
    return {i: t.cpu() for i, t in replica.__dict__.pop(REBOUND, {}).items()}


class _Pickler(cloudpickle.Pickler):
    """Pickles the model with its parameters and buffers replaced by references."""

    def __init__(self, file: io.BytesIO, ids: dict[int, tuple]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._ids = ids

    def persistent_id(self, obj: Any) -> Any:  # noqa: D401
        if isinstance(obj, torch.Tensor):
            return self._ids.get(id(obj))
        return None

    def reducer_override(self, obj: Any) -> Any:
        if _held.stays_behind(obj):  # (the training loop's objects: see dpool.held.LeftBehind)
            return _held.LeftBehind, (f"a {type(obj).__module__}.{type(obj).__qualname__}",)
        if type(obj) is torch.nn.SyncBatchNorm:  # dpool's layer in the replicas (see dpool.sync_batchnorm)
            return _sync_bn.empty_replica, (), _sync_bn.torch_layer_state(obj)
        if isinstance(obj, torch.nn.Module) and _parametrize.is_parametrized(obj) and _CAN_REBUILD:
            return _reduce_parametrized(obj)
        if isinstance(obj, types.FunctionType) and _library_closure(obj):
            return _reduce_library_closure(obj)
        return super().reducer_override(obj)


# A function a library made at run time (a closure: a hook HF transformers installs on the model when hidden
# states are first asked for) has no name to be imported by, so cloudpickle sends it by value, and with it
# the module globals it names, by value too: copies. In the workers it would then read a copy of its
# module's state (HF's hooks: a copy of the context variable the model's forward sets, so they would never
# fire), or not pickle at all (a ContextVar, a lock). In one process its globals are its module's; so here:
# the function travels as its code, closure and attributes, and is rebuilt over the worker's own import of
# its module. Functions of the script (``__main__``) and of modules registered to pickle by value keep
# cloudpickle's way.
class _EmptyCell:
    """Stands for a closure cell not yet assigned (pickled by reference, as a class)."""


def _library_closure(func: types.FunctionType) -> bool:
    module = sys.modules.get(func.__module__ or "")
    if (module is None or module.__name__ == "__main__" or getattr(module, "__spec__", None) is None
            or func.__globals__ is not getattr(module, "__dict__", None)):  # (a module made at run time: by value)
        return False
    by_reference = getattr(_cloudpickle_internals, "_should_pickle_by_reference", None)
    by_value = getattr(_cloudpickle_internals, "_is_registered_pickle_by_value", None)
    if by_reference is None or by_value is None:  # (another cloudpickle: its own way)
        return False
    return not by_reference(func) and not by_value(module)


def _reduce_library_closure(func: types.FunctionType) -> tuple:
    cells = []
    for cell in func.__closure__ or ():
        try:
            cells.append(cell.cell_contents)
        except ValueError:
            cells.append(_EmptyCell)
    state = (func.__qualname__, func.__defaults__, func.__kwdefaults__, tuple(cells), dict(func.__dict__))
    # (state after the skeleton, so that a closure that refers to itself pickles)
    return (_function_skeleton, (func.__module__, func.__code__, func.__name__, len(cells), _rewriter_globals(func)),
            state, None, None, _fill_function)


def _rewriter_globals(func: types.FunctionType) -> dict[str, Any]:
    """The globals ``func``'s code names that a code rewriter put in its module under names no source can
    write: pytest's assertion rewriting adds ``@py_builtins`` and ``@pytest_ar`` to a test module, whose
    failing asserts call them. A worker's own import of the module was not rewritten, so they travel."""
    return {n: func.__globals__[n] for n in code_names(func.__code__) if not n.isidentifier() and n in func.__globals__}


def _function_skeleton(module: str, code: types.CodeType, name: str, ncells: int,
                       added: dict[str, Any] | None = None) -> types.FunctionType:
    closure = tuple(types.CellType() for _ in range(ncells)) or None
    namespace = importlib.import_module(module).__dict__
    for key, value in (added or {}).items():
        namespace.setdefault(key, value)
    return types.FunctionType(code, namespace, name, None, closure)


def _fill_function(func: types.FunctionType, state: tuple) -> None:
    func.__qualname__, func.__defaults__, func.__kwdefaults__, cells, attributes = state
    for cell, value in zip(func.__closure__ or (), cells):
        if value is not _EmptyCell:
            cell.cell_contents = value
    func.__dict__.update(attributes)


# Modules with parametrizations (torch.nn.utils.parametrize: parametrizations.weight_norm, spectral_norm,
# orthogonal; HF's wav2vec2 uses weight_norm) refuse pickling: torch swaps their class for a generated
# subclass whose __getstate__ raises, and whose properties compute the parametrized tensors. They travel
# as their original class, their state (the `parametrizations` ModuleDict holds the original tensors,
# which go by reference like any parameter), and the names of the parametrized tensors; the worker
# redoes the class swap with torch's own helpers.
_CAN_REBUILD = hasattr(_parametrize, "_inject_new_class") and hasattr(_parametrize, "_inject_property")


def _reduce_parametrized(module: torch.nn.Module) -> tuple:
    cls = type(module).__bases__[0]  # the class register_parametrization() replaced
    return _parametrized, (cls, tuple(module.parametrizations.keys())), dict(module.__dict__)


def _parametrized(cls: type[torch.nn.Module], names: tuple[str, ...]) -> torch.nn.Module:
    """An empty ``cls`` module with parametrized ``names`` (pickle then sets its state)."""
    module = cls.__new__(cls)  # type: ignore[call-overload]  # (as pickle makes any object)
    _parametrize._inject_new_class(module)
    for name in names:
        _parametrize._inject_property(module, name)
    return module


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage that ``t`` (not empty) reaches: ``(first, end)``."""
    start = t.storage_offset() * t.element_size()
    return start, start + (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * t.element_size()


def _unpicklable_attribute(module: torch.nn.Module) -> str | None:
    """``model.sub.attr: type`` of the first attribute of ``module`` (or a submodule) that cannot be pickled."""
    skip = {"_parameters", "_buffers", "_modules"}
    for name, m in module.named_modules():
        for key, value in vars(m).items():
            if key in skip or isinstance(value, torch.Tensor):
                continue
            try:
                cloudpickle.dumps(value)
            except Exception:
                path = "model" + (f".{name}" if name else "") + f".{key}"
                return f"{path}: {type(value).__module__}.{type(value).__qualname__}"
    return None


# The module hooks a replica runs. register_*() and a handle's remove() change these dicts in place, so
# they are compared by their keys (the handles' ids); ``training`` is left out, every forward sends it.
_RUN_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_SENT_EACH_FORWARD = frozenset({"training"})
_MISSING = object()


class _Sent:
    """A live view of the values of a module's ``__dict__`` that pickling it sends (:func:`dpool.held.unsent`)."""

    __slots__ = ("d", "unsent")

    def __init__(self, d: dict, unsent: frozenset[str]) -> None:
        self.d, self.unsent = d, unsent

    def __iter__(self) -> Any:
        unsent = self.unsent
        return (v for k, v in self.d.items() if k not in unsent)


class Master:
    """The master module's tensors, bound to one shared region.

    Args:
        module: the master module, on ``device`` (the CPU, or ``device_ids[0]``'s GPU).
        device: where the master lives.
    """

    def __init__(self, module: torch.nn.Module, device: torch.device) -> None:
        self.module = module
        self.device = device
        self.changed = False
        self._warned_skipped: set[str] = set()
        self._hooks: list[Any] = []
        self.region: Any = None
        self.param_views: list[torch.Tensor] = []
        self.buffer_views: list[torch.Tensor] = []
        self.collect()

    # ------------------------------------------------------------------ reading the module
    def collect(self) -> None:
        """Read the module's parameters and buffers (names, tensors), refusing what dpool cannot run."""
        self._read()
        self.snapshot(self._walked)  # (what _read just walked: the same modules, nothing changed since)

    @classmethod
    def check(cls, module: torch.nn.Module, device: torch.device) -> None:
        """Raise what :meth:`collect` would refuse in ``module`` as it is now, changing nothing: before a
        re-sync gives up the old shared memory, so that a refused change leaves the pool as it was."""
        probe = cls.__new__(cls)
        probe.module, probe.device = module, device
        probe._read()

    def _read(self) -> None:
        module = self.module
        self.param_names = [n for n, _ in module.named_parameters()]
        self.params = list(module.parameters())
        named_buffers = list(module.named_buffers())
        self.buffer_names = [n for n, _ in named_buffers]
        self.buffers = [b for _, b in named_buffers]
        named = list(module.named_modules())
        self.modules = [m for _, m in named]
        self._module_names = [n for n, _ in named]
        self._module_ids = {id(m) for m in self.modules}
        for name, m in named:
            if isinstance(m, torch.nn.SyncBatchNorm) and (type(m) is not torch.nn.SyncBatchNorm
                                                          or m.process_group is not None):
                raise UnsupportedError(
                    f"{'model.' + name if name else 'the model'} is a torch.nn.SyncBatchNorm "
                    + ("given its own process_group. " if type(m) is torch.nn.SyncBatchNorm else
                       f"subclass ({type(m).__qualname__}). ")
                    + "In dpool's workers, which have no process group, torch's layer would normalise each "
                    "shard alone; dpool runs plain torch.nn.SyncBatchNorm layers as dpool.SyncBatchNorm, whose "
                    "statistics span the whole batch of every worker (and node), but cannot keep a subset of "
                    "ranks or a subclass's own code. Use process_group=None, or dpool.convert_sync_batchnorm(net)."
                )
            if isinstance(m, torch.jit.ScriptModule):  # (preorder: the outermost one is named)
                raise UnsupportedError(
                    f"{'model.' + name if name else 'the model'} is a TorchScript module ({type(m).__name__}, made "
                    "by torch.jit.script or torch.jit.trace). dpool ships each worker its replica as a pickle, and "
                    "TorchScript modules cannot be pickled. Give dpool.wrap() the eager module instead "
                    "(torch.compile works inside and outside a dpool model)."
                )
        for name, t in list(zip(self.param_names, self.params)) + named_buffers:
            if isinstance(t, torch.nn.parameter.UninitializedTensorMixin):
                raise DpoolValueError(
                    f"{name} is an uninitialized (lazy) tensor; run one forward pass on a sample batch "
                    "before dpool.wrap() so that its shape is known"
                )
            if t.requires_grad and not isinstance(t, torch.nn.Parameter):
                raise UnsupportedError(
                    f"buffer {name} requires grad. nn.DataParallel broadcasts such a buffer with autograd so that "
                    "gradients reach it; dpool's replicas read buffers from shared memory and could not return "
                    "those gradients, so they would be silently wrong. Register it as an nn.Parameter "
                    "(requires_grad=True) to train it, or .detach() it if it needs no gradient."
                )
            if t.device.type == "meta":
                raise DpoolValueError(
                    f"{name} is a meta tensor (no data): materialize the module on the CPU before dpool.wrap(), "
                    "e.g. module.to_empty(device='cpu') and initialize it, or load_state_dict(..., assign=True)"
                )
            if t.device != self.device:
                if self.device.type == "cuda":
                    raise DpoolValueError(
                        f"module must have its parameters and buffers on device {self.device} (device_ids[0]) but "
                        f"found {name} on device: {t.device}. Move it there before dpool.wrap() (and before "
                        f"creating the optimizer): module.to('{self.device}'); or list its GPU first in device_ids "
                        "(device_ids are logical: CUDA_VISIBLE_DEVICES reorders them)."
                    )
                raise DpoolValueError(
                    f"{name} is on {t.device}, but CPU workers need the master module on the CPU; "
                    "call module.cpu() before dpool.wrap()"
                )
        self._refuse_overlaps()
        self._read_tensor_attributes()

    def _refuse_overlaps(self) -> None:
        """Refuse parameters and buffers that share memory (``register_buffer("w_t", lin.weight.detach().t())``).

        In one process such a buffer changes with the weight. dpool gives every parameter and buffer a
        place of its own in shared memory, which would silently part them. (Parameters that are slices of
        one flat tensor, as after an LSTM's ``flatten_parameters()`` or a checkpoint mapped from a file,
        share a storage but no bytes: that is fine.)
        """
        names = self.param_names + self.buffer_names
        spans = sorted((t.untyped_storage().data_ptr(), *_byte_span(t), i)
                       for i, t in enumerate(self.params + self.buffers) if t.numel())
        reach: tuple[int, int, int] | None = None  # (storage, end, index) of the furthest-reaching span so far
        for storage, start, end, i in spans:
            if reach is not None and reach[0] == storage and start < reach[1]:
                a, b = sorted((reach[2], i))
                both_params = b < len(self.params)
                raise UnsupportedError(
                    f"{names[a]} and {names[b]} share memory (one is a view of the other). In one process "
                    f"{'they change together' if both_params else names[b] + ' changes with ' + names[a]}; dpool gives every "
                    "parameter and buffer a place of its own in shared memory, which would silently part them. "
                    + ("Tie them by assigning the same nn.Parameter object to both modules."
                       if both_params else
                       f"Keep the view as a plain attribute (self.{names[b].rsplit('.', 1)[-1]} = ..., which dpool "
                       "keeps pointing at its base) or compute it in forward().")
                )
            if reach is None or reach[0] != storage or end > reach[1]:
                reach = (storage, end, i)

    def _read_tensor_attributes(self, refuse: bool = True) -> None:
        """Find the plain tensor attributes that view a parameter's or buffer's memory, and (with
        ``refuse``) refuse those dpool cannot keep as they are in one process.

        ``self.alpha = torch.tensor(1.0, requires_grad=True)``, trained by passing it to the optimizer, gets
        its gradient in one process (and in DataParallel's replicas, which share it); the workers would
        compute theirs on a copy and never return it, so it would silently not train: an error.

        ``self.w_t = self.lin.weight.detach().t()`` shares the weight's memory in one process, so it sees
        every optimizer step. Pickled by value it would be a stale copy in the workers, and rebinding the
        weight to shared memory would leave the master's own attribute behind: both silently wrong. Such an
        alias is recorded as ``(module, name, base index, byte offset in the base)``; :meth:`bind` and
        :meth:`unbind` move it with its base, and :meth:`pickle` sends it as a reference. An attribute that
        needs grad (a graph made once, in ``__init__``) is left alone, as is one that shares a storage
        with the parameters but none of their bytes (a file mapping of a checkpoint). One that views part
        of a base in a way that cannot be kept is an error (with ``refuse``), or left alone.
        """
        bases = self.params + self.buffers
        spans: dict[int, list[tuple[int, int, int]]] = {}  # storage -> (first byte, end, base index)
        for i, t in enumerate(bases):
            if t.numel():
                spans.setdefault(t.untyped_storage().data_ptr(), []).append((*_byte_span(t), i))
        own = {id(t) for t in bases}
        named = list(self.module.named_modules())  # (the live tree: an alias on a module added later too)
        held = self._walked = _held.walk([m for _, m in named], ["model" + (f".{n}" if n else "") for n, _ in named])
        self.aliases: list[tuple[Any, Any, int, int, str]] = []  # (holder, key, base index, byte offset, name)
        for where, holder, key, a in held.tensors:
            if (refuse and a.requires_grad and a.is_leaf and id(a) not in own
                    and not isinstance(a, torch.nn.Parameter)):  # (a module's that is not a submodule: a copy)
                raise UnsupportedError(
                    f"{where} is a tensor that requires grad but is not an nn.Parameter of the model. dpool's "
                    "workers would compute its gradient on their copies and never return it, so it would silently "
                    "not train. Register it as an nn.Parameter (then model.parameters() has it), or "
                    "requires_grad_(False) it if it is not meant to train."
                )
            if (id(a) in own or a.requires_grad or not a.numel() or a.is_inference()
                    or a.untyped_storage().data_ptr() not in spans):
                continue
            start, end = _byte_span(a)
            for b_start, b_end, i in spans[a.untyped_storage().data_ptr()]:
                if b_start <= start and end <= b_end and (bases[i].is_contiguous() or dense_strides(bases[i])):
                    self.aliases.append((holder, key, i, start - b_start, where))
                    break
                if start < b_end and b_start < end and refuse:
                    name = (self.param_names + self.buffer_names)[i]
                    raise UnsupportedError(
                        f"{where} is a plain tensor attribute that views part of {name}'s memory in a way dpool cannot keep "
                        f"(it reaches outside {name}, or {name} is not dense): the workers would compute with a "
                        "stale copy of it. Register it as a buffer, or compute it from the parameter in forward()."
                    )

    def _move_aliases(self, indices: Any = None) -> None:
        """Point the aliases of the bases in ``indices`` (default: all) at their bases' memory now."""
        bases = self.params + self.buffers
        with torch.no_grad():
            for holder, key, i, offset, _ in self.aliases:
                a, t = _held.get(holder, key), bases[i]
                if not isinstance(a, torch.Tensor) or (indices is not None and i not in indices):
                    continue
                first = t.storage_offset() * t.element_size() + offset
                a.data = standalone(t.untyped_storage(), t.device, first, a.dtype, a.shape, strides=list(a.stride()))

    # ------------------------------------------------------------------ attributes and hooks
    def snapshot(self, walked: _held.Held | None = None) -> None:
        """Remember every module's attributes (the objects themselves: an id is never reused while they are
        held) and the keys of the hooks a replica runs: what :meth:`touched` and :meth:`attribute_changes`
        compare with. ``walked``: :func:`dpool.held.walk` of the modules, taken just now."""
        self._dicts, self._unsent = [m.__dict__ for m in self.modules], [_held.unsent(m) for m in self.modules]
        self._values = [d.values() if not u else _Sent(d, u) for d, u in zip(self._dicts, self._unsent)]
        self._flat = list(itertools.chain.from_iterable(self._values))
        self._saved = [dict(d) for d in self._dicts]
        self._where = ["model" + (f".{n}" if n else "") for n in self._module_names]
        hooks = [(d[h], f"{w}.{h}") for d, w in zip(self._dicts, self._where) for h in _RUN_HOOKS if h in d]
        self._hook_dicts = [d for d, _ in hooks]  # (a dict rebound later is an attribute change)
        self._hook_names = [n for _, n in hooks]
        self._hook_keys = list(map(tuple, self._hook_dicts))
        self._nhooks = sum(map(len, self._hook_keys))
        self._next_handle = RemovableHandle.next_id
        # objects the modules hold (``self.config``, ``self.scales = [1.0, 2.0]``) travel by value, so a change
        # inside one after wrap() (``model.config.output_hidden_states = True``) must ship them again: each
        # container found is compared with a copy (dpool/held.py says which are followed)
        held = self._held = walked if walked is not None else _held.walk(self.modules, self._where)
        for name in held.skipped:
            if name not in self._warned_skipped:
                self._warned_skipped.add(name)
                warnings.warn(
                    f"dpool: {name} holds more than dpool follows ({_held.LIMIT} entries in all, {_held.DEPTH} "
                    "levels deep): a change made inside it after dpool.wrap() will not reach the workers. Close "
                    "the model and wrap it again after such a change, or keep large objects outside the model.",
                    RuntimeWarning, stacklevel=4)
        # tensors kept as plain attributes (``self.mask = torch.tril(...)``, not buffers) or in such objects
        # travel by value, so an in-place change (``model.mask[0] = 0``, ``model.temperature.fill_(2)``) must
        # ship them again: their version counters say so (inference tensors have none, and cannot change
        # outside inference) (an alias of a parameter or buffer changes with it, and travels by reference: see
        # _read_tensor_attributes; the model's own parameters and buffers travel by reference too)
        skip = {id(_held.get(holder, key)) for holder, key, _, _, _ in self.aliases}
        skip.update(map(id, self.params + self.buffers))
        tensors = {id(t): (name, t) for name, _, _, t in held.tensors if not t.is_inference() and id(t) not in skip}
        self._tensor_names = [n for n, _ in tensors.values()]
        self._tensors = [t for _, t in tensors.values()]
        self._versions = [t._version for t in self._tensors]

    def touched(self) -> bool:
        """Whether an attribute of a module may have been assigned, or a hook added or removed, since the
        last snapshot; :meth:`attribute_changes` then says what changed.

        It runs before every forward, so it compares in C: the list of every module's attribute values
        against the snapshot's (identical objects compare equal without a call), the held containers
        against their copies, the held tensors' versions, the hooks' count, and torch's count of hook
        handles ever made (when that moved, the hooks' keys: a hook made on a tensor or on another model
        costs a look at the keys, not a closer look). An attribute replaced by an equal value (``==``) counts as
        unchanged: the replicas' copy behaves the same.
        """
        if sum(map(len, self._hook_dicts)) != self._nhooks:
            return True
        if self._tensors and [t._version for t in self._tensors] != self._versions:
            return True
        try:
            if list(itertools.chain.from_iterable(self._values)) != self._flat:
                return True
            if self._held.containers and self._held.containers != self._held.copies:
                return True
        except Exception:  # an __eq__ that cannot answer (a tensor's, an array's): look closer
            return True
        if RemovableHandle.next_id != self._next_handle:  # a hook was made somewhere: one of the model's?
            if list(map(tuple, self._hook_dicts)) != self._hook_keys or self.global_hooks():
                return True
            self._next_handle = RemovableHandle.next_id  # (a tensor's, another model's)
        return False

    @staticmethod
    def global_hooks() -> list[str]:
        """The kinds of global module hooks set now (``register_module_forward_hook`` and its kin): they
        run in this process only, never in the workers' replicas."""
        return [f"register_module_{kind}_hook" for kind, d in (
            ("forward", _module_hooks._global_forward_hooks), ("forward_pre", _module_hooks._global_forward_pre_hooks),
            ("full_backward", _module_hooks._global_backward_hooks),
            ("full_backward_pre", _module_hooks._global_backward_pre_hooks)) if d]

    def attribute_changes(self) -> list[str]:
        """The attributes assigned and the hooks added or removed since the last snapshot, as
        ``model.sub.attr`` (``training`` left out: every forward sends it). The snapshot stays: the caller
        takes a new one once the replicas follow (:meth:`collect` does)."""
        changes = []
        for where, d, saved, unsent in zip(self._where, self._dicts, self._saved, self._unsent):
            for key in sorted(d.keys() | saved.keys()):
                if key not in _SENT_EACH_FORWARD and key not in unsent and d.get(key, _MISSING) is not saved.get(key, _MISSING):
                    changes.append(f"{where}.{key}")
        changes += [name for name, d, keys in zip(self._hook_names, self._hook_dicts, self._hook_keys)
                    if tuple(d) != keys]
        changes += [f"{name} (changed in place)" for name, t, version in
                    zip(self._tensor_names, self._tensors, self._versions) if t._version != version]
        changes += [f"{name} (changed in place)" for name in self._held.changed()]
        return changes

    def same_objects(self) -> bool:
        """Whether the module still has the parameters, buffers and submodules :meth:`collect` read."""
        return ([id(p) for p in self.module.parameters()] == [id(p) for p in self.params]
                and [id(b) for b in self.module.buffers()] == [id(b) for b in self.buffers]
                and [id(m) for m in self.module.modules()] == [id(m) for m in self.modules])

    # ------------------------------------------------------------------ shared memory
    def bind(self, new_region: Callable[[int], Any]) -> None:
        """Lay the tensors out in a region from ``new_region(bytes)`` and rebind the module's tensors to it."""
        layout = self.layout = Layout(self.params, self.buffers)
        self.region = region = new_region(layout.size)
        self.param_strides = [dense_strides(p) for p in self.params]  # memory formats, kept in shared memory
        self.param_views = []
        for p, off, st in zip(self.params, layout.param_offsets, self.param_strides):
            v = region.standalone(off, p.dtype, p.shape, st)
            v.copy_(p.detach())
            self.param_views.append(v)
        self.buffer_views = []
        for b, off in zip(self.buffers, layout.buffer_offsets):
            v = region.standalone(off, b.dtype, b.shape)
            v.copy_(b.detach())
            self.buffer_views.append(v)
        bases = self.params + self.buffers
        for _, _, i, _, where in self.aliases:
            t, v = bases[i], (self.param_views + self.buffer_views)[i]
            if t.stride() != v.stride() and not (t.is_contiguous() and v.is_contiguous()):
                raise UnsupportedError(
                    f"{where} is a plain tensor attribute that views "
                    f"{(self.param_names + self.buffer_names)[i]}, whose shared copy is laid out row-major: "
                    "it cannot keep viewing it. Register it as a buffer, or compute it in forward()."
                )
        with torch.no_grad():
            for t, v in zip(bases, self.param_views + self.buffer_views):
                t.data = v
        self._move_aliases()
        self._ptrs = [t.data_ptr() for t in bases]

    def unbind(self) -> None:
        """Give every tensor still bound to the region private memory (a copy of its values), and the
        attributes that view one (an alias made after ``wrap()`` included) the same memory as before."""
        self._read_tensor_attributes(refuse=False)
        moved = set()
        with torch.no_grad():
            for i, (t, v) in enumerate(zip(self.params + self.buffers, self.param_views + self.buffer_views)):
                if t.data_ptr() == v.data_ptr():
                    t.data = v.clone()
                    moved.add(i)
        self._move_aliases(moved)

    def check_bindings(self) -> tuple[str, ...]:
        """Re-attach tensors the user replaced (``p.data = ...``, ``load_state_dict(assign=True)``,
        ``module.to(memory_format=...)``); return the names of those that came in another memory format,
        which their shared copy does not take (it keeps the layout it was given at ``wrap()``)."""
        relaid: tuple[str, ...] = ()  # (the empty tuple is shared: nothing is made before every forward)
        for i, t in enumerate(self.params + self.buffers):
            if t.data_ptr() != self._ptrs[i] and self._rebind(i, t):
                relaid += ((self.param_names + self.buffer_names)[i],)
        return relaid

    def _rebind(self, i: int, t: torch.Tensor) -> bool:
        """Copy ``t``'s values into tensor ``i``'s shared copy and point it there; True if ``t`` is dense in
        another layout than that copy's (its memory format is then lost)."""
        v = (self.param_views + self.buffer_views)[i]
        if t.shape != v.shape or t.dtype != v.dtype or t.device != v.device:
            name = (self.param_names + self.buffer_names)[i]
            raise ModelChangedError(
                f"{name} of the master module changed to {tuple(t.shape)}/{t.dtype}/{t.device} after "
                f"dpool.wrap() (it was {tuple(v.shape)}/{v.dtype}/{v.device}). The workers' replicas cannot follow a "
                "change of shape, dtype or device: close this model and dpool.wrap() the module again."
            )
        relaid = t.stride() != v.stride() and (t.is_contiguous() or dense_strides(t) is not None)
        with torch.no_grad():
            v.copy_(t.detach())
            t.data = v
        self._ptrs[i] = t.data_ptr()
        return relaid

    # ------------------------------------------------------------------ the model, shipped
    def pickle(self) -> bytes:
        """The module pickled with its tensors by reference; an unpicklable attribute is named in the error."""
        self._read_tensor_attributes()  # (now: an alias set after wrap() travels as one from its first shipping)
        ids: dict[int, tuple] = {}
        for i, p in enumerate(self.params):
            ids[id(p)] = ("p", i, p.requires_grad)
        for i, b in enumerate(self.buffers):
            ids.setdefault(id(b), ("b", i))
        n = len(self.params)
        for holder, key, i, offset, _ in self.aliases:
            a = _held.get(holder, key)
            if isinstance(a, torch.Tensor):
                ids.setdefault(id(a), ("a", "p" if i < n else "b", i if i < n else i - n, offset,
                                       dtype_name(a.dtype), tuple(a.shape), tuple(a.stride())))
        buf = io.BytesIO()
        try:
            _Pickler(buf, ids).dump(self.module)
        except Exception as exc:
            where = _unpicklable_attribute(self.module)
            raise UnpicklableModelError(
                f"dpool could not pickle the model to ship it to the workers: {exc}"
                + (f"\nThe culprit is {where}. Delete that attribute before dpool.wrap(), create it lazily "
                   "(e.g. in forward, or a property), or give its class a __getstate__ that leaves it out."
                   if where else "")
            ) from exc
        return buf.getvalue()

    # ------------------------------------------------------------------ changes after wrap()
    def watch(self) -> None:
        """Set :attr:`changed` on any assignment to a parameter, buffer or submodule of the module.

        torch's global registration hooks run on every such ``setattr``; the hook only sets the flag,
        and the coordinator compares identities (:meth:`same_objects`) before its next forward.
        """
        ref = weakref.ref(self)

        def changed(module: torch.nn.Module, name: str, value: Any) -> None:
            master = ref()
            if master is not None and id(module) in master._module_ids:
                master.changed = True

        self._hooks = [_module_hooks.register_module_parameter_registration_hook(changed),
                       _module_hooks.register_module_buffer_registration_hook(changed),
                       _module_hooks.register_module_module_registration_hook(changed)]

    def close(self) -> None:
        """Stop watching, give the tensors private memory, drop every view of the region."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.unbind()
        if self.region is not None:
            self.region.close_fd()
        self.param_views = self.buffer_views = []
        self.region = None
