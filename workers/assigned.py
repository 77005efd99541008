"""Persistent buffers a forward assigned a new tensor, put back into the worker's layout.

A replica's buffers are views of the worker's state segment: refreshed from the master's buffers
before each forward, and read back after it by the buffer policy (:mod:`dpool.buffers`). An update in
place (BatchNorm's ``running_mean.mul_(...)``) lands in the view. A forward that *assigns* a new tensor
to a buffer (``self.avg = 0.9 * self.avg + 0.1 * x.mean(0)``) leaves the view behind: the master never
saw the update, and the replica kept a value of its own that the next refresh no longer reached, so
the workers drifted apart from each other and from the master, whose ``state_dict()`` is what gets
saved. In one process the module simply holds the new tensor.

torch's global buffer-registration hook says when a forward assigned any buffer (nothing is checked
otherwise, so a forward that assigns none costs nothing). Then each *persistent* buffer of the layout
that is no longer its view is, if the new tensor has its shape, dtype and device, copied into the view,
and the view put back: the update reaches the master by the buffer policy, as an in-place one does.
That is what one process computes unless something else still holds the old tensor (another module's
buffer, an attribute, a container: in one process it would keep the old values, here it would see the
new ones), and unless the new tensor does not fit the view; both are errors, raised after the view is
put back so that the replica stays in the layout.

Non-persistent buffers are left as the forward made them, in the replica only: they are caches the
model rebuilds from its own Python state (transformers' dynamic rotary embeddings reassign ``inv_freq``
and remember the length it was made for in a plain attribute), so each replica keeps the two
consistent, as one process does; they are not saved by ``state_dict()``.
"""
from __future__ import annotations

import gc
import sys
from typing import Any

import torch
from torch.nn.modules import module as _module_hooks

__all__ = ["AssignedBuffers"]

_current: AssignedBuffers | None = None  # the replica's (one model per worker at a time)
_hooked = False


def _on_assign(module: torch.nn.Module, name: str, value: Any) -> None:
    if _current is not None:
        _current.assigned = True


class AssignedBuffers:
    """Where each persistent buffer of the layout sits in the replica, and the put-back after a forward.

    Args:
        model: the replica, just unpickled: its buffers are ``views``.
        views: the buffers' views of the state segment, in the layout's order.
        viewed: indices of the buffers another tensor of the replica views (an attribute made from one).
    """

    def __init__(self, model: torch.nn.Module, views: list[torch.Tensor], viewed: set[int]) -> None:
        global _current, _hooked
        index = {id(v): i for i, v in enumerate(views)}
        self.views = views
        self.homes: list[tuple[torch.nn.Module, str, int, str]] = []
        self._entries: set[tuple[int, str]] = set()  # (id of a module's _buffers, name): where views belong
        places: dict[int, int] = {}
        for prefix, m in model.named_modules(remove_duplicate=False):
            for name, b in m._buffers.items():
                i = index.get(id(b)) if b is not None else None
                if i is None or (id(m._buffers), name) in self._entries:
                    continue
                self._entries.add((id(m._buffers), name))
                places[i] = places.get(i, 0) + 1
                if name not in m._non_persistent_buffers_set:
                    self.homes.append((m, name, i, f"{prefix}.{name}" if prefix else name))
        # held by more than their one home: known now (viewed, or the buffer of several modules), and
        # the rest looked up once, the first time a buffer is assigned (see _held_elsewhere)
        self._shared = set(viewed) | {i for i, n in places.items() if n > 1}
        self._looked = False
        self.assigned = False
        _current = self
        if not _hooked and self.homes:
            _module_hooks.register_module_buffer_registration_hook(_on_assign)
            _hooked = True

    def put_back(self) -> None:
        """After a forward that assigned a buffer: each persistent one no longer its view, into its view."""
        self.assigned = False
        for m, name, i, qualified in self.homes:
            view = self.views[i]
            now = m._buffers.get(name)
            if now is view or name in m._non_persistent_buffers_set:  # (made non-persistent since)
                continue
            fits = (isinstance(now, torch.Tensor) and now.shape == view.shape and now.dtype == view.dtype
                    and now.device == view.device)
            if fits and not self._held_elsewhere(i):
                with torch.no_grad():
                    view.copy_(now)
                m._buffers[name] = view
                continue
            m._buffers[name] = view
            if not fits:
                was = f"{tuple(view.shape)}/{view.dtype}/{view.device}"
                new = (f"{tuple(now.shape)}/{now.dtype}/{now.device}" if isinstance(now, torch.Tensor)
                       else type(now).__name__)
                raise RuntimeError(
                    f"the forward replaced buffer {qualified} ({was}) with {new}. dpool keeps each buffer at a "
                    "fixed size in shared memory, and the master's copy, which state_dict() saves, cannot "
                    "follow a new shape, dtype or device made in a replica. Keep its shape and dtype (assign a "
                    "tensor like it, or update it in place), or register it with persistent=False if it is a "
                    "cache the forward may rebuild at another size: each worker then keeps its own."
                )
            raise RuntimeError(
                f"the forward assigned buffer {qualified} a new tensor while the model still holds the old one "
                "elsewhere (another module's buffer, an attribute, a container, or a view of it). In one "
                "process the two would part; dpool keeps the buffer at one place in shared memory and cannot "
                "part them. Update the buffer in place (copy_, mul_, add_) or drop the other reference."
            )

    def _held_elsewhere(self, i: int) -> bool:
        """Whether anything but its home holds buffer ``i``'s view (looked up once: a scan of the heap)."""
        if not self._looked:
            self._looked = True
            targets = tuple(self.views)
            index = {id(v): j for j, v in enumerate(targets)}
            mine = {id(self.views), id(targets), id(sys._getframe()), id(sys._getframe(1))}
            for holder in gc.get_referrers(*targets):
                if id(holder) in mine:
                    continue
                if isinstance(holder, dict):  # a module's _buffers (where views belong), or an attribute dict
                    held = [(k, v) for k, v in holder.items() if id(v) in index]
                else:
                    held = [(None, v) for v in gc.get_referents(holder) if id(v) in index]
                for key, v in held:
                    j = index[id(v)]
                    if v is targets[j] and (id(holder), key) not in self._entries:
                        self._shared.add(j)
        return i in self._shared
