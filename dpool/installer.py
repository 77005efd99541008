"""``dpool.install()``: torch's ``DataParallel`` names, HF's ``Trainer`` and Lightning's ``strategy="dp"`` on dpool.

What ``python -m dpool script.py`` does before it runs the script, for code that builds its own
``nn.DataParallel`` (a script, a recipe, HF Trainer's multi-GPU path) or asks Lightning for "dp". The names are
replaced where torch defines them, so code that looks them up at call time (``nn.DataParallel(model)``) gets
dpool's; a module that copied torch's class under its own name before ``install()`` keeps torch's, and is named
in a warning. Libraries imported later are patched as they load (an import hook that watches two modules).
"""
from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import sys
import threading
import warnings
from types import ModuleType
from typing import Any, Callable, Iterator, Sequence

import torch.nn
import torch.nn.parallel
from torch import nn

from .devices import DeviceLike, parse_devices
from .errors import UnsupportedError
from .functional import data_parallel as _dpool_data_parallel
from .wrapper import DataParallel as _DpoolDataParallel

__all__ = ["install", "uninstall", "installed"]

_torch_dp_module = sys.modules["torch.nn.parallel.data_parallel"]
_TORCH_CLASS = _torch_dp_module.DataParallel
_TORCH_FUNCTION = _torch_dp_module.data_parallel
# Where torch defines the two names (the attribute's owner and its name): what install() replaces.
_CLASS_SITES = ((torch.nn, "DataParallel"), (torch.nn.parallel, "DataParallel"), (_torch_dp_module, "DataParallel"))
_FUNCTION_SITES = ((torch.nn.parallel, "data_parallel"), (_torch_dp_module, "data_parallel"))
# The methods of torch's class that a subclass may override and dpool never calls (its replicas run in workers).
_NOT_CALLED = ("scatter", "gather", "replicate", "parallel_apply")

_lock = threading.RLock()
_options: dict[str, Any] | None = None  # the installation: wrap()'s keyword arguments, device_ids among them
_reported: set[str] = set()


class DataParallel(_DpoolDataParallel):
    r"""What ``torch.nn.DataParallel`` is while dpool is installed: ``nn.DataParallel``'s constructor, dpool's model.

    Takes torch's arguments; the installation's ``device_ids`` (when given) replace the script's, together with its
    ``output_device``, and its other options apply. The workers start at the first forward, so that
    ``nn.DataParallel(model).cuda()`` works. A subclass may override ``forward`` (it runs in this process, around
    dpool's); one that overrides ``scatter``, ``gather``, ``replicate`` or ``parallel_apply`` is refused, since dpool
    never calls them.
    """

    def __init__(self, module: nn.Module, device_ids: Sequence[DeviceLike] | None = None,
                 output_device: DeviceLike | None = None, dim: int = 0) -> None:
        _refuse_overrides(type(self))
        options = dict(_options or {})
        chosen = options.pop("device_ids", None)
        if chosen is not None:
            device_ids, output_device = chosen, None
        super().__init__(module, device_ids, output_device, dim, **options)


DataParallel.__module__ = __name__


def _refuse_overrides(cls: type) -> None:
    for klass in cls.__mro__:
        if klass is DataParallel:
            return
        for name in _NOT_CALLED:
            if name in vars(klass):
                raise UnsupportedError(
                    f"{klass.__module__}.{klass.__qualname__} overrides nn.DataParallel.{name}, which dpool's "
                    f"DataParallel (put in torch's place by dpool.install() or python -m dpool) never calls: its "
                    "replicas run in worker processes. Drop the override (an overridden forward is kept), or create "
                    "the class with torch's DataParallel: call dpool.uninstall() before the class statement, or run "
                    "the script without dpool.")


def _data_parallel(module: nn.Module, inputs: Any, device_ids: Sequence[DeviceLike] | None = None,
                   output_device: DeviceLike | None = None, dim: int = 0,
                   module_kwargs: dict[str, Any] | None = None) -> Any:
    """What ``torch.nn.parallel.data_parallel`` is while dpool is installed (see :func:`dpool.data_parallel`)."""
    chosen = (_options or {}).get("device_ids")
    if chosen is not None:
        device_ids, output_device = chosen, None
    return _dpool_data_parallel(module=module, inputs=inputs, device_ids=device_ids, output_device=output_device,
                                dim=dim, module_kwargs=module_kwargs)


_data_parallel.__name__ = _data_parallel.__qualname__ = "data_parallel"


def install(device_ids: Sequence[DeviceLike] | None = None, **options: Any) -> None:
    r"""Run the ``nn.DataParallel`` that code builds for itself, HF Trainers and Lightning's "dp" on dpool.

    While installed:

    * ``torch.nn.DataParallel`` (and ``torch.nn.parallel.DataParallel``,
      ``torch.nn.parallel.data_parallel.DataParallel``) is dpool's, with torch's constructor: its workers start
      at the first forward; a module wrapped again while a pool of it is alive joins that pool;
    * ``torch.nn.parallel.data_parallel`` is :func:`dpool.data_parallel`;
    * every ``transformers.Trainer`` made, subclasses included, is a
      :class:`~dpool.integrations.transformers.DpoolTrainer` (its forwards on the workers);
    * Lightning's ``Trainer(strategy="dp")`` and ``Fabric(strategy="dp")`` get a
      :class:`~dpool.integrations.lightning.DpoolStrategy`.

    Code that looks these names up when it runs sees dpool's, whether it was imported before or after. A module
    that bound torch's class or function under a name of its own before ``install()`` keeps torch's: it is named
    in a ``UserWarning`` (once per name). Calling it again replaces the options; :func:`uninstall` puts torch's
    objects back.

    Args:
        device_ids (list of int, str or torch.device, optional): the workers of every model built while installed,
            in place of the ``device_ids`` and ``output_device`` the code passes. Default: what the code passes;
            for a ``DataParallel`` given none, every visible GPU, or one CPU worker per physical core; for a
            Trainer, the Trainer's devices.
        **options: :func:`dpool.wrap`'s other keyword arguments (``max_restarts``, ``buffers``...), for every
            model built while installed.

    Example::

        >>> dpool.install(device_ids=["cpu", "cpu"])
        >>> model = torch.nn.DataParallel(net)    # dpool's: workers start at its first forward
        >>> dpool.uninstall()                     # torch.nn.DataParallel is torch's again
    """
    global _options
    if device_ids is not None:
        device_ids = parse_devices(device_ids)  # (a bad entry is an error here, before anything runs)
    with _lock:
        _options = {**options, "device_ids": device_ids}
        for owner, name in _CLASS_SITES:
            setattr(owner, name, DataParallel)
        for owner, name in _FUNCTION_SITES:
            setattr(owner, name, _data_parallel)
        _report_early_bindings()
        _hooks.arm()


def uninstall() -> None:
    """Put torch's ``DataParallel`` and ``data_parallel`` back (the same objects), and undo :func:`install`'s
    Trainer and Lightning changes. Models built while installed stay dpool models. Does nothing if not installed."""
    global _options
    with _lock:
        if _options is None:
            return
        _options = None
        for owner, name in _CLASS_SITES:
            setattr(owner, name, _TORCH_CLASS)
        for owner, name in _FUNCTION_SITES:
            setattr(owner, name, _TORCH_FUNCTION)
        _hooks.disarm()


@contextlib.contextmanager
def installed(device_ids: Sequence[DeviceLike] | None = None, **options: Any) -> Iterator[None]:
    """:func:`install` for the ``with`` block; the installation in effect before it (or none) comes back after.

    Example::

        >>> with dpool.installed(device_ids=["cpu", "cpu"]):
        ...     trainer = transformers.Trainer(model=model, args=args, train_dataset=ds)   # a DpoolTrainer
        ...     trainer.train()
    """
    before = None if _options is None else dict(_options)
    install(device_ids, **options)
    try:
        yield
    finally:
        if before is None:
            uninstall()
        else:
            install(**before)


def _report_early_bindings() -> None:
    """Warn, once per name, about modules that hold torch's class or function under a name of their own."""
    sites = {id(owner) for owner, _ in _CLASS_SITES + _FUNCTION_SITES}
    found = []
    for module in list(sys.modules.values()):
        if not isinstance(module, ModuleType) or id(module) in sites or module.__name__.split(".")[0] == "dpool":
            continue
        try:
            names = list(vars(module).items())
        except TypeError:
            continue
        for name, value in names:
            if value is _TORCH_CLASS or value is _TORCH_FUNCTION:
                where = f"{module.__name__}.{name}"
                if where not in _reported:
                    _reported.add(where)
                    found.append(where)
    if found:
        warnings.warn(
            f"dpool.install(): {', '.join(found)} still name{'s' if len(found) == 1 else ''} torch's DataParallel "
            "(bound before install()); code that calls it by that name runs torch's. Install dpool before "
            "importing that code (python -m dpool does), or call nn.DataParallel by its torch name.",
            UserWarning, stacklevel=3)


# ------------------------------------------------------------------------------------- the libraries
def _patch_transformers(trainer_module: ModuleType) -> Callable[[], None]:
    """Every Trainer made from now on is a DpoolTrainer: ``Trainer.__new__`` makes it an instance of a subclass
    of its class with :class:`DpoolTrainerMixin` first (so ``isinstance`` and the subclass's overrides hold)."""
    trainer = trainer_module.Trainer
    had = "__new__" in vars(trainer)
    before = vars(trainer).get("__new__")

    def __new__(cls: type, *args: Any, **kwargs: Any) -> Any:
        if _options is not None:
            from .integrations.transformers import installed_trainer_class

            cls = installed_trainer_class(cls, _options)
        return object.__new__(cls)

    trainer.__new__ = __new__

    def undo() -> None:
        # (a __new__ of its own is put back; else ours stays, inert while uninstalled: deleting a __new__ set on a
        # class leaves CPython passing the constructor's arguments to object.__new__, which refuses them)
        if had:
            trainer.__new__ = before

    return undo


def _patch_lightning(connector_module: ModuleType, class_name: str) -> Callable[[], None]:
    """``strategy="dp"`` reaches the connector of Lightning's Trainer (or Fabric's) as a DpoolStrategy."""
    connector = getattr(connector_module, class_name)
    init = connector.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if _options is not None and kwargs.get("strategy") == "dp":
            from .integrations.lightning import DpoolStrategy

            options = dict(_options)
            kwargs["strategy"] = DpoolStrategy(options.pop("device_ids"), **options)
        init(self, *args, **kwargs)

    connector.__init__ = __init__

    def undo() -> None:
        connector.__init__ = init

    return undo


_WATCHED: dict[str, Callable[[ModuleType], Callable[[], None]]] = {
    "transformers.trainer": _patch_transformers,
    "lightning.pytorch.trainer.connectors.accelerator_connector":
        lambda m: _patch_lightning(m, "_AcceleratorConnector"),
    "lightning.fabric.connector": lambda m: _patch_lightning(m, "_Connector"),
}


class _Hooks(importlib.abc.MetaPathFinder):
    """Patches the watched modules: at once if loaded, else as they load (a finder first on ``sys.meta_path``)."""

    def __init__(self) -> None:
        self.undo: dict[str, Callable[[], None]] = {}

    def arm(self) -> None:
        for name, patch in _WATCHED.items():
            module = sys.modules.get(name)
            if module is not None and name not in self.undo:
                self.undo[name] = patch(module)
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def disarm(self) -> None:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        for undo in self.undo.values():
            undo()
        self.undo.clear()

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in _WATCHED or name in self.undo:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchAfter(spec.loader, self, name)
                return spec
        return None


class _PatchAfter(importlib.abc.Loader):
    """A loader that runs the module's own loader, then the patch of the module."""

    def __init__(self, loader: Any, hooks: _Hooks, name: str) -> None:
        self.loader, self.hooks, self.name = loader, hooks, name

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        with _lock:
            if _options is not None and self.name not in self.hooks.undo:
                self.hooks.undo[self.name] = _WATCHED[self.name](module)

    def __getattr__(self, name: str) -> Any:  # (get_resource_reader, is_package...: the module's own loader's)
        return getattr(self.loader, name)


_hooks = _Hooks()
