"""Synchronized BatchNorm for dpool's CPU (and any) workers.

``torch.nn.SyncBatchNorm`` needs a process group and refuses CPU tensors. dpool's version
all-reduces per-channel sums across the shards of a call through the coordinator (see
``AllReduce`` in :mod:`dpool.protocol`), in float64, so every shard normalises with the
statistics of the *whole* batch. The all-reduce is an autograd Function whose backward
all-reduces the gradients, so the gradients equal full-batch BatchNorm's as well. Running
statistics are updated from the full-batch statistics, identically on every shard.

Outside a dpool worker (the master module used directly, or a single shard) the layer is
an ordinary BatchNorm.

``torch.nn.SyncBatchNorm`` layers (``nn.SyncBatchNorm.convert_sync_batchnorm``, as scripts written
for DDP have) are this layer in the workers: the replicas are shipped with this class in their place
(:func:`torch_layer_state`), since in a worker, which has no process group, torch's layer would
silently normalise each shard with its own statistics. The master keeps torch's class.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .errors import UnsupportedError

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]

_CURRENT: Any = None  # set by the worker around a forward/backward: an object with .world, .allreduce()


def _set_collective(coll: Any) -> None:
    global _CURRENT
    _CURRENT = coll


def synchronizes(module: nn.Module) -> bool:
    """Whether ``module`` all-reduces in a dpool worker's forward and backward: dpool's layer, or torch's."""
    return isinstance(module, (SyncBatchNorm, nn.SyncBatchNorm))


def torch_layer_state(module: nn.SyncBatchNorm) -> dict[str, Any]:
    """The state a replica of torch's ``module`` is rebuilt from as a :class:`SyncBatchNorm`.

    torch's ``process_group`` is left out: across workers (and nodes) the layer spans the whole batch
    of the call. A layer given its own group (statistics over a subset of DDP's ranks) is refused at
    ``wrap()`` (:meth:`dpool.replicate.Master.collect`) rather than synchronized over a different set.
    """
    state = dict(module.__dict__)
    state.pop("process_group", None)
    return state


def empty_replica() -> SyncBatchNorm:
    """An empty layer for a replica of torch's (its state follows: :func:`torch_layer_state`)."""
    return SyncBatchNorm.__new__(SyncBatchNorm)


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, coll: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.coll = coll
        return coll.allreduce(t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        # d(sum over shards)/d(this shard's part) = 1, and every shard's loss depends on the sum:
        # the gradient of the part is the sum of the shards' gradients of the total.
        return ctx.coll.allreduce(grad), None


class SyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    r"""BatchNorm over the whole batch of a dpool call, across worker processes.

    Same arguments as ``torch.nn.BatchNorm2d``; works for inputs of any rank ≥ 2 (channels in
    dim 1). Build it with :func:`convert_sync_batchnorm`.
    """

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        coll = _CURRENT
        if not (self.training and coll is not None and coll.world > 1):
            return super().forward(input)
        self._check_input_dim(input)
        c = input.shape[1]
        dims = [0] + list(range(2, input.dim()))
        local = torch.cat([
            input.sum(dims, dtype=torch.float64),
            (input.double() * input.double()).sum(dims),
            torch.tensor([input.numel() / c], dtype=torch.float64, device=input.device),
        ])
        total = _AllReduce.apply(local, coll)
        n = total[2 * c]
        mean = total[:c] / n
        var = total[c:2 * c] / n - mean * mean  # biased, over the whole batch
        shape = [1, c] + [1] * (input.dim() - 2)
        invstd = torch.rsqrt(var + self.eps)
        out = (input - mean.view(shape).to(input.dtype)) * invstd.view(shape).to(input.dtype)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                f = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                nn_ = float(n)
                self.running_mean.mul_(1 - f).add_(mean.detach().to(self.running_mean.dtype), alpha=f)
                unbiased = var.detach() * (nn_ / max(nn_ - 1, 1.0))
                self.running_var.mul_(1 - f).add_(unbiased.to(self.running_var.dtype), alpha=f)
        return out


def convert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Replace every BatchNorm layer of ``module`` with :class:`SyncBatchNorm` (in place where possible).

    Parameters and buffers are carried over (the same parameter objects), as
    ``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` does. Call it before :func:`dpool.wrap`.
    A BatchNorm subclass with a ``forward`` of its own (timm's ``BatchNormAct2d``: BatchNorm, then
    an activation) is refused with :class:`~dpool.UnsupportedError`: replacing it would silently drop
    what its forward adds, which torch's converter does.

    Example::

        >>> net = dpool.convert_sync_batchnorm(net)
        >>> model = dpool.wrap(net)
    """
    for name, m in module.named_modules():  # all refused before any is replaced: nothing half converted
        cls = type(m)
        if (isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, SyncBatchNorm)
                and cls.forward not in (nn.modules.batchnorm._BatchNorm.forward, nn.SyncBatchNorm.forward)):
            raise UnsupportedError(
                f"{'model.' + name if name else 'the model'} is a {cls.__qualname__}, a BatchNorm with a forward "
                "of its own: dpool.convert_sync_batchnorm would replace it with a dpool.SyncBatchNorm and "
                "silently drop what that forward adds (an activation, in timm's BatchNormAct2d). Subclass "
                "dpool.SyncBatchNorm with the same additions and put it there yourself, or convert only the "
                "submodules without such layers (net.block = dpool.convert_sync_batchnorm(net.block))."
            )
    return _convert(module)


def _convert(module: nn.Module) -> nn.Module:
    out = module
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, SyncBatchNorm):
        out = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats)
        if module.affine:
            with torch.no_grad():
                out.weight = module.weight
                out.bias = module.bias
        out.running_mean = module.running_mean
        out.running_var = module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.training = module.training
    for name, child in module.named_children():
        out.add_module(name, _convert(child))
    return out
