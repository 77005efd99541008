"""``dpool.DataParallel``: ``nn.DataParallel``'s API, with replicas in long-lived worker processes."""
from __future__ import annotations

import collections
import functools
import contextlib
import inspect
import os
import sys
import threading
import warnings
import weakref
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from . import knobs
from .step import Runtime
from .step.state import Options
from .config import Config
from .cpus import local_share, physical_cores
from .crossnode import CrossNode, resolve_group
from .devices import DeviceLike, check_devices, parse_devices, pool_devices
from .errors import DpoolTypeError, DpoolValueError, PoolBrokenError, UnsupportedError

__all__ = ["DataParallel", "wrap", "unwrap", "is_wrapped"]

class DataParallel(nn.DataParallel):
    r"""Data parallelism over long-lived worker processes, with ``nn.DataParallel``'s API.

    The module is replicated once into one worker process per entry of
    ``device_ids``. Each forward call splits the inputs along ``dim`` into even
    shards, runs each shard on a replica, and gathers the outputs on
    ``output_device``. ``loss.backward()`` runs the replicas' backward passes
    and sums their parameter gradients into the master module's ``.grad``, so
    a single optimizer on ``model.parameters()`` trains every replica.

    Constructing it checks the arguments only: the workers start at the first
    forward (or :meth:`no_sync`, :meth:`stats`, :meth:`worker_states`), from the
    module as it is then (``DataParallel(net).cuda()`` works); :func:`wrap`
    starts them at once. A live pool of the module started with the same
    arguments is joined, not started again.

    On CPU the master's parameters live in shared memory and the replicas use
    them directly: an optimizer step reaches every worker with no copy. On GPUs
    they live in a GPU buffer shared over CUDA IPC, used directly by the workers
    on the master's GPU and copied to the others before each forward.

    Args:
        module (nn.Module): module to parallelize; it becomes ``self.module``
            (the master) and must be on the CPU for CPU workers, on
            ``device_ids[0]`` for GPU workers (as ``nn.DataParallel`` requires).
        device_ids (list of int, str or torch.device, optional): one worker per
            entry. ``"cpu"`` entries are CPU worker processes; GPU entries are GPU
            worker processes, and may repeat (``[0, 0]``: two workers on GPU 0).
            Default: where the module is when the workers start: every visible
            GPU for a module on a GPU, one CPU worker per physical core this
            process may run on (its affinity mask) for a module on the CPU.
        output_device (int, str or torch.device, optional): where outputs are
            gathered: ``device_ids[0]`` by default for GPU workers (``-1`` or
            ``"cpu"``: the CPU); the CPU for CPU workers.
        dim (int): dimension along which inputs are split and outputs
            concatenated. Default: 0.
        worker_threads (int, optional): torch threads per worker. Default:
            the physical cores this process may run on divided by the number of
            workers (at least 1).
        max_restarts (int): how many worker deaths or hangs to survive. The
            failed call still raises (and changes nothing); the worker is
            respawned and re-synced from the master, and the next call works.
            Default: 0, a dead worker breaks the pool (every later call raises).
        buffers (str): how replica buffer updates reach the master: ``"first"``
            (DataParallel's: the first shard's), ``"average"`` (shard-size
            weighted mean) or ``"sync"`` (BatchNorm running statistics equal to
            one BatchNorm over the whole batch). Default: ``"first"``.
        shard_weights (list of float, optional): the share of each batch each
            worker gets (e.g. ``[2, 1]``); default: even shards.
        balance (str, optional): ``"auto"`` derives the shares from measured
            per-worker step times, so a slower worker gets a smaller shard.
        pool (str, optional): attach to the warm workers of the running
            ``dpool-workers`` pool of that name instead of spawning workers (also
            chosen by the ``DPOOL_POOL`` environment variable). ``"tcp://HOST:PORT"``
            attaches to a pool started with ``--listen``; the ``DPOOL_KEY_FILE``
            environment variable then names a 0600 copy of the pool's key.
        gather (bool): ``False`` keeps outputs on the workers: a forward returns a
            :class:`dpool.ShardedOutput` for :func:`dpool.criterion` (loss computed on
            the workers) or for ``.gather()``. A training forward of CPU workers then waits
            for its loss and goes to the workers with it, in one round (its errors are
            raised by the criterion; ``DPOOL_FORWARD_WITH_LOSS=off`` sends it at once; see
            docs/features.md). Default: ``True``.
        process_group (optional): cross-node mode, one dpool node per machine under
            ``torchrun``: ``"auto"`` (the default group, when ``torch.distributed`` is
            initialised with more than one rank), ``None`` to stay on this node, or a
            ``torch.distributed`` group. The nodes' gradients are averaged (DDP's
            convention), parameters and buffers are taken from rank 0 at ``wrap()``; see
            docs/multinode.md. Default: ``"auto"``.
        coordinator_threads (int, optional): torch threads of this process
            while the pool is open, so that it does not compete with the
            workers for cores; restored by :meth:`close`. ``None`` leaves the
            setting alone. Default: 1.
        config (Config, optional): timeouts and limits; keyword arguments
            matching :class:`dpool.Config` fields override single values.

    Example::

        >>> net = torch.nn.Linear(10, 2)
        >>> model = dpool.DataParallel(net, device_ids=["cpu", "cpu"])
        >>> out = model(torch.randn(8, 10))      # starts 2 workers; shards of 4 rows
        >>> out.sum().backward()                 # net.weight.grad is filled
        >>> model.close()

    Attributes that the model lacks are the master module's (``model.generate(...)``,
    ``model.config``), run in this process as they would be unwrapped.

    .. note::
        Buffers follow DataParallel: updates made by the replica of the first
        shard (e.g. BatchNorm running statistics) are copied to the master
        after every successful forward; the other shards' updates are dropped.
        Python attribute changes made inside replicas stay in the workers.
    """

    _is_dpool_wrapped = True
    device_ids: list[str]
    _start_with: Any  # what starts the workers (see _start); None once a cross-node pool started

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[DeviceLike] | None = None,
        output_device: DeviceLike | None = None,
        dim: int = 0,
        *,
        worker_threads: int | None = None,
        coordinator_threads: int | None = 1,
        max_restarts: int = 0,
        buffers: str = "first",
        shard_weights: Sequence[float] | None = None,
        balance: str | None = None,
        gather: bool = True,
        pool: str | None = None,
        process_group: Any = "auto",
        config: Config | None = None,
        **options: Any,
    ) -> None:
        # A subclass of nn.DataParallel, so that code which unwraps by type (HF Trainer, timm, Lightning:
        # isinstance(model, nn.DataParallel) → model.module) treats dpool alike; DataParallel's own
        # __init__ (CUDA device checks and replication setup) is deliberately not run.
        nn.Module.__init__(self)
        torch._C._log_api_usage_once("dpool.DataParallel")
        if not isinstance(module, nn.Module):
            raise DpoolTypeError(f"dpool.wrap expects an nn.Module, got {type(module).__name__}")
        self._wrap_args: tuple | None = None  # set by wrap(), which compares it
        pool = pool if pool is not None else knobs.get("DPOOL_POOL")
        group = resolve_group(process_group)
        if pool is not None:  # attach to a running dpool-workers daemon: its devices
            devices = pool_devices(pool)
            if device_ids is not None and parse_devices(device_ids) != devices:
                raise DpoolValueError(f"device_ids {list(device_ids)} differ from pool {pool!r}'s devices {devices}")
        else:
            devices = parse_devices(device_ids, module)
        if not isinstance(dim, int) or dim < 0:
            raise DpoolValueError(f"dim must be a non-negative int, got {dim!r}")
        if not isinstance(max_restarts, int) or max_restarts < 0:
            raise DpoolValueError(f"max_restarts must be a non-negative int, got {max_restarts!r}")
        self.module = module
        self.dim = dim
        cfg = (config or Config()).replace(**options) if options else (config or Config())
        # device_ids=None: the workers go where the module is when they start (see _start)
        self._follow = device_ids is None and pool is None and group is None
        self._settings = (output_device, dim, cfg, worker_threads, max_restarts, buffers, shard_weights, balance,
                          gather, pool)
        self._place(devices)
        self._saved_threads: int | None = None
        self._runtime: Runtime | None = None
        self._closing: Runtime | None = None  # a close() cut short (Ctrl-C): the next close() finishes it
        self._close_lock, self._owner_thread = threading.Lock(), threading.get_ident()
        self._sharing: weakref.WeakSet[DataParallel] = weakref.WeakSet([self])  # the open models on this pool
        self._lazy, self._reopens, self._coordinator_threads = True, False, coordinator_threads  # (see _live)
        self._nodes: CrossNode | None = None
        if group is not None:  # (every rank joins here, at one point of the script: the pool starts now)
            self._nodes = CrossNode(group, cfg, torch.device(devices[0]), auto=isinstance(process_group, str))
            self._start_with = functools.partial(_join_nodes, self._nodes, module, len(devices), self._start_with)
            self._start()
            self._start_with = None  # (a cross-node pool is the job's: it is never started again)

    def _place(self, devices: list[str]) -> None:
        """Put the workers on ``devices``; what follows from them is :func:`_start_key`'s."""
        self.device_ids, (self.output_device, self._key) = devices, _start_key(devices, self._settings)
        self._start_with = functools.partial(Runtime, self.module, self._key)

    def __getattr__(self, name: str) -> Any:
        # what neither this model nor nn.Module has is the master's (model.generate, model.config), run here
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None or name.startswith("__"):
                raise
            return getattr(module, name)

    def _forward(self, *inputs: Any, **kwargs: Any) -> Any:
        # Not traceable on purpose: a step talks to other processes. Under torch.compile(dpool.wrap(net))
        # the dispatch runs eagerly (a dynamo-disabled call) instead of breaking the graph, with a warning,
        # at every socket and file call; compile inside (dpool.wrap(torch.compile(net))) instead. Only
        # when Dynamo is loaded: importing it costs ~1.5 s, which `import dpool` must not pay.
        if "torch._dynamo" in sys.modules:
            return _not_traced()(self, inputs, kwargs)
        return self._dispatch(inputs, kwargs)

    def _dispatch(self, inputs: tuple, kwargs: dict) -> Any:
        rt = self._runtime
        return (rt if rt is not None else self._live()).forward(inputs, kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Keep parameter gradients on the workers during gradient accumulation.

        Backward passes inside the context accumulate gradients in each worker; the first backward after leaving it
        transfers the accumulated sum once, as ``DistributedDataParallel.no_sync`` does. Input gradients are
        returned as usual. The master's ``.grad`` is only updated by that first backward outside the context; until
        then each parameter with a held gradient has a zero ``.grad`` there. As with DDP, whose ``.grad`` holds
        them, ``zero_grad()`` in between drops the held gradients, and an optimizer step over them raises
        ``UnsupportedError`` (see ``dpool/accumulate.py``). While a hook is registered on a master parameter
        (``register_hook``, ``register_post_accumulate_grad_hook``), nothing is held: each backward reduces as
        outside the context, so the hook sees every micro-batch's gradient, as in one process.
        """
        rt = self._live()
        old, rt.no_sync = rt.no_sync, True
        try:
            yield
        finally:
            rt.no_sync = old

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load a checkpoint saved with or without the ``module.`` prefix.

        Accepts ``model.state_dict()`` of a dpool model or of ``nn.DataParallel``
        (``module.``-prefixed keys), and ``module.state_dict()`` of a plain module.
        The values reach the workers before the next forward.
        """
        if state_dict and not any(k.startswith("module.") for k in state_dict):
            prefixed = collections.OrderedDict(("module." + k, v) for k, v in state_dict.items())
            meta = getattr(state_dict, "_metadata", None)
            if meta is not None:
                prefixed._metadata = collections.OrderedDict(  # type: ignore[attr-defined]
                    (("module." + k) if k else "module", v) for k, v in meta.items()
                )
            state_dict = prefixed
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def worker_states(self, fn: Any) -> list[Any]:
        """Run ``fn(replica)`` in every worker and return the results, one per worker.

        Use it to read state that replicas keep in Python attributes (counters,
        caches), which never reaches the master.
        """
        return self._live().call_workers(fn)

    def stats(self, inspect: bool = False) -> dict[str, Any]:
        """Timings and traffic of the latest step, per worker.

        Args:
            inspect: also ask every worker what it holds (one round trip to the workers; raises like a forward if the
                pool is broken): per worker, ``graphs_kept`` (autograd graphs it keeps for outputs you can still
                backpropagate through; a number that grows step after step means something holds on to old outputs)
                and ``rss_bytes`` (its resident memory).

        Returns:
            dict: ``steps`` (forwards so far), ``restarts`` (workers respawned), ``shard_rows`` (rows per shard of the
            latest forward), ``workers`` (per worker: ``index``, ``device``, ``pid``, ``forward_ms`` and
            ``backward_ms``, the time its handler took in the latest forward and backward; ``forward_request_ms``,
            ``forward_reply_ms``, ``backward_request_ms`` and ``backward_reply_ms``, the time its request took to
            reach the handler and its reply to be read back; with ``inspect``, ``graphs_kept`` and ``rss_bytes``),
            ``round_ms`` (``forward``, ``backward``: each round's wall time, 0 for a backward that the loss round
            already ran; a forward sent with its loss counts the whole round, loss included) and ``bytes_per_step``
            (``inputs``, ``outputs``, ``output_grads`` and ``param_grads`` moved through shared memory in the latest
            step), ``backward_rounds_saved`` (backwards of a :class:`dpool.criterion`'s loss that the workers had
            already run in the loss round), ``forward_rounds_saved`` (``gather=False`` forwards that went to the
            workers with their loss, in one round: see "Loss on the workers" in docs/features.md), ``rounds_spun``
            (rounds so far whose replies the coordinator caught while it spun instead of sleeping: short rounds, see
            ``DPOOL_WAIT_SPIN_US`` in docs/knobs.md).
        """
        rt = self._live()
        held = rt.inspect() if inspect else None
        return rt.stats.snapshot([w.pid for w in rt.pool.workers], self.device_ids, held, rt.pool.rounds_spun)

    @property
    def rank(self) -> int:
        """This node's rank in cross-node mode (0 otherwise)."""
        return self._nodes.rank if self._nodes is not None else 0

    @property
    def world_size(self) -> int:
        """The number of nodes in cross-node mode (1 otherwise)."""
        return self._nodes.size if self._nodes is not None else 1

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0 (the node that saves checkpoints and logs); ``True`` on one node."""
        return self.rank == 0

    @property
    def pids(self) -> list[int]:
        """Process ids of the workers, in device order."""
        rt = self._runtime
        return [] if rt is None else [w.pid for w in rt.pool.workers]

    def close(self) -> None:
        """Stop the workers and free shared memory. The master module stays usable.

        Idempotent and thread-safe: a call that finds a close already running in
        another thread waits for it, so when any ``close()`` returns the workers
        are reaped and the parameters live in private memory again. A close cut
        short (Ctrl-C) is finished by the next one.
        """
        with self._close_lock:
            self._lazy = False
            rt = self._runtime
            others = [m for m in self._sharing if m is not self and m._runtime is rt] if rt is not None else []
            if others:  # another model of this module still uses the pool: it stays
                self._runtime = None
                _BOUND[self.module] = weakref.ref(others[0])
                self._sharing.discard(self)
            else:
                # _closing first: a close cut short (Ctrl-C) anywhere after it is finished by the next one
                self._closing = rt or self._closing
                self._runtime = None  # (the model reads as closed from here on)
                if self._closing is not None:
                    self._closing.close()
                    self._closing = None
            # torch's thread count belongs to the thread that set it (OpenMP keeps it per thread):
            # restore it there, and never call into torch's pools from another thread at close.
            if self._saved_threads is not None and threading.get_ident() == self._owner_thread:
                torch.set_num_threads(self._saved_threads)
                self._saved_threads = None

    def _start(self) -> Runtime | None:
        """Start the workers, if this model has none: join a live pool of the module started with the same
        arguments, or close one started with others (a module is never bound to two pools) and start a new one.
        The trainer integrations start theirs again after a close (``_reopens``)."""
        with self._close_lock:
            if self._runtime is not None or self._start_with is None or self._closing is not None:
                return self._runtime
            self._lazy = False
            devices = parse_devices(None, self.module) if self._follow else self.device_ids
            if devices != self.device_ids:  # the module moved since (DataParallel(net).cuda())
                self._place(devices)
            old = _bound_model(self.module)
            if old is not None and old._key == self._key:  # (its lock may be this one: no close)
                self._runtime, self._sharing, self._close_lock = old._runtime, old._sharing, old._close_lock
                self._sharing.add(self)
                return self._runtime
            if old is not None:
                warnings.warn(
                    f"this module is already bound to a live dpool pool (workers {old.pids}, device_ids "
                    f"{old.device_ids}); closing that pool before wrapping it again with other arguments. To keep "
                    "it, reuse the model dpool.wrap() returned, or call dpool.wrap() with the same arguments.",
                    UserWarning, stacklevel=3)
                old._close_pool()
            self._runtime = self._start_with()
            self._sharing = weakref.WeakSet([self])
            _BOUND[self.module] = weakref.ref(self)
            if self._coordinator_threads is not None and threading.get_ident() == self._owner_thread:
                self._saved_threads = torch.get_num_threads()
                torch.set_num_threads(self._coordinator_threads)
            return self._runtime

    def _live(self) -> Runtime:
        """The runtime; started first if not yet (``_lazy``) or if closed and reopened by use (``_reopens``)."""
        rt = self._runtime
        if rt is None and (self._lazy or self._reopens):
            rt = self._start()
        if rt is None:
            raise PoolBrokenError(
                "this dpool model is closed; call model.module(...) or dpool.unwrap(model), or wrap it again")
        return rt

    def _close_pool(self) -> None:
        """Close the pool itself: every model on it reads as closed."""
        for model in list(self._sharing):
            if model is not self:
                model._runtime = None
        self._sharing.clear()
        self.close()

    def __enter__(self) -> "DataParallel":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __reduce_ex__(self, protocol: Any) -> Any:
        """``copy.deepcopy(model)`` and ``torch.save(model, f)`` give a plain copy of the master module.

        A copy never starts worker processes of its own (EMA helpers such as
        ``torch.optim.swa_utils.AveragedModel`` and best-model snapshots deep-copy the
        model they are given); wrap the copy with :func:`dpool.wrap` to train it in parallel.
        """
        warnings.warn(
            "copying or pickling a dpool model gives a plain copy of its master module (model.module), "
            "without worker processes; wrap the copy with dpool.wrap() to train it in parallel",
            UserWarning, stacklevel=3)
        return _master_copy, (self.module,)

    @property
    def _ddp_params_and_buffers_to_ignore(self) -> Any:
        # DistributedDataParallel's constructor reads this attribute of the module it wraps: reading it on a
        # dpool model means DDP is being put around dpool (accelerate's prepare() in a multi-process run,
        # Lightning's DDP), which would reduce the gradients twice: refused there, at construction.
        raise UnsupportedError(
            "DistributedDataParallel around a dpool model would reduce its gradients twice (dpool already sums "
            "them over its workers). Run one process (python train.py, or accelerate launch --num_processes=1) "
            "and let dpool use the devices, or use dpool's cross-node mode under torchrun (one dpool.wrap per "
            "machine, no DDP around it).")

    def extra_repr(self) -> str:
        nodes = f", rank={self.rank}, world_size={self.world_size}" if self._nodes is not None else ""
        return f"device_ids={self.device_ids}, dim={self.dim}{nodes}"


class _Forward:
    """``model.forward`` of a dpool model: calls like ``nn.DataParallel``'s, and has the wrapped module's
    signature, so that code which reads ``inspect.signature(model.forward)`` (HF Trainer keeps only the
    dataset columns it names) sees the module's parameters, not ``(*inputs, **kwargs)``."""

    __slots__ = ("_model",)

    def __init__(self, model: "DataParallel") -> None:
        self._model = model

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        return self._model._forward(*inputs, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self._model.module.forward)

    def __repr__(self) -> str:
        return f"<dpool forward of {type(self._model.module).__name__}>"


class _ForwardAttribute:
    """The ``forward`` attribute of :class:`DataParallel`: a :class:`_Forward` per instance (a non-data
    descriptor, so that a library may still assign ``model.forward``, as accelerate does for autocast)."""

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        return DataParallel._forward if obj is None else _Forward(obj)


DataParallel.forward = _ForwardAttribute()  # type: ignore[assignment,method-assign]

_NOT_TRACED: Any = None


def _not_traced() -> Any:
    """``DataParallel._dispatch`` wrapped by ``torch._dynamo.disable`` (made on first use)."""
    global _NOT_TRACED
    if _NOT_TRACED is None:
        import torch._dynamo

        _NOT_TRACED = torch._dynamo.disable(DataParallel._dispatch)
    return _NOT_TRACED


def _join_nodes(nodes: CrossNode, module: nn.Module, workers: int, start: Any) -> Runtime:
    """Cross-node: compare the module with every rank's, then start this node's workers."""
    try:
        nodes.join(module, workers)
    except BaseException as exc:
        nodes.fail(exc)
        nodes.close()
        raise
    return start(nodes=nodes)


def _another(model: DataParallel) -> DataParallel:
    """A second model on ``model``'s pool (what :func:`wrap` gives for the same module and arguments):
    closing either leaves the other usable; the pool stops with the last one closed or collected."""
    other: DataParallel = DataParallel.__new__(DataParallel)
    nn.Module.__init__(other)
    other.module = model.module
    for name in ("device_ids", "output_device", "dim", "_wrap_args", "_runtime", "_close_lock", "_owner_thread",
                 "_nodes", "_sharing", "_start_with", "_key", "_coordinator_threads", "_follow", "_settings"):
        object.__setattr__(other, name, getattr(model, name))
    other._closing, other._saved_threads, other._reopens, other._lazy = None, None, False, False
    other.training = model.training
    model._sharing.add(other)
    return other


def _start_key(devices: list[str], settings: tuple) -> tuple[torch.device, Options]:
    """For workers on ``devices``: where outputs gather, and what a pool must have been started with for a model
    to join it (the :class:`Runtime`'s options: the workers' threads follow the devices)."""
    output_device, dim, cfg, worker_threads, max_restarts, buffers, shard_weights, balance, gather, pool = settings
    out_dev = check_devices(devices, output_device)
    threads = worker_threads or max(1, physical_cores() // (len(devices) * local_share()[1]))
    return out_dev, Options(devices=devices, dim=dim, config=cfg, worker_threads=threads, max_restarts=max_restarts,
                            buffers=buffers, shard_weights=shard_weights, balance=balance, gather=gather,
                            attach=pool, output_device=str(out_dev))


def _master_copy(module: nn.Module) -> nn.Module:
    """What a copied or unpickled dpool model becomes: its (already copied) master module."""
    return module


def wrap(
    module: nn.Module,
    device_ids: Sequence[DeviceLike] | None = None,
    output_device: DeviceLike | None = None,
    dim: int = 0,
    **kwargs: Any,
) -> DataParallel:
    r"""Wrap ``module`` for data-parallel training in worker processes.

    The drop-in replacement for ``nn.DataParallel(module, device_ids,
    output_device, dim)``; see :class:`DataParallel` for every argument.

    A module is never bound to two pools. Wrapping a dpool model returns it
    unchanged. Wrapping a module that a live (open, unbroken) dpool model
    already holds gives a second model on that model's pool when the arguments
    are the same (as a re-run notebook cell does): closing either leaves the
    other usable, and the pool stops with the last one. With other arguments
    that pool is closed first, with a warning, and a new one is made.

    Returns:
        DataParallel: an ``nn.Module`` whose ``.module`` is ``module``.
    """
    if is_wrapped(module):
        return module  # type: ignore[return-value]
    key = _wrap_args(device_ids, output_device, dim, kwargs)
    live = _bound_model(module)
    if live is not None and live._wrap_args == key:
        return _another(live)
    model = DataParallel(module, device_ids, output_device, dim, **kwargs)
    model._wrap_args = key
    model._start()
    return model


# The live dpool model holding each master module (a module is bound to at most one pool).
_BOUND: "weakref.WeakKeyDictionary[nn.Module, weakref.ref[DataParallel]]" = weakref.WeakKeyDictionary()


def _bound_model(module: nn.Module) -> DataParallel | None:
    ref = _BOUND.get(module)
    model = ref() if ref is not None else None
    return model if model is not None and usable(model) else None


def usable(model: DataParallel) -> bool:
    """Whether ``model``'s pool can serve a call now: started, neither closed nor broken, and this process's (a
    forked child's copy of a model is not). :func:`wrap`, :func:`dpool.data_parallel` and the trainer
    integrations ask this, and only this."""
    rt = model._runtime
    return rt is not None and rt.pool.broken is None and os.getpid() == rt.pool.owner_pid


def reopens(model: DataParallel) -> None:
    """Let ``model`` start its workers again when it is used after a close (a trainer closes its pool when
    ``train()`` returns, and may train again)."""
    model._reopens = True


def reopen(model: DataParallel) -> None:
    """Start ``model``'s workers again if it was closed (see :func:`reopens`); nothing if it runs."""
    if model._runtime is None:
        model._start()


def _wrap_args(device_ids: Any, output_device: Any, dim: int, kwargs: dict) -> tuple:
    """What ``wrap()`` compares to decide that a call repeats the one that made a live model."""
    return (None if device_ids is None else [str(d) for d in device_ids], str(output_device), dim,
            sorted(kwargs.items(), key=lambda kv: kv[0]), knobs.get("DPOOL_POOL"))


def unwrap(model: nn.Module) -> nn.Module:
    """Return the master module of a dpool (or ``nn.DataParallel``) model; other modules unchanged."""
    if is_wrapped(model) or isinstance(model, nn.DataParallel):
        return model.module  # type: ignore[return-value]
    return model


def is_wrapped(model: Any) -> bool:
    """Whether ``model`` is a :class:`DataParallel` made by dpool."""
    return getattr(type(model), "_is_dpool_wrapped", False) is True
