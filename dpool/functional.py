"""``dpool.data_parallel``: the functional form, ``nn.parallel.data_parallel``'s call with a pool kept per module."""
from __future__ import annotations

from typing import Any, Sequence

from torch import nn

from .devices import DeviceLike
from .errors import DpoolTypeError
from .wrapper import DataParallel, usable, wrap

__all__ = ["data_parallel"]

_ATTR = "_dpool_functional_pool"


class _PoolHolder:
    """The dpool model that :func:`data_parallel` keeps for a module, held by the module itself.

    The module holds it (as an attribute) and it holds the module (as the model's master): a reference
    cycle, so the pool lives as long as the module and closes when the module is collected. A copy or a
    pickle of the module (the replicas dpool ships, ``copy.deepcopy``, ``torch.save``) gets an empty holder.
    """

    __slots__ = ("model", "key")

    def __init__(self) -> None:
        self.model: DataParallel | None = None
        self.key: tuple | None = None

    def __reduce__(self) -> tuple:
        return _PoolHolder, ()

    def __deepcopy__(self, memo: dict) -> "_PoolHolder":
        return _PoolHolder()


def data_parallel(
    module: nn.Module,
    inputs: Any,
    device_ids: Sequence[DeviceLike] | None = None,
    output_device: DeviceLike | None = None,
    dim: int = 0,
    module_kwargs: dict[str, Any] | None = None,
) -> Any:
    r"""Evaluate ``module(*inputs, **module_kwargs)`` in parallel over dpool workers.

    The functional form of :class:`dpool.DataParallel`, with the semantics of
    ``torch.nn.parallel.data_parallel``: the inputs are split along ``dim``, each shard
    runs on a replica, and the outputs are gathered on ``output_device``.

    Unlike ``torch.nn.parallel.data_parallel``, which replicates the module on every call,
    the first call starts the workers and later calls with the same module and arguments
    reuse them, so calling it inside a ``forward`` (as pytorch/examples' DCGAN does) costs
    one pool, not one per step. The pool closes when ``module`` is garbage-collected, or at
    exit; a call with other ``device_ids``, ``output_device`` or ``dim`` replaces it.

    Args:
        module (nn.Module): the module to evaluate in parallel.
        inputs (Tensor or tuple): the positional inputs to ``module``.
        device_ids (list of int, str or torch.device, optional): one worker per entry, as
            :func:`dpool.wrap`'s. Default: every visible GPU, or CPU workers when there is none.
        output_device (int, str or torch.device, optional): where the output is gathered.
            Default: ``device_ids[0]`` (the CPU for CPU workers).
        dim (int): the dimension along which inputs are split. Default: 0.
        module_kwargs (dict, optional): keyword arguments to ``module``.

    Returns:
        The gathered output of ``module(*inputs, **module_kwargs)``.

    Example::

        >>> out = dpool.data_parallel(net, x, device_ids=["cpu", "cpu"])
        >>> out.sum().backward()      # net's parameters get the gradients
    """
    if not isinstance(module, nn.Module):
        raise DpoolTypeError(f"dpool.data_parallel expects an nn.Module, got {type(module).__name__}")
    if not isinstance(inputs, tuple):
        inputs = (inputs,) if inputs is not None else ()
    holder = module.__dict__.get(_ATTR)
    if not isinstance(holder, _PoolHolder):
        holder = _PoolHolder()
        object.__setattr__(module, _ATTR, holder)  # (set before wrap(): the replicas get an empty holder)
    key = (None if device_ids is None else [str(d) for d in device_ids], str(output_device), dim)
    model = holder.model
    if model is None or holder.key != key or not usable(model):
        if model is not None:
            model.close()
        holder.model = None
        holder.model = model = wrap(module, None if device_ids is None else list(device_ids), output_device, dim)
        holder.key = key
    return model(*inputs, **(module_kwargs or {}))
