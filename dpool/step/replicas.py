"""The replicas: the master bound to shared memory, the model shipped to the workers, each worker's memory.

:class:`ReplicaSet` binds the master (:class:`dpool.replicate.Master`) to a shared region, ships the pickled
model, builds each worker's views (:class:`WorkerMemory`, rebuilt the same way at start and at a restart),
repeats run-time patches of the model's code there, and re-syncs the replicas when the model changed after
``wrap()``. Rounds that run functions on the replicas are the caller's (``call``): this module sends only the
start-up round itself.
"""
from __future__ import annotations

import functools
import logging
import sys
import time
import warnings
from typing import Any, Callable

import torch

from .. import patches as _patches
from .. import protocol as P
from ..accumulate import refuse_change
from ..bridge import _user_stacklevel
from ..buffers import BufferCommit
from ..cpus import physical_cores
from ..crossnode import CrossNodeReducer
from ..errors import UnpicklableModelError, WorkerDiedError, WorkerStartError, WorkerTimeoutError
from ..gpu import check_free_memory
from ..layout import Layout
from ..reduce import Reducer
from ..replicate import Master, take_rebound
from ..sync_batchnorm import synchronizes
from .hints import names
from .parts import StepParts

__all__ = ["ReplicaSet", "WorkerMemory", "ALIAS_SAME_GPU"]

log = logging.getLogger("dpool")

Call = Callable[[Any, Any], dict]  # run a function on the replicas of some workers (Rounds.call)

# Workers on the master's GPU use its parameter arena directly (as CPU workers use its segment); others get
# a copy pushed before each forward. A test sets this to False to force the copy path on one GPU.
ALIAS_SAME_GPU = True


class WorkerMemory:
    """Each worker's shared memory as the coordinator views it: its state segment (gradient slots, buffer
    slots), its copy of the master arena on another GPU, and the master's and first worker's buffers."""

    def __init__(self, n: int) -> None:
        self.states: list[Any] = [None] * n
        self.arenas: list[Any] = [None] * n  # a GPU copy of the master arena (workers not on its GPU)
        self.grad_slots: list[list[torch.Tensor]] = [[] for _ in range(n)]
        self.buffer_slots: list[list[torch.Tensor]] = [[] for _ in range(n)]
        self.master_buffers: torch.Tensor | None = None
        self.first_buffers: torch.Tensor | None = None


class ReplicaSet:
    """The master's binding and the workers' replicas of it (see the module's docstring)."""

    def __init__(self, parts: StepParts) -> None:
        setup = self.setup = parts.setup
        self.state, self.pool, self.io, self.master, self.graphs = parts.state, parts.pool, parts.io, parts.master, \
            parts.graphs
        self.held, self.notices, self.config = parts.held, parts.notices, parts.config
        self.alias = [not setup.cuda or (ALIAS_SAME_GPU and torch.device(d) == setup.device) for d in setup.devices]
        self.memory = WorkerMemory(setup.n)
        self.layout: Layout
        self.buffers: BufferCommit
        self.reducer: Reducer | None = None
        self.forward_collectives = False  # cross-node: a training forward exchanges something
        self.speculable = False  # a criterion's backward may run with its loss (dpool.step.loss_round)
        self._model_bytes = b""
        self._resyncs, self._resynced_at = 0, -1  # re-syncs on consecutive forwards, the forward of the latest
        self.version = 0  # moved by every shipping and restart: the replicas a step plan was made for

    # ------------------------------------------------------------------ start
    def start(self, call: Call) -> None:
        """Bind the master, start the workers and ship them the model."""
        pool, master = self.pool, self.master
        if self.setup.cuda:  # fail fast, with each GPU's numbers, rather than with an OOM inside a worker
            check_free_memory(self.setup.devices, Layout(master.params, master.buffers).size,
                              spawn=pool.launcher.spawns)
        self.bind()
        # Spawned workers map the parameters through an inherited fd, so the name can go at once
        # (and a respawned worker can still map them); a daemon's workers map it by name.
        if pool.launcher.spawns:
            master.region.unlink()
        self._model_bytes = master.pickle()  # an unpicklable model fails here, before the workers start
        pool.start([master.region.fd] if master.region.fd is not None else [])
        self.ship(call, by_name=not pool.launcher.spawns)
        master.watch()
        self.notices.global_hooks(master.global_hooks())

    def bind(self) -> None:
        """Bind the master to a new shared region; the stages that read it follow."""
        setup, master = self.setup, self.master
        # on a GPU: the master arena, exported to each worker on the master's GPU (see dpool.transport.cuda_ipc)
        master.bind(lambda size: self.pool.new_segment(size, min_size=64, keep_fd=not setup.cuda,
                                                       device=setup.devices[0]))
        self.layout = master.layout
        self.buffers = BufferCommit(setup.buffer_policy, setup.module, master.buffers, self.layout.buffer_offsets,
                                    master.buffer_views)
        if self.reducer is not None:  # re-binding a changed model: the old reducer's helper threads go
            self.reducer.close()
        modules = list(setup.module.modules())
        # cross-node: whether a training forward exchanges anything (buffers, SyncBatchNorm statistics)
        self.forward_collectives = self.layout.buffer_range is not None or any(synchronizes(m) for m in modules)
        # A criterion's backward may run on the workers right after the loss: not with SyncBatchNorm (its
        # backward's collective would wait on shards that skip it) nor with sparse gradients.
        self.speculable = not any(synchronizes(m) or getattr(m, "sparse", False) is True for m in modules)
        if setup.nodes is not None:
            # Buckets leave during the backward as the workers complete them: CPU workers only (a GPU
            # worker's report would have to wait for its stream), and not with SyncBatchNorm, whose
            # exchanges inside the backward would then interleave with the buckets' by timing.
            overlap = (self.config.cross_node_overlap and not setup.cuda
                       and not any(synchronizes(m) for m in modules))
            self.reducer = CrossNodeReducer(layout=self.layout, params=master.params, strides=master.param_strides,
                                            device=setup.device, nodes=setup.nodes, overlap=overlap,
                                            fold=not self.forward_collectives)
        else:
            # a large sum may use the workers' cores: they are idle while it runs
            self.reducer = Reducer(self.layout, master.params, master.param_strides, setup.device,
                                   threads=min(physical_cores(), self.pool.threads * setup.n))

    def ship(self, call: Call, by_name: bool) -> None:
        """Build every worker's replica from the pickled master module."""
        self.version += 1
        for i in range(self.setup.n):
            self._new_memory(i)
        self.init_workers(range(self.setup.n), call, by_name=by_name)

    def _new_memory(self, i: int) -> None:
        """Worker ``i``'s state segment (and arena copy on another GPU), new."""
        setup, memory = self.setup, self.memory
        memory.states[i] = self.pool.new_segment(self.layout.size, min_size=64, device=setup.devices[i], owner=i)
        memory.arenas[i] = None if self.alias[i] else self._arena(i)

    def _arena(self, i: int) -> Any:
        """A GPU copy of the master arena for worker ``i`` (not on the master's GPU); refreshed each forward."""
        arena = self.pool.new_segment(self.layout.size, min_size=64, device=self.setup.devices[i], owner=i)
        arena.u8.copy_(self.master.region.u8)
        return arena

    def rebuild(self, i: int) -> None:
        """Worker ``i``'s views of its state segment: gradient slots (one dense tensor per dtype group, summed
        in the backward), buffer slots, and the first worker's buffers."""
        memory, st = self.memory, self.memory.states[i]
        memory.grad_slots[i] = [st.u8[a:b].view(dt) for dt, a, b, _ in self.layout.param_groups]
        memory.buffer_slots[i] = self.buffers.slot_views(st.u8)
        b = self.layout.buffer_range
        if b is not None:
            memory.master_buffers = self.master.region.u8[b[0]:b[1]]
            if i == 0:
                memory.first_buffers = st.u8[b[0]:b[1]]

    def push(self) -> None:
        """Copy the master's parameters and buffers to the workers on other GPUs (DataParallel's broadcast)."""
        for arena in self.memory.arenas:
            if arena is not None:
                arena.u8.copy_(self.master.region.u8)

    def _params_ref(self, i: int, by_name: bool) -> list:
        region = self.master.region
        if self.setup.cuda:
            arena = self.memory.arenas[i]
            return arena.ref() if arena is not None else region.ref(self.pool.workers[i])
        return region.ref() if by_name else region.fd_ref()

    def init_workers(self, indices: Any, call: Call, by_name: bool = False, restarting: bool = False) -> None:
        """Ship the model to ``indices`` and wait until their replicas are built. A worker that dies or hangs
        meanwhile breaks the pool, unless ``restarting`` (the restart policy then decides)."""
        pool, layout, master = self.pool, self.layout, self.master
        assert self.reducer is not None
        pl = Layout.wire(master.params, layout.param_offsets, True)
        bl = Layout.wire(master.buffers, layout.buffer_offsets, False)
        msgs = {
            i: P.Init(model=self._model_bytes, sys_path=[p for p in sys.path if isinstance(p, str)],
                      params=self._params_ref(i, by_name), state=self.memory.states[i].ref(), param_layout=pl,
                      buffer_layout=bl, threads=pool.threads,
                      options={"bn_counts": self.buffers.needs_counts, "event": pool.events.request_handle(i),
                               "reply_event": pool.events.reply_handle(i),
                               "buckets": self.reducer.bucket_members()})
            for i in indices
        }
        try:
            # startup_timeout_s bounds this round, not heartbeats (why: Pool.request)
            replies = pool.request(msgs, "loading the model", loading=True)
        except (WorkerDiedError, WorkerTimeoutError) as exc:
            if restarting:
                raise
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
        for seg in (master.region, *(self.memory.states[i] for i in indices)):
            seg.unlink()  # every worker mapped what its Init named (the master's by name: a daemon's, a re-sync)
        for i in range(self.setup.n):
            self.rebuild(i)
        self._follow_patches(indices, call)

    def restart(self, indices: list[int], call: Call) -> None:
        """Replace the workers ``indices`` and re-sync them from the master. A Ctrl-C may cut it anywhere:
        it then runs again, whole, at the next call (:meth:`dpool.step.rounds.Rounds.check_usable`)."""
        if self.state.workers_hold:  # their no_sync() gradients are gone: the held sums miss them
            self.held.lost(self.setup.module, self.master.params,
                           f"worker(s) {indices} were restarted at step {self.pool.progress.step}")
        # Graphs kept by the dead worker are gone: calls made so far can no longer be backpropagated.
        self.graphs.lose_all()
        self.state.slots.bump("restart")  # (first, so that a cut restart leaves no speculative result valid)
        self.version += 1
        self.pool.respawn(indices)
        for i in indices:
            self._new_memory(i)
            self.io.reset(i)  # (a new process: its I/O segments are made anew)
        self.state.forget_sent()  # a new process starts with torch's default numerics settings
        self.init_workers(indices, call, restarting=True)
        self.state.end_restart()

    def _follow_patches(self, indices: Any, call: Call) -> None:
        """Repeat in the workers ``indices`` what this process patched in the model's code at run time
        (``SomeClass.forward = my_forward``, ``F.gelu = my_gelu``: :mod:`dpool.patches`), as DataParallel's
        replicas, in its one process, run the patched code. One round trip at each shipping, two when
        something differs; what cannot be repeated is named in a warning."""
        refs = _patches.code_refs(self.master.module)
        if not refs:
            return
        ours = _patches.fingerprints(refs)
        places = _patches.addresses(refs)
        theirs = call(indices, functools.partial(_patches.fingerprints_at, places))
        # (a name the workers lack was added here, as transformers adds Module.smart_apply: their code does not
        # use it, and repeating it could import a library there for nothing; but an entry added to a
        # registry, as AttentionInterface.register("mine", fn), is what the config names)
        differ = sorted({j for t in theirs.values() for j, (a, b) in enumerate(zip(ours, t))
                         if a != b and (b != _patches.MISSING or isinstance(refs[j][0], _patches.Registry))
                         and not _patches.instrumentation(a)})
        if not differ:
            return
        patched = [_patches.name_of(*refs[j]) for j in differ]
        log.info("repeating %d run-time patches of the model's code in the workers: %s", len(differ),
                 ", ".join(patched))
        sent: dict[int, bytes] = {}  # ref index -> the pickled patch
        unsent = []
        for j, name in zip(differ, patched):
            try:
                sent[j] = _patches.pickle_patch(*refs[j], _patches.value_of(*refs[j]))
            except Exception as exc:
                unsent.append(f"{name} (cannot be pickled: {exc})")
        if sent:
            call(indices, functools.partial(_patches.apply, list(sent.values())))
            theirs = call(indices, functools.partial(_patches.fingerprints_at, [places[j] for j in sent]))
            unsent += sorted({_patches.name_of(*refs[j]) for t in theirs.values() for j, b in zip(sent, t)
                              if ours[j] != b})
        if unsent:
            warnings.warn(
                f"dpool: the workers run other code than this process for {', '.join(unsent)}: it was changed at "
                "run time here (a monkeypatch) and could not be repeated there, so results may differ from "
                "one process's. Make the patch picklable (no locks, files or handles in its closure), or apply "
                "it in a module the model's code imports.", RuntimeWarning, stacklevel=2)

    # ------------------------------------------------------------------ changes after wrap()
    def follow_changes(self, call: Call) -> None:
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
        self.notices.global_hooks(master.global_hooks())  # (registering one moves torch's hook handle count)
        changes = master.attribute_changes()
        same = master.same_objects()
        if same and not changes:
            master.snapshot()
            return  # (a train()/eval() switch: every forward sends the modes)
        what = names(changes)
        if self.state.workers_hold:
            master.changed = True  # (and again at the next forward, until the change is undone)
            raise refuse_change(what or "the model's parameters, buffers or submodules")
        log.info("the model changed after wrap() (%s): re-syncing the replicas",
                 what or "its parameters, buffers or submodules")
        started = time.perf_counter()
        model_bytes = self._pickle_changed(what) if same else None
        if not same:  # what collect() refuses (a buffer that views a parameter) is raised while nothing changed
            try:
                Master.check(master.module, master.device)
            except BaseException:
                master.changed = True  # (and again at the next forward, until the change is undone)
                raise
        self._resync(call, model_bytes)
        self._say_repeated(what if changes else "", time.perf_counter() - started)

    def _pickle_changed(self, what: str) -> bytes:
        """Only attributes or hooks changed: pickle first, so that an unpicklable one breaks nothing."""
        try:
            return self.master.pickle()
        except UnpicklableModelError as exc:
            raise UnpicklableModelError(
                f"{what} changed after dpool.wrap(), and the workers cannot follow: {exc} Nothing was "
                "changed, and each forward raises this until that attribute is deleted or picklable (keep "
                "loggers, writers and handles outside the model).") from None

    def _resync(self, call: Call, model_bytes: bytes | None) -> None:
        master = self.master
        old_region = master.region
        master.unbind()  # what we bound so far gets private memory: the old segment goes
        try:
            master.collect()
            self.bind()  # running workers map the new segment by name
            if master.region.fd is not None:
                self.pool.pass_fds([master.region.fd])  # for workers respawned later
            self.graphs.lose_all()  # earlier graphs referred to the old replicas
            self.state.slots.bump("re-sync")
            self._model_bytes = model_bytes if model_bytes is not None else master.pickle()
            self.ship(call, by_name=True)
        except BaseException as exc:
            self.pool.break_pool(f"re-syncing the replicas after a change to the model failed: {exc}")
            raise
        finally:
            old_region.close_fd()

    def _say_repeated(self, what: str, took: float) -> None:
        """The same attribute changed before every forward: say what it costs, once."""
        self._resyncs = self._resyncs + 1 if self._resynced_at == self.pool.progress.step else 1
        self._resynced_at = self.pool.progress.step + 1  # (the forward this re-sync is for)
        if self._resyncs == 3 and what:
            warnings.warn(
                f"dpool: {what} changed before each of the last 3 forwards. Each change ships the "
                f"model to the workers again ({took * 1e3:.0f} ms this time), as "
                "DataParallel's per-forward replication would pick it up. Pass a value that changes every step "
                "as an argument of forward() instead; and keep what forward() does not read (an EMA copy of "
                "the weights, metrics, counters) outside the model.", stacklevel=_user_stacklevel())

    def commit_rebound(self, shards: list[int], call: Call) -> None:
        """Parameters whose ``.data`` the shards' forward replaced (see ``Replica._rebound``): the first
        shard's new values, into the master (each shard's forward started from the same values)."""
        taken = call(shards, take_rebound)
        done: set[int] = set()
        with torch.no_grad():
            for s in shards:
                for i, t in taken[s].items():
                    if i not in done:
                        self.master.param_views[i].copy_(t)
                        done.add(i)

    def close(self) -> None:
        """Drop every view of shared memory (the pool unmaps and removes the segments)."""
        if self.reducer is not None:
            self.reducer.close()
        self.memory = WorkerMemory(self.setup.n)
