"""Gradient reduction: the workers' gradient slots → the master's parameter gradients.

Each worker's backward writes its parameter gradients into its *gradient slot*,
laid out like the master's parameters (:class:`dpool.layout.Layout`): one dense
range per dtype group. Reducing is one sum per group over the shards that ran,
on the master's device (DataParallel's ``reduce_add``), then a view per
parameter in its own memory format. Sparse gradients (``nn.Embedding(sparse=True)``)
are summed as sparse tensors, as DataParallel's reduce does.

:class:`Reducer` is the seam for a reducer that also combines the groups across
nodes (:class:`dpool.crossnode.CrossNodeReducer`, an all-reduce over
``torch.distributed``). It overrides :meth:`Reducer.combine`: given the slots and
the local "used" mask, it returns which groups have a gradient, their totals and
the mask of parameters that have one anywhere, all before any parameter sees a
gradient. Two more hooks let it start work while the workers still run the
backward: :meth:`Reducer.bucket_members` (the buckets the workers report as they
complete) and :meth:`Reducer.begin` (the handler of those reports for one round).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import torch

from .layout import Layout

__all__ = ["Reducer", "Totals", "sum_sparse", "PARALLEL_SUM_BYTES"]

# A CPU sum of at least this many bytes per shard is split over helper threads (see Reducer._sum).
# Below it the hand-off costs more than it saves: the benchmark's mlp (2 MiB) summed slower with
# helpers than without (docs/performance.md).
PARALLEL_SUM_BYTES = 4 << 20

# torch's count of the references to a storage (what torch's own cudagraph trees read); without it
# every step's totals are new memory
_storage_use_count: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)


class Totals:
    """The memory a step's summed gradients are written to, reused once nothing else holds it.

    The master's gradients are views of the totals, and autograd keeps them as ``.grad`` (it takes a
    gradient over when ``.grad`` is ``None``), so a step's totals belong to the user until
    ``zero_grad()`` or the user lets go of them. A buffer is handed out again only when this object
    holds the only reference to its storage; otherwise new memory is made, and kept for later steps
    while fewer than :attr:`keep` buffers of that key are (so at most ``keep`` idle buffers per group stay
    allocated between steps). New memory every step cost the coordinator a page fault per 4 KiB of
    gradients whenever glibc had given the previous step's block back to the kernel (hundreds per step
    on the benchmark's 2 MiB mlp), and on every step for a sum over 32 MiB, which glibc maps anew (a
    ResNet-18 step's sum took about three times as long: docs/performance.md).

    Buffers are kept on the CPU only: on a GPU every take is new memory, as before, since CUDA's caching
    allocator already reuses blocks and knows which streams still use them.
    """

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._held: dict[tuple, list[tuple[torch.Tensor, int]]] = {}  # key -> [(buffer, its idle count)]
        self.made = 0  # buffers made (tests read it)

    def take(self, key: Any, numel: int, dtype: torch.dtype, device: torch.device, pre: int = 0,
             post: int = 0) -> torch.Tensor:
        """A 1-D buffer of ``numel`` elements nobody else holds, with ``pre`` elements of room in front
        of it and ``post`` behind it in the same storage (a cross-node trailer and header)."""
        full = (key, numel, dtype, device, pre, post)
        held = self._held.get(full, ())
        count = _storage_use_count
        if count is not None:
            for t, idle in held:
                if count(t.untyped_storage()._cdata) == idle:
                    return t
        t = torch.empty(pre + numel + post, dtype=dtype, device=device)[pre:pre + numel]
        self.made += 1
        if count is not None and device.type == "cpu" and len(held) < self.keep:
            self._held.setdefault(full, []).append((t, count(t.untyped_storage()._cdata)))
        return t

    def clear(self) -> None:
        self._held.clear()


class Reducer:
    """Sums dense gradient slots, one op per dtype group.

    Args:
        layout: where each parameter's gradient lies in a slot.
        params: the master's parameters (shapes, element sizes).
        strides: each parameter's memory-format strides (``None``: row-major).
        device: where the sum is made and the gradients live (the master's device).
        threads: how many threads a large sum on the CPU may use: the reduce runs after the backward
            round, while the workers wait for the next request, so their cores are free.
    """

    def __init__(self, layout: Layout, params: Sequence[torch.Tensor], strides: Sequence[Sequence[int] | None],
                 device: torch.device, threads: int = 1) -> None:
        self.layout = layout
        self.params = list(params)
        self.strides = list(strides)
        self.device = device
        # Per parameter: its gradient's shape, strides (its memory format) and element offset in its
        # group, so that each gradient is one strided view of the group's total.
        group_start = [0] * len(self.params)
        for _, start, _, idxs in layout.param_groups:
            for i in idxs:
                group_start[i] = start
        self._views: list[tuple[torch.Size, tuple[int, ...], int]] = []
        for i, p in enumerate(self.params):
            st = self.strides[i]
            self._views.append((p.shape, tuple(st) if st else _row_major(p.shape),
                                (layout.param_offsets[i] - group_start[i]) // p.element_size()))
        # slots of workers on other GPUs are summed on the master's; CPU slots are already in place
        self._move = device.type != "cpu"
        self.threads = max(1, threads) if device.type == "cpu" else 1
        self._helpers: ThreadPoolExecutor | None = None  # made at the first large sum
        self.totals = Totals()  # where the sums go, reused step after step

    def close(self) -> None:
        """Stop the helper threads (the runtime's close)."""
        if self._helpers is not None:
            self._helpers.shutdown(wait=True)
            self._helpers = None
        self.totals.clear()

    def bucket_members(self) -> list[list[int]]:
        """Per gradient bucket the workers report during a backward, its parameters' indices (none here)."""
        return []

    def begin(self, slots: Sequence[Sequence[torch.Tensor]], call: int, at: int
              ) -> Callable[[int, int, int], None] | None:
        """A backward round of ``call`` starts on ``slots``; :meth:`reduce` ends it.

        Returns:
            the handler of the round's bucket reports, called with (shard, call, bucket) as each
            arrives, or ``None`` when this reducer takes none.
        """
        return None

    def reduce(self, slots: Sequence[Sequence[torch.Tensor]], used: Sequence[bytes], at: int = -1,
               late: bool = False) -> list[torch.Tensor | None]:
        """The master's gradients, summed over shards.

        Args:
            slots: per shard that ran, its gradient slot's view of each dtype group.
            used: per shard, one byte per parameter: 1 where the shard produced a gradient.
            at: which training forward the backward belongs to (checked across nodes).
            late: a shard's gradient grew after it reported its bucket (see :meth:`begin`).

        Returns:
            one gradient per parameter; ``None`` for a parameter no shard produced a gradient for.
        """
        mask = bytearray(len(self.params))
        for m in used:
            for i, b in enumerate(m):
                if b == 1:
                    mask[i] = 1
        groups, totals, mask = self.combine(slots, mask, at, late)
        grads: list[torch.Tensor | None] = [None] * len(self.params)
        views = self._views
        for g, total in zip(groups, totals):
            base = total.storage_offset()
            for i in self.layout.param_groups[g][3]:
                if mask[i]:
                    shape, stride, a = views[i]
                    grads[i] = total.as_strided(shape, stride, base + a)
        return grads

    def _sum(self, views: list[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
        """The sum of ``views`` (one per shard) on :attr:`device`: into ``out``, or new memory (the slots
        are reused next step).

        A large CPU sum is split into :attr:`threads` contiguous chunks, one per thread: this one and
        helper threads, which run while the op releases the GIL. Not OpenMP's team: after a parallel
        region its threads spin for milliseconds, on the cores the workers' next forward needs (the
        benchmark's mlp step got a third slower that way); helper threads block between sums.
        Only while this process runs one torch thread (dpool's ``coordinator_threads=1``); otherwise
        torch's own parallelism applies. Each element is the same sum, in the same order, either way.
        """
        n = len(views)
        if (self.threads > 1 and n > 1 and not self._move and views[0].numel() * views[0].element_size()
                >= PARALLEL_SUM_BYTES and torch.get_num_threads() == 1):
            if out is None:
                out = torch.empty_like(views[0], memory_format=torch.contiguous_format)
            if self._helpers is None:
                self._helpers = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="dpool-reduce")
            numel = out.numel()
            step = -(-numel // self.threads)
            cuts = [(a, min(a + step, numel)) for a in range(0, numel, step)]
            futures = [self._helpers.submit(self._sum_plain, [v[a:b] for v in views], out[a:b]) for a, b in cuts[1:]]
            a, b = cuts[0]
            try:
                self._sum_plain([v[a:b] for v in views], out[a:b])
            finally:
                for f in futures:
                    f.result()
            return out
        return self._sum_plain(views, out)

    def _sum_plain(self, views: list[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
        if self._move:
            views = [v.to(self.device) for v in views]  # replicas on other GPUs: summed on the master's
        if len(views) > 1:
            total = torch.add(views[0], views[1], out=out)
        elif out is None:
            total = views[0].clone()
        else:
            total = out.copy_(views[0])
        for v in views[2:]:
            total.add_(v)
        return total

    def combine(self, slots: Sequence[Sequence[torch.Tensor]], mask: bytearray, at: int, late: bool = False
                ) -> tuple[list[int], list[torch.Tensor], bytearray]:
        """The gradient groups: here, the sum over this process's shards of every group a shard used.

        A cross-node reducer also combines them with the other nodes' and widens ``mask``.

        Args:
            slots: per shard, its gradient slot's view of each dtype group.
            mask: one byte per parameter, 1 where a local shard produced a gradient.
            at: which training forward the backward belongs to.
            late: a shard's gradient grew after it reported its bucket.

        Returns:
            the indices (into ``layout.param_groups``) of the groups that have gradients, each one's
            total, and the mask of the parameters that get a gradient.
        """
        groups = [g for g, (_, _, _, idxs) in enumerate(self.layout.param_groups) if any(mask[i] for i in idxs)]
        return groups, [self._sum([s[g] for s in slots], self._total(g, slots[0][g])) for g in groups], mask

    def _total(self, g: int, like: torch.Tensor) -> torch.Tensor | None:
        """Group ``g``'s total on the CPU master (a free buffer of :attr:`totals`); ``None``: new memory."""
        if self.device.type != "cpu":
            return None
        return self.totals.take(g, like.numel(), like.dtype, self.device)


def _row_major(shape: torch.Size) -> tuple[int, ...]:
    """A contiguous tensor's strides for ``shape`` (what ``torch.empty(shape).stride()`` gives)."""
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def sum_sparse(grads: list[torch.Tensor | None], parts: Sequence[tuple[int, torch.Tensor, torch.Tensor]],
               params: Sequence[torch.Tensor], device: torch.device) -> None:
    """Add sparse gradient ``parts`` (parameter index, indices, values) into ``grads``, in place."""
    for i, indices, values in parts:
        part = torch.sparse_coo_tensor(indices.to(device, copy=True), values.to(device, copy=True),
                                       params[i].shape, check_invariants=False)
        g = grads[i]
        grads[i] = part if g is None else g + part
