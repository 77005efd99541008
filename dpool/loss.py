"""Loss on the workers: ``dpool.wrap(net, gather=False)`` and ``dpool.criterion(loss)``.

With ``gather=False`` a forward returns a :class:`ShardedOutput`: the outputs stay on the
workers, and nothing piles up on the coordinator (DataParallel's "GPU-0 imbalance", which
PyTorch-Encoding's DataParallelCriterion fixed with threads). ``dpool.criterion(loss)(out,
target)`` scatters the targets the same way, computes the loss on each worker, and returns
the full-batch loss: each shard reports its loss with ``reduction="sum"`` and the number the
mean divides by (rows, elements, or the sum of class weights), and the coordinator divides the
totals, so unequal shards, class weights and ``ignore_index`` give exactly the single-process
value. ``loss.backward()`` backpropagates on the workers from their shard losses.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import cloudpickle
import torch

from . import gather as _gather
from .errors import DpoolValueError

if TYPE_CHECKING:
    from .bridge import CallState
    from .coordinator import Runtime

__all__ = ["ShardedOutput", "criterion"]


class ShardedOutput:
    """Outputs of a forward kept on the workers (``gather=False``).

    Pass it to a :func:`criterion`, or call :meth:`gather` for the usual gathered output.
    """

    def __init__(self, runtime: "Runtime", state: "CallState", specs: list, diff_inputs: list) -> None:
        self._runtime = runtime
        self._state = state
        self._specs = specs
        self._diff_inputs = diff_inputs

    @property
    def saved_tensors(self) -> tuple:  # lets the runtime's graph-release probe treat handles like ctx objects
        return ()

    @property
    def shard_sizes(self) -> list[int]:
        """Rows of the batch each worker holds."""
        return list(self._state.rows)

    def gather(self) -> Any:
        """The gathered output, exactly as ``gather=True`` would have returned it (differentiable)."""
        return self._runtime.gather_kept(self)

    def __repr__(self) -> str:
        return f"ShardedOutput(call={self._state.call}, shard_sizes={self.shard_sizes})"


class criterion:
    """Wrap a loss module so that it runs on the workers, next to the outputs.

    Args:
        loss (nn.Module): e.g. ``nn.CrossEntropyLoss()``; ``reduction`` must be ``"mean"`` or ``"sum"``.

    Example::

        >>> model = dpool.wrap(net, gather=False)
        >>> crit = dpool.criterion(nn.CrossEntropyLoss())
        >>> loss = crit(model(x), y)       # a 0-dim tensor: the full-batch loss
        >>> loss.backward()
    """

    def __init__(self, loss: torch.nn.Module) -> None:
        reduction = getattr(loss, "reduction", "mean")
        if reduction not in ("mean", "sum"):
            raise DpoolValueError(f"dpool.criterion supports reduction 'mean' or 'sum', not {reduction!r}")
        self.loss = loss
        self.reduction = reduction
        self._bytes = cloudpickle.dumps(loss)

    def __call__(self, output: Any, *targets: Any) -> torch.Tensor:
        if not isinstance(output, ShardedOutput):
            return self.loss(output, *targets)  # a gathered output: compute it here
        return output._runtime.criterion(output, self, targets)


class LossBridge(torch.autograd.Function):
    """``forward``: the combined loss; ``backward``: each worker backpropagates its shard loss."""

    @staticmethod
    def forward(ctx: Any, box: Any, *inputs: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.box = box
        ctx.save_for_backward(inputs[0])
        return box.value.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        ctx.saved_tensors
        box = ctx.box
        scale = grad / box.denom
        pieces = [[None] * (idx + 1) for idx in box.indices]
        for s, idx in enumerate(box.indices):
            pieces[s][idx] = scale.to(box.value.dtype).reshape(())
        return (None, *box.runtime.backward(box.state, (), pieces))


class _LossBox:
    __slots__ = ("runtime", "state", "value", "denom", "indices", "handle")

    def __init__(self, runtime: "Runtime", handle: ShardedOutput, value: torch.Tensor, denom: float,
                 indices: list[int]) -> None:
        self.runtime, self.state, self.value, self.denom, self.indices = runtime, handle._state, value, denom, indices
        self.handle = handle  # the loss's graph keeps the outputs on the workers alive


def combine(runtime: "Runtime", handle: ShardedOutput, replies: list, dtype: torch.dtype,
            reduction: str) -> torch.Tensor:
    """The full-batch loss from the shards' (sum, denominator) replies, differentiable."""
    total = sum(r.value for r in replies)
    denom = sum(r.denom for r in replies) if reduction == "mean" else 1.0
    value = torch.tensor(total / denom if denom else total, dtype=dtype, device=runtime.output_device)
    box = _LossBox(runtime, handle, value, denom if denom else 1.0, [r.index for r in replies])
    grad_inputs = handle._diff_inputs + [p for p in runtime.params if p.requires_grad]
    if torch.is_grad_enabled() and grad_inputs and any(handle._state.differentiable):
        return LossBridge.apply(box, *grad_inputs)
    return value


def build_output(handle: ShardedOutput, gathered: list) -> Any:
    return _gather.build(handle._specs, iter(gathered))
