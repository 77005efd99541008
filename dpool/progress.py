"""How far training has come: one counter that the step advances, and the pool and the nodes read.

:class:`dpool.step.state.StepState` owns it and is the only writer; :class:`dpool.pool.Pool` and
:class:`dpool.crossnode.CrossNode` read it, so that their messages and errors name the step the user's
script is at.
"""
from __future__ import annotations

__all__ = ["Progress"]


class Progress:
    """``step``: forwards so far (the step a message or an error names). ``fseq``: the training forwards that
    took part in the nodes' collectives (in cross-node mode, a backward's header names its forward by it)."""

    __slots__ = ("step", "fseq")

    def __init__(self) -> None:
        self.step = 0
        self.fseq = 0
