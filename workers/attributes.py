"""Tensors a training forward stores on the replica's modules, which the master's modules never get.

A forward that keeps a differentiable result on its module (a Bayesian layer's ``self.kl = ...``, a
mixture-of-experts layer's ``self.l_aux = ...``) keeps it on the worker's replica. The master's module
keeps the value it had, as with ``nn.DataParallel``, whose replicas lose such values too. So a training
loop that reads it after the call (``loss = loss_fn(out, y) + layer.kl``) adds an old value, and
trains without that term, silently. In one process the module holds the new value.

Such attributes cannot be brought back: each shard computed its own, and whether the batch's value is
their sum, their mean or any one of them depends on the model. So the worker looks, at the first
:data:`CHECKS` forwards with autograd on after each load of the model, for attributes the shipped
model already had (its ``__init__`` made them, or a forward before ``wrap()``) that the forward set to a
new tensor requiring grad, and reports their names. The coordinator warns once per name, and says to
return the value from the forward instead. An attribute the shipped model did not have is left alone:
reading it on the master raises ``AttributeError``, which is not silent; so are the weights that torch's
hook-based ``weight_norm``, ``spectral_norm`` and pruning recompute before each forward.
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["AttributeWatch", "CHECKS"]

CHECKS = 3  # forwards with autograd on that are looked at after each load (the same code runs every step)


class AttributeWatch:
    """Watches the first :data:`CHECKS` forwards with autograd on of ``model`` (just unpickled)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._modules = [(prefix, m, frozenset(m.__dict__) - _hooks_set(m)) for prefix, m in model.named_modules()]
        self._left = CHECKS
        self._before: list[dict[str, Any]] = []

    def start(self, grad: bool) -> bool:
        """Before a forward: whether this one is looked at (then :meth:`assigned` must follow)."""
        if not grad or not self._left:
            return False
        self._left -= 1
        self._before = [dict(m.__dict__) for _, m, _ in self._modules]
        return True

    def assigned(self) -> list[str]:
        """After that forward: the shipped attributes it set to a new tensor that requires grad."""
        found = []
        for (prefix, m, shipped), before in zip(self._modules, self._before):
            for k, v in m.__dict__.items():
                if (isinstance(v, torch.Tensor) and v.requires_grad and k in shipped and before.get(k) is not v
                        and not isinstance(v, torch.nn.Parameter)):
                    found.append(f"{prefix}.{k}" if prefix else k)
        self._before = []
        return found


def _hooks_set(m: torch.nn.Module) -> set[str]:
    """Attributes torch's own forward pre-hooks recompute from the parameters before every forward: the
    hook-based ``weight_norm`` and ``spectral_norm`` (``name``) and pruning (``_tensor_name``). Stale on
    the master as on DataParallel's, but no training loop reads them as a loss term."""
    names = set()
    for hook in m._forward_pre_hooks.values():
        for attr in ("name", "_tensor_name"):
            value = getattr(hook, attr, None)
            if isinstance(value, str):
                names.add(value)
    return names
