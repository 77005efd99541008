"""The autograd bridge between the coordinator's graph and the workers' graphs.

``Bridge`` is a ``torch.autograd.Function`` whose inputs are the input tensors
that require grad and the master parameters that require grad, and whose
outputs are the gathered output tensors. Its forward only concatenates what
the workers wrote (the remote forward already ran); its backward sends the
output gradients to the workers, lets each backpropagate through the graph it
kept, and returns the summed parameter gradients and the input gradients, so
``loss.backward()`` fills the master's ``.grad`` by the usual accumulation rules.

Workers keep each call's graph (``retain_graph=True``) until the coordinator
knows it is no longer needed: when the ``ctx`` of its ``Bridge`` node is freed
or a backward without ``retain_graph`` went through the node.
The coordinator detects that before each request and piggybacks a ``release``.
"""
from __future__ import annotations

import os
import sys
import warnings
import weakref
from typing import Any, Protocol, Sequence

import torch

from .tensors import Placer, read
from .errors import GatherError, UnsupportedError

__all__ = ["Bridge", "CallState", "DoubleBridge", "DoubleState", "Graphs", "Host", "keeps_graph"]


class Host(Protocol):
    """What the bridge and the loss need of the runtime that made a call (:class:`dpool.step.Runtime`)."""

    io: Any
    graphs: "Graphs"

    @property
    def dim(self) -> int: ...

    @property
    def n(self) -> int: ...

    @property
    def output_device(self) -> torch.device: ...

    @property
    def no_sync(self) -> bool: ...

    @property
    def params(self) -> list[torch.Tensor]: ...

    def backward(self, call_state: Any, grads: Sequence[torch.Tensor | None], pieces: Any = None,
                 param_idx: Sequence[int] = (), taken: Any = None) -> list[torch.Tensor | None]: ...

    def backward_speculated(self, call_state: Any, guess: Any, hit: bool, crit: Any,
                            param_idx: Sequence[int]) -> list[torch.Tensor | None] | None: ...

    def criterion(self, handle: Any, crit: Any, targets: tuple) -> torch.Tensor: ...

    def gather_kept(self, handle: Any) -> Any: ...

    def double_backward(self, double: Any, vs: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]: ...

_SCALAR_WARNING = (
    "Was asked to gather along dimension 0, but all input tensors were scalars; "
    "will instead unsqueeze and return a vector."
)


_INTERNAL = (os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.abspath(torch.__file__)))


def _user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the user's line (outside dpool and torch)."""
    frame: Any = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    return level


_ASK_KEEP_GRAPH = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)


# Each autograd Function of dpool (Bridge, DoubleBridge, loss.LossBridge) saves no tensor: a saved tensor
# would run the saved-tensor hooks around the forward (torch.utils.checkpoint's non-reentrant mode
# recomputes the forward when one is unpacked; torch.autograd.graph.save_on_cpu copies it to the CPU
# and back), and the workers' graphs hold what the backward needs. A flag on the node stands in for
# torch's check of a second backward through freed buffers. Only a torch without the keep-graph getter
# saves one tensor, whose release Graphs.collect reads.
_BACKWARD_TWICE = (
    "Trying to backward through the graph a second time (or directly access saved tensors after they have already "
    "been freed). Saved intermediate values of the graph are freed when you call .backward() or autograd.grad(). "
    "Specify retain_graph=True if you need to backward through the graph a second time or if you need to access "
    "saved tensors after calling backward.")


def track_release(ctx: Any, probe: torch.Tensor) -> None:
    """In a Function's forward: its node is not yet freed (see :func:`enter_backward`)."""
    ctx.freed = False
    if _ASK_KEEP_GRAPH is None:
        ctx.save_for_backward(probe)


def enter_backward(ctx: Any) -> None:
    """In a Function's backward: torch's own error if an earlier backward freed the node's graph."""
    if ctx.freed:
        raise RuntimeError(_BACKWARD_TWICE)
    if _ASK_KEEP_GRAPH is None:
        ctx.saved_tensors


def accumulates(ctx: Any, n: int) -> list[bool | None]:
    """In a Function's backward: for each of its last ``n`` inputs (the master's parameters), whether this
    backward accumulates into its ``.grad``: ``False`` where ``backward(inputs=...)`` leaves it out or
    ``torch.autograd.grad`` runs, ``None`` where ``torch.autograd.grad`` takes its gradient.

    Under ``no_sync()`` the workers add to the gradients they hold, so they must add only what one process
    would add to ``.grad`` (``Runtime.backward``)."""
    nodes = ctx.next_functions
    will = getattr(torch._C, "_will_engine_execute_node", None)
    out: list[bool | None] = []
    for node, _ in nodes[len(nodes) - n:] if n else ():
        try:
            out.append(node is not None and (will is None or bool(will(node))))
        except RuntimeError:  # "a leaf node ... running autograd.grad()": it takes this leaf's gradient
            out.append(None)
    return out


def leave_backward(ctx: Any) -> bool:
    """In a Function's backward, at its end: True if this backward frees the graph (no ``retain_graph``)."""
    if keeps_graph():
        return False
    ctx.freed = True
    return True


def keeps_graph() -> bool:
    """Inside a backward: whether it was asked to keep the graph (``retain_graph``). ``True`` when torch
    cannot tell: then :meth:`Graphs.collect` asks the node itself whether its saved tensor is gone."""
    if _ASK_KEEP_GRAPH is None:
        return True
    try:
        return bool(_ASK_KEEP_GRAPH())
    except RuntimeError:  # not inside the engine's graph task (it always is, here)
        return True


class Graphs:
    """Which calls' graphs the workers keep, and when they may free them.

    A call's graph lives on the workers while the coordinator-side object that can still
    backpropagate through it lives: the :class:`Bridge` node's ``ctx`` (or a
    :class:`~dpool.loss.ShardedOutput`). Once that is freed, or a backward without
    ``retain_graph`` went through the node (:meth:`spent`), the call is *released*: its id
    piggybacks on the next request, and the workers free the graph after replying.
    A worker restart or a re-shipped model loses every graph at once (:meth:`lose_all`).
    """

    def __init__(self) -> None:
        self.last_call = 0
        self._epoch = 0  # graphs of calls up to this id are lost
        self._live: dict[int, Any] = {}  # call → weakref to what keeps its graph alive
        self._released: set[int] = set()
        self._spent: set[int] = set()  # live calls that a backward without retain_graph went through
        self.told: list[int] = []  # the calls the latest collect() handed out, for retell()

    def new_call(self) -> int:
        self.last_call += 1
        return self.last_call

    def track(self, call: int, owner: Any) -> None:
        """Keep ``call``'s graph while ``owner`` lives and no backward freed it (:meth:`spent`)."""
        self._live[call] = weakref.ref(owner)

    def release(self, calls: int | Sequence[int]) -> None:
        """Let the workers free ``calls``' graphs (told with the next request)."""
        if isinstance(calls, int):
            self._released.add(calls)
        else:
            self._released.update(calls)

    def lost(self, call: int) -> bool:
        """Whether ``call``'s graph was lost with a restarted worker or a re-shipped model."""
        return call <= self._epoch

    def kept(self, call: int) -> bool:
        """Whether ``call``'s graph (and its outputs, for ``gather=False``) are still on the workers."""
        return not self.lost(call) and call in self._live

    def spent(self, call: int) -> None:
        """A backward without ``retain_graph`` ran through ``call``'s node (see :func:`leave_backward`): the
        node cannot backpropagate again, so the workers may free the call's graph."""
        if call in self._live:
            self._spent.add(call)

    def collect(self, on_release: Any, take: bool = True) -> list[int]:
        """Calls whose graphs may be freed now: released ones, and those whose owner is gone.

        ``take``: they are handed out to be told to the workers with the request being built (kept in
        :attr:`told` for :meth:`retell`); otherwise they stay released for the next request.
        """
        for call, ref in list(self._live.items()):
            owner = ref()
            freed = owner is None or call in self._spent
            if not freed and _ASK_KEEP_GRAPH is None:
                try:
                    owner.saved_tensors
                except RuntimeError:  # released by a backward without retain_graph
                    freed = True
            if freed:
                del self._live[call]
                self._spent.discard(call)
                self._released.add(call)
                on_release(call)
        out = sorted(self._released)
        if take:
            self.told = out  # first: a Ctrl-C right after the clear below loses nothing (see retell)
            self._released.clear()
        return out

    def retell(self) -> None:
        """The request that carried :attr:`told` may not have reached every worker: release them again."""
        self._released.update(self.told)

    def lose_all(self) -> None:
        """Every graph kept so far is gone (a worker restarted, the model was shipped again)."""
        self._epoch = self.last_call
        self._released.update(self._live)
        self._live.clear()
        self._spent.clear()

    def clear(self) -> None:
        self._live.clear()
        self._spent.clear()


class CallState:
    """What the coordinator knows about one forward call until its graph is released."""

    def __init__(self, runtime: Host, call: int, k: int, groups: list[list[int]], metas: list[list],
                 outs: list[Any], splits: list, gin_sizes: list[int], rg: list[bool],
                 shard_shapes: list[list[torch.Size]], fseq: int = 0, diff_inputs: Sequence[torch.Tensor] = (),
                 diff_idx: Sequence[int] = (), params: Sequence[torch.Tensor] = (),
                 versions: Sequence[int] = ()) -> None:
        self.runtime = runtime
        self.call = call
        self.k = k
        self.groups = groups
        self.metas = metas
        self.outs: list[Any] | None = outs
        self.splits = splits
        self.gin_sizes = gin_sizes
        self.rg = rg
        self.shard_shapes = shard_shapes
        self.ctx: Any = None
        self.rows: list[int] = [1] * k
        self.fseq = fseq  # cross-node mode: the training forward this call was (its backward's header names it)
        self.doubled = False  # a create_graph backward built a graph of gradients on this call's graph
        self.diff_inputs = list(diff_inputs)  # the inputs that require grad: what a double backward differentiates
        self.diff_idx = list(diff_idx)  # the indices of diff_params among the master's parameters
        self.params = list(params)  # the master's parameters at the forward
        self.diff_params = [self.params[i] for i in self.diff_idx]
        # the parameters' versions after it (a training forward's; see dpool.step.backward.check_params)
        self.versions = list(versions)
        self.input_devices = [t.device for t in self.diff_inputs]  # of the inputs that require grad, in order
        dim = runtime.dim
        self.differentiable = [any(metas[s][g[s]].requires_grad for s in range(k)) for g in groups]
        self.stacked = [runtime.n > 1 and all(len(metas[s][g[s]].shape) == 0 for s in range(k)) for g in groups]
        self.sizes: list[Any] = [
            None if st else [metas[s][g[s]].shape[dim] if len(metas[s][g[s]].shape) > dim else None for s in range(k)]
            for g, st in zip(groups, self.stacked)
        ]

    def gather(self) -> list[torch.Tensor]:
        """Concatenate the shards' outputs (copied out of shared memory) in group order."""
        out = []
        dim = self.runtime.dim
        dev = self.runtime.output_device
        warned = False
        for g, stacked in zip(self.groups, self.stacked):
            assert self.outs is not None
            parts = [read(self.outs[s].views, self.metas[s][g[s]]) for s in range(self.k)]
            if parts and parts[0].device != dev:  # GPU workers, outputs gathered elsewhere (another GPU, the CPU)
                parts = [p.to(dev) for p in parts]
                if len(parts) == 1:
                    out.append(parts[0])
                    continue
            if stacked:
                if dim == 0 and not warned:
                    warnings.warn(_SCALAR_WARNING, stacklevel=_user_stacklevel())
                    warned = True
                out.append(torch.stack(parts))
            elif len(parts) == 1:
                out.append(parts[0].clone())
            else:
                try:
                    out.append(torch.cat(parts, dim))
                except RuntimeError as exc:
                    shapes = [tuple(p.shape) for p in parts]
                    raise GatherError(
                        f"dpool cannot gather output tensor {len(out)}: the shards returned shapes {shapes}, which "
                        f"differ outside dim {dim} ({exc}). If the model pads packed sequences, pass "
                        "pad_packed_sequence(..., total_length=max_len) so that every shard pads to the same "
                        "length (PyTorch's FAQ for DataParallel)."
                    ) from None
        return out

    def grad_pieces(self, grads: Sequence[torch.Tensor | None]) -> list[list[torch.Tensor | None]]:
        """Per shard, the slice of each output gradient that belongs to it, by worker output index."""
        k = self.k
        pieces: list[list[torch.Tensor | None]] = [[None] * len(self.metas[s]) for s in range(k)]
        dim = self.runtime.dim
        for j, g in enumerate(self.groups):
            grad = grads[j] if j < len(grads) else None
            if grad is None or not self.differentiable[j]:
                continue
            if self.stacked[j]:
                for s in range(k):
                    pieces[s][g[s]] = grad[s]
            elif k == 1:
                pieces[0][g[0]] = grad
            else:  # one call for all the shards' views (k narrows cost four times as much)
                for s, piece in enumerate(torch.split_with_sizes(grad, self.sizes[j], dim)):
                    pieces[s][g[s]] = piece
        return pieces

    def input_grads(self, metas: list[list]) -> list[torch.Tensor | None]:
        """Gradients of the input tensors that require grad: shards concatenated, or summed if given whole."""
        out: list[torch.Tensor | None] = []
        dim = self.runtime.dim
        io = self.runtime.io
        devices = iter(self.input_devices)
        for j, needs in enumerate(self.rg):
            if not needs:
                continue
            dev = next(devices)
            parts: list[Any] = []
            for s in range(self.k):
                m = metas[s][j]
                if m is None:
                    parts.append(None)
                else:
                    parts.append(read(io.segment(s, "gin").views, m))
            if all(p is None for p in parts):
                out.append(None)
                continue
            if self.splits[j] is None:
                total = None
                for p in parts:
                    if p is not None:
                        total = p.clone() if total is None else total.add_(p)
                out.append(total if total is None or total.device == dev else total.to(dev))
            else:
                if any(p is not None and p.device != dev for p in parts):  # back to the input's device
                    parts = [p.to(dev) if p is not None else None for p in parts]
                filled = [p if p is not None else torch.zeros(self.shard_shapes[s][j], dtype=parts_dtype(parts),
                                                              device=dev)
                          for s, p in enumerate(parts)]
                out.append(torch.cat(filled, dim) if len(filled) > 1 else filled[0].clone())
        return out


def parts_dtype(parts: list[torch.Tensor | None]) -> torch.dtype:
    return next(p.dtype for p in parts if p is not None)


class Bridge(torch.autograd.Function):
    """``forward``: gather the workers' outputs. ``backward``: backpropagate on the workers.

    ``apply(state, param_idx, *inputs)``: ``inputs`` are the input tensors that require grad, then the master's
    parameters ``param_idx`` (by index), whose gradients the backward returns.
    """

    @staticmethod
    def forward(ctx: Any, call_state: CallState, param_idx: list[int],  # type: ignore[override]
                *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        call_state.ctx = ctx
        ctx.call_state = call_state
        ctx.param_idx = param_idx
        track_release(ctx, inputs[0])
        outs = call_state.gather()
        frozen = [o for o, d in zip(outs, call_state.differentiable) if not d or not (o.is_floating_point() or o.is_complex())]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        enter_backward(ctx)
        call_state: CallState = ctx.call_state
        runtime = call_state.runtime
        taken = accumulates(ctx, len(ctx.param_idx)) if runtime.no_sync else None
        grads_out = runtime.backward(call_state, grads, None, ctx.param_idx, taken)
        if leave_backward(ctx):  # autograd frees the node as this returns: the workers may free their graphs
            runtime.graphs.spent(call_state.call)
        return (None, None, *grads_out)


class DoubleState:
    """A ``create_graph=True`` backward of one call, whose gradients are themselves differentiable.

    The workers kept the graph of the gradients as call ``call`` (see ``keep_as`` in
    :class:`dpool.protocol.Backward`). Its outputs, per shard, are the gradients of the parameters
    that require grad, then of the input leaves; its leaves are the incoming output gradients
    (``roots`` order), then the inputs.
    """

    def __init__(self, runtime: Host, call_state: CallState, call: int, per_shard: list[list[Any]],
                 grads: Sequence[torch.Tensor | None], out: list[torch.Tensor | None]) -> None:
        self.runtime, self.call_state, self.call, self.k = runtime, call_state, call, call_state.k
        self.ctx: Any = None
        self.per_shard = per_shard
        self.roots = [[o for o, g in enumerate(per_shard[s]) if g is not None and call_state.metas[s][o].requires_grad]
                      for s in range(call_state.k)]
        self.grad_groups = [j for j, g in enumerate(grads) if j < len(call_state.groups) and g is not None
                            and g.requires_grad]
        self.inputs = ([grads[j] for j in self.grad_groups] + list(call_state.diff_inputs)  # type: ignore[misc]
                       + list(call_state.diff_params))
        self.present = [g is not None for g in out]
        self.values = [g.clone() for g in out if g is not None]
        self.n_in = sum(call_state.rg)

    def pieces(self, vs: Sequence[torch.Tensor | None]) -> tuple[list[list[Any]], list[int]]:
        """Per shard, the gradients for the kept graph's outputs; and the input-gradient segment sizes."""
        it = iter(vs)
        full = [next(it) if p else None for p in self.present]
        v_in, v_par = full[: self.n_in], full[self.n_in:]
        st, dim = self.call_state, self.runtime.dim
        idx = [j for j, r in enumerate(st.rg) if r]
        per_shard, sizes = [], []
        for s in range(self.k):
            mine: list[Any] = list(v_par)
            for jj, j in enumerate(idx):
                v = v_in[jj]
                if v is not None and st.splits[j] is not None and self.k > 1:
                    v = v.narrow(dim, sum(st.splits[j][:s]), st.splits[j][s])
                mine.append(v)
            per_shard.append(mine)
            placer = Placer()
            for o in self.roots[s]:
                placer.reserve(self.per_shard[s][o])
            sizes.append(placer.offset + st.gin_sizes[s] + 64)
        return per_shard, sizes

    def results(self, metas: list[list[Any]], param_grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Gradients for :attr:`inputs`: incoming output gradients, then inputs, then parameters."""
        st, dim, io = self.call_state, self.runtime.dim, self.runtime.io
        d_grads: list[torch.Tensor | None] = []
        for j in self.grad_groups:
            parts: list[torch.Tensor | None] = []
            for s in range(self.k):
                o = st.groups[j][s]
                m = metas[s][self.roots[s].index(o)] if o in self.roots[s] else None
                parts.append(read(io.segment(s, "gin").views, m) if m is not None else None)
            if all(p is None for p in parts):
                d_grads.append(None)
                continue
            dev = self.runtime.output_device  # where the gathered outputs (and so their gradients) live
            parts = [p.to(dev) if p is not None else None for p in parts]
            filled = [p if p is not None else torch.zeros(self.per_shard[s][st.groups[j][s]].shape,
                                                          dtype=parts_dtype(parts), device=dev)
                      for s, p in enumerate(parts)]
            if st.stacked[j]:
                d_grads.append(torch.stack(filled))
            else:
                d_grads.append(torch.cat(filled, dim) if len(filled) > 1 else filled[0].clone())
        d_inputs = st.input_grads([metas[s][len(self.roots[s]):] for s in range(self.k)])
        return d_grads + d_inputs + list(param_grads)


class DoubleBridge(torch.autograd.Function):
    """The gradients of a ``create_graph=True`` backward, differentiable through the workers' graphs.

    ``forward`` returns the gradients the workers computed (inputs: the incoming output gradients
    that require grad, the inputs and the parameters they depend on); ``backward`` sends the
    gradients of those gradients to the workers, which backpropagate through the graphs they kept:
    a gradient penalty (WGAN-GP, R1) reaches the parameters as in one process.
    """

    @staticmethod
    def forward(ctx: Any, double: DoubleState, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        double.ctx = ctx
        ctx.double = double
        track_release(ctx, inputs[0])
        return tuple(double.values)

    @staticmethod
    def backward(ctx: Any, *vs: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        enter_backward(ctx)
        if torch.is_grad_enabled():
            raise UnsupportedError(
                "third- and higher-order gradients through a dpool model are not supported (a create_graph=True "
                "backward through gradients that a create_graph=True backward made); compute this term on "
                "dpool.unwrap(model)"
            )
        double: DoubleState = ctx.double
        out = double.runtime.double_backward(double, vs)
        if leave_backward(ctx):
            double.runtime.graphs.spent(double.call)
        return (None, *out)
