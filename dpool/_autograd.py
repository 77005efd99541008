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
or its saved tensors were released by a backward without ``retain_graph``.
The coordinator detects that before each request and piggybacks a ``release``.
"""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Sequence

import torch

from ._tensors import read
from .errors import UnsupportedError

if TYPE_CHECKING:
    from ._runtime import Runtime
    from .shm import Segment

__all__ = ["Bridge", "CallState"]

_SCALAR_WARNING = (
    "Was asked to gather along dimension 0, but all input tensors were scalars; "
    "will instead unsqueeze and return a vector."
)


class CallState:
    """What the coordinator knows about one forward call until its graph is released."""

    def __init__(self, runtime: "Runtime", call: int, k: int, groups: list[list[int]], metas: list[list],
                 outs: list["Segment"], splits: list, gin_sizes: list[int], rg: list[bool],
                 shard_shapes: list[list[torch.Size]]) -> None:
        self.runtime = runtime
        self.call = call
        self.k = k
        self.groups = groups
        self.metas = metas
        self.outs = outs
        self.splits = splits
        self.gin_sizes = gin_sizes
        self.rg = rg
        self.shard_shapes = shard_shapes
        self.ctx: Any = None
        self.rows: list[int] = [1] * k
        dim = runtime.dim
        self.differentiable = [any(metas[s][g[s]][3] for s in range(k)) for g in groups]
        self.stacked = [runtime.n > 1 and all(len(metas[s][g[s]][1]) == 0 for s in range(k)) for g in groups]
        self.sizes = [
            None if st else [metas[s][g[s]][1][dim] if len(metas[s][g[s]][1]) > dim else None for s in range(k)]
            for g, st in zip(groups, self.stacked)
        ]

    def gather(self) -> list[torch.Tensor]:
        """Concatenate the shards' outputs (copied out of shared memory) in group order."""
        out = []
        dim = self.runtime.dim
        warned = False
        for g, stacked in zip(self.groups, self.stacked):
            parts = [read(self.outs[s].views, self.metas[s][g[s]]) for s in range(self.k)]
            if stacked:
                if dim == 0 and not warned:
                    warnings.warn(_SCALAR_WARNING)
                    warned = True
                out.append(torch.stack(parts))
            elif len(parts) == 1:
                out.append(parts[0].clone())
            else:
                out.append(torch.cat(parts, dim))
        return out

    def grad_pieces(self, grads: Sequence[torch.Tensor | None], s: int) -> list[torch.Tensor | None]:
        """The slice of each output gradient that belongs to shard ``s``, per worker output tensor."""
        pieces: list[torch.Tensor | None] = [None] * len(self.metas[s])
        dim = self.runtime.dim
        for j, g in enumerate(self.groups):
            grad = grads[j] if j < len(grads) else None
            if grad is None or not self.differentiable[j]:
                continue
            if self.stacked[j]:
                pieces[g[s]] = grad[s]
            elif self.k == 1:
                pieces[g[s]] = grad
            else:
                sizes = self.sizes[j]
                start = sum(sizes[:s])
                pieces[g[s]] = grad.narrow(dim, start, sizes[s])
        return pieces

    def input_grads(self, metas: list[list]) -> list[torch.Tensor | None]:
        """Gradients of the input tensors that require grad: shards concatenated, or summed if given whole."""
        out: list[torch.Tensor | None] = []
        dim = self.runtime.dim
        io = self.runtime._io
        for j, needs in enumerate(self.rg):
            if not needs:
                continue
            parts = []
            for s in range(self.k):
                m = metas[s][j]
                if m is None:
                    parts.append(None)
                else:
                    parts.append(read(io[s]["gin"].seg.views, m))
            if all(p is None for p in parts):
                out.append(None)
                continue
            if self.splits[j] is None:
                total = None
                for p in parts:
                    if p is not None:
                        total = p.clone() if total is None else total.add_(p)
                out.append(total)
            else:
                filled = [p if p is not None else torch.zeros(self.shard_shapes[s][j], dtype=parts_dtype(parts))
                          for s, p in enumerate(parts)]
                out.append(torch.cat(filled, dim) if len(filled) > 1 else filled[0].clone())
        return out


def parts_dtype(parts: list[torch.Tensor | None]) -> torch.dtype:
    return next(p.dtype for p in parts if p is not None)


class Bridge(torch.autograd.Function):
    """``forward``: gather the workers' outputs. ``backward``: backpropagate on the workers."""

    @staticmethod
    def forward(ctx: Any, state: CallState, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        state.ctx = ctx
        ctx.state = state
        ctx.save_for_backward(inputs[0])  # lets the runtime see when the graph is freed
        outs = state.gather()
        frozen = [o for o, d in zip(outs, state.differentiable) if not d or not (o.is_floating_point() or o.is_complex())]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        ctx.saved_tensors  # raises torch's own error on a second backward without retain_graph
        if torch.is_grad_enabled():  # autograd enables grad mode here only for create_graph=True
            raise UnsupportedError(
                "higher-order gradients through a dpool model are not supported: backward(create_graph=True) "
                "or torch.autograd.grad(..., create_graph=True) (a gradient penalty, R1, MAML, Jacobian "
                "regularisation) would get gradients that are not differentiable, and the penalty's share of "
                "the parameters' gradients would be lost. Compute that term on dpool.unwrap(model) (the master "
                "module, in this process), or train with DistributedDataParallel."
            )
        state: CallState = ctx.state
        return (None, *state.runtime.backward(state, grads))
