"""The step's cross-cutting state: what the stages of a step share between calls, in one object.

No I/O here: the stages read and change this state, and talk to the workers themselves.

Invariants:

* ``slots`` (:class:`SlotGen`) moves whenever the workers' gradient slots may be written: a backward
  round (a criterion's speculative backward included), a restart, a re-sync, a change of which
  parameters require grad, and any function run on the replicas. A speculative backward's result is
  used only under the token it was made with (:meth:`SlotGen.valid`).
* ``workers_hold``: the workers may hold ``no_sync()`` gradients (a backward with hold ran since the last
  synchronized one). While it is set the model cannot be re-synced and no parameter may be frozen.
* ``sent_*``: what the workers were last given; ``None`` (or empty) means unknown, so it is sent again
  (after a restart, a new worker has torch's defaults).
* ``pending``: at most one forward waits for its loss (:mod:`dpool.step.deferred`); every call other than
  its criterion runs it first.
"""
from __future__ import annotations

import ctypes
import hashlib

from typing import Any, Sequence

import torch

from ..crossnode import CrossNode

__all__ = ["Setup", "SlotGen", "StepState"]


class Setup:
    """What a runtime was made with, fixed for its life.

    Args:
        module: the master module (on ``devices[0]``).
        devices: one device string per worker.
        dim: the scatter and gather dimension.
        buffer_policy: ``buffers=`` of :func:`dpool.wrap`.
        gather_outputs: ``gather=`` of :func:`dpool.wrap`.
        output_device: where outputs are gathered (``None``: the master's device).
        nodes: cross-node mode's view of the other nodes, or ``None``.
    """

    __slots__ = ("module", "devices", "n", "dim", "device", "cuda", "output_device", "buffer_policy",
                 "gather_outputs", "nodes")

    def __init__(self, module: torch.nn.Module, devices: Sequence[str], dim: int, buffer_policy: str,
                 gather_outputs: bool, output_device: str | None, nodes: CrossNode | None) -> None:
        self.module = module
        self.devices = list(devices)
        self.n = len(self.devices)
        self.dim = dim
        self.device = torch.device(self.devices[0])
        self.cuda = self.device.type == "cuda"
        self.output_device = torch.device(output_device) if output_device is not None else self.device
        self.buffer_policy = buffer_policy
        self.gather_outputs = gather_outputs
        self.nodes = nodes


class SlotGen:
    """The generation of the workers' gradient slots: bumped whenever they may be written."""

    __slots__ = ("_gen", "reason")

    def __init__(self) -> None:
        self._gen = 0
        self.reason = ""  # why it moved last (for debugging)

    def bump(self, reason: str) -> None:
        self._gen += 1
        self.reason = reason

    def token(self) -> int:
        """The current generation: a result made now is valid while :meth:`valid` says so."""
        return self._gen

    def valid(self, token: int) -> bool:
        return token == self._gen


class StepState:
    """The state a step's stages share (see the module's invariants)."""

    def __init__(self, out_dtype: torch.dtype) -> None:
        self.slots = SlotGen()
        self.no_sync = False  # inside model.no_sync()
        self.workers_hold = False
        self.sent_requires_grad = b""  # the parameters' requires_grad flags the workers have
        self.sent_flags: tuple | None = None  # the GPU numerics settings the workers have (cuDNN, cuBLAS)
        # the default dtype, ... (see dpool.numerics): unknown, so sent at the first forward (a daemon's workers
        # may keep an earlier session's; a new worker has torch's defaults, which differ between versions)
        self.sent_numerics: tuple | None = None
        self.last_rows: list[int] | None = None  # shard sizes of the latest forward (for error hints)
        # what a deferred forward's loss predicts from: the latest forward's output dtype, shapes and rows;
        # before the first forward, the output's dtype is taken to be the parameters'
        self.last_out: tuple[torch.dtype, list, list[int]] = (out_dtype, [], [])
        self.pending: Any = None  # a forward waiting for its loss (dpool.step.deferred.Pending)
        self.restarting: list[int] | None = None  # workers whose restart a Ctrl-C cut short
        self.restarts_left = 0
        self.closed = False
        self._rng_key = b""  # the digest of the script's generator state at the latest forward
        self._rng_count = 0  # forwards since that state was first seen

    def draw_seed(self) -> int:
        """A forward's seed, derived without drawing from the script's generator (a draw would change what a
        shuffled ``DataLoader`` yields, compared with the same script without dpool): a digest of the
        generator's state and of how many forwards saw that state before. ``torch.manual_seed(s)`` makes a
        run reproducible, embedded or attached, and a forward after the script drew anything gets new
        numbers. Each shard seeds its own stream from it (as replicas on several GPUs draw their own), so the
        numbers differ from a single process's."""
        state = torch.default_generator.get_state()  # (read as bytes without numpy, which dpool does without)
        key = hashlib.blake2b(ctypes.string_at(state.data_ptr(), state.numel()), digest_size=8).digest()
        if key == self._rng_key:
            self._rng_count += 1
        else:
            self._rng_key, self._rng_count = key, 0
        seed = hashlib.blake2b(self._rng_count.to_bytes(8, "little"), digest_size=8, key=key).digest()
        return int.from_bytes(seed, "little") >> 2  # (below 2**62: a msgpack int)
