"""Each worker's I/O segments, and which input regions must outlive a call.

A worker has one growable segment per role: ``in`` (input shards, and targets
for a loss on the workers), ``out`` (its outputs), ``gout`` (gradients of its
outputs), ``gin`` (gradients of its inputs) and ``sparse`` (sparse parameter
gradients). A segment is allocated once and replaced by a larger one (at least
twice the size, a power of two) when a larger batch arrives.

Inputs are different: a graph kept on a worker may have saved its input
tensors, which are views of ``in``. So each call's input span is recorded
(:meth:`IORegions.keep`) until the call's graph is released, and new inputs
go to the first gap of the current ``in`` segment that no kept span covers
and that holds them (first fit from its start); when none does, a new segment
is made and the old one lives as long as the spans in it. (Placing them after
every kept span instead grew the segment without end where each step's
inputs are placed while the previous step's are still kept, as with the loss
on the workers: the frontier only moved on, and each time it reached the end
the segment was replaced by one twice as large.)

A worker maps a segment by its name when a request first names it, and the
coordinator unlinks every name after each request. So a segment made while the
messages of a round were built, when building failed before the round was sent,
could never be mapped: the next round would name it after its unlink (the
worker: "No such file or directory", at every call). :meth:`IORegions.rollback`
puts back the segments each role had before; :meth:`IORegions.commit` (at the
send) keeps the new ones. Likewise a worker whose request failed may have failed
before mapping the names it was given: the coordinator resets its segments
(:meth:`IORegions.reset`, from ``Runtime._raise_failures``), and it gets new ones next time.
"""
from __future__ import annotations

from typing import Any, Callable, Hashable

__all__ = ["IORegions", "MIN_IO", "ROLES"]

MIN_IO = 1 << 20
ROLES = ("in", "out", "gout", "gin", "sparse")

Span = tuple[Any, int, int]  # (segment, start, end)
NewSegment = Callable[[int, int], Any]  # (worker, bytes) → a new segment on that worker's device


def _grown(need: int, old: Any) -> int:
    return max(need, MIN_IO, 2 * old.size if old is not None else 0)


class IORegions:
    """The I/O segments of ``n`` workers.

    Args:
        n: number of workers.
        new_segment: makes a segment of at least the given size for a worker (the pool's allocator).
    """

    def __init__(self, n: int, new_segment: NewSegment) -> None:
        self._new = new_segment
        self._segs: list[dict[str, Any]] = [dict.fromkeys(ROLES) for _ in range(n)]
        self._kept: list[dict[Hashable, Span]] = [{} for _ in range(n)]
        self._made: list[tuple[int, str, Any]] = []  # (worker, role, the segment it replaced) since commit()

    def segment(self, w: int, role: str) -> Any:
        """Worker ``w``'s current segment for ``role`` (``None`` before its first use)."""
        return self._segs[w][role]

    def ensure(self, w: int, role: str, need: int) -> Any:
        """Worker ``w``'s segment for ``role``, replaced by a larger one if it holds fewer than ``need`` bytes."""
        seg = self._segs[w][role]
        if seg is None or seg.size < need:
            seg = self._replace(w, role, need)
        return seg

    def _replace(self, w: int, role: str, need: int) -> Any:
        """A new, larger segment for worker ``w``'s ``role``, journaled until :meth:`commit`."""
        old = self._segs[w][role]
        seg = self._segs[w][role] = self._new(w, _grown(need, old))
        self._made.append((w, role, old))
        return seg

    def commit(self) -> None:
        """The segments made since the last commit are named in a round being sent: keep them."""
        if self._made:
            self._made.clear()

    def rollback(self) -> None:
        """Building a round failed before it was sent: each role gets back the segment it had before (the
        new ones were never named to a worker, and their names are unlinked after the next request)."""
        for w, role, old in reversed(self._made):
            self._segs[w][role] = old
        self._made.clear()

    def _input_start(self, w: int, need: int) -> tuple[Any, int]:
        """Worker ``w``'s ``in`` segment and the start of its first gap between kept spans that holds ``need``
        bytes (or the end of the last span: then they may not fit)."""
        seg = self._segs[w]["in"]
        start = 0
        for a, b in sorted((a, b) for s, a, b in self._kept[w].values() if s is seg):
            if start + need <= a:
                break
            start = max(start, b)
        return seg, start

    def input_growth(self, w: int, need: int) -> int:
        """Bytes of the new segment :meth:`input_region` would create for ``need`` bytes (0 if they fit)."""
        seg, start = self._input_start(w, need)
        if seg is not None and start + need <= seg.size:
            return 0
        return 1 << (_grown(need, seg) - 1).bit_length()

    def input_region(self, w: int, need: int) -> tuple[Any, int]:
        """Where ``need`` bytes of new inputs go for worker ``w``: ``(segment, start)``, in the first gap between
        the kept spans that holds them."""
        seg, start = self._input_start(w, need)
        if seg is None or start + need > seg.size:
            seg, start = self._replace(w, "in", need), 0
        return seg, start

    def keep(self, w: int, key: Hashable, span: Span) -> None:
        """Keep worker ``w``'s input ``span`` until :meth:`release` of the call ``key`` names (its first item)."""
        self._kept[w][key] = span

    def kept(self, w: int, key: Hashable) -> Span | None:
        return self._kept[w].get(key)

    def release(self, call: int) -> None:
        """Forget the spans of ``call`` (keys ``call`` and ``(call, ...)``) on every worker."""
        for kept in self._kept:
            for key in [k for k in kept if k == call or (isinstance(k, tuple) and k[0] == call)]:
                del kept[key]

    def reset(self, w: int) -> None:
        """Worker ``w`` was replaced, or its request failed: new segments for it from now on. Its spans are
        forgotten too (the old segments, where its graphs' inputs live, are not reused)."""
        self._segs[w] = dict.fromkeys(ROLES)
        self._kept[w] = {}
        self._made = [m for m in self._made if m[0] != w]

    def clear(self) -> None:
        """Drop every reference to shared memory (at close)."""
        self._segs = []
        self._kept = []
        self._made = []
