"""The backward, coordinator side: slice the output gradients per shard → request → reduce → commit.

Each worker backpropagates its shard's graph and writes its parameter gradients into its gradient slot;
the coordinator sums the slots into the master's gradients (:mod:`dpool.reduce`; across nodes, averaged
over them too) and returns them to autograd. Under ``no_sync()`` the workers hold their gradients instead
(:mod:`dpool.accumulate`). A failed round leaves the master's gradients as they were.
"""
from __future__ import annotations

import functools
from typing import Any, Iterable, Sequence

import torch

from .. import hook_gate, protocol as P
from ..accumulate import hooked
from ..bridge import CallState, DoubleBridge, DoubleState, Host, keeps_graph
from ..errors import ModelChangedError, UnsupportedError
from ..reduce import sum_sparse
from ..regions import IORegions
from ..tensors import read
from .deferred import changed_since
from .plan import Placements, shapes_of
from .replicas import ReplicaSet
from .rounds import Rounds
from .parts import StepParts

__all__ = ["Backwards", "params_changed"]


def params_changed(call_state: CallState) -> bool:
    """Whether a parameter of ``call_state``'s forward was changed in place since (an ``optimizer.step()``
    before ``loss.backward()``): the workers' graphs read the parameters' current values."""
    return any(p._version != v for p, v in zip(call_state.params, call_state.versions))


class Backwards:
    """The backward stage (see the module's docstring)."""

    def __init__(self, parts: StepParts, replicas: ReplicaSet, rounds: Rounds) -> None:
        self.setup, self.state, self.pool, self.io, self.graphs = parts.setup, parts.state, parts.pool, parts.io, \
            parts.graphs
        self.stats, self.balancer, self.master, self.replicas, self.rounds = parts.stats, parts.balancer, \
            parts.master, replicas, rounds
        self.held, self.notices = parts.held, parts.notices
        self.gouts = Placements(parts.setup.n)  # each shard's output gradients, where they went last

    def holds(self) -> bool:
        """Whether a backward now keeps its parameter gradients on the workers: under ``no_sync()``, unless
        a hook of the loop's is registered on a master parameter, which must see each backward's gradient
        as in one process (see ``dpool/accumulate.py``). Raises if one was registered while the workers hold
        its parameter's gradient."""
        state, params = self.state, self.master.params
        if not (state.no_sync or state.workers_hold):
            return False
        with_hooks = hooked(params, self.held.own_hooks())
        if with_hooks and state.workers_hold:
            self.held.refuse_hooked(params, with_hooks)
        if with_hooks and state.no_sync and self.setup.nodes is not None:
            raise UnsupportedError(
                "model.no_sync() in cross-node mode with hooks on the model's parameters (p.register_hook or "
                "p.register_post_accumulate_grad_hook): one process runs them on each micro-batch's gradient, "
                "which only a synchronized backward has. Call the backward outside no_sync(), or remove the hooks.")
        return state.no_sync and not with_hooks

    def run(self, host: Host, call_state: CallState, grads: Sequence[torch.Tensor | None],
            pieces: list[list[torch.Tensor | None]] | None, param_idx: Sequence[int],
            taken: Sequence[bool | None] | None = None, hold: bool = False) -> list[torch.Tensor | None]:
        """Backpropagate the call ``call_state`` on the workers (see :meth:`dpool.step.Runtime.backward`)."""
        nodes = self.setup.nodes
        self.rounds.check_usable()
        if self.graphs.lost(call_state.call):
            raise RuntimeError(
                "the autograd graph of this forward was lost when a dpool worker was restarted; "
                "run the forward again (the master module is unchanged)"
            )
        self.check_params(call_state)
        create_graph = torch.is_grad_enabled()  # autograd enables grad mode here only for create_graph
        if create_graph and nodes is not None:
            raise UnsupportedError("higher-order gradients (create_graph=True) are not combined across nodes; "
                                   "compute this term on dpool.unwrap(model), or pass process_group=None")
        if create_graph and (pieces is not None or hold):
            raise UnsupportedError(
                "higher-order gradients (create_graph=True) through a dpool model are supported for gathered "
                "outputs outside no_sync() only; compute this term on dpool.unwrap(model)"
            )
        skip = self._skipped(hold, taken, param_idx)
        self.graphs.collect(self.io.release, take=False)  # frees their input spans; told with the next forward
        per_shard = pieces if pieces is not None else call_state.grad_pieces(grads)
        keep = self.graphs.new_call() if create_graph else 0
        # the workers free the call's graph as they go where this backward frees its node: the one node of a
        # gathered call, unless a graph of gradients (create_graph) was built on it, which a later backward still
        # runs through. Outputs kept on the workers (gather=False) may have several nodes (losses, gathers) that
        # one backward runs through, a round each: their graph stays until released.
        call_state.doubled = call_state.doubled or create_graph
        retain = call_state.doubled or not self.setup.gather_outputs or keeps_graph()
        param_grads, replies = self.round(call=call_state.call, k=call_state.k, per_shard=per_shard,
                                          gin_sizes=call_state.gin_sizes, keep=keep, hold=hold, rows=call_state.rows,
                                          at=call_state.fseq, skip=skip, retain=retain)
        input_grads = call_state.input_grads([replies[s].input_grads for s in range(call_state.k)])
        if not hold:
            self.gate_hooks(param_grads, param_idx)
        out = input_grads + [param_grads[i] for i in param_idx]
        if not create_graph:
            return out
        # the gradients' graph lives on the workers as call `keep`; its input regions must outlive it
        for s in range(call_state.k):
            span = self.io.kept(s, call_state.call)
            if span is not None:
                self.io.keep(s, keep, span)
        double = DoubleState(runtime=host, call_state=call_state, call=keep, per_shard=per_shard, grads=grads, out=out)
        results = DoubleBridge.apply(double, *double.inputs)
        if not isinstance(results, tuple):
            results = (results,)
        self.graphs.track(keep, double.ctx)
        double.ctx = None
        it = iter(results)
        return [next(it) if g is not None else None for g in out]

    @staticmethod
    def _skipped(hold: bool, taken: Sequence[bool | None] | None, param_idx: Sequence[int]) -> list[int]:
        """Under ``no_sync()``: the parameters this backward does not accumulate into."""
        if not hold or taken is None:
            return []
        if any(t is None for t in taken):
            raise UnsupportedError(
                "torch.autograd.grad of a dpool model's parameters inside model.no_sync() is not supported: "
                "there the workers keep the gradients, accumulating, and return none. Call it outside "
                "no_sync(), or on dpool.unwrap(model); gradients of the inputs only are fine.")
        return [i for i, t in zip(param_idx, taken) if not t]

    def check_params(self, call_state: CallState) -> None:
        """Refuse a backward through a forward whose parameters were changed in place since. One process
        raises too, for the parameters its graph saved; the workers' graphs saved views of the shared
        parameters, whose versions this process's in-place operations do not move, and would backpropagate
        with the new values. So the coordinator compares every parameter's version (frozen ones' too: a graph
        may save them) with the forward's; it cannot tell which the graphs saved, so it refuses for any."""
        if not params_changed(call_state):
            return
        changed = changed_since(self.master.param_names, self.master.params, call_state.versions)
        raise ModelChangedError(
            f"one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"{changed} of the dpool model changed in place "
            "after its forward (an optimizer.step() or an update under torch.no_grad() before this backward). "
            "The workers' graphs would backpropagate with the new values, so dpool refuses, as one process "
            "refuses for the tensors its graph saved. Run the backward before changing the parameters, or the "
            "forward again after the change. (A change through .data is not tracked, here as in one process.)")

    def gate_hooks(self, param_grads: Sequence[torch.Tensor | None], param_idx: Sequence[int]) -> None:
        """Keep autograd from calling the hooks of the parameters this backward brought no gradient (no
        shard used them), as one process does not (see dpool/hook_gate.py). Which parameters the workers'
        graphs reached is known only now."""
        bare = [i for i in param_idx if param_grads[i] is None]
        if not bare:
            return
        params = self.master.params
        own = self.held.own_hooks()
        hooks = [bare[j] for j in hooked([params[i] for i in bare], own)]
        if not hooks or hook_gate.gate([params[i] for i in hooks], own.__contains__):
            return
        # a torch without _current_graph_task_id: the hooks run; say so, once per parameter
        self.notices.hooks_without_gradient([self.master.param_names[i] for i in hooks])

    def _messages(self, call: int, k: int, n: int, per_shard: list[list[torch.Tensor | None]],
                  gin_sizes: list[int], keep: int, hold: bool, flags: bytes, drop: bytes,
                  retain: bool) -> dict[int, P.Message]:
        """Each shard's output gradients placed in its ``gout`` segment, and its message; workers ``k..n-1``
        (without a shard) only hand over or drop what they hold."""
        io, pool = self.io, self.pool
        together = pool.together(n)
        msgs: dict[int, P.Message] = {}
        for s in range(k, n):
            sparse = io.segment(s, "sparse")
            msgs[s] = P.Backward(call=P.HELD_ONLY, step=pool.progress.step, grads=[None, 0], grad_tensors=[],
                                 input_grads=[None, 0], hold=hold,
                                 sparse=sparse.ref() if sparse is not None else [None, 0], keep_as=0,
                                 requires_grad=flags, together=together, drop=drop)
        for s in range(k):
            gmetas, seg, _, _ = self.gouts.place(s, per_shard[s], functools.partial(_at_start, io, s, "gout"),
                                                 shapes_of(per_shard[s]))
            gin = io.ensure(s, "gin", gin_sizes[s])
            sparse = io.segment(s, "sparse")
            msgs[s] = P.Backward(call=call, step=pool.progress.step, grads=seg.ref(), grad_tensors=gmetas,
                                 input_grads=gin.ref(), hold=hold,
                                 sparse=sparse.ref() if sparse is not None else [None, 0], keep_as=keep,
                                 requires_grad=flags, together=together, drop=drop, retain_graph=retain)
        return msgs

    def round(self, call: int, k: int, per_shard: list[list[torch.Tensor | None]], gin_sizes: list[int],
              keep: int, hold: bool, rows: list[int] | None = None, at: int = -1,
              skip: Sequence[int] = (), retain: bool = True) -> tuple[list, dict]:
        """One backward round on ``k`` shards of ``call``: the summed parameter gradients and the replies.
        ``skip``: parameters the workers backpropagate as frozen (autograd does not accumulate into them).
        ``retain``: the workers keep the call's graph (see :class:`dpool.protocol.Backward`)."""
        pool, state, params = self.pool, self.state, self.master.params
        flags = bytes(p.requires_grad for p in params)  # accumulate as one process would now
        if skip:
            flags = bytes(0 if i in skip else f for i, f in enumerate(flags))
        drop = b""
        if state.workers_hold:
            drop = self.held.cleared(params)  # (zero_grad() since: dropped)
            self.held.refuse_frozen(params)
        # Workers without a shard in this backward (its batch had fewer rows than an earlier one of no_sync()) may
        # hold gradients: the backward that ends no_sync() takes their sums too, and one after a zero_grad() has
        # them drop what was cleared. They backpropagate nothing (P.HELD_ONLY); one that holds nothing adds zeros.
        n = self.setup.n if state.workers_hold and k < self.setup.n and (not hold or any(drop)) else k
        try:
            msgs = self._messages(call=call, k=k, n=n, per_shard=per_shard, gin_sizes=gin_sizes, keep=keep, hold=hold,
                                  flags=flags, drop=drop, retain=retain)
        except BaseException:
            self.rounds.unsent()
            raise
        state.slots.bump("backward")  # the slots are written from here on, whatever the outcome
        holding = hold or state.workers_hold
        if hold:
            state.hold()
        slots = [self.replicas.memory.grad_slots[s] for s in range(n)]
        assert self.replicas.reducer is not None
        # the reducer may start combining while the workers still run (cross-node buckets)
        pool.on_bucket = None if hold else self.replicas.reducer.begin(slots, call, at)
        try:
            replies, changed = self._send(msgs, call, k)
        except BaseException as exc:
            if holding and not pool.broken:
                # Some workers may have added their part of this backward to the gradients they hold (the
                # others failed, or never ran it): those sums are the master's no longer, until dropped.
                self.held.failed(self.setup.module, params, flags,
                                 f"the backward at step {pool.progress.step} failed ({type(exc).__name__})")
            raise
        self.stats.backward([replies[s].busy for s in range(k)],
                            sum(g.numel() * g.element_size() for ms in per_shard for g in ms
                                if isinstance(g, torch.Tensor)),
                            sum(end - start for _, start, end, _ in self.replicas.layout.param_groups) * k)
        if rows is not None:
            self.balancer.observe(1, [replies[s].busy for s in range(k)], rows)
        if hold:  # under no_sync() the gradients stay on the workers
            self.held.mark(self.setup.module, params, flags)
            self.commit_buffers(changed, k, rows)
            return [None] * len(params), replies
        return self._reduce(slots=slots, replies=replies, n=n, k=k, rows=rows, at=at, changed=changed), replies

    def _send(self, msgs: dict[int, P.Message], call: int, k: int) -> tuple[dict[int, Any], list[int]]:
        """The round itself, and the fetch of sparse gradients that did not fit: the replies, and the buffers
        the backward changed."""
        pool = self.pool
        try:
            replies = self.rounds.request(msgs, "running backward")
        finally:
            pool.on_bucket = None
        self.rounds.settle(replies, "backward")
        changed = self.changed_buffers(replies.values())
        self.stats.split_round("backward", pool.sent_at, pool.arrived, replies, k)
        need = {s: r.sparse_need for s, r in replies.items() if r.sparse_need}
        if need:  # sparse gradients larger than the sparse segment (or the first ones): grow it, fetch them
            fetched = self.rounds.fetch(
                lambda s, ref: P.FetchSparse(call=call if s < k else P.HELD_ONLY, sparse=ref), "sparse", need,
                "returning sparse gradients", "backward")
            for s, r in fetched.items():
                replies[s].sparse = r.sparse
        return replies, changed

    def _reduce(self, slots: list, replies: dict[int, Any], n: int, k: int, rows: list[int] | None, at: int,
                changed: list[int]) -> list:
        """The workers' gradient slots, one sum per dtype group (averaged over the nodes in cross-node mode);
        then sparse gradients."""
        params = self.master.params
        assert self.replicas.reducer is not None
        self.state.release()
        self.held.release(params)
        param_grads = self.replicas.reducer.reduce(slots, [replies[s].param_mask for s in range(n)], at,
                                                   any(replies[s].late for s in range(n)))
        self.commit_buffers(changed, k, rows)  # (after the reduce, which may fail across nodes)
        for s in range(n):
            seg = self.io.segment(s, "sparse")
            sum_sparse(param_grads, [(i, read(seg.views, imeta), read(seg.views, vmeta))
                                     for i, imeta, vmeta in replies[s].sparse], params, self.setup.device)
        return param_grads

    def commit_buffers(self, changed: list[int], k: int, rows: Sequence[int] | None) -> None:
        """Buffers the shards' backward changed in place, into the master as a forward's updates are."""
        if changed:
            memory = self.replicas.memory
            self.replicas.buffers.commit_changed(changed, memory.master_buffers, memory.first_buffers,
                                                 memory.buffer_slots[:k], rows)

    def changed_buffers(self, replies: Iterable[Any]) -> list[int]:
        """The buffers the shards' backward changed in place (a module's backward hook updating one), which
        the next forward's refresh would otherwise overwrite with the master's: committed as a forward's
        updates are. Across nodes only under ``"first"`` (rank 0's are broadcast before each training
        forward): the other policies would need an exchange no node can know to expect."""
        changed = [i for r in replies for i in r.buffers]
        policy = self.setup.buffer_policy
        if changed and self.setup.nodes is not None and policy != "first":
            buffers = sorted({self.master.buffer_names[i] for i in changed})
            raise UnsupportedError(
                f"the backward changed buffers {buffers} in place (a backward hook?); in cross-node mode dpool "
                f"combines such updates only with buffers='first', not buffers={policy!r}"
            )
        return changed

    def double(self, double: Any, vs: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Differentiate the gradients of a ``create_graph=True`` backward (see ``DoubleBridge``)."""
        self.rounds.check_usable()
        if self.graphs.lost(double.call):
            raise RuntimeError("the graph of these gradients was lost when a dpool worker was restarted")
        self.check_params(double.call_state)
        per_shard, gin_sizes = double.pieces(vs)
        param_grads, replies = self.round(call=double.call, k=double.k, per_shard=per_shard, gin_sizes=gin_sizes,
                                          keep=0, hold=False)
        return double.results([replies[s].input_grads for s in range(double.k)],
                              [param_grads[i] for i in double.call_state.diff_idx])


def _at_start(io: IORegions, s: int, role: str, need: int) -> tuple[Any, int]:
    """Worker ``s``'s segment for ``role``, grown to ``need`` bytes, from its start."""
    return io.ensure(s, role, need), 0
