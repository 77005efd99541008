"""How tensors cross a process boundary: one transport per device type.

The coordinator owns every region; workers only map them (the ownership rules are in
:mod:`dpool.transport.shm` for CPU memory and ``NOTE [ CUDA ownership ]`` in
:mod:`dpool.transport.cuda_ipc` for GPU memory). Everything above this package treats both
alike, through two shapes:

* **Region** (coordinator side, from :func:`new_region`): ``name``, ``size``, ``u8`` (its bytes),
  ``views`` (cached :class:`~dpool.transport.base.Views`), ``standalone(offset, dtype, shape,
  strides)`` (a tensor with its own version counter), ``ref(consumer)`` (what a worker needs to
  map it, sent in messages), ``unlink()`` and ``close_fd()``.
* **Mapping** (worker side, from :func:`attach`): ``name``, ``size``, ``u8``, ``views`` and
  ``standalone(...)``.

A new device type is one module with those two classes and one entry in :data:`TRANSPORTS`.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from . import cuda_ipc, shm
from .base import ALIGN, Views, align, tensor_view

__all__ = ["Transport", "TRANSPORTS", "new_region", "attach", "ALIGN", "align", "Views", "tensor_view"]


class Transport(NamedTuple):
    """One device type's way to share memory with workers."""

    region: Callable[..., Any]
    """``region(directory, name, size, device=, owner=, keep_fd=)``: a coordinator-owned region."""
    attach: Callable[[str, list], Any]
    """``attach(directory, ref)``: a worker's mapping of a region from its ``ref``."""
    ref_len: int
    """How many entries this transport's refs have (how :func:`attach` tells them apart)."""


def _shm_region(directory: str, name: str, size: int, *, device: torch.device, owner: Any, keep_fd: bool) -> Any:
    return shm.Segment(directory, name, size, keep_fd=keep_fd)


def _cuda_region(directory: str, name: str, size: int, *, device: torch.device, owner: Any, keep_fd: bool) -> Any:
    return cuda_ipc.Arena(name, size, device, owner)


TRANSPORTS: dict[str, Transport] = {
    "cpu": Transport(_shm_region, lambda directory, ref: shm.Mapped(directory, ref[0], ref[1]), 2),
    "cuda": Transport(_cuda_region, lambda directory, ref: cuda_ipc.Imported(ref), 3),
}
_BY_REF_LEN = {t.ref_len: t for t in TRANSPORTS.values()}


def new_region(device: torch.device, directory: str, name: str, size: int, owner: Any = None,
               keep_fd: bool = False) -> Any:
    """A region of ``size`` bytes on ``device``, shared with workers by its device type's transport.

    Args:
        device: where the bytes live.
        directory: the shared-memory directory (CPU regions).
        name: the region's name, unique for the pool's life (workers cache mappings by name).
        size: bytes.
        owner: on a GPU, the worker the region is exported to (``None``: each worker ``ref`` names).
        keep_fd: CPU only: keep a file descriptor so that a spawned worker can inherit it.
    """
    return TRANSPORTS[device.type].region(directory, name, size, device=device, owner=owner, keep_fd=keep_fd)


def attach(directory: str, ref: list, current: Any = None) -> Any:
    """Map the region ``ref`` in a worker, reusing ``current`` if it is the same one."""
    name = ref[0]
    if current is not None and current.name == (f"fd:{name}" if isinstance(name, int) else name):
        return current
    return _BY_REF_LEN[len(ref)].attach(directory, ref)
