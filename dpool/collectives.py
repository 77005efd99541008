"""The coordinator's hub for collectives among the shards of one round (SyncBatchNorm's all-reduce).

A worker inside a collective sends ``allreduce(seq, float64 bytes)`` and blocks
until ``allreduce_done``. The hub sums the parts once every shard of the
round has sent its own (in cross-node mode, also summed with the other nodes'
totals through ``across``), and answers each. If any shard fails, every worker
blocked in a collective of the round is released with ``abort``, so no
worker waits for a part that will never come. The same happens when the round
is abandoned (Ctrl-C, a worker's death; :meth:`dpool.pool.Pool.request`), and
a part that arrives later for an abandoned request is answered with ``abort``
at once (``Pool._take``: the part names its request).
"""
from __future__ import annotations

from typing import Callable

import torch

from . import protocol as P
from .tensors import from_bytes, to_bytes

__all__ = ["AllReduceHub"]

Reply = Callable[[int, P.Message], None]  # (worker index, message): sends without blocking, never raises


class AllReduceHub:
    """Sums the parts of each all-reduce of one round of requests."""

    def __init__(self) -> None:
        # Cross-node mode: sums the node's total with the other nodes' in place (dpool.crossnode).
        self.across: Callable[[torch.Tensor], None] | None = None
        self._members = 0
        self._aborted = False
        self._parts: dict[int, dict[int, bytes]] = {}

    def begin(self, members: int) -> None:
        """A new round with ``members`` shards."""
        self._members = members
        self._aborted = False
        self._parts = {}

    def offer(self, idx: int, msg: P.AllReduce, reply: Reply) -> None:
        """Worker ``idx``'s part; answers every part once the last one arrives."""
        if self._aborted:
            reply(idx, P.AllReduceDone(seq=msg.seq, data=b"", abort=True))
            return
        parts = self._parts.setdefault(msg.seq, {})
        parts[idx] = msg.data
        if len(parts) < self._members:
            return
        del self._parts[msg.seq]
        sizes = {len(d) for d in parts.values()}
        if len(sizes) != 1 or next(iter(sizes)) % 8:  # shards disagree on what they reduce: nobody gets a sum
            self._parts[msg.seq] = parts
            self.abort(reply)
            return
        total = torch.zeros(next(iter(sizes)) // 8, dtype=torch.float64)
        for d in parts.values():
            total += from_bytes(d, torch.float64)
        if self.across is not None:
            self.across(total)
        data = to_bytes(total)
        for w in parts:
            reply(w, P.AllReduceDone(seq=msg.seq, data=data, abort=False))

    def abort(self, reply: Reply) -> None:
        """A shard failed: release every worker blocked in a collective of this round."""
        self._aborted = True
        for seq, parts in self._parts.items():
            for w in parts:
                reply(w, P.AllReduceDone(seq=seq, data=b"", abort=True))
        self._parts.clear()
