"""One training step, coordinator side: scatter → dispatch → gather, and backward.

:class:`Runtime` owns the pool, the shared parameter segment and each worker's
I/O segments. The master's parameters are rebound (``p.data = view``) to views
of the shared segment, so the optimizer's in-place updates reach every replica
with no copy. ``close()`` rebinds them to private memory again, so the master
module outlives the pool.

A step is transactional: the master is only touched after every shard has
succeeded (buffers are committed after the forward round; gradients are
returned to autograd after the backward round). A failed round leaves the
master's parameters, gradients, buffers and optimizer state as they were.
"""
from __future__ import annotations

import functools
import io
import logging
import os
import sys
import threading
import weakref
from typing import Any, Callable, Sequence, TypeVar

import cloudpickle
import torch

from . import gather as _gather, scatter as _scatter, tree as _tree
from . import protocol as P
from .bridge import Bridge, CallState, DoubleBridge, DoubleState
from .buffers import BufferCommit
from .loss import ShardedOutput, build_output, combine
from .layout import Layout
from .tensors import DTYPES, Placer, dense_strides, dtype_name, meta_nbytes as _meta_bytes, nbytes, read
from .config import Config
from .errors import (
    DpoolValueError,
    ModelChangedError,
    UnpicklableModelError,
    UnsupportedError,
    WorkerDiedError,
    WorkerStartError,
    WorkerTimeoutError,
    remote_error,
)
from .gpu import apply_backend_flags, backend_flags, check_free_memory, memory_report
from .pool import Pool
from .sweep import sweep
from .transport.shm import Segment, check_free

__all__ = ["Runtime"]

log = logging.getLogger("dpool")

_MIN_IO = 1 << 20
_SEED_RANGE = 1 << 62
_ROLES = ("in", "out", "gout", "gin", "sparse")  # a worker's growable I/O segments (see _ensure)
F = TypeVar("F", bound=Callable[..., Any])


class _Pickler(cloudpickle.Pickler):
    """Pickles the model with its parameters and buffers replaced by references."""

    def __init__(self, file: io.BytesIO, ids: dict[int, tuple]) -> None:
        super().__init__(file, protocol=pickle_protocol())
        self._ids = ids

    def persistent_id(self, obj: Any) -> Any:  # noqa: D401
        if isinstance(obj, torch.Tensor):
            return self._ids.get(id(obj))
        return None


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


def pickle_protocol() -> int:
    import pickle

    return pickle.HIGHEST_PROTOCOL


def _one_call_at_a_time(method: F) -> F:
    """Hold the runtime's call lock for the whole call (threads wait for the call in flight)."""

    @functools.wraps(method)
    def locked(self: "Runtime", *args: Any, **kwargs: Any) -> Any:
        with self.call_lock:
            return method(self, *args, **kwargs)

    return locked  # type: ignore[return-value]


def per_shard_tensors(per_shard: list[list[Any]]) -> list[torch.Tensor]:
    return [g for ms in per_shard for g in ms if isinstance(g, torch.Tensor)]


class _Stats:
    """What ``DataParallel.stats()`` reports: per-worker step times, shard sizes, restarts, bytes moved."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.steps = 0
        self.restarts = 0
        self.rows: list[int] = []
        self.forward_ms = [0.0] * n
        self.backward_ms = [0.0] * n
        self.bytes = {"inputs": 0, "outputs": 0, "output_grads": 0, "param_grads": 0}

    def forward(self, rows: list[int], busy: list[float], inputs: int, outputs: int) -> None:
        self.steps += 1
        self.rows = list(rows)
        for s, b in enumerate(busy):
            self.forward_ms[s] = b * 1e3
        self.bytes["inputs"], self.bytes["outputs"] = inputs, outputs

    def backward(self, busy: list[float], output_grads: int, param_grads: int) -> None:
        for s, b in enumerate(busy):
            self.backward_ms[s] = b * 1e3
        self.bytes["output_grads"], self.bytes["param_grads"] = output_grads, param_grads

    def snapshot(self, pids: list[int], devices: list[str]) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "restarts": self.restarts,
            "shard_rows": list(self.rows),
            "workers": [{"index": i, "device": devices[i], "pid": pids[i],
                         "forward_ms": round(self.forward_ms[i], 3), "backward_ms": round(self.backward_ms[i], 3)}
                        for i in range(self.n)],
            "bytes_per_step": dict(self.bytes),
        }


class _IO:
    """A worker's growable I/O segment for one role."""

    __slots__ = ("seg",)

    def __init__(self) -> None:
        self.seg: Segment | None = None


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
                 gather: bool = True, attach: str | None = None, output_device: str | None = None) -> None:
        self.module = module
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
        self._collect_tensors()
        self._next_call = 0
        self._release: set[int] = set()
        self._live: dict[int, Any] = {}  # call -> weakref to the autograd ctx
        self._regions: list[dict[int, tuple[Segment, int, int]]] = [{} for _ in range(self.n)]
        self._io = [{r: _IO() for r in _ROLES} for _ in range(self.n)]
        self._closed = False
        self.restarts_left = max_restarts
        if shard_weights is not None:
            if len(shard_weights) != self.n or any(not w > 0 for w in shard_weights):
                raise DpoolValueError(f"shard_weights needs {self.n} positive numbers (one per worker), got {shard_weights!r}")
            if balance is not None:
                raise DpoolValueError("give either shard_weights or balance='auto', not both")
        if balance not in (None, "auto"):
            raise DpoolValueError(f"balance={balance!r}: the only balancing mode is 'auto'")
        self._weights = list(map(float, shard_weights)) if shard_weights is not None else None
        self._balance = balance
        self._rates = [[0.0, 0.0] for _ in range(self.n)]  # EMA seconds per row: forward, backward
        self.no_sync = False
        self.buffer_policy = buffers
        self.gather_outputs = gather
        self._epoch_call = 0  # graphs of calls up to this id were lost in a worker restart
        # One call at a time: calls from several threads (an evaluation thread, a server's handlers)
        # wait for the one in flight, as nn.DataParallel's do; they share segments and the workers.
        self.call_lock = threading.RLock()
        self._last_rows: list[int] | None = None  # shard sizes of the latest forward (for error hints)
        self._stats = _Stats(self.n)
        self._sent_flags: tuple | None = None  # GPU numerics settings the workers have (see _follow_backend_flags)
        if attach is not None and max_restarts:
            raise DpoolValueError("max_restarts is not available with pool=...: the dpool-workers daemon restarts workers")
        self.pool = Pool(devices, config, worker_threads, attach=attach)
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ start
    def _collect_tensors(self) -> None:
        """Read the master's parameters and buffers (names, tensors), refusing what dpool cannot run."""
        module = self.module
        self.param_names = [n for n, _ in module.named_parameters()]
        self.params = list(module.parameters())
        named_buffers = [(n, b) for n, b in module.named_buffers()]
        self.buffer_names = [n for n, _ in named_buffers]
        self.buffers = [b for _, b in named_buffers]
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
                if self.cuda:
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

    def _start(self) -> None:
        pool = self.pool
        if self.cuda:  # fail fast, with each GPU's numbers, rather than with an OOM inside a worker
            check_free_memory(self.devices, Layout(self.params, self.buffers).size, spawn=pool.launcher.spawns)
        # Workers map the parameters through an inherited fd, so the name can go at once
        # (and a respawned worker can still map them).
        self._bind_master(unlink=pool.launcher.spawns)  # attached (daemon) workers map it by name
        self._pickle_model()  # an unpicklable model fails here, before ~a second of worker start-up
        pool.start([self.master.fd] if self.master.fd is not None else [])
        self._ship(by_name=not pool.launcher.spawns, pickled=True)
        self._watch()

    def _bind_master(self, unlink: bool) -> None:
        """Lay the master's parameters and buffers out in a new shared segment and rebind them to it."""
        layout = self.layout = Layout(self.params, self.buffers)
        # on a GPU: the master arena, exported to each worker on the master's GPU (see dpool.transport.cuda_ipc)
        self.master = self.pool.new_segment(layout.size, min_size=64, keep_fd=not self.cuda, device=self.devices[0])
        if unlink:
            self.master.unlink()
        self.param_views = []
        self._param_strides = [dense_strides(p) for p in self.params]  # memory formats, kept in shared memory
        for p, off, st in zip(self.params, layout.param_offsets, self._param_strides):
            v = self.master.standalone(off, p.dtype, p.shape, st)
            v.copy_(p.detach())
            self.param_views.append(v)
        self.buffer_views = []
        for b, off in zip(self.buffers, layout.buffer_offsets):
            v = self.master.standalone(off, b.dtype, b.shape)
            v.copy_(b.detach())
            self.buffer_views.append(v)
        self._buffers = BufferCommit(self.buffer_policy, self.module, self.buffers, layout.buffer_offsets,
                                     self.buffer_views)
        with torch.no_grad():
            for p, v in zip(self.params, self.param_views):
                p.data = v
            for b, v in zip(self.buffers, self.buffer_views):
                b.data = v
        self._ptrs = [p.data_ptr() for p in self.params] + [b.data_ptr() for b in self.buffers]

    def _pickle_model(self) -> None:
        """Pickle the master module, its tensors by reference; done before any worker is started."""
        ids: dict[int, tuple] = {}
        for i, p in enumerate(self.params):
            ids[id(p)] = ("p", i, p.requires_grad)
        for i, b in enumerate(self.buffers):
            ids.setdefault(id(b), ("b", i))
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
        self._model_bytes = buf.getvalue()

    def _ship(self, by_name: bool, pickled: bool = False) -> None:
        """Build every worker's replica from the pickled master module (pickled here unless ``pickled``)."""
        pool, layout = self.pool, self.layout
        if not pickled:
            self._pickle_model()
        self.states = [pool.new_segment(layout.size, min_size=64, device=self.devices[i], owner=i) for i in range(self.n)]
        self._replicas: list[Any] = [None if self._alias[i] else self._replica_arena(i) for i in range(self.n)]
        self._init_workers(range(self.n), by_name=by_name)
        self._module_list = list(self.module.modules())
        self._module_ids = {id(m) for m in self._module_list}
        self._changed = False

    # ------------------------------------------------------------------ changes after wrap()
    def _watch(self) -> None:
        """Notice assignments to the master's parameters, buffers and submodules (module.head = ...).

        torch's global registration hooks run on every such ``setattr``; the hook only sets a flag, and
        the next forward compares identities and follows a real change (see :meth:`_follow_changes`).
        """
        ref = weakref.ref(self)

        def changed(module: torch.nn.Module, name: str, value: Any) -> None:
            rt = ref()
            if rt is not None and id(module) in rt._module_ids:
                rt._changed = True

        from torch.nn.modules import module as _m

        self._hooks = [_m.register_module_parameter_registration_hook(changed),
                       _m.register_module_buffer_registration_hook(changed),
                       _m.register_module_module_registration_hook(changed)]

    def _follow_changes(self) -> None:
        """Re-sync the replicas if the master's parameters, buffers or submodules are other objects now.

        DataParallel re-replicates every forward, so it follows a new head or a new ``nn.Parameter``
        assigned after wrapping; dpool ships the changed model to the running workers once (new
        layout, new shared segment, new replicas). Graphs of earlier forwards can no longer be
        backpropagated.
        """
        self._changed = False
        same = ([id(p) for p in self.module.parameters()] == [id(p) for p in self.params]
                and [id(b) for b in self.module.buffers()] == [id(b) for b in self.buffers]
                and [id(m) for m in self.module.modules()] == [id(m) for m in self._module_list])
        if same:
            return
        log.info("the model changed after wrap(): re-syncing the replicas")
        pool = self.pool
        old_master = self.master
        with torch.no_grad():  # what we bound so far gets private memory: the old segment goes
            for t, v in zip(self.params + self.buffers, self.param_views + self.buffer_views):
                if t.data_ptr() == v.data_ptr():
                    t.data = v.clone()
        try:
            self._collect_tensors()
            self._bind_master(unlink=False)  # running workers map the new segment by name
            if self.master.fd is not None:
                pool.pass_fds([self.master.fd])  # for workers respawned later
            self._epoch_call = self._next_call  # earlier graphs referred to the old replicas
            self._release.update(self._live)
            self._live.clear()
            self._ship(by_name=True)
        except BaseException as exc:
            pool.break_pool(f"re-syncing the replicas after a change to the model failed: {exc}")
            raise
        finally:
            old_master.close_fd()

    def _replica_arena(self, i: int) -> Any:
        """A GPU copy of the master arena for worker ``i`` (not on the master's GPU); refreshed each forward."""
        arena = self.pool.new_segment(self.layout.size, min_size=64, device=self.devices[i], owner=i)
        arena.u8.copy_(self.master.u8)
        return arena

    def _push(self) -> None:
        """Copy the master's parameters and buffers to the workers on other GPUs (DataParallel's broadcast)."""
        for arena in self._replicas:
            if arena is not None:
                arena.u8.copy_(self.master.u8)

    def _params_ref(self, i: int, by_name: bool) -> list:
        if self.cuda:
            arena = self._replicas[i]
            return arena.ref() if arena is not None else self.master.ref(self.pool.workers[i])
        return self.master.ref() if by_name else self.master.fd_ref()

    def _init_workers(self, indices: Any, by_name: bool = False) -> None:
        """Ship the model to ``indices`` and wait until their replicas are built."""
        pool, layout = self.pool, self.layout
        pl = Layout.wire(self.params, layout.param_offsets, True)
        bl = Layout.wire(self.buffers, layout.buffer_offsets, False)
        msgs = {
            i: P.Init(self._model_bytes, [p for p in sys.path if isinstance(p, str)], self._params_ref(i, by_name),
                      self.states[i].ref(), pl, bl, pool.threads,
                      {"bn_counts": self._buffers.needs_counts, "event": pool.event_handle(i)})
            for i in indices
        }
        try:
            replies = pool.request(msgs, "loading the model", timeout=self.config.startup_timeout_s)
        except (WorkerDiedError, WorkerTimeoutError) as exc:
            pool.break_pool(str(exc))
            raise WorkerStartError(f"{exc}\nThe worker crashed while unpickling the model; no pool was started.") from None
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
            self._master_buffers = self.master.u8[b[0]:b[1]]
            self._first_buffers = self.states[0].u8[b[0]:b[1]]
        self._buffer_slots = [self._buffers.slot_views(st.u8) for st in self.states]

    def _request(self, msgs: dict[int, P.Message], stage: str) -> dict[int, P.Message]:
        """``pool.request`` that, on a dead or hung worker, restarts it (``max_restarts``) or breaks the pool."""
        try:
            return self._lost_contexts(self.pool.request(msgs, stage))
        except (WorkerDiedError, WorkerTimeoutError) as exc:
            dead = getattr(exc, "workers", None) or [exc.worker]
            if self.restarts_left >= len(dead):
                self.restarts_left -= len(dead)
                self._stats.restarts += len(dead)
                log.warning("%s; restarting worker(s) %s (%d restart(s) left)", str(exc).split("\n", 1)[0], dead,
                            self.restarts_left)
                try:
                    self._restart(dead)
                except BaseException as again:
                    self.pool.break_pool(str(again))
                    exc.args = (f"{exc.args[0]} Restarting it failed too ({again}); the pool is broken; "
                                "the master module is unchanged (dpool.unwrap(model) returns it).",)
                    raise exc from again
                exc.restarted = True  # type: ignore[attr-defined]
                exc.args = (f"{exc.args[0]} Worker(s) {dead} were restarted and re-synced from the master "
                            f"({self.restarts_left} restart(s) left): the master module is unchanged and the next "
                            "call runs on the restarted pool.",)
                raise
            self.pool.break_pool(str(exc))
            exc.args = (f"{exc.args[0]} The pool is broken; the master module is unchanged (dpool.unwrap(model) "
                        "returns it; pass max_restarts=K to dpool.wrap to respawn workers instead).",)
            raise

    def _lost_contexts(self, replies: dict[int, P.Message]) -> dict[int, P.Message]:
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

    def _restart(self, indices: list[int]) -> None:
        self.pool.respawn(indices)
        for i in indices:
            self.states[i] = self.pool.new_segment(self.layout.size, min_size=64, device=self.devices[i], owner=i)
            if self._replicas[i] is not None:
                self._replicas[i] = self._replica_arena(i)
            self._grad_slots[i] = [self.states[i].u8[a:b].view(dt) for dt, a, b, _ in self.layout.param_groups]
            self._io[i] = {r: _IO() for r in _ROLES}
            self._regions[i] = {}
            self._buffer_slots[i] = self._buffers.slot_views(self.states[i].u8)
        if 0 in indices and self.layout.buffer_range is not None:
            a, b = self.layout.buffer_range
            self._first_buffers = self.states[0].u8[a:b]
        # Graphs kept by the dead worker are gone: calls made so far can no longer be backpropagated.
        self._epoch_call = self._next_call
        self._sent_flags = None  # a new process starts with torch's default numerics settings
        self._release.update(self._live)
        self._live.clear()
        self._init_workers(indices)

    # ------------------------------------------------------------------ helpers
    def _ensure(self, w: int, role: str, nbytes_: int) -> Segment:
        slot = self._io[w][role]
        seg = slot.seg
        if seg is None or seg.size < nbytes_:
            want = max(nbytes_, _MIN_IO, 2 * seg.size if seg is not None else 0)
            slot.seg = seg = self.pool.new_segment(want, device=self.devices[w], owner=w)
        return seg

    def _input_growth(self, w: int, need: int) -> int:
        """Bytes of new segment ``_input_region(w, need)`` will create (0 if it fits)."""
        seg = self._io[w]["in"].seg
        start = max((end for rseg, _, end in self._regions[w].values() if rseg is seg), default=0)
        if seg is not None and start + need <= seg.size:
            return 0
        want = max(need, _MIN_IO, 2 * seg.size if seg is not None else 0)
        return 1 << (want - 1).bit_length()

    def _input_region(self, w: int, need: int) -> tuple[Segment, int]:
        seg = self._io[w]["in"].seg
        start = 0
        if seg is not None:
            for rseg, _, end in self._regions[w].values():
                if rseg is seg:
                    start = max(start, end)
        if seg is None or start + need > seg.size:
            slot = self._io[w]["in"]
            want = max(need, _MIN_IO, 2 * seg.size if seg is not None else 0)
            slot.seg = seg = self.pool.new_segment(want, device=self.devices[w], owner=w)
            start = 0
        return seg, start

    def _collect_released(self) -> list[int]:
        for call, ref in list(self._live.items()):
            ctx = ref()
            freed = ctx is None
            if not freed:
                try:
                    ctx.saved_tensors
                except RuntimeError:
                    freed = True
            if freed:
                del self._live[call]
                self._release.add(call)
                for regions in self._regions:
                    for key in [key for key in regions if key == call or (isinstance(key, tuple) and key[0] == call)]:
                        del regions[key]
        out = sorted(self._release)
        self._release.clear()
        return out

    def _check_bindings(self) -> None:
        """Re-attach master tensors the user replaced (``p.data = ...``, ``load_state_dict(assign=True)``)."""
        tensors = self.params + self.buffers
        for i, t in enumerate(tensors):
            if t.data_ptr() != self._ptrs[i]:
                self._rebind(i, t)

    def _rebind(self, i: int, t: torch.Tensor) -> None:
        views = self.param_views + self.buffer_views
        names = self.param_names + self.buffer_names
        v = views[i]
        if t.shape != v.shape or t.dtype != v.dtype or t.device != v.device:
            raise ModelChangedError(
                f"{names[i]} of the master module changed to {tuple(t.shape)}/{t.dtype}/{t.device} after "
                f"dpool.wrap() (it was {tuple(v.shape)}/{v.dtype}/{v.device}). The workers' replicas cannot follow a "
                "change of shape, dtype or device: close this model and dpool.wrap() the module again."
            )
        with torch.no_grad():
            v.copy_(t.detach())
            t.data = v
        self._ptrs[i] = t.data_ptr()

    def _raise_failures(self, replies: dict[int, P.Message], where: str) -> None:
        failed = sorted((i, r) for i, r in replies.items() if isinstance(r, P.Failed))
        if not failed:
            return
        # Shards released from a collective because another failed are not the cause: report the cause.
        causes = [(i, r) for i, r in failed if r.qualname != "CollectiveAborted"] or failed
        i, r = causes[0]
        w = self.pool.workers[i]
        message = r.message
        if "Expected more than 1 value per channel when training" in message and self._last_rows:
            message += (f"\n(dpool: the batch was split into shards of {self._last_rows} rows, and BatchNorm cannot "
                        "train on a one-row shard. Use DataLoader(..., drop_last=True), a batch of at least 2 rows "
                        "per worker, or fewer workers.)")
        if r.qualname == "OutOfMemoryError" and self.cuda:
            message += (f"\n(dpool: {memory_report(self.devices)}. Each worker holds its shard's activations: use a "
                        "smaller batch, fewer workers per GPU, or free memory first: torch.cuda.empty_cache() here, "
                        "other processes per nvidia-smi.)")
        # raised without a local name: a local would tie the exception to this frame's locals (the
        # I/O segments among them) in a cycle that only the GC frees
        raise remote_error(r.module, r.qualname, message, r.traceback, worker=i, device=w.device, pid=w.pid,
                           step=self.pool.step, where=f"{where} (shard {i})")

    # ------------------------------------------------------------------ forward
    @_one_call_at_a_time
    def forward(self, args: tuple, kwargs: dict) -> Any:
        pool = self.pool
        pool.check_usable()
        if self._changed:
            self._follow_changes()
        self._check_bindings()
        if self.cuda:
            self._follow_backend_flags()
        release = self._collect_released()
        tensors: list[torch.Tensor] = []
        spec = _tree.flatten((tuple(args), dict(kwargs)), tensors)
        k, splits = _scatter.plan(tensors, self.n, self.dim, self.shard_weights())
        self._last_rows = next((sizes for sizes in splits if sizes is not None), None)
        shards = _scatter.shard_views(tensors, splits, k, self.dim)
        grad = torch.is_grad_enabled()
        rg = [grad and t.requires_grad for t in tensors]
        training = bytes(m.training for m in self._modules())
        requires_grad = bytes(p.requires_grad for p in self.params)
        autocast = None
        kind = self.device.type  # autocast of the workers' device type ("cuda" or "cpu")
        if torch.is_autocast_enabled(kind):
            autocast = [kind, dtype_name(torch.get_autocast_dtype(kind)), torch.is_autocast_cache_enabled()]
        call = self._next_call = self._next_call + 1
        pool.step += 1
        # One draw from the coordinator's generator per forward: torch.manual_seed(s) makes a run
        # reproducible, embedded or attached. Each shard seeds its own stream from it (as replicas on
        # several GPUs draw their own), so the numbers differ from a single process's.
        seed = int(torch.randint(_SEED_RANGE, (), dtype=torch.int64))
        msgs: dict[int, P.Message] = {}
        spans: list[tuple[Segment, int, int]] = []
        gin_sizes = []
        layouts = []
        grow = 0
        for s in range(k):
            placer = Placer()
            offs = [placer.reserve(t) for t in shards[s]]
            layouts.append((offs, placer.offset))
            grow += self._input_growth(s, placer.offset)
        if grow and not self.cuda:
            check_free(self.config.shm_dir, grow)  # all shards' new segments, before creating any
        if self.cuda:
            self._push()
        try:
            for s in range(k):
                offs, need = layouts[s]
                seg, start = self._input_region(s, need)
                metas = [Placer.write(seg.views, start + o, t, r) for o, t, r in zip(offs, shards[s], rg)]
                spans.append((seg, start, start + need))
                gin = Placer()
                for t, r in zip(shards[s], rg):
                    if r:
                        gin.reserve(t)
                gin_sizes.append(gin.offset)
                out = self._ensure(s, "out", 0)
                msgs[s] = P.Forward(call, pool.step, grad, training, requires_grad,
                                    self.layout.buffer_range is not None, seg.ref(), out.ref(), spec, metas, s,
                                    k, not self.gather_outputs, autocast, release, seed)
        except BaseException:
            pool.unlink_segments()  # segments made for this call were never announced to a worker
            self._release.update(release)
            raise
        try:
            replies = self._request(msgs, "running forward")
            pool.unlink_segments()
            self._raise_failures(replies, "forward")
            fetch = {s: r.need for s, r in replies.items() if r.need}
            if fetch:
                fmsgs = {s: P.Fetch(call, self._ensure(s, "out", need).ref()) for s, need in fetch.items()}
                fetched = self._request(fmsgs, "returning outputs")
                pool.unlink_segments()
                self._raise_failures(fetched, "forward")
                for s, r in fetched.items():
                    replies[s].tensors = r.tensors
        except BaseException:
            if grad:
                self._release.add(call)  # drop graphs kept by the shards that succeeded
            raise
        specs = [replies[s].tree for s in range(k)]
        metas = [replies[s].tensors for s in range(k)]
        groups = _gather.tensor_groups(specs)
        outs = [self._io[s]["out"].seg for s in range(k)]
        state = CallState(self, call, k, groups, metas, outs, splits, gin_sizes, rg,
                          [[t.shape for t in shards[s]] for s in range(k)])
        diff_inputs = [t for t, r in zip(tensors, rg) if r]
        diff_params = [p for p in self.params if p.requires_grad] if grad else []
        state.diff_inputs, state.diff_params = diff_inputs, diff_params  # what a double backward differentiates
        state.input_devices = [t.device for t in diff_inputs]
        if not self.gather_outputs:  # outputs stay on the workers until a criterion or .gather()
            handle = ShardedOutput(self, state, specs, diff_inputs)
            self._live[call] = weakref.ref(handle)
            for s in range(k):
                self._regions[s][call] = spans[s]
            gathered = None
        elif grad and any(state.differentiable):
            gathered = Bridge.apply(state, *diff_inputs, *diff_params)
            if not isinstance(gathered, tuple):
                gathered = (gathered,)
            self._live[call] = weakref.ref(state.ctx)
            for s in range(k):
                self._regions[s][call] = spans[s]
            state.ctx = None
        else:
            if grad:
                self._release.add(call)
            gathered = state.gather()
        state.outs = None  # read by the gather above; a later gather (gather=False) maps them anew
        rows = next((sizes for sizes in splits if sizes is not None), [1] * k)
        self._stats.forward(rows, [replies[s].busy for s in range(k)], sum(nbytes(t) for sh in shards for t in sh),
                            sum(_meta_bytes(m) for ms in metas for m in ms))
        if log.isEnabledFor(logging.DEBUG):
            log.debug("step %d: forward of %d shards (rows %s), workers busy %s ms", pool.step, k, rows,
                      [round(replies[s].busy * 1e3, 2) for s in range(k)])
        if self._balance:
            for s in range(k):
                self._observe(s, 0, replies[s].busy, rows[s])
        # Commit: every shard succeeded, so buffer updates may reach the master (see buffers.py).
        if self.layout.buffer_range is not None:
            self._buffers.commit(self._master_buffers, self._first_buffers, self._buffer_slots[:k], rows,
                                 [replies[s].stats for s in range(k)],
                                 [bn.training for bn, *_ in self._buffers.batchnorms])
        state.rows = rows
        if gathered is None:
            return handle
        return _gather.build(specs, iter(gathered))

    # ------------------------------------------------------------------ loss on the workers
    @_one_call_at_a_time
    def criterion(self, handle: Any, crit: Any, targets: tuple) -> torch.Tensor:
        """Compute ``crit`` on every shard of ``handle`` (see :mod:`dpool.loss`)."""
        pool, state = self.pool, handle._state
        pool.check_usable()
        if state.call <= self._epoch_call or state.call not in self._live:
            raise RuntimeError("the outputs of this forward are no longer on the workers (released or restarted)")
        tensors: list[torch.Tensor] = []
        spec = _tree.flatten(tuple(targets), tensors)
        k, rows = state.k, state.rows
        msgs: dict[int, P.Message] = {}
        for t in tensors:
            if t.dim() > self.dim and t.size(self.dim) != sum(rows):
                raise DpoolValueError(f"target has {t.size(self.dim)} rows along dim {self.dim}, the output {sum(rows)}")
        shards = _scatter.shard_views(tensors, [rows if t.dim() > self.dim else None for t in tensors], k, self.dim)
        for s in range(k):
            placer = Placer()
            offs = [placer.reserve(t) for t in shards[s]]
            seg, start = self._input_region(s, placer.offset)
            metas = [Placer.write(seg.views, start + o, t) for o, t in zip(offs, shards[s])]
            # the loss graph may save the targets: keep their region until the call is released
            self._regions[s][(state.call, "targets", len(self._regions[s]))] = (seg, start, start + placer.offset)
            msgs[s] = P.Criterion(state.call, crit._bytes, spec, metas, seg.ref())
        replies = self._request(msgs, "computing the loss")
        pool.unlink_segments()
        self._raise_failures(replies, "criterion")
        dtype = next((DTYPES[m.dtype] for m in state.metas[0] if DTYPES[m.dtype].is_floating_point), torch.float32)
        return combine(self, handle, [replies[s] for s in range(k)], dtype, crit.reduction)

    @_one_call_at_a_time
    def gather_kept(self, handle: Any) -> Any:
        """Gather outputs kept on the workers, through the autograd bridge."""
        state = handle._state
        self.pool.check_usable()
        if state.call <= self._epoch_call or state.call not in self._live:
            raise RuntimeError("the outputs of this forward are no longer on the workers (released or restarted)")
        msgs = {s: P.Fetch(state.call, self._ensure(s, "out", sum(
            _meta_bytes(m) for m in state.metas[s]) or 64).ref()) for s in range(state.k)}
        replies = self._request(msgs, "returning outputs")
        self.pool.unlink_segments()
        self._raise_failures(replies, "gather")
        state.metas = [replies[s].tensors for s in range(state.k)]
        state.outs = [self._io[s]["out"].seg for s in range(state.k)]
        grad_inputs = handle._diff_inputs + [p for p in self.params if p.requires_grad]
        if torch.is_grad_enabled() and grad_inputs and any(state.differentiable):
            gathered = Bridge.apply(state, *grad_inputs)
            state.ctx.handle = handle  # the gathered output's graph keeps the outputs on the workers alive
            state.ctx = None
            if not isinstance(gathered, tuple):
                gathered = (gathered,)
        else:
            gathered = state.gather()
        return build_output(handle, list(gathered))

    def _observe(self, w: int, phase: int, busy: float, rows: int) -> None:
        rate = busy / max(rows, 1)
        old = self._rates[w][phase]
        self._rates[w][phase] = rate if old == 0.0 else 0.7 * old + 0.3 * rate

    def shard_weights(self) -> list[float] | None:
        """Shares of the batch per worker: manual ``shard_weights``, measured (``balance="auto"``) or even."""
        if self._weights is not None:
            return self._weights
        if self._balance and all(r[0] > 0 for r in self._rates):
            return [1.0 / (r[0] + r[1]) for r in self._rates]
        return None

    def _modules(self) -> list[torch.nn.Module]:
        return self._module_list

    # ------------------------------------------------------------------ backward
    @_one_call_at_a_time
    def backward(self, state: CallState, grads: Sequence[torch.Tensor | None],
                 pieces: list[list[torch.Tensor | None]] | None = None) -> list[torch.Tensor | None]:
        """Backpropagate on the workers. ``pieces``: per shard, gradients by worker output index
        (given directly for losses computed on the workers); otherwise sliced from ``grads``.

        Under ``create_graph=True`` (autograd runs this with grad mode on) the gradients returned are
        differentiable: see :class:`dpool.bridge.DoubleBridge`.
        """
        pool = self.pool
        pool.check_usable()
        if state.call <= self._epoch_call:
            raise RuntimeError(
                "the autograd graph of this forward was lost when a dpool worker was restarted; "
                "run the forward again (the master module is unchanged)"
            )
        create_graph = torch.is_grad_enabled()  # autograd enables grad mode here only for create_graph
        if create_graph and (pieces is not None or self.no_sync):
            raise UnsupportedError(
                "higher-order gradients (create_graph=True) through a dpool model are supported for gathered "
                "outputs outside no_sync() only; compute this term on dpool.unwrap(model)"
            )
        release = self._collect_released()
        if release:
            self._release.update(release)  # piggybacked on the next forward
        per_shard = [pieces[s] if pieces is not None else state.grad_pieces(grads, s) for s in range(state.k)]
        keep = 0
        if create_graph:
            keep = self._next_call = self._next_call + 1
        param_grads, replies = self._backward_round(state.call, state.k, per_shard, state.gin_sizes, keep,
                                                    self.no_sync, rows=state.rows)
        input_grads = state.input_grads([replies[s].input_grads for s in range(state.k)])
        out = input_grads + [g for g, p in zip(param_grads, self.params) if p.requires_grad]
        if not create_graph:
            return out
        # the gradients' graph lives on the workers as call `keep`; its input regions must outlive it
        for s in range(state.k):
            span = self._regions[s].get(state.call)
            if span is not None:
                self._regions[s][keep] = span
        double = DoubleState(self, state, keep, per_shard, grads, out)
        results = DoubleBridge.apply(double, *double.inputs)
        if not isinstance(results, tuple):
            results = (results,)
        self._live[keep] = weakref.ref(double.ctx)
        double.ctx = None
        it = iter(results)
        return [next(it) if g is not None else None for g in out]

    def _backward_round(self, call: int, k: int, per_shard: list[list[torch.Tensor | None]], gin_sizes: list[int],
                        keep: int, hold: bool, rows: list[int] | None = None) -> tuple[list, dict]:
        """One backward round on ``k`` shards of ``call``: the summed parameter gradients and the replies."""
        pool = self.pool
        msgs: dict[int, P.Message] = {}
        for s in range(k):
            mine = per_shard[s]
            placer = Placer()
            offs = [placer.reserve(g) if g is not None else None for g in mine]
            seg = self._ensure(s, "gout", placer.offset)
            gmetas = [Placer.write(seg.views, o, g.detach()) if g is not None else None for o, g in zip(offs, mine)]
            gin = self._ensure(s, "gin", gin_sizes[s])
            sparse = self._io[s]["sparse"].seg
            msgs[s] = P.Backward(call, pool.step, seg.ref(), gmetas, gin.ref(), hold,
                                 sparse.ref() if sparse is not None else [None, 0], keep)
        replies = self._request(msgs, "running backward")
        pool.unlink_segments()
        self._raise_failures(replies, "backward")
        need = {s: r.sparse_need for s, r in replies.items() if r.sparse_need}
        if need:  # sparse gradients larger than the sparse segment (or the first ones): grow it, fetch them
            fetched = self._request({s: P.FetchSparse(call, self._ensure(s, "sparse", n).ref())
                                     for s, n in need.items()}, "returning sparse gradients")
            pool.unlink_segments()
            self._raise_failures(fetched, "backward")
            for s, r in fetched.items():
                replies[s].sparse = r.sparse
        self._stats.backward([replies[s].busy for s in range(k)],
                             sum(g.numel() * g.element_size() for g in per_shard_tensors(per_shard)),
                             sum(end - start for _, start, end, _ in self.layout.param_groups) * k)
        if self._balance and rows is not None:
            for s in range(k):
                self._observe(s, 1, replies[s].busy, rows[s])
        # Sum the workers' gradient slots, one dense op per dtype group.
        mask = bytearray(len(self.params))
        for s in range(k):
            for i, b in enumerate(replies[s].param_mask):
                if b == 1:
                    mask[i] = 1
        param_grads: list[torch.Tensor | None] = [None] * len(self.params)
        for g, (dtype, start, end, idxs) in enumerate(self.layout.param_groups):
            if not any(mask[i] for i in idxs):
                continue
            views = [self._grad_slots[s][g] for s in range(k)]
            if self.cuda:  # replicas on other GPUs: summed on the master's (DataParallel's reduce_add)
                views = [v.to(self.device) for v in views]
            total = torch.add(views[0], views[1]) if len(views) > 1 else views[0].clone()
            for v in views[2:]:
                total.add_(v)
            for i in idxs:
                if mask[i]:
                    p = self.params[i]
                    a = (self.layout.param_offsets[i] - start) // p.element_size()
                    st = self._param_strides[i]  # the gradient in the parameter's memory format
                    param_grads[i] = total.as_strided(p.shape, st, a) if st else total[a : a + p.numel()].view(p.shape)
        for s in range(k):  # sparse gradients: summed as sparse tensors, as DataParallel's reduce does
            seg = self._io[s]["sparse"].seg
            for i, imeta, vmeta in replies[s].sparse:
                part = torch.sparse_coo_tensor(read(seg.views, imeta).to(self.device, copy=True),
                                               read(seg.views, vmeta).to(self.device, copy=True),
                                               self.params[i].shape, check_invariants=False)
                g = param_grads[i]
                param_grads[i] = part if g is None else g + part
        return param_grads, replies

    @_one_call_at_a_time
    def double_backward(self, double: Any, vs: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Differentiate the gradients of a ``create_graph=True`` backward (see ``DoubleBridge``)."""
        self.pool.check_usable()
        if double.call <= self._epoch_call:
            raise RuntimeError("the graph of these gradients was lost when a dpool worker was restarted")
        per_shard, gin_sizes = double.pieces(vs)
        param_grads, replies = self._backward_round(double.call, double.k, per_shard, gin_sizes, 0, False)
        return double.results([replies[s].input_grads for s in range(double.k)],
                              [g for g, p in zip(param_grads, self.params) if p.requires_grad])

    # ------------------------------------------------------------------ misc
    def _follow_backend_flags(self) -> None:
        """Give the workers this process's TF32 and cuDNN settings when they changed (or after a restart)."""
        flags = backend_flags()
        if flags != self._sent_flags:
            self.call_workers(functools.partial(apply_backend_flags, flags))
            self._sent_flags = flags

    @_one_call_at_a_time
    def call_workers(self, fn: Any) -> list[Any]:
        payload = cloudpickle.dumps(fn)
        replies = self._request({i: P.Call(payload) for i in range(self.n)}, "running a function")
        self._raise_failures(replies, "worker_states")
        return [cloudpickle.loads(replies[i].result) for i in range(self.n)]

    def close(self) -> None:
        """Close the pool; the master keeps its values in private memory."""
        if self._closed:
            return
        self._closed = True
        for h in getattr(self, "_hooks", []):
            h.remove()
        views = getattr(self, "param_views", None)
        if views is not None:
            with torch.no_grad():
                for t, v in zip(self.params + self.buffers, self.param_views + self.buffer_views):
                    if t.data_ptr() == v.data_ptr():
                        t.data = v.clone()
        self.pool.close()
        master = getattr(self, "master", None)
        if master is not None:
            master.close_fd()
        # Drop every reference to shared memory: a graph or output the user still holds keeps this
        # object alive, but not the mappings (each one also holds an fd; see close() in DataParallel).
        self.param_views = self.buffer_views = []
        self._io = []
        self._regions = []
        self._live.clear()
        for name in ("master", "states", "_grad_slots", "_buffer_slots", "_master_buffers", "_first_buffers",
                     "_buffers", "_replicas"):
            self.__dict__.pop(name, None)
