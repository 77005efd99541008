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
from dataclasses import dataclass

from typing import Any, Sequence

import torch

from ..config import Config
from ..crossnode import CrossNode
from ..progress import Progress

__all__ = ["Options", "Setup", "SlotGen", "StepState"]


@dataclass(frozen=True, kw_only=True)
class Options:
    """What a runtime is started with besides its module, as :func:`dpool.wrap` resolved it (a model joins a
    live pool only if it was started with equal options).

    Args:
        devices: one device string per worker.
        dim: the scatter and gather dimension.
        config: limits and timeouts.
        worker_threads: torch threads per worker.
        max_restarts, buffers, shard_weights, balance, gather, attach: as :func:`dpool.wrap`'s (``attach``:
            its ``pool``).
        output_device: where outputs are gathered.
    """

    devices: list[str]
    dim: int
    config: Config
    worker_threads: int
    max_restarts: int = 0
    buffers: str = "first"
    shard_weights: Sequence[float] | None = None
    balance: str | None = None
    gather: bool = True
    attach: str | None = None
    output_device: str | None = None


class Setup:
    """What a runtime was made with, fixed for its life.

    Args:
        module: the master module (on ``devices[0]``).
        options: what it was started with.
        nodes: cross-node mode's view of the other nodes, or ``None``.
    """

    __slots__ = ("module", "devices", "n", "dim", "device", "cuda", "output_device", "buffer_policy",
                 "gather_outputs", "nodes")

    def __init__(self, module: torch.nn.Module, options: Options, nodes: CrossNode | None) -> None:
        self.module = module
        self.devices = list(options.devices)
        self.n = len(self.devices)
        self.dim = options.dim
        self.device = torch.device(self.devices[0])
        self.cuda = self.device.type == "cuda"
        out = options.output_device
        self.output_device = torch.device(out) if out is not None else self.device
        self.buffer_policy = options.buffers
        self.gather_outputs = options.gather
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
    """The state a step's stages share (see the module's invariants). Its fields are read anywhere and
    changed only through its methods, each a named transition."""

    def __init__(self, out_dtype: torch.dtype, max_restarts: int) -> None:
        self.slots = SlotGen()
        self.progress = Progress()  # the step counter (the pool and the nodes read it)
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
        self.pending: Any = None  # a forward waiting for its loss (dpool.step.forward.Pending)
        self.restarting: list[int] | None = None  # workers whose restart a Ctrl-C cut short
        self.restarts_left = max_restarts
        self.closed = False
        self._rng_key = b""  # the digest of the script's generator state at the latest forward
        self._rng_count = 0  # forwards since that state was first seen

    # ------------------------------------------------------------------ a forward
    def begin_forward(self, rows: list[int] | None) -> int:
        """A forward of shards of ``rows`` begins: the next step, whose number is returned."""
        self.last_rows = rows
        self.progress.step += 1
        return self.progress.step

    def begin_across(self) -> int:
        """A training forward takes part in the nodes' collectives: its number among them."""
        self.progress.fseq += 1
        return self.progress.fseq

    def kept_outputs(self, dtype: torch.dtype, shapes: list, rows: list[int]) -> None:
        """A forward kept its outputs on the workers: what the loss of a deferred one predicts from."""
        self.last_out = (dtype, shapes, rows)

    # ------------------------------------------------------------------ the forward held for its loss
    def defer(self, pending: Any) -> None:
        """``pending`` waits for its loss (at most one does)."""
        self.pending = pending

    def take_pending(self) -> Any:
        """The held forward, now on its way to the workers (it is no longer pending)."""
        pending, self.pending = self.pending, None
        return pending

    def drop_pending(self, f: Any = None) -> None:
        """Forget the held forward (only if it is the forward ``f``, when given): it never runs."""
        if f is None or (self.pending is not None and self.pending.f is f):
            self.pending = None

    # ------------------------------------------------------------------ restarts
    def begin_restart(self, dead: list[int], cost: int) -> None:
        """Restarting the workers ``dead`` (a Ctrl-C from here on leaves it to the next call), for ``cost``
        of the restarts left."""
        self.restarting = dead
        self.restarts_left -= cost

    def end_restart(self) -> None:
        """Nothing is left of a restart to finish (it finished, or the pool broke)."""
        self.restarting = None

    def forget_sent(self) -> None:
        """New worker processes have torch's default settings: send ours again."""
        self.sent_flags = None
        self.sent_numerics = None

    # ------------------------------------------------------------------ what the workers were given
    def sent_requires_grad_flags(self, flags: bytes) -> None:
        """The workers have the parameters' ``requires_grad`` ``flags`` (their slots change: see ``slots``)."""
        self.slots.bump("requires_grad changed")
        self.sent_requires_grad = flags

    def sent_numerics_values(self, values: tuple) -> None:
        self.sent_numerics = values

    def sent_backend_flags(self, flags: tuple) -> None:
        self.sent_flags = flags

    # ------------------------------------------------------------------ no_sync() and held gradients
    def set_no_sync(self, value: bool) -> None:
        self.no_sync = value

    def hold(self) -> None:
        """The workers now hold ``no_sync()`` gradients."""
        self.workers_hold = True

    def release(self) -> None:
        """The workers' held gradients were taken into a synchronized backward."""
        self.workers_hold = False

    def close(self) -> None:
        """Every step of the runtime's close ran."""
        self.closed = True

    def draw_seed(self) -> int:
        """A forward's seed, derived without drawing from the script's generator (a draw would change what a
        shuffled ``DataLoader`` yields, compared with the same script without dpool): a digest of the
        generator's state and of how many forwards saw that state before. ``torch.manual_seed(s)`` makes a
        run reproducible, embedded or attached, and a forward after the script drew anything gets new
        numbers. Each shard seeds its own stream from it (as replicas on several GPUs draw their own), so the
        numbers differ from a single process's."""
        generator = torch.default_generator.get_state()  # (read as bytes without numpy, which dpool does without)
        key = hashlib.blake2b(ctypes.string_at(generator.data_ptr(), generator.numel()), digest_size=8).digest()
        if key == self._rng_key:
            self._rng_count += 1
        else:
            self._rng_key, self._rng_count = key, 0
        seed = hashlib.blake2b(self._rng_count.to_bytes(8, "little"), digest_size=8, key=key).digest()
        return int.from_bytes(seed, "little") >> 2  # (below 2**62: a msgpack int)
