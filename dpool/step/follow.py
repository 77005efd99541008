"""Following the user's process: what a forward checks of this process before it sends anything.

The workers copy this process's numerics settings (default dtype, precisions, attention backends) and, on
GPUs, its cuDNN and cuBLAS flags; calls that cannot travel (inside a ``torch.func`` transform, with dual
tensors) are refused. :class:`Notices` says each thing the workers cannot follow once.
"""
from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Sequence

import torch
import torch.autograd.forward_ad as _fwad

from ..bridge import _user_stacklevel
from ..errors import UnsupportedError
from ..gpu import apply_backend_flags, backend_flags
from ..numerics import apply_numerics, legacy_precision, numerics
from .hints import names as _names
from .state import StepState

__all__ = ["Notices", "refuse_transform", "refuse_dual", "follow_numerics", "follow_backend_flags", "in_transform",
           "in_dual_level"]

# the innermost torch.func transform this thread is inside (None: none); absent from older torch
_TRANSFORMS = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None)


def in_transform() -> bool:
    return _TRANSFORMS is not None and _TRANSFORMS() is not None


def in_dual_level() -> bool:
    return _fwad._current_level >= 0  # inside forward_ad.dual_level()


class Notices:
    """Warnings said once: once per name of each kind (a parameter, an attribute), or once at all."""

    def __init__(self) -> None:
        self._said: dict[str, set[str]] = {}

    def new(self, kind: str, items: Sequence[str]) -> list[str]:
        """The ``items`` of ``kind`` not said yet, now counted as said."""
        said = self._said.setdefault(kind, set())
        fresh = [n for n in items if n not in said]
        said.update(fresh)
        return fresh

    def global_hooks(self, hooks: Sequence[str]) -> None:
        """Say once that global module hooks do not run in the workers (DataParallel's replicas, in this
        process, run them)."""
        if hooks and self.new("global hooks", ["*"]):
            warnings.warn(
                f"dpool: global module hooks ({', '.join(hooks)}) are set; they run in this process only, not in "
                "dpool's workers, so they do not see or change the replicas' forward and backward. Register "
                "the hook on the model's modules instead (module.register_forward_hook(...)): those travel "
                "with the model.", stacklevel=_user_stacklevel())

    def relaid(self, tensors: Sequence[str]) -> None:
        """Say once per tensor that a new memory format given to it after wrap() (``model.to(memory_format=
        torch.channels_last)``) was not kept: its shared copy keeps the layout it had at wrap()."""
        new = self.new("relaid", tensors)
        if new:
            warnings.warn(
                f"dpool: {_names(new)} of the master module got another memory format after "
                "dpool.wrap() (module.to(memory_format=...)); the values are followed, but in shared memory "
                "(the master's and the workers') a parameter keeps the layout it had at wrap(), and a buffer is "
                "row-major. Convert the module before dpool.wrap(): its parameters keep channels_last then.",
                stacklevel=_user_stacklevel())

    def attributes(self, attrs: set[str]) -> None:
        """Say once per attribute that a forward set it to a tensor that requires grad on the workers only
        (see ``workers/attributes.py``): a loss term read from the master's module afterwards is stale."""
        new = self.new("attributes", sorted(attrs))
        if new:
            warnings.warn(
                f"dpool: the forward set the attribute{'s' * (len(new) > 1)} {', '.join(map(repr, new))} of "
                f"model.module to a tensor that requires grad on the workers' replicas only. "
                f"This process's module keeps its old value (nn.DataParallel's replicas lose such values too), "
                f"so a loss term read from it after the call is stale and does not train. Return the value from "
                f"forward() instead (in a tuple or dict with the output): it is then gathered like the output.",
                stacklevel=_user_stacklevel())

    def hooks_without_gradient(self, params: Sequence[str]) -> None:
        """Say once per parameter that autograd calls its hooks although no shard used it (a torch without
        ``torch._C._current_graph_task_id``, which dpool needs to hold them back: see dpool/hook_gate.py)."""
        new = self.new("hooks", params)
        if new:
            warnings.warn(
                f"dpool: parameter{'s' * (len(new) > 1)} {_names(list(map(repr, new)))} got no gradient "
                f"in this backward (no shard's forward used {'them' if len(new) > 1 else 'it'}), but autograd "
                f"calls their hooks: a tensor hook (p.register_hook) with None, a post-accumulate hook with the "
                f".grad it has (while accumulating, the earlier micro-batches' sum). One process would not call "
                f"them; this torch has no torch._C._current_graph_task_id, which dpool needs to hold them back. "
                f"Let a tensor hook return early on None, or upgrade torch.",
                stacklevel=_user_stacklevel())


def refuse_transform() -> None:
    """A call inside a torch.func transform (vmap, grad, jacrev, jvp, hessian): its inputs are the
    transform's wrapped tensors, which cannot travel, and the workers' forward runs outside it. Refused
    before anything is sent (torch's own errors came from deep inside the input copy and said nothing)."""
    raise UnsupportedError(
        "the dpool model was called inside a torch.func transform (vmap, grad, jacrev, jvp, hessian): the "
        "forward runs in dpool's worker processes, which the transform cannot follow. Apply the transform to "
        "dpool.unwrap(model) (the plain module, in this process), or call the model outside it and use "
        "loss.backward() / torch.autograd.grad for gradients.")


def refuse_dual(tensors: Sequence[torch.Tensor]) -> None:
    """Forward-mode AD: the shards travel as plain data, so a dual input's tangent would be dropped and the
    output would come back without one. Refused rather than lost."""
    for t in tensors:
        if _fwad.unpack_dual(t).tangent is not None:
            raise UnsupportedError(
                "an input of the dpool model is a dual tensor (torch.autograd.forward_ad): its tangent cannot "
                "travel to the workers, so the output would have none. Compute forward-mode derivatives on "
                "the plain module (dpool.unwrap(model)), or use reverse mode (backward(), torch.autograd.grad).")


def follow_numerics(state: StepState, call_all: Callable[[Any], Any]) -> None:
    """Give the workers this process's :func:`~dpool.numerics.numerics` settings (default dtype,
    deterministic mode, anomaly detection, float32 precision, attention backends) when they changed, at
    the first forward, or after a restart."""
    values = numerics()
    if values != state.sent_numerics:
        call_all(functools.partial(apply_numerics, values, legacy=legacy_precision()))
        state.sent_numerics_values(values)


def follow_backend_flags(state: StepState, call_all: Callable[[Any], Any]) -> None:
    """Give the workers this process's cuDNN and cuBLAS settings when they changed (or after a restart)."""
    flags = backend_flags()
    if flags != state.sent_flags:
        call_all(functools.partial(apply_backend_flags, flags))
        state.sent_backend_flags(flags)
