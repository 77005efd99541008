"""The parts a step's stages share, in one frozen object.

Each stage of :mod:`dpool.step` is made from a :class:`StepParts` and the stages it calls, and keeps the
parts it uses; no stage gets the :class:`~dpool.step.runtime.Runtime` (a runtime in no cycle goes with its
last reference).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..accumulate import HeldGradients
from ..bridge import Graphs
from ..config import Config
from ..pool import Pool
from ..regions import IORegions
from ..replicate import Master
from ..scatter import Balancer
from ..stats import Stats
from .follow import Notices
from .state import Setup, StepState

__all__ = ["StepParts"]


@dataclass(frozen=True, slots=True)
class StepParts:
    """What a runtime's stages share (each is made once, with the runtime).

    Args:
        setup: what the runtime was made with.
        state: the step's state, changed only through its methods.
        pool: the worker processes and their rounds.
        io: each worker's input and output segments.
        graphs: the calls whose graphs the workers keep.
        stats: what the steps measured.
        master: the master module, bound to shared memory.
        config: limits and timeouts.
        balancer: each worker's share of a batch.
        notices: warnings said once.
        held: what the loop did to gradients the workers hold (``no_sync()``).
    """

    setup: Setup
    state: StepState
    pool: Pool
    io: IORegions
    graphs: Graphs
    stats: Stats
    master: Master
    config: Config
    balancer: Balancer
    notices: Notices
    held: HeldGradients
