"""The forward, coordinator side: plan → place → messages → request → finish.

``run`` reads as the algorithm: follow the user's process (:mod:`dpool.step.follow`, re-sync in
:mod:`dpool.step.replicas`), flatten and plan the shards (:mod:`dpool.tree`, :mod:`dpool.scatter`), place each
shard in its worker's input segment, build the messages, then send them (or, with the loss on the
workers, hold them for the loss: :mod:`dpool.step.deferred`) and finish: gather, or keep the outputs on
the workers, and commit the buffers.

A forward is transactional: the master's buffers change only after every shard succeeded.
"""
from __future__ import annotations

import functools
import logging
import weakref
from typing import Any, Callable

import torch

from .. import gather as _gather, hook_gate, protocol as P, scatter as _scatter, tree as _tree
from ..bridge import Bridge, CallState, Host
from ..crossnode import FORWARD
from ..policies import forward_with_loss
from ..loss import ShardedOutput, Unrun
from ..tensors import DTYPES, dtype_name, meta_nbytes, nbytes
from ..transport.shm import check_free
from . import follow, plan as _plan
from .plan import Plan, Plans
from .replicas import ReplicaSet
from .rounds import Rounds
from .parts import StepParts

__all__ = ["Forwards", "Planned", "Pending", "EARLIER_FORWARD"]

log = logging.getLogger("dpool")

# How a deferred forward run by another call names itself in its workers' errors: the call that raises is
# not the model(x) that failed (in one process, model(x) itself would have raised)
EARLIER_FORWARD = ("forward of an earlier model(x) call, which with gather=False waited for its loss and ran "
                   "only now, before this call")


class Planned:
    """A forward whose messages are built: what the rest of it needs once its round's replies are in."""

    __slots__ = ("call", "k", "splits", "shards", "tensors", "rg", "grad", "spans", "gin_sizes", "nodes", "versions",
                 "handle", "plan")

    def __init__(self, call: int, plan: Plan, shards: list, tensors: list[torch.Tensor], grad: bool,
                 nodes: Any) -> None:
        self.call, self.k, self.splits, self.shards, self.tensors, self.rg = call, plan.k, plan.splits, shards, \
            tensors, plan.rg
        self.grad, self.nodes, self.plan = grad, nodes, plan
        self.spans: list[tuple[Any, int, int]] = []  # each shard's inputs in its segment
        self.gin_sizes: list[int] = plan.gin_sizes  # each shard's input gradients' bytes
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


class Pending:
    """A forward held for its loss (see :mod:`dpool.step.deferred`): its messages, and what it planned."""

    __slots__ = ("msgs", "f")

    def __init__(self, msgs: dict[int, P.Message], f: Planned) -> None:
        self.msgs, self.f = msgs, f


class Forwards:
    """The forward stage (see the module's docstring)."""

    def __init__(self, parts: StepParts, replicas: ReplicaSet, rounds: Rounds) -> None:
        self.setup, self.state, self.config, self.pool, self.io, self.graphs = parts.setup, parts.state, \
            parts.config, parts.pool, parts.io, parts.graphs
        self.stats, self.balancer, self.master, self.replicas, self.rounds = parts.stats, parts.balancer, \
            parts.master, replicas, rounds
        self.notices = parts.notices
        self.defer = forward_with_loss()  # (DPOOL_FORWARD_WITH_LOSS; see dpool.step.deferred)
        self.plans = Plans(parts.stats.plan)  # the latest step plan (dpool.step.plan)
        self._rank0_buffers: torch.Tensor | None = None  # cross-node, buffers="first": staging for the broadcast

    def run(self, host: Host, args: tuple, kwargs: dict, synced: bool) -> Any:
        """``model(x)``: the gathered output, or (``gather=False``) a :class:`ShardedOutput`. ``synced``: it takes
        part in the nodes' collectives (a cross-node training forward)."""
        setup, state, io = self.setup, self.state, self.io
        self._follow()
        tensors: list[torch.Tensor] = []
        spec = _tree.flatten((tuple(args), dict(kwargs)), tensors)
        if follow.in_dual_level():
            follow.refuse_dual(tensors)
        grad = torch.is_grad_enabled()
        flags = self._flags()
        plan, shards = self._plan(spec, tensors, grad, flags, synced)
        call = self.graphs.new_call()
        state.begin_forward(next((sizes for sizes in plan.splits if sizes is not None), None))
        nodes = setup.nodes if synced else None
        if nodes is not None:
            self._begin_across(nodes)
        seed = state.draw_seed()
        f = Planned(call=call, plan=plan, shards=shards, tensors=tensors, grad=grad, nodes=nodes)
        self._reserve(f)
        if setup.cuda:
            self.replicas.push()
        together = self.pool.together(f.k)  # reply together ([] unless the pool asks for it, see Pool.together)
        try:
            # Calls collected here must reach the workers with this request, or be released again (every
            # path out of here that may not have told every worker does), or the workers keep their graphs.
            release = self.graphs.collect(io.release)
            msgs = self._messages(f=f, spec=spec, flags=flags, release=release, seed=seed, together=together)
        except BaseException:
            self.rounds.unsent()
            self.graphs.retell()
            raise
        # (no call between the try above and this one: a Ctrl-C lands in one of them, and the calls collected
        # for release reach the workers or are told again)
        try:
            if self._defers(f):  # held until its loss (see dpool.step.deferred): the targets go after these inputs
                for s in range(f.k):
                    io.keep(s, call, f.spans[s])
                f.versions = [p._version for p in self.master.params]
                handle = ShardedOutput(host, Unrun(call=f.call, k=f.k, rows=f.rows(), gin_sizes=f.gin_sizes), None,
                                       f.diff_inputs())
                f.handle = weakref.ref(handle)
                state.defer(Pending(msgs, f))
                return handle
            return self.finish(host, f, self.rounds.request(msgs, "running forward"))
        except BaseException:
            if state.pending is not None and state.pending.f is f:  # (cut before model(x) returned it)
                self.drop(f)
            self.failed(f)
            raise

    def _follow(self) -> None:
        """Before a forward: the pool usable, and the workers following this process's model and settings."""
        master = self.master
        self.rounds.check_usable()
        hook_gate.restore(master.params, keep_running=True)  # a failed backward's gates (seldom any)
        if master.changed or master.touched():
            self.replicas.follow_changes(self.rounds.call)
        relaid = master.check_bindings()
        if relaid:
            self.notices.relaid(relaid)
        follow.follow_numerics(self.state, self.rounds.call_all)
        if self.setup.cuda:
            follow.follow_backend_flags(self.state, self.rounds.call_all)

    def _plan(self, spec: Any, tensors: list[torch.Tensor], grad: bool, flags: tuple,
              synced: bool) -> tuple[Plan, list[list[torch.Tensor]]]:
        """This forward's plan (the latest one if its signature is this forward's, see :mod:`dpool.step.plan`),
        and its shards."""
        setup = self.setup
        training, requires_grad, autocast = flags
        shares = self.balancer.weights()
        key = _plan.signature(spec=spec, tensors=tensors, grad=grad, autocast=autocast, training=training,
                              requires_grad=requires_grad, model=self.replicas.version, shares=shares,
                              buffers=self.replicas.layout.buffer_range is not None, no_sync=self.state.no_sync,
                              synced=synced)
        plan = self.plans.get(key)
        if plan is not None:
            return plan, _scatter.shard_views(tensors, plan.splits, plan.k, setup.dim)
        k, splits = _scatter.plan(tensors, setup.n, setup.dim, shares)
        shards = _scatter.shard_views(tensors, splits, k, setup.dim)
        rg = [grad and t.requires_grad for t in tensors]
        params = self.master.params
        plan = Plan(key=key, k=k, splits=splits, rg=rg, needs=[_plan.need(shards[s]) for s in range(k)],
                    gin_sizes=[_plan.need([t for t, r in zip(shards[s], rg) if r]) for s in range(k)],
                    diff_idx=[i for i, p in enumerate(params) if p.requires_grad] if grad else [],
                    shapes=[[t.shape for t in shards[s]] for s in range(k)],
                    nbytes=sum(nbytes(t) for sh in shards for t in sh))
        self.plans.keep(plan)
        return plan, shards

    def _flags(self) -> tuple[bytes, bytes, list | None]:
        """The modules' training flags, the parameters' requires_grad flags, and autocast, as sent."""
        state, params = self.state, self.master.params
        training = bytes(m.training for m in self.master.modules)
        requires_grad = bytes(p.requires_grad for p in params)
        if requires_grad != state.sent_requires_grad:  # the workers zero the slots of newly frozen parameters
            if state.workers_hold:
                self.replicas.held.refuse_frozen(params)
            state.sent_requires_grad_flags(requires_grad)
        autocast = None
        kind = self.setup.device.type  # autocast of the workers' device type ("cuda" or "cpu")
        if torch.is_autocast_enabled(kind):
            autocast = [kind, dtype_name(torch.get_autocast_dtype(kind)), torch.is_autocast_cache_enabled()]
        return training, requires_grad, autocast

    def _begin_across(self, nodes: Any) -> None:
        """Cross-node: the nodes agree on where they are; then rank 0's buffers (DDP's broadcast_buffers)."""
        replicas = self.replicas
        fseq = self.state.begin_across()
        if replicas.forward_collectives:  # none for a model without buffers or SyncBatchNorm
            nodes.header(FORWARD, fseq)
        mine = replicas.memory.master_buffers
        if self.setup.buffer_policy == "first" and mine is not None:
            # into a staging copy (made once per layout): a failed broadcast leaves the master as it was
            theirs = self._rank0_buffers
            if theirs is None or theirs.numel() != mine.numel():
                theirs = self._rank0_buffers = torch.empty_like(mine)
            theirs.copy_(mine)
            nodes.broadcast(theirs, "taking rank 0's buffers")
            mine.copy_(theirs)

    def _reserve(self, f: Planned) -> None:
        """The space all shards' new input segments need is checked before any is made. Only what this call
        really adds counts: the input spans of calls whose graphs are gone are freed first (they are told to
        the workers with this call's request, or the next)."""
        self.graphs.collect(self.io.release, take=False)
        grow = sum(self.io.input_growth(s, need) for s, need in enumerate(f.plan.needs))
        if grow and not self.setup.cuda:
            check_free(self.config.shm_dir, grow)

    def _messages(self, f: Planned, spec: Any, flags: tuple, release: list, seed: int,
                  together: list) -> dict[int, P.Message]:
        """Place each shard's inputs in its segment, and build its message."""
        setup, io = self.setup, self.io
        training, requires_grad, autocast = flags
        # the shards that take part in the call's collectives (SyncBatchNorm): in cross-node mode the other
        # nodes' too, so that a node with one worker still joins them
        world = f.k if setup.nodes is None else f.k + setup.nodes.size - 1
        sync_buffers = self.replicas.layout.buffer_range is not None
        msgs: dict[int, P.Message] = {}
        inputs = f.plan.inputs
        for s in range(f.k):
            # (key (): the plan's own placements, of the dtypes and shapes its signature fixed)
            metas, seg, start, need = inputs.place(s, f.shards[s], functools.partial(io.input_region, s), (), f.rg)
            f.spans.append((seg, start, start + need))
            out = io.ensure(s, "out", 0)
            msgs[s] = P.Forward(call=f.call, step=self.pool.progress.step, grad=f.grad, training=training,
                                requires_grad=requires_grad, sync_buffers=sync_buffers, inputs=seg.ref(),
                                outputs=out.ref(), tree=spec, tensors=metas, shard=s, world=world,
                                keep=not setup.gather_outputs, autocast=autocast, release=release, seed=seed,
                                together=together)
        return msgs

    def _defers(self, f: Planned) -> bool:
        """Whether this forward waits for its loss (see :mod:`dpool.step.deferred`)."""
        return (self.defer and not self.setup.gather_outputs and f.grad and not self.setup.cuda
                and self.replicas.layout.buffer_range is None
                and (f.nodes is None or not self.replicas.forward_collectives))

    def drop(self, f: Planned) -> None:
        """Forget the deferred forward ``f`` without running it: its output can no longer be used. (Last, the
        pending forward goes: a Ctrl-C before leaves it to be checked, and dropped, again at the next call.)"""
        self.graphs.retell()  # the calls its messages would have told the workers to release
        self.io.release(f.call)
        self.graphs.release(f.call)
        self.state.drop_pending(f)

    def failed(self, f: Planned) -> None:
        """A forward's round or what follows it failed or was cut short (Ctrl-C): until its call is tracked,
        nothing would ever free the graphs the workers keep for it, so they are released now."""
        if f.grad and not self.graphs.kept(f.call):
            self.graphs.release(f.call)
        self.graphs.retell()  # a round cut short may not have told every worker

    def finish(self, host: Host, f: Planned, replies: dict[int, Any], where: str = "forward") -> Any:
        """The rest of a forward once its round's replies are in: fetch outputs that did not fit, build its
        :class:`CallState`, gather (or keep the outputs on the workers), and commit its buffer updates. Its
        callers run :meth:`failed` if it raises (a GatherError, a Ctrl-C before the call is tracked).
        ``where`` names the forward in its workers' errors."""
        pool = self.pool
        self.rounds.settle(replies, where)
        self.stats.split_round("forward", pool.sent_at, pool.arrived, replies, f.k)
        fetch = {s: r.need for s, r in replies.items() if r.need}
        if fetch:
            fetched = self.rounds.fetch(lambda s, ref: P.Fetch(call=f.call, outputs=ref), "out", fetch,
                                        "returning outputs", "forward")
            for s, r in fetched.items():
                replies[s].tensors = r.tensors
        specs = [replies[s].tree for s in range(f.k)]
        call_state = self._call_state(host, f, replies)
        gathered, handle = self._gather_or_keep(host, f, call_state, specs)
        call_state.outs = None  # read by the gather above; a later gather (gather=False) maps them anew
        rows = f.rows()
        self._commit(f, replies, rows, call_state.metas)
        call_state.rows = rows
        if gathered is None:
            # what a deferred forward's loss predicts from: this forward's output dtype and shapes
            self.state.kept_outputs(loss_dtype(call_state.metas), out_shapes(call_state.metas, specs), rows)
            return handle
        return _gather.build(specs, iter(gathered))

    def _call_state(self, host: Host, f: Planned, replies: dict[int, Any]) -> CallState:
        params = self.master.params
        return CallState(
            runtime=host, call=f.call, k=f.k, groups=_gather.tensor_groups([replies[s].tree for s in range(f.k)]),
            metas=[replies[s].tensors for s in range(f.k)], outs=[self.io.segment(s, "out") for s in range(f.k)],
            splits=f.splits, gin_sizes=f.gin_sizes, rg=f.rg, shard_shapes=f.plan.shapes,
            fseq=self.state.progress.fseq if self.setup.nodes is not None else 0,  # the forward its backward names
            diff_inputs=f.diff_inputs(), diff_idx=f.plan.diff_idx, params=params,  # (what a double backward
            # differentiates)
            versions=f.versions if f.versions is not None else [p._version for p in params] if f.grad else [],
        )

    def _gather_or_keep(self, host: Host, f: Planned, call_state: CallState,
                        specs: list) -> tuple[Any, ShardedOutput | None]:
        """The gathered outputs (through the autograd bridge when they are differentiable), or ``None`` and
        the :class:`ShardedOutput` of outputs kept on the workers (``gather=False``)."""
        io, graphs = self.io, self.graphs
        if not self.setup.gather_outputs:  # outputs stay on the workers until a criterion or .gather()
            handle = f.output()
            if handle is None:  # (a deferred forward whose output nothing holds: it runs all the same)
                handle = ShardedOutput(host, call_state, specs, call_state.diff_inputs)
            handle.call_state, handle.specs = call_state, specs  # (a deferred forward's handle: filled in now)
            graphs.track(f.call, handle)
            for s in range(f.k):
                io.keep(s, f.call, f.spans[s])
            return None, handle
        if f.grad and any(call_state.differentiable):
            gathered = Bridge.apply(call_state, call_state.diff_idx, *call_state.diff_inputs, *call_state.diff_params)
            if not isinstance(gathered, tuple):
                gathered = (gathered,)
            graphs.track(f.call, call_state.ctx)
            for s in range(f.k):
                io.keep(s, f.call, f.spans[s])
            call_state.ctx = None
            return gathered, None
        if f.grad:
            graphs.release(f.call)
        return call_state.gather(), None

    def _commit(self, f: Planned, replies: dict[int, Any], rows: list[int], out_metas: list) -> None:
        """Every shard succeeded: count the round, and let its buffer updates reach the master (buffers.py)."""
        k, replicas = f.k, self.replicas
        busy = [replies[s].busy for s in range(k)]
        self.stats.forward(rows, busy, f.plan.nbytes,
                           sum(meta_nbytes(m) for ms in out_metas for m in ms) if self.setup.gather_outputs else 0)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("step %d: forward of %d shards (rows %s), workers busy %s ms", self.pool.progress.step, k, rows,
                      [round(b * 1e3, 2) for b in busy])
        self.balancer.observe(0, busy, rows)
        if any(replies[s].attributes for s in range(k)):
            self.notices.attributes({n for s in range(k) for n in replies[s].attributes})
        if any(replies[s].rebound for s in range(k)):
            replicas.commit_rebound([s for s in range(k) if replies[s].rebound], self.rounds.call)
        memory = replicas.memory
        if replicas.layout.buffer_range is not None:
            replicas.buffers.commit(master_bytes=memory.master_buffers, first_bytes=memory.first_buffers,
                                    slots=memory.buffer_slots[:k], sizes=rows,
                                    counts=[replies[s].stats for s in range(k)],
                                    training=[bn.training for bn, *_ in replicas.buffers.batchnorms],
                                    across=None if f.nodes is None else functools.partial(
                                        f.nodes.all_reduce, doing="combining buffer statistics"))


def out_shapes(metas: list[list[Any]], specs: list) -> list[list[int] | None]:
    """Each shard's output shape, where its output is one tensor (what an elementwise loss's mean divides by)."""
    return [list(ms[0].shape) if spec == ["T", 0] else None for ms, spec in zip(metas, specs)]


def loss_dtype(metas: list[list[Any]]) -> torch.dtype:
    """The dtype a criterion's loss takes: the first floating output's of shard 0."""
    return next((DTYPES[m.dtype] for m in metas[0] if DTYPES[m.dtype].is_floating_point), torch.float32)
