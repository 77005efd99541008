"""The hooks of a master parameter that a backward brought no gradient do not run, as in one process.

The master's parameters are inputs of dpool's autograd node (:class:`dpool.bridge.Bridge`), so autograd
runs the accumulation of every one of them, and with it their hooks: a tensor hook (``p.register_hook``)
with ``None``, a post-accumulate hook (``p.register_post_accumulate_grad_hook``) with the ``.grad`` it
has. One process, whose graph never reaches a parameter that no shard used, calls neither. A hook that
reads the gradient fails on ``None``; one that changes ``.grad`` (scales it, adds noise) changes the
earlier micro-batches' sum once more.

Whether a parameter gets a gradient is known only when its accumulation runs: another path of the same
backward (the model called twice in one loss, a loss term on the parameter itself) may bring one, and
autograd sums what reaches a parameter before its hooks see it. So for each parameter that the workers'
backward left without a gradient, the Bridge's backward calls :func:`gate`, which puts a gate in front of
its hooks for the rest of that backward. torch reads a leaf's two hook dicts when its accumulation runs,
so the gate replaces them with its own; it calls the hooks of the original dicts (read then, in their
order, each tensor hook given what the one before returned, as torch does) unless the gradient it is given
is ``None``. Hooks of dpool (``always``) and of torch itself (``register_multi_grad_hook`` counts on a call
with ``None``) always run.

Lifecycle: the original dicts come back at the end of the backward (a final callback of autograd's
engine). A backward that fails before its end leaves its gates: the model's next forward and its
``close()`` put them back (:func:`restore`); a backward before that which gates the same parameter adopts
its gate. Until then a gate left so does what it does within a backward. A hook
registered on a parameter while it is gated lands in the gate's dict and goes with it.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any

import torch

_current_task = getattr(torch._C, "_current_graph_task_id", None)


class _GateDict(collections.OrderedDict):
    """A hook dict of dpool's, in place of a parameter's own for one backward."""


class _Gate:
    """The gates of one parameter in one backward (``task``: autograd's id of it)."""

    __slots__ = ("param", "pre", "post", "task", "got", "always")

    def __init__(self, param: torch.Tensor, task: int, always: Callable[[int], bool]) -> None:
        self.param = param
        self.pre = param._backward_hooks  # the parameter's own dicts (None: it has no such hook)
        self.post = param._post_accumulate_grad_hooks
        self.task = task
        self.got = False  # whether the accumulation brought a gradient
        self.always = always

    def _runs(self, key: int, hook: Any) -> bool:
        return self.got or self.always(key) or (getattr(hook, "__module__", None) or "").startswith("torch.")

    def before(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        self.got = grad is not None
        for key, hook in list((self.pre or {}).items()):
            if self._runs(key, hook):
                out = hook(grad)
                if out is not None:
                    grad = out
        return grad

    def after(self, param: torch.Tensor) -> None:
        for key, hook in list((self.post or {}).items()):
            if self._runs(key, hook) and hook(param) is not None:
                raise RuntimeError("Tensor post accumulate grad hooks should return None.")  # (torch's check)

    def install(self) -> None:
        self.param._backward_hooks = _GateDict([(-1, self.before)])
        self.param._post_accumulate_grad_hooks = _GateDict([(-1, self.after)])

    def remove(self) -> None:
        p = self.param
        if isinstance(p._backward_hooks, _GateDict):  # (not if something replaced it meanwhile)
            p._backward_hooks = self.pre
        if isinstance(p._post_accumulate_grad_hooks, _GateDict):
            p._post_accumulate_grad_hooks = self.post


_gates: dict[int, _Gate] = {}  # id(param) -> its gate, installed


def gate(params: Sequence[torch.Tensor], always: Callable[[int], bool]) -> bool:
    """Gate the hooks of ``params`` for the rest of the running backward (see the module's docstring);
    ``always(key)``: whether the hook registered under ``key`` is one that runs on ``None`` too.

    Returns False, gating nothing, where it cannot: outside autograd's backward, or a torch without
    ``_current_graph_task_id``."""
    task = _current_task() if _current_task is not None else -1
    if task < 0:
        return False
    if not any(g.task == task for g in _gates.values()):  # this backward's first: it puts them back at its end
        torch.autograd.Variable._execution_engine.queue_callback(  # type: ignore[attr-defined]
            lambda: restore([g.param for g in _gates.values() if g.task == task]))
    for p in params:
        g = _gates.get(id(p))
        if g is None:
            g = _gates[id(p)] = _Gate(p, task, always)
            g.install()
        g.task = task  # (a gate a failed backward left is this one's now)
    return True


def restore(params: Sequence[torch.Tensor], keep_running: bool = False) -> None:
    """Put back the own hook dicts of ``params``: at the end of a backward; at a model's ``close()``, and
    with ``keep_running`` at its next forward, those a failed backward left, but not those of the backward
    now running (a forward inside it: a checkpoint's recomputation)."""
    if not _gates:
        return
    running = _current_task() if keep_running and _current_task is not None else -1
    for p in params:
        g = _gates.get(id(p))
        if g is not None and (running < 0 or g.task != running):
            del _gates[id(p)]
            g.remove()
