"""Lightning's ``Trainer`` and ``Fabric`` with the module's forward on dpool workers: :class:`DpoolStrategy`.

>>> import lightning as L
>>> from dpool.integrations.lightning import DpoolStrategy
>>> L.Trainer(strategy=DpoolStrategy(device_ids=["cpu", "cpu"])).fit(module, loader)
>>> L.Trainer(strategy="dpool", accelerator="cpu", devices=2).fit(module, loader)   # once imported
>>> fabric = L.Fabric(strategy=DpoolStrategy(device_ids=["cpu", "cpu"]))

Requires ``pip install dpool[lightning]``.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator, Sequence

import lightning
import torch
from lightning.fabric.strategies import STRATEGY_REGISTRY as _FABRIC_REGISTRY
from lightning.fabric.strategies import DataParallelStrategy as _FabricDataParallelStrategy
from lightning.fabric.strategies import Strategy as _FabricStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.pytorch.accelerators import Accelerator as _TrainerAccelerator
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from torch import nn

from . import require
from ..devices import DeviceLike
from ..errors import UnsupportedError
from ..wrapper import DataParallel, is_wrapped, wrap

__all__ = ["DpoolStrategy"]

require("lightning", lightning.__version__, (2, 4))

_DESCRIPTION = "dpool: the module's forward on worker processes, one optimizer in this process"


class _ToPool:
    """Set as a LightningModule's ``_compiled_call_impl`` while it trains: ``self(x)`` in ``training_step``
    (which runs here) goes to the dpool model, whose workers run the module's own forward. torch drops this
    attribute when it pickles a module (and this object pickles and copies as ``None`` where a module's own
    ``__getstate__`` keeps it, as LightningModule's does), so the replicas call their forward as usual."""

    __slots__ = ("model",)

    def __init__(self, model: DataParallel) -> None:
        self.model = model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> None:
        return None

    def __reduce__(self) -> tuple:
        return _nothing, ()


def _nothing() -> None:
    return None


def _device_ids(given: Sequence[DeviceLike] | None, parallel_devices: Sequence[torch.device] | None) -> list:
    if given is not None:
        return list(given)
    return [str(d) if d.type == "cpu" else d for d in parallel_devices or [torch.device("cpu")]]


@contextlib.contextmanager
def _direct_calls(module: nn.Module) -> Iterator[list[str]]:
    """The names of ``module``'s children with trainable parameters that are called, in this process, within the
    block (a global forward pre-hook, removed after it). Under DpoolStrategy the module's own forward runs on the
    workers, so such a call comes from ``training_step`` itself. Children without parameters (metrics, losses)
    are left out: running them here is what they are for."""
    children = {id(c): n for n, c in module.named_children() if any(p.requires_grad for p in c.parameters())}
    called: list[str] = []

    def seen(child: nn.Module, inputs: Any) -> None:
        name = children.get(id(child))
        if name is not None and name not in called:
            called.append(name)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(seen)
    try:
        yield called
    finally:
        handle.remove()


def _refuse_many_processes(world_size: int, num_nodes: int) -> None:
    if world_size > 1 or num_nodes > 1:
        raise UnsupportedError(
            f"DpoolStrategy runs in one process on one machine; this run has {world_size} processes on "
            f"{num_nodes} node(s). Launch one process (no torchrun, num_nodes=1), or use dpool's cross-node "
            "mode (one dpool.wrap per machine under torchrun) in a loop of your own.")


class DpoolStrategy(ParallelStrategy):
    r"""Lightning strategy: the LightningModule's forward on dpool workers, everything else in this process.

    ``training_step``, ``self.log``, metrics, callbacks and the optimizer run in the main process, on
    the bare module; what ``self(x)`` computes (the module's ``forward`` and the child modules it calls)
    runs on the workers, under ``nn.DataParallel``'s semantics (each worker's BatchNorm sees its shard).
    A child module called directly from ``training_step`` (``self.encoder(x)``) runs in this process.
    Checkpoints hold the bare module's keys (``MyModule.load_from_checkpoint(path)`` works), and
    ``accumulate_grad_batches`` holds gradients on the workers until the last micro-batch.

    The same object works with ``lightning.Fabric(strategy=DpoolStrategy(...))``: ``fabric.setup(model,
    opt)`` wraps the model with :func:`dpool.wrap`, and ``fabric.no_backward_sync(model)`` is its
    :meth:`~dpool.DataParallel.no_sync`.

    Args:
        device_ids (list of int, str or torch.device, optional): one worker per entry, as
            :func:`dpool.wrap`'s. Default: the Trainer's ``devices`` (``accelerator="cpu", devices=4``:
            four CPU workers).
        **dpool_options: other keyword arguments of :func:`dpool.wrap` (``worker_threads``,
            ``max_restarts``, ``buffers``...).

    Raises:
        UnsupportedError: at setup, in a run of several processes or nodes.
    """

    strategy_name = "dpool"
    _precision = None  # (what Fabric's connector reads of a strategy it is given, before it converts it)

    def __init__(self, device_ids: Sequence[DeviceLike] | None = None, **dpool_options: Any) -> None:
        super().__init__()
        self._dpool_device_ids = None if device_ids is None else list(device_ids)
        self._dpool_options = dpool_options
        self._dpool: DataParallel | None = None
        self._num_nodes = 1
        self._direct_calls_checked = False

    # Lightning's Trainer sets its own accelerator here; Fabric's connector sets one of its own. That is
    # where this object learns which API it serves, and becomes Fabric's kind of strategy for Fabric.
    @property
    def accelerator(self) -> Any:
        return self._accelerator

    @accelerator.setter
    def accelerator(self, accelerator: Any) -> None:
        if accelerator is not None and not isinstance(accelerator, _TrainerAccelerator):
            _become_fabric(self)
        self._accelerator = accelerator

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def root_device(self) -> torch.device:
        devices = self.parallel_devices
        return devices[0] if devices else torch.device("cpu")

    @property
    def is_distributed(self) -> bool:
        return False

    @property
    def distributed_sampler_kwargs(self) -> None:  # type: ignore[override]
        return None

    def setup_environment(self) -> None:
        env = self.cluster_environment
        _refuse_many_processes(env.world_size() if env is not None else 1, self._num_nodes)
        super().setup_environment()

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        module = self.lightning_module
        assert module is not None
        self._dpool = wrap(module, _device_ids(self._dpool_device_ids, self.parallel_devices), **self._dpool_options)
        module._compiled_call_impl = _ToPool(self._dpool)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._direct_calls_checked or self.lightning_module is None:
            return super().training_step(*args, **kwargs)
        self._direct_calls_checked = True  # (the first step's calls tell)
        with _direct_calls(self.lightning_module) as called:
            out = super().training_step(*args, **kwargs)
        if called:
            module = type(self.lightning_module).__name__
            warnings.warn(
                f"{module}.training_step calls {', '.join(f'self.{n}' for n in called)} directly: that runs in this "
                "process, on the master module, not on dpool's workers (they run what self(...) computes: the "
                "module's forward). Call it from forward() and use self(...) in training_step.", UserWarning)
        return out

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        if self._dpool is None:
            yield
            return
        with self._dpool.no_sync():
            yield

    def reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return tensor

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        pass

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        return tensor

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return decision

    def teardown(self) -> None:
        model, self._dpool = self._dpool, None
        module = self.lightning_module
        if module is not None and isinstance(module.__dict__.get("_compiled_call_impl"), _ToPool):
            module._compiled_call_impl = None
        if model is not None:
            model.close()
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("dpool", cls, description=_DESCRIPTION)


class _Sync(_BackwardSyncControl):
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> Any:
        return module.no_sync() if enabled and is_wrapped(module) else contextlib.nullcontext()


class _FabricDpoolStrategy(_FabricDataParallelStrategy):
    """What a :class:`DpoolStrategy` becomes when Fabric's connector sets it up (see its ``accelerator``): Fabric's
    one-process ``DataParallelStrategy`` (which Fabric runs without ``launch()``), with dpool in DataParallel's place."""

    def __init__(self, device_ids: Sequence[DeviceLike] | None = None, **dpool_options: Any) -> None:
        super().__init__()
        self._dpool_device_ids = None if device_ids is None else list(device_ids)
        self._dpool_options = dpool_options
        self._dpool: DataParallel | None = None
        self._backward_sync_control = _Sync()

    @property
    def root_device(self) -> torch.device:
        devices = self.parallel_devices
        return devices[0] if devices else torch.device("cpu")

    @property
    def distributed_sampler_kwargs(self) -> None:  # type: ignore[override]
        return None

    def setup_environment(self) -> None:
        env = self.cluster_environment
        _refuse_many_processes(env.world_size() if env is not None else 1, 1)
        super().setup_environment()

    def module_to_device(self, module: nn.Module) -> None:
        module.to(self.root_device)

    def setup_module(self, module: nn.Module) -> nn.Module:
        if self._dpool is not None:
            self._dpool.close()
        self._dpool = wrap(module, _device_ids(self._dpool_device_ids, self.parallel_devices), **self._dpool_options)
        return self._dpool

    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        return super().get_module_state_dict(module.module if is_wrapped(module) else module)

    def load_module_state_dict(self, module: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        super().load_module_state_dict(module.module if is_wrapped(module) else module, state_dict, strict=strict)

    def all_reduce(self, collection: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return collection

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        pass

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return decision

    def teardown(self) -> None:
        model, self._dpool = self._dpool, None
        if model is not None:
            model.close()
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        pass


def _become_fabric(strategy: DpoolStrategy) -> None:
    device_ids, options = strategy._dpool_device_ids, strategy._dpool_options
    strategy.__dict__.clear()
    strategy.__class__ = _FabricDpoolStrategy  # type: ignore[assignment]
    _FabricDpoolStrategy.__init__(strategy, device_ids, **options)  # type: ignore[arg-type]


_FabricStrategy.register(DpoolStrategy)  # Fabric's connector accepts it; its accelerator setter converts it
DpoolStrategy.register(_FabricDpoolStrategy)  # isinstance(fabric.strategy, DpoolStrategy) stays true
if "dpool" not in StrategyRegistry:
    DpoolStrategy.register_strategies(StrategyRegistry)
if "dpool" not in _FABRIC_REGISTRY:
    _FABRIC_REGISTRY.register("dpool", DpoolStrategy, description=_DESCRIPTION)
