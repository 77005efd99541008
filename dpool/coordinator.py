"""One training step, coordinator side: the stages composed.

:class:`Runtime` is the step, read top to bottom the way ``DataParallel.forward``
reads in torch::

    forward:   check the master (replicate) → flatten and plan shards (tree, scatter)
               → place shards in shared memory (regions, transport) → request (pool)
               → gather (bridge, gather) → commit buffers (buffers)
    backward:  slice output gradients per shard → request (pool) → reduce

With the loss on the workers (``gather=False``, :mod:`dpool.loss`) a training
forward stops before its request and waits for its loss (:class:`_Deferred`):
the criterion sends both in one request, with the backward when its gradient
can be told in advance, so a step is one round.

Each stage is its own module; this one only composes them, and owns the
restart policy and the one-call-at-a-time lock.

A step is transactional: the master is only touched after every shard has
succeeded (buffers are committed after the forward round; gradients are
returned to autograd after the backward round). A failed round leaves the
master's parameters, gradients, buffers and optimizer state as they were.

In cross-node mode (``nodes``, see :mod:`dpool.crossnode`) a training forward
starts with the nodes agreeing on where they are (and rank 0's buffers), and
the reduce also averages over the nodes. A failure in such a call ends this
node's part in the job: the other nodes are told (the abort key), this node's
workers are stopped, and the process exits past gloo's teardown (the exit
guard in :mod:`dpool.peers`).
"""
from __future__ import annotations

import functools
import logging
import os
import re
import sys
import threading
import time
import warnings
import weakref
from typing import Any, Callable, Iterable, Mapping, Sequence, TypeVar

import cloudpickle
import torch
import torch.autograd.forward_ad as _fwad

from . import gather as _gather, hook_gate, patches as _patches, scatter as _scatter, tree as _tree
from . import protocol as P
from .accumulate import HeldGradients, hooked, refuse_change
from .bridge import Bridge, CallState, DoubleBridge, DoubleState, Graphs, _user_stacklevel
from .buffers import BufferCommit
from .config import Config
from .cpus import bind_threads, physical_cores
from .crossnode import FORWARD, CrossNode, CrossNodeReducer
from .errors import (DpoolValueError, ModelChangedError, PoolBrokenError, UnpicklableModelError, UnsupportedError,
                     WorkerDiedError, WorkerStartError, WorkerTimeoutError, remote_error)
from .gpu import apply_backend_flags, backend_flags, check_free_memory, memory_report
from .launch import coordinator_cpus, forward_with_loss, reply_together, wait_spin
from .layout import Layout
from .loss import ShardedOutput, build_output, combine, predict_seed
from .peers import arm_exit_guard
from .pool import Pool
from .reduce import Reducer, sum_sparse
from .regions import IORegions
from .numerics import apply_numerics, legacy_precision, numerics
from .replicate import Master, take_rebound
from .stats import Stats
from .sync_batchnorm import synchronizes
from .sweep import sweep
from .tensors import DTYPES, Placer, dtype_name, meta_nbytes, nbytes, read
from .transport.shm import check_free

__all__ = ["Runtime"]

# the innermost torch.func transform this thread is inside (None: none); absent from older torch
_TRANSFORMS = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None)

log = logging.getLogger("dpool")

_SEED_RANGE = 1 << 62
F = TypeVar("F", bound=Callable[..., Any])


def _one_call_at_a_time(method: F) -> F:
    """Hold the runtime's call lock for the whole call (threads wait for the call in flight), and run a
    deferred forward first (see :class:`_Deferred`)."""

    first = method.__name__ != "criterion"  # (the criterion sends a deferred forward with its loss, or first)

    @functools.wraps(method)
    def locked(self: "Runtime", *args: Any, **kwargs: Any) -> Any:
        with self.call_lock:
            if first and self._pending is not None:
                self._run_deferred()  # every other call finds the forwards before it run (see _Deferred)
            return method(self, *args, **kwargs)

    return locked  # type: ignore[return-value]


def _tensors_of(per_shard: list[list[Any]]) -> list[torch.Tensor]:
    return [g for ms in per_shard for g in ms if isinstance(g, torch.Tensor)]


class _Forward:
    """What the rest of a forward needs once its round's replies are in (see :meth:`Runtime._finish_forward`)."""

    __slots__ = ("call", "k", "splits", "shards", "tensors", "rg", "grad", "spans", "gin_sizes", "nodes", "versions",
                 "handle")

    def __init__(self, call: int, k: int, splits: list, shards: list, tensors: list[torch.Tensor], rg: list[bool],
                 grad: bool, spans: list, gin_sizes: list[int], nodes: Any) -> None:
        self.call, self.k, self.splits, self.shards, self.tensors, self.rg = call, k, splits, shards, tensors, rg
        self.grad, self.spans, self.gin_sizes, self.nodes = grad, spans, gin_sizes, nodes
        self.versions: list[int] | None = None  # the parameters' versions when the forward was called (deferred)
        # a deferred forward's output, filled in when it runs; weakly: the runtime keeps the pending forward, and
        # the output keeps the runtime (a cycle would keep a model dropped without close() alive until the GC)
        self.handle: Callable[[], ShardedOutput | None] | None = None

    def rows(self) -> list[int]:
        return next((sizes for sizes in self.splits if sizes is not None), [1] * self.k)

    def output(self) -> ShardedOutput | None:
        """A deferred forward's output, if anything still holds it."""
        return self.handle() if self.handle is not None else None

    def diff_inputs(self) -> list[torch.Tensor]:
        return [t for t, r in zip(self.tensors, self.rg) if r]


class _Unrun:
    """The :class:`CallState` stand-in of a deferred forward's :class:`ShardedOutput` until the forward runs:
    what is known before it (its call, shards and rows)."""

    def __init__(self, f: _Forward) -> None:
        self.call, self.k, self.rows, self.gin_sizes = f.call, f.k, f.rows(), f.gin_sizes
        self.refused: str | None = None  # why the forward never ran, if it was dropped for a changed parameter

    def check(self) -> None:
        if self.refused is not None:
            raise ModelChangedError(self.refused)


class _Deferred:
    """A forward with ``gather=False`` whose round waits for its loss (lifecycle of the deferral).

    With ``gather=False`` a training forward's outputs stay on the workers, and the next thing a step does
    with them is ``dpool.criterion(...)(out, target)``. So ``model(x)`` places the shards and builds the
    forward's messages (the inputs, flags, seed and parameter versions of that moment) but sends nothing, and
    the criterion sends each worker its forward and its loss as one request: one round per step less, the same
    numbers. Any other call on the runtime (another forward, ``out.gather()``, a backward, ``worker_states``,
    a criterion of another output) first runs the deferred forward in a round of its own, so the workers see
    every request in the order the program made it. ``close()`` drops a forward nothing used. A parameter
    changed in place before the deferred forward ran means it cannot run as it was called: its criterion raises
    :class:`ModelChangedError`; another call drops it, and its output raises that error when it is used. Only
    for CPU workers, models without buffers (in cross-node mode: whose training forwards exchange nothing),
    with grad enabled; ``DPOOL_FORWARD_WITH_LOSS=off`` turns it off. A cross-node training forward's failure
    ends the node's part in the job wherever it runs (:meth:`Runtime._deferred_synced`), as in ``model(x)``.

    Ctrl-C: the calls a forward's messages tell the workers to release are told again (``Graphs.retell``)
    wherever the deferral, the round that sends it, or its dropping is cut; ``tests/test_lifecycle.py`` cuts
    each of them at every point.
    """

    __slots__ = ("msgs", "f")

    def __init__(self, msgs: dict[int, P.Message], f: _Forward) -> None:
        self.msgs, self.f = msgs, f


# How a deferred forward run by another call names itself in its workers' errors: the call that raises is
# not the model(x) that failed (in one process, model(x) itself would have raised)
_EARLIER_FORWARD = ("forward of an earlier model(x) call, which with gather=False waited for its loss and ran "
                    "only now, before this call")


class Runtime:
    """Runs a module's forward and backward on a pool of worker processes.

    Args:
        module: the master module (on ``devices[0]``: the CPU, or the first GPU).
        devices: one device string per worker (all ``"cpu"`` or all ``"cuda:i"``).
        dim: scatter/gather dimension.
        config: limits and timeouts.
        worker_threads: torch threads per worker.
    """

    def __init__(self, module: torch.nn.Module, devices: Sequence[str], dim: int, config: Config,
                 worker_threads: int, max_restarts: int = 0, buffers: str = "first",
                 shard_weights: Sequence[float] | None = None, balance: str | None = None,
                 gather: bool = True, attach: str | None = None, output_device: str | None = None,
                 nodes: CrossNode | None = None) -> None:
        self.module = module
        self.nodes = nodes
        self.dim = dim
        self.config = config
        self.n = len(devices)
        self.devices = list(devices)
        # The master lives on device_ids[0] (a GPU for CUDA workers); outputs are gathered on output_device.
        self.device = torch.device(self.devices[0])
        self.cuda = self.device.type == "cuda"
        self.output_device = torch.device(output_device) if output_device is not None else self.device
        # Workers on the master's GPU use its parameter arena directly (as CPU workers use its segment);
        # others get a copy pushed before each forward. DPOOL_CUDA_ALIAS=0 forces the copy (tests).
        alias = os.environ.get("DPOOL_CUDA_ALIAS", "1") != "0"
        self._alias = [not self.cuda or (alias and torch.device(d) == self.device) for d in self.devices]
        sweep(config.shm_dir)
        self.master = Master(module, self.device)
        self.graphs = Graphs()
        self._closed = False
        self.restarts_left = max_restarts
        self._restarting: list[int] | None = None  # workers whose restart a Ctrl-C cut short (_check_usable ends it)
        self.balancer = _scatter.Balancer(self.n, shard_weights, balance)
        self.no_sync = False
        # The workers' gradient slots change with every backward (a criterion's speculative one included),
        # restart and re-sync; a speculative backward's result is only used while this has not moved.
        self._slot_gen = 0
        self._workers_hold = False  # the workers may hold no_sync gradients (a backward with hold ran since)
        master = self.master  # (not self: a runtime in no cycle goes with its last reference)
        self._held = HeldGradients(lambda: master.param_names)  # what the loop did to them (accumulate.py)
        self._sent_requires_grad = b""
        self.buffer_policy = buffers
        self._rank0_buffers: torch.Tensor | None = None  # cross-node, buffers="first": staging for the broadcast
        self.gather_outputs = gather
        self._pending: _Deferred | None = None  # a forward waiting for its loss (see _Deferred)
        self._defer = forward_with_loss()
        # see _finish_forward; before the first forward, the output's dtype is taken to be the parameters'
        dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.get_default_dtype())
        self._last_out: tuple[torch.dtype, list, list[int]] = (dtype, [], [])
        # One call at a time: calls from several threads (an evaluation thread, a server's handlers)
        # wait for the one in flight, as nn.DataParallel's do; they share segments and the workers.
        self.call_lock = threading.RLock()
        self._seed = torch.empty((), dtype=torch.int64)  # each forward's draw from the CPU generator
        self._last_rows: list[int] | None = None  # shard sizes of the latest forward (for error hints)
        self.stats = Stats(self.n)
        self._sent_flags: tuple | None = None  # GPU numerics settings the workers have (see _follow_backend_flags)
        # the default dtype, ... (see _follow_numerics): unknown, so sent at the first forward (a daemon's workers
        # may keep an earlier session's; a new worker has torch's defaults, which differ between versions)
        self._sent_numerics: tuple | None = None
        self._resyncs, self._resynced_at = 0, -1  # re-syncs on consecutive forwards, the forward of the latest
        self._warned_global_hooks = False
        self._warned_attributes: set[str] = set()
        self._warned_relaid: set[str] = set()
        self._warned_hooks: set[str] = set()  # parameters whose hooks were called without a gradient
        if attach is not None and max_restarts:
            raise DpoolValueError("max_restarts is not available with pool=...: the dpool-workers daemon restarts workers")
        # Where the coordinator has no core of its own, rounds of several shards ask the workers to reply
        # together (see dpool.protocol.TOGETHER_WAIT_S); never in cross-node mode, whose buckets leave while
        # the workers still run. (Read before the pool exists: a bad DPOOL_REPLY_TOGETHER leaves nothing.)
        together = nodes is None and reply_together(self.devices, worker_threads)
        spin = wait_spin(self.devices)
        self.pool = Pool(devices, config, worker_threads, attach=attach)
        self.pool.reply_together = together
        self.pool.spin_s = spin
        if nodes is not None:  # SyncBatchNorm's statistics span every worker of every node
            self.pool.hub.across = functools.partial(nodes.all_reduce, doing="combining SyncBatchNorm statistics")
        pool, devices = self.pool, self.devices  # (not self: a runtime in no cycle goes with its last reference)
        self.io = IORegions(self.n, lambda w, size: pool.new_segment(size, device=devices[w], owner=w))
        self._unbind: Callable[[], None] | None = None  # undoes the coordinator's binding (close())
        try:
            self._start()
            # under torchrun, the coordinator joins its workers on its local rank's share of the cores
            cpus = coordinator_cpus(self.pool.threads, self.devices) if attach is None else None
            if cpus is not None:
                self._unbind = bind_threads(cpus)
        except BaseException:
            self.close()
            raise

    @property
    def params(self) -> list[torch.Tensor]:
        return self.master.params

    # ------------------------------------------------------------------ start
    def _start(self) -> None:
        pool, master = self.pool, self.master
        if self.cuda:  # fail fast, with each GPU's numbers, rather than with an OOM inside a worker
            check_free_memory(self.devices, Layout(master.params, master.buffers).size, spawn=pool.launcher.spawns)
        self._bind()
        # Spawned workers map the parameters through an inherited fd, so the name can go at once
        # (and a respawned worker can still map them); a daemon's workers map it by name.
        if pool.launcher.spawns:
            master.region.unlink()
        self._model_bytes = master.pickle()  # an unpicklable model fails here, before ~a second of worker start-up
        pool.start([master.region.fd] if master.region.fd is not None else [])
        self._ship(by_name=not pool.launcher.spawns)
        master.watch()
        self._warn_global_hooks()

    def _bind(self) -> None:
        """Bind the master to a new shared region; the stages that read it follow."""
        master = self.master
        # on a GPU: the master arena, exported to each worker on the master's GPU (see dpool.transport.cuda_ipc)
        master.bind(lambda size: self.pool.new_segment(size, min_size=64, keep_fd=not self.cuda, device=self.devices[0]))
        self.layout = master.layout
        self._buffers = BufferCommit(self.buffer_policy, self.module, master.buffers, self.layout.buffer_offsets,
                                     master.buffer_views)
        old = self.__dict__.get("reducer")
        if old is not None:  # re-binding a changed model: the old reducer's helper threads go
            old.close()
        self.reducer: Reducer
        # cross-node: whether a training forward exchanges anything (buffers, SyncBatchNorm statistics)
        self._forward_collectives = self.layout.buffer_range is not None or any(
            synchronizes(m) for m in self.module.modules())
        # A criterion's backward may run on the workers right after the loss (see criterion()): not with
        # SyncBatchNorm (its backward's collective would wait on shards that skip it) nor with sparse gradients.
        self._speculable = not any(synchronizes(m) or getattr(m, "sparse", False) is True
                                   for m in self.module.modules())
        if self.nodes is not None:
            # Buckets leave during the backward as the workers complete them: CPU workers only (a GPU
            # worker's report would have to wait for its stream), and not with SyncBatchNorm, whose
            # exchanges inside the backward would then interleave with the buckets' by timing.
            overlap = (self.config.cross_node_overlap and not self.cuda
                       and not any(synchronizes(m) for m in self.module.modules()))
            self.reducer = CrossNodeReducer(self.layout, master.params, master.param_strides, self.device, self.nodes,
                                            overlap, fold=not self._forward_collectives)
        else:
            # a large sum may use the workers' cores: they are idle while it runs
            self.reducer = Reducer(self.layout, master.params, master.param_strides, self.device,
                                   threads=min(physical_cores(), self.pool.threads * self.n))

    def _ship(self, by_name: bool) -> None:
        """Build every worker's replica from the pickled master module."""
        pool, layout = self.pool, self.layout
        self.states = [pool.new_segment(layout.size, min_size=64, device=self.devices[i], owner=i) for i in range(self.n)]
        self._replicas: list[Any] = [None if self._alias[i] else self._replica_arena(i) for i in range(self.n)]
        self._init_workers(range(self.n), by_name=by_name)

    def _follow_changes(self) -> None:
        """Re-sync the replicas if the master's parameters, buffers or submodules are other objects now,
        or an attribute of a module was assigned or a hook added or removed (:meth:`Master.touched`).

        DataParallel re-replicates every forward, so it follows a new head, a new ``nn.Parameter``,
        ``dropout.p = 0`` or a hook registered after wrapping; dpool ships the changed model to the running
        workers once (new layout, new shared segment, new replicas). Graphs of earlier forwards can no
        longer be backpropagated. A tensor attribute changed in place is seen (its version counter), and so
        is an object the model holds changed in place (``model.config.x = y``: dpool/held.py).
        """
        master = self.master
        master.changed = False
        self._warn_global_hooks()  # (registering one moves torch's hook handle count: touched() said so)
        changes = master.attribute_changes()
        same = master.same_objects()
        if same and not changes:
            master.snapshot()
            return  # (a train()/eval() switch: every forward sends the modes)
        what = ", ".join(changes[:3]) + (f" and {len(changes) - 3} more" if len(changes) > 3 else "")
        if self._workers_hold:
            master.changed = True  # (and again at the next forward, until the change is undone)
            raise refuse_change(what or "the model's parameters, buffers or submodules")
        log.info("the model changed after wrap() (%s): re-syncing the replicas",
                 what or "its parameters, buffers or submodules")
        started = time.perf_counter()
        model_bytes = None
        if same:  # only attributes or hooks changed: pickle first, so that an unpicklable one breaks nothing
            try:
                model_bytes = master.pickle()
            except UnpicklableModelError as exc:
                raise UnpicklableModelError(
                    f"{what} changed after dpool.wrap(), and the workers cannot follow: {exc} Nothing was "
                    "changed, and each forward raises this until that attribute is deleted or picklable (keep "
                    "loggers, writers and handles outside the model).") from None
        else:  # what collect() refuses (a buffer that views a parameter) is raised while nothing changed
            try:
                Master.check(master.module, master.device)
            except BaseException:
                master.changed = True  # (and again at the next forward, until the change is undone)
                raise
        old_region = master.region
        master.unbind()  # what we bound so far gets private memory: the old segment goes
        try:
            master.collect()
            self._bind()  # running workers map the new segment by name
            if master.region.fd is not None:
                self.pool.pass_fds([master.region.fd])  # for workers respawned later
            self.graphs.lose_all()  # earlier graphs referred to the old replicas
            self._slot_gen += 1
            self._model_bytes = model_bytes if model_bytes is not None else master.pickle()
            self._ship(by_name=True)
        except BaseException as exc:
            self.pool.break_pool(f"re-syncing the replicas after a change to the model failed: {exc}")
            raise
        finally:
            old_region.close_fd()
        # the same attribute changed before every forward: say what it costs, once
        self._resyncs = self._resyncs + 1 if self._resynced_at == self.pool.step else 1
        self._resynced_at = self.pool.step + 1  # (the forward this re-sync is for)
        if self._resyncs == 3 and changes:
            warnings.warn(
                f"dpool: {what} changed before each of the last 3 forwards. Each change ships the "
                f"model to the workers again ({(time.perf_counter() - started) * 1e3:.0f} ms this time), as "
                "DataParallel's per-forward replication would pick it up. Pass a value that changes every step "
                "as an argument of forward() instead; and keep what forward() does not read (an EMA copy of "
                "the weights, metrics, counters) outside the model.", stacklevel=_user_stacklevel())

    @staticmethod
    def _refuse_transform() -> None:
        """A call inside a torch.func transform (vmap, grad, jacrev, jvp, hessian): its inputs are the
        transform's wrapped tensors, which cannot travel, and the workers' forward runs outside it. Refused
        before anything is sent (torch's own errors came from deep inside the input copy and said nothing)."""
        raise UnsupportedError(
            "the dpool model was called inside a torch.func transform (vmap, grad, jacrev, jvp, hessian): the "
            "forward runs in dpool's worker processes, which the transform cannot follow. Apply the transform to "
            "dpool.unwrap(model) (the plain module, in this process), or call the model outside it and use "
            "loss.backward() / torch.autograd.grad for gradients.")

    @staticmethod
    def _refuse_dual(tensors: Sequence[torch.Tensor]) -> None:
        """Forward-mode AD: the shards travel as plain data, so a dual input's tangent would be dropped and the
        output would come back without one. Refused rather than lost."""
        for t in tensors:
            if _fwad.unpack_dual(t).tangent is not None:
                raise UnsupportedError(
                    "an input of the dpool model is a dual tensor (torch.autograd.forward_ad): its tangent cannot "
                    "travel to the workers, so the output would have none. Compute forward-mode derivatives on "
                    "the plain module (dpool.unwrap(model)), or use reverse mode (backward(), torch.autograd.grad).")

    def _warn_global_hooks(self) -> None:
        """Say once that global module hooks do not run in the workers (DataParallel's replicas, in this
        process, run them)."""
        hooks = self.master.global_hooks()
        if hooks and not self._warned_global_hooks:
            self._warned_global_hooks = True
            warnings.warn(
                f"dpool: global module hooks ({', '.join(hooks)}) are set; they run in this process only, not in "
                "dpool's workers, so they do not see or change the replicas' forward and backward. Register "
                "the hook on the model's modules instead (module.register_forward_hook(...)): those travel "
                "with the model.", stacklevel=_user_stacklevel())

    def _warn_relaid(self, names: Sequence[str]) -> None:
        """Say once per tensor that a new memory format given to it after wrap() (``model.to(memory_format=
        torch.channels_last)``) was not kept: its shared copy keeps the layout it had at wrap()."""
        new = [n for n in names if n not in self._warned_relaid]
        if new:
            self._warned_relaid.update(new)
            more = f" and {len(new) - 3} more" if len(new) > 3 else ""
            warnings.warn(
                f"dpool: {', '.join(new[:3])}{more} of the master module got another memory format after "
                "dpool.wrap() (module.to(memory_format=...)); the values are followed, but in shared memory "
                "(the master's and the workers') a parameter keeps the layout it had at wrap(), and a buffer is "
                "row-major. Convert the module before dpool.wrap(): its parameters keep channels_last then.",
                stacklevel=_user_stacklevel())

    def _gate_hooks(self, param_grads: Sequence[torch.Tensor | None], param_idx: Sequence[int]) -> None:
        """Keep autograd from calling the hooks of the parameters this backward brought no gradient (no
        shard used them), as one process does not (see dpool/hook_gate.py). Which parameters the workers'
        graphs reached is known only now."""
        bare = [i for i in param_idx if param_grads[i] is None]
        if not bare:
            return
        own = self._held.own_hooks()
        hooks = [bare[j] for j in hooked([self.params[i] for i in bare], own)]
        if not hooks or hook_gate.gate([self.params[i] for i in hooks], own.__contains__):
            return
        new = [n for n in (self.master.param_names[i] for i in hooks) if n not in self._warned_hooks]
        if new:  # a torch without _current_graph_task_id: the hooks run; say so, once per parameter
            self._warned_hooks.update(new)
            more = f" and {len(new) - 3} more" if len(new) > 3 else ""
            warnings.warn(
                f"dpool: parameter{'s' * (len(new) > 1)} {', '.join(map(repr, new[:3]))}{more} got no gradient "
                f"in this backward (no shard's forward used {'them' if len(new) > 1 else 'it'}), but autograd "
                f"calls their hooks: a tensor hook (p.register_hook) with None, a post-accumulate hook with the "
                f".grad it has (while accumulating, the earlier micro-batches' sum). One process would not call "
                f"them; this torch has no torch._C._current_graph_task_id, which dpool needs to hold them back. "
                f"Let a tensor hook return early on None, or upgrade torch.",
                stacklevel=_user_stacklevel())

    def _warn_attributes(self, names: set[str]) -> None:
        """Say once per attribute that a forward set it to a tensor that requires grad on the workers only
        (see ``workers/attributes.py``): a loss term read from the master's module afterwards is stale."""
        new = sorted(names - self._warned_attributes)
        if new:
            self._warned_attributes.update(new)
            shown = ", ".join(map(repr, new))
            warnings.warn(
                f"dpool: the forward set the attribute{'s' * (len(new) > 1)} {shown} of model.module to a tensor "
                f"that requires grad on the workers' replicas only. "
                f"This process's module keeps its old value (nn.DataParallel's replicas lose such values too), "
                f"so a loss term read from it after the call is stale and does not train. Return the value from "
                f"forward() instead (in a tuple or dict with the output): it is then gathered like the output.",
                stacklevel=_user_stacklevel())

    def _replica_arena(self, i: int) -> Any:
        """A GPU copy of the master arena for worker ``i`` (not on the master's GPU); refreshed each forward."""
        arena = self.pool.new_segment(self.layout.size, min_size=64, device=self.devices[i], owner=i)
        arena.u8.copy_(self.master.region.u8)
        return arena

    def _push(self) -> None:
        """Copy the master's parameters and buffers to the workers on other GPUs (DataParallel's broadcast)."""
        for arena in self._replicas:
            if arena is not None:
                arena.u8.copy_(self.master.region.u8)

    def _params_ref(self, i: int, by_name: bool) -> list:
        region = self.master.region
        if self.cuda:
            arena = self._replicas[i]
            return arena.ref() if arena is not None else region.ref(self.pool.workers[i])
        return region.ref() if by_name else region.fd_ref()

    def _init_workers(self, indices: Any, by_name: bool = False) -> None:
        """Ship the model to ``indices`` and wait until their replicas are built."""
        pool, layout, master = self.pool, self.layout, self.master
        pl = Layout.wire(master.params, layout.param_offsets, True)
        bl = Layout.wire(master.buffers, layout.buffer_offsets, False)
        msgs = {
            i: P.Init(self._model_bytes, [p for p in sys.path if isinstance(p, str)], self._params_ref(i, by_name),
                      self.states[i].ref(), pl, bl, pool.threads,
                      {"bn_counts": self._buffers.needs_counts, "event": pool.event_handle(i),
                       "buckets": self.reducer.bucket_members()})
            for i in indices
        }
        try:
            # startup_timeout_s bounds this round, not heartbeats (why: Pool.request)
            replies = pool.request(msgs, "loading the model", loading=True)
        except (WorkerDiedError, WorkerTimeoutError) as exc:
            pool.break_pool(str(exc))
            raise WorkerStartError(f"{exc}\nThe worker failed while unpickling the model; no pool was started.") from None
        for i, r in sorted(replies.items()):
            if isinstance(r, P.Failed):
                w = pool.workers[i]
                raise WorkerStartError(
                    f"{w.where()} failed while {r.stage}: {r.qualname}: {r.message}\n"
                    "Every class the model uses must be importable in the workers (they get the coordinator's "
                    f"sys.path) or defined in the training script.\n--- remote traceback ---\n{r.traceback}"
                )
        pool.unlink_segments()
        # Each worker's gradient slot, one dense tensor per dtype group (summed in backward).
        self._grad_slots = [
            [st.u8[start:end].view(dtype) for dtype, start, end, _ in self.layout.param_groups] for st in self.states
        ]
        b = self.layout.buffer_range
        if b is not None:
            self._master_buffers = master.region.u8[b[0]:b[1]]
            self._first_buffers = self.states[0].u8[b[0]:b[1]]
        self._buffer_slots = [self._buffers.slot_views(st.u8) for st in self.states]
        self._follow_patches(indices)

    def _follow_patches(self, indices: Any) -> None:
        """Repeat in the workers ``indices`` what this process patched in the model's code at run time
        (``SomeClass.forward = my_forward``, ``F.gelu = my_gelu``: :mod:`dpool.patches`), as DataParallel's
        replicas, in its one process, run the patched code. One round trip at each shipping, two when
        something differs; what cannot be repeated is named in a warning."""
        refs = _patches.code_refs(self.master.module)
        if not refs:
            return
        ours = _patches.fingerprints(refs)
        places = _patches.addresses(refs)
        theirs = self._call(indices, functools.partial(_patches.fingerprints_at, places))
        # (a name the workers lack was added here, as transformers adds Module.smart_apply: their code does not
        # use it, and repeating it could import a library there for nothing; but an entry added to a
        # registry, as AttentionInterface.register("mine", fn), is what the config names)
        differ = sorted({j for t in theirs.values() for j, (a, b) in enumerate(zip(ours, t))
                         if a != b and (b != _patches.MISSING or isinstance(refs[j][0], _patches.Registry))
                         and not _patches.instrumentation(a)})
        if not differ:
            return
        names = [_patches.name_of(*refs[j]) for j in differ]
        log.info("repeating %d run-time patches of the model's code in the workers: %s", len(differ), ", ".join(names))
        sent: dict[int, bytes] = {}  # ref index -> the pickled patch
        unsent = []
        for j, name in zip(differ, names):
            try:
                sent[j] = _patches.pickle_patch(*refs[j], _patches.value_of(*refs[j]))
            except Exception as exc:
                unsent.append(f"{name} (cannot be pickled: {exc})")
        if sent:
            self._call(indices, functools.partial(_patches.apply, list(sent.values())))
            theirs = self._call(indices, functools.partial(_patches.fingerprints_at, [places[j] for j in sent]))
            unsent += sorted({_patches.name_of(*refs[j]) for t in theirs.values() for j, b in zip(sent, t)
                              if ours[j] != b})
        if unsent:
            warnings.warn(
                f"dpool: the workers run other code than this process for {', '.join(unsent)}: it was changed at "
                "run time here (a monkeypatch) and could not be repeated there, so results may differ from "
                "one process's. Make the patch picklable (no locks, files or handles in its closure), or apply "
                "it in a module the model's code imports.", RuntimeWarning, stacklevel=2)

    def _call(self, indices: Any, fn: Any) -> dict[int, Any]:
        """Run ``fn(replica)`` in the workers ``indices``: their results."""
        payload = cloudpickle.dumps(fn)
        replies = self._request({i: P.Call(payload) for i in indices}, "running a function")
        self._raise_failures(replies, "worker_states")
        return {i: cloudpickle.loads(replies[i].result) for i in indices}

    # ------------------------------------------------------------------ rounds and their failures
    def _unsent(self) -> None:
        """Building a round's messages failed: forget the segments made for it (no worker will map them)."""
        self.io.rollback()
        self.pool.unlink_segments()

    def _fetch_round(self, make: Callable[[int, Any], P.Message], role: str, needs: Mapping[int, int], stage: str,
                     where: str) -> dict[int, Any]:
        """A round that fetches what did not fit in a reply: worker ``s``'s ``role`` segment grown to
        ``needs[s]`` bytes and named in its message ``make(s, ref)``; the replies, failures raised."""
        try:
            msgs = {s: make(s, self.io.ensure(s, role, n).ref()) for s, n in needs.items()}
        except BaseException:
            self._unsent()
            raise
        replies = self._request(msgs, stage)
        self.pool.unlink_segments()
        self._raise_failures(replies, where)
        return replies

    def _request(self, msgs: Mapping[int, P.Message], stage: str) -> dict[int, Any]:
        """``pool.request`` that, on a dead or hung worker, restarts it (``max_restarts``) or breaks the pool."""
        sent = self.pool.rounds_sent
        self.io.commit()  # the segments made for these messages are named in them
        try:
            return self._lost_contexts(self.pool.request(msgs, stage))
        except BaseException as exc:
            if self.pool.rounds_sent == sent:
                # Cut short while sending (Ctrl-C): some workers may never see the segments these messages
                # name, and the next request unlinks every name. Those workers start over with new ones.
                for w in msgs:
                    self.io.reset(w)
            if not isinstance(exc, (WorkerDiedError, WorkerTimeoutError)):
                raise
            dead = getattr(exc, "workers", None) or [exc.worker]
            if self.restarts_left >= len(dead):
                self.restarts_left -= len(dead)
                self.stats.restarts += len(dead)
                log.warning("%s; restarting worker(s) %s (%d restart(s) left)", str(exc).split("\n", 1)[0], dead,
                            self.restarts_left)
                lost = ""
                if self._workers_hold:  # their no_sync() gradients are gone: the held sums miss them
                    self._held.lost(self.module, self.params, f"worker(s) {dead} were restarted at step "
                                    f"{self.pool.step}")
                    lost = (" The gradients model.no_sync() had accumulated on them were lost: call "
                            "optimizer.zero_grad() and accumulate again (the next backward raises until then).")
                self._restarting = dead
                try:
                    self._restart(dead)
                except Exception as again:
                    self.pool.break_pool(str(again))
                    exc.args = (f"{exc.args[0]} Restarting it failed too ({again!r}); the pool is broken; "
                                "the master module is unchanged (dpool.unwrap(model) returns it).",)
                    raise exc from again
                except BaseException as cut:  # Ctrl-C: the next call finishes the restart (_check_usable)
                    note = (f"dpool: this interrupted the restart of worker(s) {dead} after: {str(exc).splitlines()[0]} "
                            "The next call to the model finishes the restart first; model.close() ends the pool.")
                    if sys.version_info >= (3, 11):
                        cut.add_note(note)
                    else:
                        log.warning("%s", note)
                    raise
                exc.restarted = True  # type: ignore[union-attr]
                exc.args = (f"{exc.args[0]} Worker(s) {dead} were restarted and re-synced from the master "
                            f"({self.restarts_left} restart(s) left): the master module is unchanged and the next "
                            f"call runs on the restarted pool.{lost}",)
                raise
            self.pool.break_pool(str(exc))
            exc.args = (f"{exc.args[0]} The pool is broken; the master module is unchanged (dpool.unwrap(model) "
                        "returns it; pass max_restarts=K to dpool.wrap to respawn workers instead).",)
            raise

    def _lost_contexts(self, replies: dict[int, Any]) -> dict[int, Any]:
        """Raise :class:`WorkerDiedError` for workers whose CUDA context a sticky error destroyed (they exit)."""
        if not self.pool.exiting:  # filled by the pool when a CONTEXT_LOST reply arrives
            return replies
        lost = sorted(i for i in replies if i in self.pool.exiting)
        if not lost:
            return replies
        w, r = self.pool.workers[lost[0]], replies[lost[0]]
        also = f" (also worker(s) {lost[1:]})" if len(lost) > 1 else ""
        raise WorkerDiedError(
            f"{w.where()}{also} hit a CUDA error its process cannot recover from while "
            f"{r.stage[: -len(P.CONTEXT_LOST)]} at step {self.pool.step}: {r.qualname}: {r.message.strip()}\n"
            "Its CUDA context is lost, so the worker exited. To find the failing operation, run with "
            "CUDA_LAUNCH_BLOCKING=1 (and TORCH_USE_CUDA_DSA=1 for device-side asserts); the coordinator's own "
            "CUDA context is unaffected.",
            worker=lost[0], device=w.device, pid=w.pid, step=self.pool.step, workers=lost)

    def _check_usable(self) -> None:
        """Raise if the pool cannot serve a call; first finish a restart that a Ctrl-C cut short."""
        self.pool.check_usable()
        if self._restarting is not None:
            dead = self._restarting
            log.warning("finishing the restart of worker(s) %s that a Ctrl-C interrupted", dead)
            try:
                self._restart(dead)
            except Exception as exc:
                self._restarting = None  # (nothing left to finish: the pool is broken)
                self.pool.break_pool(f"restarting worker(s) {dead} failed: {exc!r}")
                raise PoolBrokenError(
                    f"restarting worker(s) {dead} (interrupted by a Ctrl-C in an earlier call) failed: {exc!r}. "
                    "The pool is broken; the master module is unchanged (dpool.unwrap(model) returns it)."
                ) from exc

    def _restart(self, indices: list[int]) -> None:
        """Replace the workers ``indices`` and re-sync them from the master. A Ctrl-C may cut it anywhere:
        it then runs again, whole, at the next call (:meth:`_check_usable`)."""
        # Graphs kept by the dead worker are gone: calls made so far can no longer be backpropagated.
        self.graphs.lose_all()
        self._slot_gen += 1  # (first, so that a cut restart leaves no speculative result looking valid)
        self.pool.respawn(indices)
        for i in indices:
            self.states[i] = self.pool.new_segment(self.layout.size, min_size=64, device=self.devices[i], owner=i)
            if self._replicas[i] is not None:
                self._replicas[i] = self._replica_arena(i)
            self._grad_slots[i] = [self.states[i].u8[a:b].view(dt) for dt, a, b, _ in self.layout.param_groups]
            self.io.reset(i)
            self._buffer_slots[i] = self._buffers.slot_views(self.states[i].u8)
        if 0 in indices and self.layout.buffer_range is not None:
            a, b = self.layout.buffer_range
            self._first_buffers = self.states[0].u8[a:b]
        self._sent_flags = None  # a new process starts with torch's default numerics settings
        self._sent_numerics = None
        self._init_workers(indices)
        self._restarting = None

    def _resized_buffer_hint(self, index: int | None) -> str:
        """What to do about a forward that resized buffer ``index`` in place (None: torch's own error, which
        does not say which; the empty buffers are the likely ones)."""
        names = self.master.buffer_names
        if index is not None and index < len(names):
            which = f"; {names[index]}"
        else:
            empty = [n for n, b in zip(names, self.master.buffers) if not b.numel()]
            more = f" and {len(empty) - 5} more" if len(empty) > 5 else ""
            which = f"; empty buffers, the likely ones: {', '.join(empty[:5])}{more}" if empty else ""
        return ("the forward resized a parameter or buffer in place, which dpool keeps at a fixed size in shared "
                f"memory{which}. Run one forward on the plain module before dpool.wrap(), so that every buffer has "
                "its final shape (quantization-aware training's per-channel observers start empty), or keep such "
                "state as a plain attribute.")

    def _raise_failures(self, replies: Mapping[int, Any], where: str) -> None:
        failed = sorted((i, r) for i, r in replies.items() if isinstance(r, P.Failed))
        if not failed:
            return
        for i, _ in failed:  # it may have failed before mapping the segments its request named, whose names
            self.io.reset(i)  # are unlinked by now: it gets new ones next time (see dpool.regions)
        # Shards released from a collective because another failed are not the cause: report the cause.
        causes = [(i, r) for i, r in failed if r.qualname != "CollectiveAborted"] or failed
        i, r = causes[0]
        w = self.pool.workers[i]
        message = r.message
        if "Expected more than 1 value per channel when training" in message and self._last_rows:
            message += (f"\n(dpool: the batch was split into shards of {self._last_rows} rows, and BatchNorm cannot "
                        "train on a one-row shard. Use DataLoader(..., drop_last=True), a batch of at least 2 rows "
                        "per worker, or fewer workers.)")
        resized = re.match(r"the forward resized buffer (\d+) ", message)
        if resized or "resize storage that is not resizable" in message:
            message += f"\n(dpool: {self._resized_buffer_hint(int(resized.group(1)) if resized else None)})"
        if r.qualname == "OutOfMemoryError" and self.cuda:
            message += (f"\n(dpool: {memory_report(self.devices)}. Each worker holds its shard's activations: use a "
                        "smaller batch, fewer workers per GPU, or free memory first: torch.cuda.empty_cache() here, "
                        "other processes per nvidia-smi.)")
        # raised without a local name: a local would tie the exception to this frame's locals (the
        # I/O segments among them) in a cycle that only the GC frees
        raise remote_error(r.module, r.qualname, message, r.traceback, worker=i, device=w.device, pid=w.pid,
                           step=self.pool.step, where=f"{where} (shard {i})")

    # ------------------------------------------------------------------ cross-node failures
    def _synced(self, run: Callable[[], Any]) -> Any:
        """Run a call that takes part in the nodes' collectives; a failure ends this node's part in the job."""
        try:
            return run()
        except BaseException as exc:
            self._leave_job(exc)
            raise

    def _leave_job(self, exc: BaseException) -> None:
        """Tell the other nodes (abort key), stop this node's workers, arm the exit guard."""
        nodes = self.nodes
        assert nodes is not None
        nodes.fail(exc)
        arm_exit_guard(self.close)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        self.pool.break_pool(f"cross-node mode: {first}")
        self.close()

    # ------------------------------------------------------------------ forward
    @_one_call_at_a_time
    def forward(self, args: tuple, kwargs: dict) -> Any:
        if _TRANSFORMS is not None and _TRANSFORMS() is not None:
            self._refuse_transform()
        if self.nodes is not None and torch.is_grad_enabled() and self.module.training and not self.no_sync:
            return self._synced(lambda: self._forward(args, kwargs, True))
        return self._forward(args, kwargs, False)

    def _forward(self, args: tuple, kwargs: dict, synced: bool) -> Any:
        pool = self.pool
        self._check_usable()
        hook_gate.restore(self.params, keep_running=True)  # a failed backward's gates (seldom any)
        if self.master.changed or self.master.touched():
            self._follow_changes()
        relaid = self.master.check_bindings()
        if relaid:
            self._warn_relaid(relaid)
        if numerics() != self._sent_numerics:
            self._follow_numerics()
        if self.cuda:
            self._follow_backend_flags()
        tensors: list[torch.Tensor] = []
        spec = _tree.flatten((tuple(args), dict(kwargs)), tensors)
        if _fwad._current_level >= 0:  # inside forward_ad.dual_level()
            self._refuse_dual(tensors)
        k, splits = _scatter.plan(tensors, self.n, self.dim, self.balancer.weights())
        self._last_rows = next((sizes for sizes in splits if sizes is not None), None)
        shards = _scatter.shard_views(tensors, splits, k, self.dim)
        grad = torch.is_grad_enabled()
        rg = [grad and t.requires_grad for t in tensors]
        training = bytes(m.training for m in self.master.modules)
        requires_grad = bytes(p.requires_grad for p in self.params)
        if requires_grad != self._sent_requires_grad:  # the workers zero the slots of newly frozen parameters
            if self._workers_hold:
                self._held.refuse_frozen(self.params)
            self._slot_gen += 1
            self._sent_requires_grad = requires_grad
        autocast = None
        kind = self.device.type  # autocast of the workers' device type ("cuda" or "cpu")
        if torch.is_autocast_enabled(kind):
            autocast = [kind, dtype_name(torch.get_autocast_dtype(kind)), torch.is_autocast_cache_enabled()]
        call = self.graphs.new_call()
        pool.step += 1
        nodes = self.nodes if synced else None
        if nodes is not None:  # the nodes agree on where they are; then rank 0's buffers (DDP's broadcast_buffers)
            nodes.step = pool.step
            nodes.fseq += 1
            if self._forward_collectives:  # none for a model without buffers or SyncBatchNorm
                nodes.header(FORWARD, nodes.fseq)
            if self.buffer_policy == "first" and self.layout.buffer_range is not None:
                # into a staging copy (made once per layout): a failed broadcast leaves the master as it was
                theirs = self._rank0_buffers
                if theirs is None or theirs.numel() != self._master_buffers.numel():
                    theirs = self._rank0_buffers = torch.empty_like(self._master_buffers)
                theirs.copy_(self._master_buffers)
                nodes.broadcast(theirs, "taking rank 0's buffers")
                self._master_buffers.copy_(theirs)
        # One draw from the coordinator's generator per forward: torch.manual_seed(s) makes a run
        # reproducible, embedded or attached. Each shard seeds its own stream from it (as replicas on
        # several GPUs draw their own), so the numbers differ from a single process's.
        seed = int(self._seed.random_(0, _SEED_RANGE))  # = torch.randint(_SEED_RANGE, ()), without a new tensor
        msgs: dict[int, P.Message] = {}
        # the shards that take part in the call's collectives (SyncBatchNorm): in cross-node mode the other
        # nodes' too, so that a node with one worker still joins them
        world = k if self.nodes is None else k + self.nodes.size - 1
        spans: list[tuple[Any, int, int]] = []
        gin_sizes: list[int] = []
        f = _Forward(call, k, splits, shards, tensors, rg, grad, spans, gin_sizes, nodes)  # (filled in below)
        layouts = []
        grow = 0
        for s in range(k):
            placer = Placer()
            offs = [placer.reserve(t) for t in shards[s]]
            layouts.append((offs, placer.offset))
            grow += self.io.input_growth(s, placer.offset)
        if grow and not self.cuda:
            check_free(self.config.shm_dir, grow)  # all shards' new segments, before creating any
        if self.cuda:
            self._push()
        together = pool.together(k)  # reply together ([] unless the pool asks for it, see Pool.together)
        try:
            # Calls collected here must reach the workers with this request, or be released again (every
            # path out of here that may not have told every worker does), or the workers keep their graphs.
            release = self.graphs.collect(self.io.release)
            for s in range(k):
                offs, need = layouts[s]
                seg, start = self.io.input_region(s, need)
                metas = [Placer.write(seg.views, start + o, t, r) for o, t, r in zip(offs, shards[s], rg)]
                spans.append((seg, start, start + need))
                gin = Placer()
                for t, r in zip(shards[s], rg):
                    if r:
                        gin.reserve(t)
                gin_sizes.append(gin.offset)
                out = self.io.ensure(s, "out", 0)
                msgs[s] = P.Forward(call, pool.step, grad, training, requires_grad,
                                    self.layout.buffer_range is not None, seg.ref(), out.ref(), spec, metas, s,
                                    world, not self.gather_outputs, autocast, release, seed, together)
        except BaseException:
            self._unsent()
            self.graphs.retell()
            raise
        # (no call between the try above and this one: a Ctrl-C lands in one of them, and the calls collected
        # for release reach the workers or are told again)
        try:
            if (self._defer and not self.gather_outputs and grad and not self.cuda
                    and self.layout.buffer_range is None and (nodes is None or not self._forward_collectives)):
                # Deferred until its loss (see _Deferred): the targets go after these inputs meanwhile.
                for s in range(k):
                    self.io.keep(s, call, spans[s])
                f.versions = [p._version for p in self.params]
                handle = ShardedOutput(self, _Unrun(f), None, f.diff_inputs())
                f.handle = weakref.ref(handle)
                self._pending = _Deferred(msgs, f)
                return handle
            return self._finish_forward(f, self._request(msgs, "running forward"))
        except BaseException:
            if self._pending is not None and self._pending.f is f:  # (cut before model(x) returned it)
                self._drop_deferred(f)
            self._forward_failed(f)
            raise

    def _forward_failed(self, f: "_Forward") -> None:
        """A forward's round or what follows it failed or was cut short (Ctrl-C): until its call is tracked,
        nothing would ever free the graphs the workers keep for it, so they are released now."""
        if f.grad and not self.graphs.kept(f.call):
            self.graphs.release(f.call)
        self.graphs.retell()  # a round cut short may not have told every worker

    def _finish_forward(self, f: "_Forward", replies: dict[int, Any], where: str = "forward") -> Any:
        """The rest of a forward once its round's replies are in: fetch outputs that did not fit, build its
        :class:`CallState`, gather (or keep the outputs on the workers), and commit its buffer updates. Its
        callers run :meth:`_forward_failed` if it raises (a GatherError, a Ctrl-C before the call is tracked).
        ``where`` names the forward in its workers' errors."""
        pool = self.pool
        pool.unlink_segments()
        self._raise_failures(replies, where)
        self.stats.split_round("forward", pool.sent_at, pool.arrived, replies, f.k)
        fetch = {s: r.need for s, r in replies.items() if r.need}
        if fetch:
            fetched = self._fetch_round(lambda s, ref: P.Fetch(f.call, ref), "out", fetch, "returning outputs",
                                        "forward")
            for s, r in fetched.items():
                replies[s].tensors = r.tensors
        specs = [replies[s].tree for s in range(f.k)]
        out_metas = [replies[s].tensors for s in range(f.k)]
        groups = _gather.tensor_groups(specs)
        outs = [self.io.segment(s, "out") for s in range(f.k)]
        state = CallState(self, f.call, f.k, groups, out_metas, outs, f.splits, f.gin_sizes, f.rg,
                          [[t.shape for t in f.shards[s]] for s in range(f.k)])
        state.fseq = self.nodes.fseq if self.nodes is not None else 0  # the training forward its backward names
        diff_inputs = f.diff_inputs()
        diff_idx = [i for i, p in enumerate(self.params) if p.requires_grad] if f.grad else []
        diff_params = [self.params[i] for i in diff_idx]
        state.diff_inputs, state.diff_params = diff_inputs, diff_params  # what a double backward differentiates
        state.diff_idx = diff_idx
        state.params = self.params
        state.versions = f.versions if f.versions is not None else [p._version for p in state.params] if f.grad else []
        state.input_devices = [t.device for t in diff_inputs]
        if not self.gather_outputs:  # outputs stay on the workers until a criterion or .gather()
            handle = f.output()
            if handle is None:  # (a deferred forward whose output nothing holds: it runs all the same)
                handle = ShardedOutput(self, state, specs, diff_inputs)
            handle._state, handle._specs = state, specs  # (a deferred forward's handle: filled in now)
            self.graphs.track(f.call, handle)
            for s in range(f.k):
                self.io.keep(s, f.call, f.spans[s])
            gathered = None
        elif f.grad and any(state.differentiable):
            gathered = Bridge.apply(state, diff_idx, *diff_inputs, *diff_params)
            if not isinstance(gathered, tuple):
                gathered = (gathered,)
            self.graphs.track(f.call, state.ctx)
            for s in range(f.k):
                self.io.keep(s, f.call, f.spans[s])
            state.ctx = None
        else:
            if f.grad:
                self.graphs.release(f.call)
            gathered = state.gather()
        state.outs = None  # read by the gather above; a later gather (gather=False) maps them anew
        rows = f.rows()
        self.stats.forward(rows, [replies[s].busy for s in range(f.k)], sum(nbytes(t) for sh in f.shards for t in sh),
                           sum(meta_nbytes(m) for ms in out_metas for m in ms) if self.gather_outputs else 0)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("step %d: forward of %d shards (rows %s), workers busy %s ms", pool.step, f.k, rows,
                      [round(replies[s].busy * 1e3, 2) for s in range(f.k)])
        self.balancer.observe(0, [replies[s].busy for s in range(f.k)], rows)
        if any(replies[s].attributes for s in range(f.k)):
            self._warn_attributes({n for s in range(f.k) for n in replies[s].attributes})
        # Commit: every shard succeeded, so buffer updates may reach the master (see buffers.py).
        if any(replies[s].rebound for s in range(f.k)):
            self._commit_rebound([s for s in range(f.k) if replies[s].rebound])
        if self.layout.buffer_range is not None:
            self._buffers.commit(self._master_buffers, self._first_buffers, self._buffer_slots[:f.k], rows,
                                 [replies[s].stats for s in range(f.k)],
                                 [bn.training for bn, *_ in self._buffers.batchnorms],
                                 across=None if f.nodes is None else functools.partial(
                                     f.nodes.all_reduce, doing="combining buffer statistics"))
        state.rows = rows
        if gathered is None:
            # what a deferred forward's loss predicts from (see criterion): this forward's output dtype and shapes
            self._last_out = (self._loss_dtype(out_metas), self._out_shapes(out_metas, specs), rows)
            return handle
        return _gather.build(specs, iter(gathered))

    # ------------------------------------------------------------------ loss on the workers
    @_one_call_at_a_time
    def criterion(self, handle: Any, crit: Any, targets: tuple) -> torch.Tensor:
        """Compute ``crit`` on every shard of ``handle`` (see :mod:`dpool.loss`).

        When the gradient ``loss.backward()`` will give each shard's loss can be told now, the workers also
        run that backward in the same round (a *speculative* backward): ``loss.backward()`` then finds the
        gradients in the slots and needs no round of its own. See :class:`dpool.loss.Speculation`.
        """
        pool, state = self.pool, handle._state
        pending = self._pending
        if pending is not None and pending.f.output() is not handle:
            self._run_deferred()  # (another forward's: it runs first, in its own round)
            pending = None
        if pending is not None:  # the forward and this loss go to the workers together
            self._deferred_synced(pending.f, functools.partial(self._refuse_changed, pending.f))
        else:
            self._check_usable()
            if isinstance(state, _Unrun):
                state.check()
        fn = crit.payload()  # (the loss may have changed since the last step)
        if pending is None and not self.graphs.kept(state.call):
            raise RuntimeError("the outputs of this forward are no longer on the workers (released or restarted)")
        tensors: list[torch.Tensor] = []
        spec = _tree.flatten(tuple(targets), tensors)
        k, rows = state.k, state.rows
        msgs: dict[int, P.Criterion] = {}
        for t in tensors:
            if t.dim() > self.dim and t.size(self.dim) != sum(rows):
                raise DpoolValueError(
                    f"dpool.criterion: a target has {t.size(self.dim)} rows along dim {self.dim}, but the model's "
                    f"inputs had {sum(rows)} (shards of {rows} rows). Targets are split over the workers like the "
                    "inputs, row for row. If the model flattens its output (logits.view(-1, V)), pass the target "
                    "with one row per input row and flatten it in the loss (a subclass of the loss, as in "
                    "docs/features.md), or compute the loss on out.gather().")
        shards = _scatter.shard_views(tensors, [rows if t.dim() > self.dim else None for t in tensors], k, self.dim)
        if pending is None:
            dtype = self._loss_dtype(state.metas)
            shapes = self._out_shapes(state.metas, handle._specs)
            differentiable = any(state.differentiable)
        else:  # the forward has not run: the previous forward's, checked against this one's once it ran
            dtype, last_shapes, last_rows = self._last_out
            shapes = last_shapes if last_rows == rows else [None] * k
            differentiable = True
        param_idx = [i for i, p in enumerate(self.params) if p.requires_grad]  # the loss's autograd inputs
        guess = None
        if (crit.backward_with_loss and torch.is_grad_enabled() and (handle._diff_inputs or param_idx)
                and differentiable):
            guess = predict_seed(crit, tuple(targets),
                                 lambda: [_tree.unflatten(spec, sh.__getitem__) for sh in shards],
                                 lambda: shapes, dtype, self.output_device)
        last = crit._last
        if last is not None and not last.settled:  # the previous loss of this criterion was never backpropagated
            crit._speculate = False
        speculate = (guess is not None and crit._speculate and self._speculable and not self.cuda
                     and not self.no_sync and not self._workers_hold)
        seed, seed_dtype = (guess.seed, dtype_name(dtype)) if speculate and guess is not None else (b"", "")
        flags = bytes(p.requires_grad for p in self.params)  # the early backward's; checked again at backward
        if speculate:
            self._slot_gen += 1  # the workers write their slots in this round, whatever its outcome
        together = pool.together(k)
        spans = []
        try:
            for s in range(k):
                placer = Placer()
                offs = [placer.reserve(t) for t in shards[s]]
                seg, start = self.io.input_region(s, placer.offset)
                metas = [Placer.write(seg.views, start + o, t) for o, t in zip(offs, shards[s])]
                spans.append((seg, start, start + placer.offset))
                gin = self.io.ensure(s, "gin", state.gin_sizes[s]).ref() if speculate else [None, 0]
                msgs[s] = P.Criterion(state.call, fn, spec, metas, seg.ref(), seed, seed_dtype, gin, pool.step,
                                      flags, together)
        except BaseException:
            self._unsent()
            if pending is not None:  # (its segments were rolled back with these: it can no longer run)
                self._drop_deferred(pending.f)
            raise
        for s, span in enumerate(spans):  # the loss graph may save the targets: kept until the call is released
            self.io.keep(s, (state.call, "targets", id(span[0]), span[1]), span)
        if pending is not None:
            replies = self._deferred_synced(pending.f, lambda: self._forward_and_loss(pending, msgs))
            state = handle._state
            real = self._loss_dtype(state.metas)
            if real != dtype:  # predicted from the previous forward: a guess made with it cannot be used
                dtype, guess = real, None
        else:
            replies = self._request(msgs, "computing the loss")
        pool.unlink_segments()
        self._raise_failures(replies, "criterion")
        done = [replies[s] for s in range(k)]
        if guess is not None:
            # usable only if every shard ran it, with the denominators predicted (the seed depends on them)
            matched = guess.matches([r.denom for r in done])
            if not matched:  # predicted with every target counted (target_count): count them from now on
                crit._count_ignored = True
            ran = speculate and all(r.backward for r in done) and matched
            guess.gen = self._slot_gen if ran else -1
            guess.replies = done if ran else None
            guess.flags = flags
            crit._last = guess
        return combine(self, handle, done, dtype, crit.reduction, guess, crit, param_idx)

    @staticmethod
    def _out_shapes(metas: list[list[Any]], specs: list) -> list[list[int] | None]:
        """Each shard's output shape, where its output is one tensor (what an elementwise loss's mean divides by)."""
        return [list(ms[0].shape) if spec == ["T", 0] else None for ms, spec in zip(metas, specs)]

    @staticmethod
    def _loss_dtype(metas: list[list[Any]]) -> torch.dtype:
        """The dtype a criterion's loss takes: the first floating output's of shard 0."""
        return next((DTYPES[m.dtype] for m in metas[0] if DTYPES[m.dtype].is_floating_point), torch.float32)

    def _forward_and_loss(self, pending: _Deferred, msgs: dict[int, P.Criterion]) -> dict[int, Any]:
        """Send the deferred forward with its loss's ``msgs`` as one request; commit the forward (its failures
        raised as a forward's) and return the loss's replies."""
        f = pending.f
        forward: dict[int, Any] = {}
        loss: dict[int, Any] = {}
        try:
            self._pending = None
            both = {s: P.ForwardCriterion(P.values_of(pending.msgs[s]), P.values_of(m), m.together)
                    for s, m in msgs.items()}
            replies = self._request(both, "running forward and computing the loss")
            for s, r in replies.items():
                if isinstance(r, P.ForwardCriterionDone):
                    forward[s] = P.inner("forward_done", r.forward)
                    loss[s] = P.inner(r.criterion_op, r.criterion)
                else:  # the forward failed: the loss did not run (nor mapped its targets' segment: see
                    forward[s] = r  # _raise_failures, which _finish_forward calls)
            self._finish_forward(f, forward)
        except BaseException:
            self._forward_failed(f)
            raise
        self.stats.forward_rounds_saved += 1
        return loss

    def _deferred_synced(self, f: _Forward, run: Callable[[], Any]) -> Any:
        """Run a step of the deferred forward ``f``: a failure of a cross-node training forward ends this node's
        part in the job wherever the forward runs, as it does in ``model(x)`` (see :meth:`_synced`)."""
        return run() if f.nodes is None else self._synced(run)

    def _run_deferred(self) -> None:
        """Run the deferred forward in a round of its own (see :class:`_Deferred`)."""
        pending = self._pending
        assert pending is not None
        self._deferred_synced(pending.f, self._run_pending)

    def _run_pending(self) -> None:
        pending = self._pending
        assert pending is not None
        refused = self._check_deferred(pending.f)
        if refused is not None:  # its output, if anything still holds it, raises this when it is used
            handle = pending.f.output()
            if handle is not None:
                handle._state.refused = refused
            return
        try:
            self._pending = None
            self._finish_forward(pending.f, self._request(pending.msgs, "running forward"), _EARLIER_FORWARD)
        except BaseException:
            self._forward_failed(pending.f)
            raise

    def _refuse_changed(self, f: _Forward) -> None:
        """Raise if the deferred forward ``f`` can no longer run as it was called (see :meth:`_check_deferred`)."""
        refused = self._check_deferred(f)
        if refused is not None:
            raise ModelChangedError(refused)

    def _check_deferred(self, f: _Forward) -> str | None:
        """Drop the deferred forward ``f`` if it can no longer run as it was called, and raise if the pool cannot
        serve it (a restart lost its segments); return why, if a parameter changed in place since (its
        output raises that when used: the forward would read the new values)."""
        try:
            self._check_usable()
            if self.graphs.lost(f.call):
                raise RuntimeError("the outputs of this forward are no longer on the workers (restarted)")
            assert f.versions is not None
            changed = self._changed_since(f.versions)
        except BaseException:
            self._drop_deferred(f)
            raise
        if not changed:
            return None
        self._drop_deferred(f)
        return (f"{changed} of the dpool model changed in "
                "place after model(x) and before its outputs were used. With gather=False a training forward waits "
                "for its loss (dpool.criterion) and runs on the workers with it, or at the model's next call, so it "
                "would have read the new values; it did not run. Compute the loss before changing the parameters, "
                "or call the model again after the change (DPOOL_FORWARD_WITH_LOSS=off runs every forward at once).")

    def _drop_deferred(self, f: _Forward) -> None:
        """Forget the deferred forward ``f`` without running it: its output can no longer be used. (Last, the
        pending forward goes: a Ctrl-C before leaves it to be checked, and dropped, again at the next call.)"""
        self.graphs.retell()  # the calls its messages would have told the workers to release
        self.io.release(f.call)
        self.graphs.release(f.call)
        if self._pending is not None and self._pending.f is f:
            self._pending = None

    @_one_call_at_a_time
    def backward_speculated(self, state: CallState, guess: Any, hit: bool, crit: Any,
                            param_idx: Sequence[int]) -> list[torch.Tensor | None] | None:
        """The gradients of a criterion's loss whose backward the workers ran right after it (see
        :meth:`criterion`), if ``hit`` (this backward's gradient for each shard's loss is bitwise the one
        they used: :meth:`dpool.loss.Speculation.hit`) and their slots still hold the result; ``None``: run
        the backward round instead. In cross-node mode the reduce averages over the nodes, with the same
        collectives the backward round's reduce would make, so ranks that took different paths stay in step."""
        if self.nodes is not None and not self.no_sync:
            return self._synced(lambda: self._backward_speculated(state, guess, hit, crit, param_idx))
        return self._backward_speculated(state, guess, hit, crit, param_idx)

    def _backward_speculated(self, state: CallState, guess: Any, hit: bool, crit: Any,
                             param_idx: Sequence[int]) -> list[torch.Tensor | None] | None:
        self._check_usable()  # (first: finishing a cut restart changes the slots and loses the graphs)
        guess.settled = True
        crit._speculate = hit  # a miss (a scaled loss, GradScaler) turns speculation off until a would-be hit
        if (not hit or guess.replies is None or guess.gen != self._slot_gen or self.no_sync
                or torch.is_grad_enabled() or self.graphs.lost(state.call) or self.params_changed(state)
                or guess.flags != bytes(p.requires_grad for p in self.params)):
            return None
        replies = guess.replies
        k = state.k
        if self.nodes is not None:
            self.nodes.step = self.pool.step
        param_grads = self.reducer.reduce([self._grad_slots[s] for s in range(k)], [r.param_mask for r in replies],
                                          state.fseq)
        self._commit_backward_buffers(self._changed_buffers(replies), k, state.rows)
        self._slot_gen += 1
        busy = [r.busy for r in replies]
        self.stats.backward(busy, k * guess.dtype.itemsize,
                            sum(end - start for _, start, end, _ in self.layout.param_groups) * k)
        self.stats.backward_rounds_saved += 1
        self.stats.no_round("backward")
        self.balancer.observe(1, busy, state.rows)
        input_grads = state.input_grads([r.input_grads for r in replies])
        self._gate_hooks(param_grads, param_idx)
        return input_grads + [param_grads[i] for i in param_idx]

    @_one_call_at_a_time
    def gather_kept(self, handle: Any) -> Any:
        """Gather outputs kept on the workers, through the autograd bridge."""
        state = handle._state
        self._check_usable()
        if isinstance(state, _Unrun):
            state.check()
        if not self.graphs.kept(state.call):
            raise RuntimeError("the outputs of this forward are no longer on the workers (released or restarted)")
        sizes = {s: sum(meta_nbytes(m) for m in state.metas[s]) or 64 for s in range(state.k)}
        replies = self._fetch_round(lambda s, ref: P.Fetch(state.call, ref), "out", sizes, "returning outputs",
                                    "gather")
        state.metas = [replies[s].tensors for s in range(state.k)]
        self.stats.bytes["outputs"] += sum(meta_nbytes(m) for ms in state.metas for m in ms)
        state.outs = [self.io.segment(s, "out") for s in range(state.k)]
        idx = [i for i, p in enumerate(self.params) if p.requires_grad]
        grad_inputs = handle._diff_inputs + [self.params[i] for i in idx]
        if torch.is_grad_enabled() and grad_inputs and any(state.differentiable):
            gathered = Bridge.apply(state, idx, *grad_inputs)
            state.ctx.handle = handle  # the gathered output's graph keeps the outputs on the workers alive
            state.ctx = None
            if not isinstance(gathered, tuple):
                gathered = (gathered,)
        else:
            gathered = state.gather()
        return build_output(handle, list(gathered))

    # ------------------------------------------------------------------ backward
    @_one_call_at_a_time
    def backward(self, state: CallState, grads: Sequence[torch.Tensor | None],
                 pieces: list[list[torch.Tensor | None]] | None = None,
                 param_idx: Sequence[int] = (), taken: Sequence[bool | None] | None = None
                 ) -> list[torch.Tensor | None]:
        """Backpropagate on the workers. ``pieces``: per shard, gradients by worker output index
        (given directly for losses computed on the workers); otherwise sliced from ``grads``.
        ``param_idx``: the parameters (by index) the calling autograd Function took as inputs, whose
        gradients are returned after the input gradients (``None`` for one that no longer requires grad).
        ``taken``: under ``no_sync()``, per ``param_idx`` entry, whether autograd accumulates into its
        ``.grad`` in this backward (see :func:`dpool.bridge.accumulates`); the workers hold only those.

        Under ``create_graph=True`` (autograd runs this with grad mode on) the gradients returned are
        differentiable: see :class:`dpool.bridge.DoubleBridge`.
        """
        hold = self.holds()
        if self.nodes is not None and not self.no_sync:
            return self._synced(lambda: self._backward(state, grads, pieces, param_idx, None, False))
        return self._backward(state, grads, pieces, param_idx, taken, hold)

    def holds(self) -> bool:
        """Whether a backward now keeps its parameter gradients on the workers: under ``no_sync()``, unless
        a hook of the loop's is registered on a master parameter, which must see each backward's gradient
        as in one process (see ``dpool/accumulate.py``). Raises if one was registered while the workers hold
        its parameter's gradient."""
        if not (self.no_sync or self._workers_hold):
            return False
        with_hooks = hooked(self.params, self._held.own_hooks())
        if with_hooks and self._workers_hold:
            self._held.refuse_hooked(self.params, with_hooks)
        if with_hooks and self.no_sync and self.nodes is not None:
            raise UnsupportedError(
                "model.no_sync() in cross-node mode with hooks on the model's parameters (p.register_hook or "
                "p.register_post_accumulate_grad_hook): one process runs them on each micro-batch's gradient, "
                "which only a synchronized backward has. Call the backward outside no_sync(), or remove the hooks.")
        return self.no_sync and not with_hooks

    def _backward(self, state: CallState, grads: Sequence[torch.Tensor | None],
                  pieces: list[list[torch.Tensor | None]] | None,
                  param_idx: Sequence[int], taken: Sequence[bool | None] | None = None,
                  hold: bool = False) -> list[torch.Tensor | None]:
        pool = self.pool
        self._check_usable()
        if self.graphs.lost(state.call):
            raise RuntimeError(
                "the autograd graph of this forward was lost when a dpool worker was restarted; "
                "run the forward again (the master module is unchanged)"
            )
        self.check_params(state)
        create_graph = torch.is_grad_enabled()  # autograd enables grad mode here only for create_graph
        if create_graph and self.nodes is not None:
            raise UnsupportedError("higher-order gradients (create_graph=True) are not combined across nodes; "
                                   "compute this term on dpool.unwrap(model), or pass process_group=None")
        if create_graph and (pieces is not None or hold):
            raise UnsupportedError(
                "higher-order gradients (create_graph=True) through a dpool model are supported for gathered "
                "outputs outside no_sync() only; compute this term on dpool.unwrap(model)"
            )
        skip: list[int] = []  # under no_sync(): parameters this backward does not accumulate into
        if hold and taken is not None:
            if any(t is None for t in taken):
                raise UnsupportedError(
                    "torch.autograd.grad of a dpool model's parameters inside model.no_sync() is not supported: "
                    "there the workers keep the gradients, accumulating, and return none. Call it outside "
                    "no_sync(), or on dpool.unwrap(model); gradients of the inputs only are fine.")
            skip = [i for i, t in zip(param_idx, taken) if not t]
        self.graphs.collect(self.io.release, take=False)  # frees their input spans; told with the next forward
        per_shard = pieces if pieces is not None else state.grad_pieces(grads)
        keep = 0
        if create_graph:
            keep = self.graphs.new_call()
        if self.nodes is not None:
            self.nodes.step = pool.step
        param_grads, replies = self._backward_round(state.call, state.k, per_shard, state.gin_sizes, keep,
                                                    hold, rows=state.rows, at=state.fseq, skip=skip)
        input_grads = state.input_grads([replies[s].input_grads for s in range(state.k)])
        if not hold:
            self._gate_hooks(param_grads, param_idx)
        out = input_grads + [param_grads[i] for i in param_idx]
        if not create_graph:
            return out
        # the gradients' graph lives on the workers as call `keep`; its input regions must outlive it
        for s in range(state.k):
            span = self.io.kept(s, state.call)
            if span is not None:
                self.io.keep(s, keep, span)
        double = DoubleState(self, state, keep, per_shard, grads, out)
        results = DoubleBridge.apply(double, *double.inputs)
        if not isinstance(results, tuple):
            results = (results,)
        self.graphs.track(keep, double.ctx)
        double.ctx = None
        it = iter(results)
        return [next(it) if g is not None else None for g in out]

    @staticmethod
    def params_changed(state: CallState) -> bool:
        """Whether a parameter of ``state``'s forward was changed in place since (an ``optimizer.step()``
        before ``loss.backward()``): the workers' graphs read the parameters' current values."""
        return any(p._version != v for p, v in zip(state.params, state.versions))

    def _changed_since(self, versions: Sequence[int]) -> str:
        """The parameters whose versions moved since ``versions`` were taken, as an error names them ("parameters
        a, b, c and 2 more"); empty if none did."""
        names = [n for n, p, v in zip(self.master.param_names, self.params, versions) if p._version != v]
        if not names:
            return ""
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        return f"parameter{'s' * (len(names) > 1)} {', '.join(names[:3])}{more}"

    def check_params(self, state: CallState) -> None:
        """Refuse a backward through a forward whose parameters were changed in place since. One process
        raises too, for the parameters its graph saved; the workers' graphs saved views of the shared
        parameters, whose versions this process's in-place operations do not move, and would backpropagate
        with the new values. So the coordinator compares every parameter's version (frozen ones' too: a graph
        may save them) with the forward's; it cannot tell which the graphs saved, so it refuses for any."""
        if not self.params_changed(state):
            return
        raise ModelChangedError(
            f"one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"{self._changed_since(state.versions)} of the dpool model changed in place "
            "after its forward (an optimizer.step() or an update under torch.no_grad() before this backward). "
            "The workers' graphs would backpropagate with the new values, so dpool refuses, as one process "
            "refuses for the tensors its graph saved. Run the backward before changing the parameters, or the "
            "forward again after the change. (A change through .data is not tracked, here as in one process.)")

    def _backward_round(self, call: int, k: int, per_shard: list[list[torch.Tensor | None]], gin_sizes: list[int],
                        keep: int, hold: bool, rows: list[int] | None = None, at: int = -1,
                        skip: Sequence[int] = ()) -> tuple[list, dict]:
        """One backward round on ``k`` shards of ``call``: the summed parameter gradients and the replies.
        ``skip``: parameters the workers backpropagate as frozen (autograd does not accumulate into them)."""
        pool = self.pool
        msgs: dict[int, P.Message] = {}
        flags = bytes(p.requires_grad for p in self.params)  # accumulate as one process would now
        if skip:
            flags = bytes(0 if i in skip else f for i, f in enumerate(flags))
        drop = b""
        if self._workers_hold:
            drop = self._held.cleared(self.params)  # (zero_grad() since: dropped)
            self._held.refuse_frozen(self.params)
        # Workers without a shard in this backward (its batch had fewer rows than an earlier one of no_sync()) may
        # hold gradients: the backward that ends no_sync() takes their sums too, and one after a zero_grad() has
        # them drop what was cleared. They backpropagate nothing (P.HELD_ONLY); one that holds nothing adds zeros.
        n = self.n if self._workers_hold and k < self.n and (not hold or any(drop)) else k
        together = pool.together(n)
        try:
            for s in range(k, n):
                sparse = self.io.segment(s, "sparse")
                msgs[s] = P.Backward(P.HELD_ONLY, pool.step, [None, 0], [], [None, 0], hold,
                                     sparse.ref() if sparse is not None else [None, 0], 0, flags, together, drop)
            for s in range(k):
                mine = per_shard[s]
                placer = Placer()
                offs: list[Any] = [placer.reserve(g) if g is not None else None for g in mine]
                seg = self.io.ensure(s, "gout", placer.offset)
                gmetas = [Placer.write(seg.views, o, g) if g is not None else None
                          for o, g in zip(offs, mine)]
                gin = self.io.ensure(s, "gin", gin_sizes[s])
                sparse = self.io.segment(s, "sparse")
                msgs[s] = P.Backward(call, pool.step, seg.ref(), gmetas, gin.ref(), hold,
                                     sparse.ref() if sparse is not None else [None, 0], keep, flags, together, drop)
        except BaseException:
            self._unsent()
            raise
        self._slot_gen += 1  # the slots are written from here on, whatever the outcome
        holding = hold or self._workers_hold
        if hold:
            self._workers_hold = True
        # the reducer may start combining while the workers still run (cross-node buckets)
        slots = [self._grad_slots[s] for s in range(n)]
        pool.on_bucket = None if hold else self.reducer.begin(slots, call, at)
        try:
            try:
                replies = self._request(msgs, "running backward")
            finally:
                pool.on_bucket = None
            pool.unlink_segments()
            self._raise_failures(replies, "backward")
            changed = self._changed_buffers(replies.values())
            self.stats.split_round("backward", pool.sent_at, pool.arrived, replies, k)
            need = {s: r.sparse_need for s, r in replies.items() if r.sparse_need}
            if need:  # sparse gradients larger than the sparse segment (or the first ones): grow it, fetch them
                fetched = self._fetch_round(lambda s, ref: P.FetchSparse(call if s < k else P.HELD_ONLY, ref),
                                            "sparse", need,
                                            "returning sparse gradients", "backward")
                for s, r in fetched.items():
                    replies[s].sparse = r.sparse
        except BaseException as exc:
            if holding and not pool.broken:
                # Some workers may have added their part of this backward to the gradients they hold (the
                # others failed, or never ran it): those sums are the master's no longer, until dropped.
                self._held.failed(self.module, self.params, flags,
                                  f"the backward at step {pool.step} failed ({type(exc).__name__})")
            raise
        self.stats.backward([replies[s].busy for s in range(k)],
                            sum(g.numel() * g.element_size() for g in _tensors_of(per_shard)),
                            sum(end - start for _, start, end, _ in self.layout.param_groups) * k)
        if rows is not None:
            self.balancer.observe(1, [replies[s].busy for s in range(k)], rows)
        # Reduce: the workers' gradient slots, one sum per dtype group (averaged over the nodes in
        # cross-node mode); then sparse gradients. Under no_sync() the gradients stay on the workers.
        if hold:
            self._held.mark(self.module, self.params, flags)
            self._commit_backward_buffers(changed, k, rows)
            return [None] * len(self.params), replies
        self._workers_hold = False
        self._held.release(self.params)
        param_grads = self.reducer.reduce(slots, [replies[s].param_mask for s in range(n)], at,
                                          any(replies[s].late for s in range(n)))
        self._commit_backward_buffers(changed, k, rows)  # (after the reduce, which may fail across nodes)
        for s in range(n):
            seg = self.io.segment(s, "sparse")
            sum_sparse(param_grads, [(i, read(seg.views, imeta), read(seg.views, vmeta))
                                     for i, imeta, vmeta in replies[s].sparse], self.params, self.device)
        return param_grads, replies

    def _commit_rebound(self, shards: list[int]) -> None:
        """Parameters whose ``.data`` the shards' forward replaced (see ``Replica._rebound``): the first
        shard's new values, into the master (each shard's forward started from the same values)."""
        taken = self._call(shards, take_rebound)
        done: set[int] = set()
        with torch.no_grad():
            for s in shards:
                for i, t in taken[s].items():
                    if i not in done:
                        self.master.param_views[i].copy_(t)
                        done.add(i)

    def _commit_backward_buffers(self, changed: list[int], k: int, rows: Sequence[int] | None) -> None:
        if changed:
            self._buffers.commit_changed(changed, self._master_buffers, self._first_buffers, self._buffer_slots[:k],
                                         rows)

    def _changed_buffers(self, replies: Iterable[Any]) -> list[int]:
        """The buffers the shards' backward changed in place (a module's backward hook updating one), which
        the next forward's refresh would otherwise overwrite with the master's: committed as a forward's
        updates are. Across nodes only under ``"first"`` (rank 0's are broadcast before each training
        forward): the other policies would need an exchange no node can know to expect."""
        changed = [i for r in replies for i in r.buffers]
        if changed and self.nodes is not None and self.buffer_policy != "first":
            names = sorted({self.master.buffer_names[i] for i in changed})
            raise UnsupportedError(
                f"the backward changed buffers {names} in place (a backward hook?); in cross-node mode dpool "
                f"combines such updates only with buffers='first', not buffers={self.buffer_policy!r}"
            )
        return changed

    @_one_call_at_a_time
    def double_backward(self, double: Any, vs: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Differentiate the gradients of a ``create_graph=True`` backward (see ``DoubleBridge``)."""
        self._check_usable()
        if self.graphs.lost(double.call):
            raise RuntimeError("the graph of these gradients was lost when a dpool worker was restarted")
        self.check_params(double.state)
        per_shard, gin_sizes = double.pieces(vs)
        param_grads, replies = self._backward_round(double.call, double.k, per_shard, gin_sizes, 0, False)
        return double.results([replies[s].input_grads for s in range(double.k)],
                              [param_grads[i] for i in double.state.diff_idx])

    # ------------------------------------------------------------------ misc
    def _follow_numerics(self) -> None:
        """Give the workers this process's :func:`~dpool.numerics.numerics` settings (default dtype,
        deterministic mode, anomaly detection, float32 precision, attention backends): at the first forward,
        and when they changed or a worker was restarted."""
        values = numerics()
        self.call_workers(functools.partial(apply_numerics, values, legacy=legacy_precision()))
        self._sent_numerics = values

    def _follow_backend_flags(self) -> None:
        """Give the workers this process's cuDNN and cuBLAS settings when they changed (or after a restart)."""
        flags = backend_flags()
        if flags != self._sent_flags:
            self.call_workers(functools.partial(apply_backend_flags, flags))
            self._sent_flags = flags

    @_one_call_at_a_time
    def call_workers(self, fn: Any) -> list[Any]:
        self._check_usable()
        self._slot_gen += 1  # fn may run anything on the replicas, a backward included
        return list(self._call(range(self.n), fn).values())

    @_one_call_at_a_time
    def inspect(self) -> list[tuple[int, int]]:
        """Per worker: the graphs it keeps for us, and its resident memory in bytes (one round trip)."""
        self._check_usable()
        try:
            release = self.graphs.collect(self.io.release)
            replies = self._request({i: P.Inspect(release) for i in range(self.n)}, "reporting its state")
        except BaseException:
            self.graphs.retell()
            raise
        self._raise_failures(replies, "stats")
        return [(replies[i].graphs, replies[i].rss) for i in range(self.n)]

    def close(self) -> None:
        """Close the pool; the master keeps its values in private memory. Every step is idempotent, and
        the runtime counts as closed only once all of them ran: a close cut short (Ctrl-C) is finished
        by the next one."""
        if self._closed:
            return
        self._pending = None  # a deferred forward nothing used (see _Deferred): it never runs
        unbind, self._unbind = self.__dict__.get("_unbind"), None
        if unbind is not None:  # the coordinator's threads back where they were before wrap()
            unbind()
        self._held.release(self.params)
        hook_gate.restore(self.params)  # gates a failed backward left on the parameters' hooks
        self.master.close()
        self.pool.close()
        if self.nodes is not None:
            self.nodes.close()
        # Drop every reference to shared memory: a graph or output the user still holds keeps this
        # object alive, but not the mappings (each one also holds an fd; see close() in DataParallel).
        self.io.clear()
        self.graphs.clear()
        reducer = self.__dict__.get("reducer")
        if reducer is not None:
            reducer.close()
        for name in ("states", "_grad_slots", "_buffer_slots", "_master_buffers", "_first_buffers", "_buffers",
                     "_replicas", "reducer"):
            self.__dict__.pop(name, None)
        self._closed = True
