"""The CUDA transport: coordinator-owned GPU buffers that workers map over CUDA IPC.

This is the GPU counterpart of :mod:`dpool.transport.shm` (see ``docs/design.md``, "CUDA workers", and
``NOTE [ CUDA ownership ]`` below). An :class:`Arena` stands in for a shared-memory
:class:`~dpool.transport.shm.Segment` wherever a worker runs on a GPU: the master's parameter
arena, each worker's state (gradient slots, private buffers) and its growable
in/out/gout/gin/sparse regions.

NOTE [ CUDA ownership ]
-----------------------
* **The coordinator allocates and exports every buffer that crosses a process
  boundary; workers only import.** CUDA requires an exporter to outlive its
  importers. The coordinator outlives its workers by construction (they exit
  the moment it dies), so a worker that dies, hangs or hits a device-side
  assert can never free memory the coordinator still uses.
* **Once, not per step.** An arena is exported once per consuming process and
  imported once by it (``cudaIpcOpenMemHandle`` can take hundreds of ms). The
  counters in :data:`STATS` prove it; the GPU tests read them.
* **Release is explicit.** Every export carries one slot of torch's IPC
  reference counters, which the consumer would decrement when it frees the
  storage. A worker the coordinator spawned never frees an import (it keeps
  each one until it exits with ``os._exit``), so the coordinator releases that
  consumer's slots itself, exactly once, after the process is reaped
  (:func:`release`), then ``torch.cuda.ipc_collect()`` returns the memory. A
  ``dpool-workers`` worker outlives its clients instead: at the end of a session
  it frees its imports (:func:`drop_imports`, which decrements the slots) and
  only then reports ``serve_done`` to the client, which waits for that before it
  frees its arenas; the client releases the slots only of a worker that died
  first. A slot is never released twice (torch without pytorch#172060 would pin
  the block forever).
* **One-way waits.** Before each request the coordinator records an
  interprocess event on each of its GPUs' current streams (exported once, in
  ``init``); a worker's stream waits on it before it touches coordinator memory,
  with no host wait on either side. A worker synchronises its stream before it
  replies. The coordinator never waits on a worker's GPU work, so a dead or hung
  worker cannot wedge the trainer's CUDA streams.
* **Replies that do not wait (``DPOOL_CUDA_ASYNC_REPLIES=1``; off by default, and
  not yet run on a GPU).** The coordinator also exports one interprocess event per
  worker process (in ``init``). The worker records it on its stream once it has
  queued a forward's or a fetch's kernels, and replies at once; when the reply
  comes, the coordinator's current stream on each of its GPUs waits on it (no host
  wait), before anything reads what the worker wrote. Every other reply still
  waits for the worker's stream: a backward's reply is the step's end, where a
  CUDA error of the step's kernels (the forward's included) surfaces, typed,
  before its gradients can reach the master's optimizer. Who may write what, then:

  - ``in``, ``gout`` and the parameters (the coordinator writes, the worker
    reads): the coordinator's next write to them is queued on its stream after
    the wait on the reply of the request that read them.
  - ``out``, ``gin``, the gradient and buffer slots (the worker writes, the
    coordinator reads): the worker's next write is queued after its stream waited
    on the request event, which the coordinator records after it queued its reads.
  - A grown region: the one it replaces goes back to the coordinator's caching
    allocator when the next request is built, after the wait on the reply of
    every request that used it, so its reuse is ordered after their kernels.
  - A restart: the replacement gets an event of its own. What a wait queued on a
    dead worker's last record does is not known yet; that needs a GPU.

  So the coordinator's streams do wait on a worker's GPU work in this mode: a
  kernel that never ends in a worker would stall them (the heartbeat still ends
  that worker). This is why it is opt-in until it has run on a GPU.
* Each worker sees only its own GPU (``CUDA_VISIBLE_DEVICES``, translated through
  the coordinator's own setting by :func:`dpool.launch.visible_device`): export
  tuples name device 0 there.
"""
from __future__ import annotations

import gc
import os
from typing import Any

import torch

from .base import Views, standalone

__all__ = ["Arena", "Imported", "STATS", "release", "drop_imports", "standalone"]

# Counts of this process's IPC work: exports (coordinator), imports (worker), releases (coordinator).
STATS = {"exports": 0, "imports": 0, "releases": 0}

# Worker side: every imported storage lives until the process exits (see NOTE [ CUDA ownership ]).
_KEEP: list[Any] = []


def _expandable() -> bool:
    conf = (os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")).replace(" ", "")
    return "expandable_segments:True" in conf or "expandable_segments:true" in conf


def _allocate(size: int, device: torch.device) -> torch.Tensor:
    """``size`` zeroed bytes on ``device``, never from an expandable segment (those cannot be shared safely)."""
    if not _expandable():
        return torch.zeros(size, dtype=torch.uint8, device=device)
    settings = torch.cuda.memory._set_allocator_settings
    settings("expandable_segments:False")
    try:
        return torch.zeros(size, dtype=torch.uint8, device=device)
    finally:
        settings("expandable_segments:True")


class Arena:
    """A coordinator-owned GPU buffer, exported to worker processes over CUDA IPC.

    It has :class:`~dpool.transport.shm.Segment`'s interface (``name``, ``size``, ``u8``, ``views``,
    ``ref()``), so the runtime places tensors in it the same way.

    Args:
        name: unique name (workers cache their import by it).
        size: bytes.
        device: the GPU, as the coordinator names it.
        owner: the worker (a ``dpool.launch.Worker``) that maps it, or ``None`` for the master arena,
            which :meth:`ref` exports to each consumer named.
    """

    is_cuda = True
    fd = None
    linked = False

    def __init__(self, name: str, size: int, device: torch.device, owner: Any = None) -> None:
        self.name = name
        self.size = size
        self.device = device
        self.owner = owner
        self.u8 = _allocate(size, device)
        self.views = Views(self.u8)
        self._refs: dict[bytes, list] = {}

    def standalone(self, offset: int, dtype: torch.dtype, shape: list[int] | tuple[int, ...],
                   strides: list[int] | None = None) -> torch.Tensor:
        return standalone(storage=self.u8.untyped_storage(), device=self.device, offset=offset, dtype=dtype,
                          shape=shape, strides=strides)

    def ref(self, consumer: Any = None) -> list:
        """``[name, size, export]`` for ``consumer`` (default: the owner): exported once per consumer process."""
        w = consumer if consumer is not None else self.owner
        ref = self._refs.get(w.ident)
        if ref is None:
            dev, handle, size, offset, rc, rc_offset, event, event_sync = self.u8.untyped_storage()._share_cuda_()
            STATS["exports"] += 1
            w.exports.append((rc, rc_offset))  # released by the pool once that process is reaped
            ref = self._refs[w.ident] = [self.name, self.size, [handle, size, offset, rc, rc_offset, event, event_sync]]
        return ref

    def unlink(self) -> None:  # nothing named in /dev/shm
        pass

    def close_fd(self) -> None:
        pass


class Imported:
    """A worker's mapping of a coordinator :class:`Arena` (imported once, kept until the worker exits)."""

    __slots__ = ("name", "size", "u8", "views", "storage", "device")

    def __init__(self, ref: list) -> None:
        name, size, (handle, storage_size, offset, rc, rc_offset, event, event_sync) = ref
        self.name, self.size = name, size
        self.device = torch.device("cuda", 0)  # each worker sees only its own GPU
        torch.cuda._lazy_init()
        self.storage = torch.UntypedStorage._new_shared_cuda(0, handle, storage_size, offset, rc, rc_offset,
                                                             event, event_sync)
        STATS["imports"] += 1
        _KEEP.append(self.storage)
        self.u8 = torch.empty(0, dtype=torch.uint8, device=self.device).set_(self.storage, 0, (size,), (1,))
        self.views = Views(self.u8)

    def standalone(self, offset: int, dtype: torch.dtype, shape: list[int] | tuple[int, ...],
                   strides: list[int] | None = None) -> torch.Tensor:
        return standalone(storage=self.storage, device=self.device, offset=offset, dtype=dtype, shape=shape,
                          strides=strides)


def drop_imports() -> None:
    """A ``dpool-workers`` worker between clients: give back every import of the client that left.

    Called once the session's replica is gone. Freeing an imported storage closes its IPC mapping and
    decrements the client's counter slot (torch's consumer-side deleter), so the client, which waits
    for the worker's ``serve_done`` before it frees its arenas, releases nothing itself.
    """
    if not _KEEP:
        return
    torch.cuda.synchronize()  # nothing of ours still reads or writes the client's memory
    _KEEP.clear()
    gc.collect()
    torch.cuda.empty_cache()


def release(exports: list) -> None:
    """Give back the IPC reference-counter slots of a consumer that is gone (reaped), each once."""
    while exports:
        rc, rc_offset = exports.pop()
        try:
            torch.UntypedStorage._release_ipc_counter_cuda(rc, rc_offset)
            STATS["releases"] += 1
        except Exception:  # pragma: no cover - interpreter teardown, CUDA gone
            pass
    try:
        torch.cuda.ipc_collect()  # frees blocks whose last consumer was just released
    except Exception:  # pragma: no cover
        pass
