"""Cross-node overlap, worker side: report each gradient bucket as soon as all its parameters have a gradient.

In cross-node mode with overlap (``Init.options["buckets"]``) the coordinator starts a bucket's exchange
with the other nodes while the rest of the backward runs. The parameters' slot hooks tell the reporter
each gradient as it lands (:meth:`BucketReporter.landed`); a bucket whose last parameter landed is
reported at once (``bucket_ready``). A gradient that grows after its bucket was reported (a parameter
used twice) marks the reply ``late``, and the coordinator then sums that bucket again after the round.

Torch-free: it only counts.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from dpool import protocol as P

__all__ = ["BucketReporter"]


class BucketReporter:
    """Counts, per bucket, the parameters still to get a gradient in the backward being reported.

    Args:
        buckets: each bucket's parameter indices.
        n_params: how many parameters the replica has.
    """

    __slots__ = ("_of", "_sizes", "_left", "_reported", "_fresh", "call", "late")

    def __init__(self, buckets: Sequence[Sequence[int]], n_params: int) -> None:
        self._of: list[tuple[int, ...]] = [() for _ in range(n_params)]  # per parameter: the buckets it lies in
        for b, members in enumerate(buckets):
            for i in members:
                self._of[i] += (b,)
        self._sizes = [len(m) for m in buckets]
        self._left: list[int] = []  # per bucket: parameters still to come in the current backward
        self._reported = bytearray(len(buckets))
        self._fresh = bytearray(n_params)  # per parameter: landed in the current backward
        self.call = -1  # the call whose buckets are reported (-1: none)
        self.late = False

    def __bool__(self) -> bool:
        return bool(self._sizes)

    def start(self, call: int, requires_grad: Sequence[bool]) -> None:
        """Report the buckets of ``call``'s backward; a parameter that does not require grad gets no gradient."""
        self.call, self.late = call, False
        self._fresh = bytearray(len(self._of))
        self._reported = bytearray(len(self._sizes))
        self._left = list(self._sizes)
        for i, flag in enumerate(requires_grad):
            if not flag:
                for b in self._of[i]:
                    self._left[b] -= 1

    def stop(self) -> None:
        self.call = -1

    def landed(self, i: int, notify: Callable[[Any], None] | None) -> None:
        """Parameter ``i``'s gradient reached its slot: report the buckets it completed."""
        if self.call < 0:
            return
        if self._fresh[i]:
            if any(self._reported[b] for b in self._of[i]):
                self.late = True  # its bucket left with an earlier value
            return
        self._fresh[i] = 1
        for b in self._of[i]:
            self._left[b] -= 1
            if self._left[b] == 0:
                self._reported[b] = 1
                assert notify is not None
                notify(P.BucketReady(call=self.call, bucket=b))
