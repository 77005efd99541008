"""Gradients that ``no_sync()`` holds on the workers, as the training loop sees them on the master.

Under ``model.no_sync()`` each worker accumulates its parameter gradients itself, and the master's
``.grad`` is updated by the first backward outside the context, once. ``DistributedDataParallel``
accumulates in each rank's ``.grad`` instead, so a loop written for it acts on those gradients: it
drops them with ``optimizer.zero_grad()`` (at an epoch's start, after a skipped batch), and an
``optimizer.step()`` in between would use them. Gradients held on the workers are out of reach of
both, and were silently added to the next synchronized backward after a ``zero_grad()``. So:

* After each held backward, every parameter that takes a gradient has a ``.grad`` on the master: a
  zero tensor (its *marker*) if it had none. The next backward sees what became of it: still that
  tensor, unchanged: the held gradients count, added to it; set to ``None`` or zeroed: the workers
  drop that parameter's held gradient first, as ``zero_grad()`` drops DDP's; changed otherwise
  (scaled, clipped): an error, since the held part cannot be changed alike.
* A backward that fails (a worker raised, died or was restarted, or Ctrl-C) while the workers hold
  gradients, or were to hold them, may have added its part on some workers and not on others. The
  held sums are then no accumulation the loop made, so the next backward requires every marked
  ``.grad`` cleared (``zero_grad()``: the workers drop them) and raises otherwise: one process
  would not have added that part, and dpool cannot take it out again.
* A worker restarted (``max_restarts``) while the workers hold gradients starts without its part of
  them, whatever call the death interrupted (a forward, too): the held sums then miss that part, and
  the next backward requires the marked ``.grad`` cleared in the same way. A ``.grad`` the loop
  cleared before the restart needs nothing more.
* ``optimizer.step()`` over a parameter with a held gradient raises (a global optimizer pre-hook,
  registered at the first held backward) instead of stepping without it.
* Autograd may add to a marker: a term of the loss computed on the master's parameters outside the
  model's forward (an L2 penalty written by hand, a weight tied to a head outside the model). That is
  accumulation, which the held sums join at the end, as in one process: hooks on the parameters see
  each such accumulation (a tensor hook before it, a post-accumulate hook after it) and take the
  result as the new marker. Any other change of a marker (scaling, clipping) is still refused.
* A parameter frozen (``requires_grad_(False)``) while its held gradient is kept raises at the next
  forward or backward: the workers bring only the gradients of parameters that require grad.
* Sparse gradients (``nn.Embedding(sparse=True)``) get a sparse marker with no entries (a dense zero
  would make their sum dense), seen the same way.
* Hooks the loop put on the master's parameters (``p.register_hook``: clipping a gradient elementwise,
  logging its norm; ``p.register_post_accumulate_grad_hook``: an optimizer step in the backward) see each
  backward's gradient in one process, and one of a held sum would see it once, summed: a clamp gives
  other numbers, and a held backward called them with ``None``. So while such a hook is registered,
  ``no_sync()`` holds nothing: every backward brings its gradients to ``.grad`` through autograd, as
  outside the context (:func:`hooked`). A hook registered while the workers hold a gradient of its
  parameter raises at the next backward (one process ran it on the later micro-batches only).

A model changed after ``wrap()`` cannot be shipped to the workers while they hold gradients (the new
replicas would start without them): :func:`refuse_change` says so.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

import torch

from .errors import UnsupportedError

__all__ = ["HeldGradients", "hooked", "refuse_change"]

_holding: weakref.WeakSet[HeldGradients] = weakref.WeakSet()
_hooked = False


class HeldGradients:
    """The markers of the master's parameters while the workers hold ``no_sync()`` gradients.

    Args:
        names: the master's parameter names, by index (for errors).
    """

    def __init__(self, names: Callable[[], Sequence[str]]) -> None:
        self._names = names
        self._marks: list[tuple[weakref.ref, int, bool] | None] | None = None  # (marker, version, made by us)
        self._ids: set[int] = set()
        self._sparse: set[int] = set()  # parameters with sparse gradients: a sparse marker
        self._hooks: list[Any] = []  # while holding: the hooks that follow autograd's accumulation into markers
        self._pending: dict[int, int] = {}  # parameter -> its intact marker's version, as autograd adds to it
        self._failed: str | None = None  # why the held sums are no accumulation (see failed() and lost())

    def mark(self, module: torch.nn.Module, params: Sequence[torch.Tensor], flags: bytes) -> None:
        """After a held backward: each parameter that took a gradient now, or before, gets its marker."""
        global _hooked
        if self._marks is None:  # an accumulation starts (the model cannot change until it ends)
            self._sparse = {id(m.weight) for m in module.modules()
                            if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse}
        sparse = self._sparse
        old = self._marks or [None] * len(params)
        marks: list[tuple[weakref.ref, int, bool] | None] = []
        for p, flag, before in zip(params, flags, old):
            if not (flag or before is not None):
                marks.append(None)
                continue
            g = p.grad
            made = g is None or (before is not None and before[2] and before[0]() is g)
            if g is None:
                g = p.grad = _sparse_zero(p) if id(p) in sparse else torch.zeros_like(p)
            marks.append((weakref.ref(g), g._version, made))
        self._marks = marks
        self._failed = None
        self._ids = {id(p) for p, m in zip(params, marks) if m is not None}
        if not self._hooks:  # (an accumulation starts)
            self._follow_accumulation(params)
        _holding.add(self)
        if not _hooked:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            register_optimizer_step_pre_hook(_refuse_step)
            _hooked = True

    def failed(self, module: torch.nn.Module, params: Sequence[torch.Tensor], flags: bytes, what: str) -> None:
        """``what`` failed while the workers held, or were to hold, gradients: they may hold part of it.
        Every parameter that takes a gradient gets its marker, and the next backward needs them cleared."""
        self.mark(module, params, flags)
        self._failed = (f"{what} while model.no_sync() held accumulated gradients on dpool's workers (or was to "
                        "hold them): some workers may have added their part of it and others not; one process "
                        "would not have added a failed backward's gradients")

    def lost(self, module: torch.nn.Module, params: Sequence[torch.Tensor], what: str) -> None:
        """Workers were restarted (``what``) while the workers held gradients: their part is gone. The
        markers stay as they are (a ``.grad`` the loop cleared since needs nothing more); the next backward
        needs the others cleared."""
        if self._marks is None:  # (not while holding: markers exist after the first held backward, failed or not)
            self.mark(module, params, bytes(p.requires_grad for p in params))
        self._failed = (f"{what} while model.no_sync() held accumulated gradients on dpool's workers: their "
                        "part of those gradients was lost with them")

    def cleared(self, params: Sequence[torch.Tensor]) -> bytes:
        """Before a backward while the workers hold: one byte per parameter, 1 where the loop cleared the
        master's ``.grad`` since (the workers drop their held gradient of it); ``b""`` if none was."""
        if self._marks is None:
            return b""
        drop = bytearray(len(params))
        kept = []
        for i, (p, mark) in enumerate(zip(params, self._marks)):
            if mark is None:
                continue
            g = p.grad
            if g is None:
                drop[i] = 1
                continue
            if _intact(mark, g):
                kept.append(i)
                continue
            if not (g._values() if g.is_sparse else g).any():  # zero_grad(set_to_none=False)
                drop[i] = 1
                continue
            name = self._names()[i]
            raise UnsupportedError(
                f"the gradient of parameter {name!r} was changed (not cleared) while model.no_sync() held its "
                f"accumulated part on dpool's workers, which cannot be changed alike. Change gradients (clip, "
                f"scale) after the backward outside no_sync(), which brings them all to .grad; zero_grad() "
                f"in between is fine (it drops the held part, as with DistributedDataParallel).")
        if self._failed is not None and kept:
            names = [self._names()[i] for i in kept]
            raise UnsupportedError(
                f"{self._failed}. So the held gradients of {len(kept)} parameter(s) "
                f"({', '.join(repr(n) for n in names[:3])}{', ...' if len(names) > 3 else ''}) are not the "
                f"accumulation of the backwards that succeeded. Call optimizer.zero_grad() (or "
                f"model.zero_grad()) to drop them, then accumulate again.")
        return bytes(drop) if any(drop) else b""

    def _follow_accumulation(self, params: Sequence[torch.Tensor]) -> None:
        """Hooks on the parameters: autograd's accumulation into an intact marker gives the new marker."""
        me = weakref.ref(self)
        for i, p in enumerate(params):
            if p.requires_grad:
                self._hooks += [p.register_hook(_before_accumulation(me, weakref.ref(p), i)),
                                p.register_post_accumulate_grad_hook(_after_accumulation(me, i))]

    def own_hooks(self) -> set[int]:
        """The ids of the hooks this object registered on the parameters (see :func:`hooked`)."""
        return {h.id for h in self._hooks}

    def refuse_hooked(self, params: Sequence[torch.Tensor], indices: Sequence[int]) -> None:
        """Raise if a parameter of ``indices`` (hooked since the workers started holding) has a held
        gradient the loop kept: one process ran the hook on the later micro-batches only, and the held sum
        would pass through it."""
        if self._marks is None:
            return
        names = [self._names()[i] for i in indices if _intact(self._marks[i], params[i].grad)]
        if names:
            raise UnsupportedError(
                f"a hook was registered on {len(names)} parameter(s) ({', '.join(repr(n) for n in names[:3])}"
                f"{', ...' if len(names) > 3 else ''}) while model.no_sync() held their accumulated gradients on "
                f"dpool's workers: one process ran it on the later micro-batches' gradients only, and here the "
                f"held sum would pass through it too. Register parameter hooks before the accumulation (with "
                f"them, no_sync() holds nothing), or drop the held gradients first (optimizer.zero_grad()).")

    def refuse_frozen(self, params: Sequence[torch.Tensor]) -> None:
        """Raise if a parameter whose held gradient the loop kept (its marker untouched) no longer requires
        grad: one process keeps that ``.grad``, but the workers bring only the gradients of parameters that
        require grad to it (and zero a frozen parameter's slot at the next forward)."""
        if self._marks is None:
            return
        frozen = []
        for name, p, mark in zip(self._names(), params, self._marks):
            if not p.requires_grad and _intact(mark, p.grad):
                frozen.append(name)
        if frozen:
            raise UnsupportedError(
                f"{len(frozen)} parameter(s) ({', '.join(repr(n) for n in frozen[:3])}"
                f"{', ...' if len(frozen) > 3 else ''}) stopped requiring grad while model.no_sync() holds their "
                f"accumulated gradients on dpool's workers, which cannot bring those to .grad any more. Freeze "
                f"parameters between optimizer steps (after the backward outside no_sync()), or drop the held "
                f"gradients first (optimizer.zero_grad()).")

    def release(self, params: Sequence[torch.Tensor]) -> None:
        """The held gradients are about to reach the master (a backward outside ``no_sync()``), or the pool
        closed. A marker made where ``.grad`` was ``None`` goes back to ``None`` (autograd then sets the
        gradient, if any: a parameter that gets none keeps ``None``, as in one process, which optimizers
        skip)."""
        for p, mark in zip(params, self._marks or ()):
            if mark is not None and mark[2] and _intact(mark, p.grad):
                p.grad = None
        self._marks = None
        self._failed = None
        self._ids = set()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._pending = {}
        _holding.discard(self)


def hooked(params: Sequence[torch.Tensor], own: set[int]) -> list[int]:
    """The indices of the parameters with a tensor hook or a post-accumulate-grad hook whose id is not in
    ``own`` (the loop's: dpool's own follow the accumulation, see :meth:`HeldGradients.own_hooks`)."""
    out = []
    for i, p in enumerate(params):
        for hooks in (p._backward_hooks, p._post_accumulate_grad_hooks):
            if hooks and any(k not in own for k in hooks):
                out.append(i)
                break
    return out


def _intact(mark: tuple[weakref.ref, int, bool] | None, g: torch.Tensor | None) -> bool:
    """Whether ``g`` (a parameter's ``.grad``) is still the marker ``mark``, unchanged since it was made."""
    return mark is not None and g is not None and g._version == mark[1] and mark[0]() is g


def _before_accumulation(held: weakref.ref, param: weakref.ref, i: int) -> Callable[[torch.Tensor], None]:
    """A tensor hook of parameter ``i``: runs before autograd adds to its ``.grad``; notes an intact marker."""

    def hook(grad: torch.Tensor) -> None:
        me, p = held(), param()
        if me is None or p is None or me._marks is None:
            return
        mark, g = me._marks[i], p.grad
        if _intact(mark, g):
            me._pending[i] = g._version

    return hook


def _after_accumulation(held: weakref.ref, i: int) -> Callable[[torch.Tensor], None]:
    """A post-accumulate hook of parameter ``i``: an intact marker plus autograd's gradient is the new marker
    (in place: one version more; or a new tensor, the old one untouched)."""

    def hook(p: torch.Tensor) -> None:
        me = held()
        if me is None or me._marks is None:
            return
        version = me._pending.pop(i, None)
        mark, g = me._marks[i], p.grad
        if version is None or mark is None or g is None:
            return
        old = mark[0]()
        if (g._version == version + 1) if g is old else (old is None or old._version == version):
            me._marks[i] = (weakref.ref(g), g._version, False)

    return hook


def _sparse_zero(p: torch.Tensor) -> torch.Tensor:
    """A sparse gradient of ``p`` with no entries, laid out as an embedding's (one sparse dimension)."""
    return torch.sparse_coo_tensor(torch.empty((1, 0), dtype=torch.long, device=p.device),
                                   p.new_empty((0, *p.shape[1:])), p.shape, check_invariants=False)


def refuse_change(what: str) -> UnsupportedError:
    """The error for a model changed after ``wrap()`` while the workers hold ``no_sync()`` gradients."""
    return UnsupportedError(
        f"{what} changed after dpool.wrap() while model.no_sync() holds accumulated gradients on the workers: "
        f"shipping the changed model to them would drop those gradients. Finish the accumulation first (a "
        f"backward outside no_sync()), then change the model; or pass a value that changes during "
        f"accumulation as an argument of forward().")


def _refuse_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
    """A global optimizer pre-hook: no step over parameters whose gradients the workers still hold.

    A step given a closure (``step(closure)``: Lightning's loop, LBFGS) runs the closure, whose backward
    may bring the held gradients to ``.grad``, before it updates: the check then runs after the closure.
    """
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)  # (args[0]: the optimizer)
    if closure is None:
        _check_step(optimizer)
        return None

    def checked() -> Any:
        loss = closure()
        _check_step(optimizer)
        return loss

    if "closure" in kwargs:
        return args, {**kwargs, "closure": checked}
    return (args[0], checked, *args[2:]), kwargs


def _check_step(optimizer: torch.optim.Optimizer) -> None:
    for held in list(_holding):
        n = sum(id(p) in held._ids for group in optimizer.param_groups for p in group["params"])
        if n:
            raise UnsupportedError(
                f"{type(optimizer).__name__}.step() over {n} parameter(s) whose gradients model.no_sync() still "
                f"holds on dpool's workers: they are not in .grad yet, and the step would go without them. Run "
                f"the last micro-batch's backward outside no_sync(), which brings them to .grad, then step.")