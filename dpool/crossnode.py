"""Cross-node mode: one dpool node per machine, and DDP's contract between the nodes' coordinators.

Two levels of reduction. Inside a node, the workers' gradient slots are summed through shared
memory (:mod:`dpool.reduce`): that sum *is* the gradient of the node's loss, as with
``nn.DataParallel``. Across nodes, only the coordinators talk, over a ``torch.distributed``
process group (gloo for CPU masters, NCCL for CUDA masters), with DDP's convention: every node's
gradient is multiplied by 1/N, then SUM all-reduced, in that order (DDP's reducer does the same),
so a node's gradient leaves it once and training equals DDP with one worker per node, and a
single process on the union batch with a mean loss in general.

What crosses the nodes, always in the same order on every rank:

* at ``wrap()`` (:meth:`CrossNode.join`): every rank's parameter and buffer names, shapes and
  dtypes (compared: a difference is an error naming the rank and the tensor), then rank 0's
  parameters and buffers (broadcast, as DDP does);
* at every training forward (grad mode, ``module.training``, outside ``no_sync()``): a *header*
  (below), then rank 0's buffers for ``buffers="first"`` (DDP's ``broadcast_buffers``); after the
  forward, for ``"average"`` and ``"sync"``, one all-reduce of the nodes' buffer statistics;
* at every backward outside ``no_sync()`` (:class:`CrossNodeReducer`): a header, then the
  gradient groups in buckets (DDP's sizes: 1 MiB first, then 25 MiB, from the last parameter),
  each bucket's all-reduce started as soon as its local sum is made, so the summing of the next
  bucket overlaps it;
* SyncBatchNorm's statistics, all-reduced across nodes after the node's own sum.

The header is an all-gather of a fixed-size int64 vector: (kind, collective number, training
forward number, rows) and the parameters' local "used" mask. Every rank compares the positions
and raises :class:`~dpool.errors.CollectiveDesyncError` (naming where each rank is) when they
differ, before anything is combined; the mask's union is which parameters get a gradient.

Every wait is bounded by :class:`dpool.peers.Peers` (heartbeats, abort key, ``peer_timeout_s``).
Gradients reach ``.grad`` only after every collective of the step completed, so a failed step
leaves the master untouched on every node.
"""
from __future__ import annotations

import itertools
import json
import logging
import os
from typing import Any, Sequence

import torch
from torch import nn

from .config import Config
from .errors import CollectiveDesyncError, DpoolValueError, UnsupportedError
from .layout import Layout
from .peers import Peer, Peers
from .reduce import Reducer

__all__ = ["CrossNode", "CrossNodeReducer", "resolve_group", "FORWARD", "BACKWARD"]

log = logging.getLogger("dpool")

FORWARD, BACKWARD = 1, 2
_KINDS = {FORWARD: "a training forward", BACKWARD: "a backward"}
FIRST_BUCKET_BYTES = 1 << 20  # DDP's kDefaultFirstBucketBytes
BUCKET_BYTES = 25 << 20  # DDP's bucket_cap_mb=25
_WRAPS = itertools.count()  # per process: the wrap number in the store namespace (same on every rank)


def resolve_group(process_group: Any) -> Any:
    """The process group ``process_group=`` asks for, or ``None`` for node-local mode.

    ``"auto"``: the default group when one is initialised with more than one rank. ``None`` or
    ``False``: node-local. A ``ProcessGroup``: that group.
    """
    if process_group is None or process_group is False:
        return None
    import torch.distributed as dist

    if isinstance(process_group, str):
        if process_group != "auto":
            raise DpoolValueError(f"process_group={process_group!r}: pass 'auto', None or a torch.distributed group")
        if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() <= 1:
            return None
        return dist.group.WORLD
    if not dist.is_initialized():
        raise DpoolValueError("process_group= was given, but torch.distributed is not initialised: call "
                              "dist.init_process_group(...) first")
    return process_group


def _store_of(group: Any) -> Any:
    from torch.distributed import distributed_c10d as c10d

    try:
        return c10d._world.pg_map[group][1]
    except (AttributeError, KeyError, IndexError, TypeError):
        return c10d._get_default_store()


class CrossNode:
    """This node's coordinator among the other nodes' coordinators.

    Args:
        group: the ``torch.distributed`` process group (one rank per node).
        config: timeouts (``peer_*``).
        device: the master's device (collectives on it for NCCL; on the CPU for gloo headers).
        auto: whether the mode turned on by itself (``process_group="auto"``): rank 0 says so.
    """

    def __init__(self, group: Any, config: Config, device: torch.device, auto: bool = False) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        if device.type == "cpu" and "gloo" not in self.backend:
            raise DpoolValueError(
                f"the process group's backend is {self.backend!r}, which cannot combine CPU tensors: the master "
                "module is on the CPU. Initialise the group with dist.init_process_group('gloo') (or "
                "'cpu:gloo,cuda:nccl'), or pass process_group=None to stay on one node")
        # gloo also takes CUDA tensors; an NCCL-only group needs its headers on the GPU
        self.comm_device = device if self.backend == "nccl" else torch.device("cpu")
        self.device = device
        self.config = config
        self.step = 0  # the runtime's step counter, for messages
        self.seq = 0  # collectives points (headers) issued
        self.fseq = 0  # training forwards so far (a backward's header names the one it belongs to)
        self.collectives = 0  # every collective issued (tests count them)
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        ns = f"dpool/{getattr(group, 'group_name', 'pg')}/{restart}/{next(_WRAPS)}"
        self.peers = Peers(_store_of(group), ns, self.rank, self.size, config.peer_heartbeat_s,
                           config.peer_heartbeat_timeout_s, config.peer_timeout_s)
        self.mask_len = 0
        self._header: torch.Tensor | None = None
        self._headers: list[torch.Tensor] = []
        if auto and self.rank == 0:
            log.warning("dpool: cross-node mode over the default process group (%d nodes, %s); pass "
                        "process_group=None to stay on one node", self.size, self.backend)

    @property
    def waited_s(self) -> float:
        """Seconds spent waiting for cross-node collectives so far (the part of them no work hid)."""
        return self.peers.waited_s

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ------------------------------------------------------------------ wrap time
    def join(self, module: nn.Module, workers: int) -> None:
        """Check that every rank wraps the same model; then take rank 0's parameters and buffers."""
        self.peers.start()
        params = list(module.named_parameters())
        buffers = [(n, b) for n, b in module.named_buffers() if b is not None]
        for m in module.modules():
            if getattr(m, "sparse", False) is True:
                raise UnsupportedError(
                    f"{type(m).__name__}(sparse=True) in cross-node mode: sparse gradients are not combined across "
                    "nodes. Use sparse=False, or process_group=None to stay on one node")
        me = {"host": self.peers.me.host, "pid": self.peers.me.pid, "workers": workers,
              "tensors": [[kind, n, list(t.shape), str(t.dtype)] for kind, ts in (("parameter", params),
                                                                                 ("buffer", buffers)) for n, t in ts]}
        everyone = [json.loads(b) for b in self._all_gather_bytes(json.dumps(me).encode(), "comparing the models")]
        self.peers.peers = [Peer(r, e["host"], int(e["pid"])) for r, e in enumerate(everyone)]
        ref = everyone[0]["tensors"]
        for r, e in enumerate(everyone[1:], 1):
            mine = e["tensors"]
            for i in range(max(len(ref), len(mine))):
                a = ref[i] if i < len(ref) else None
                b = mine[i] if i < len(mine) else None
                if a != b:
                    what = (f"{b[0]} {b[1]!r} has shape {b[2]} and dtype {b[3]}" if b else "it has no more tensors")
                    was = (f"{a[0]} {a[1]!r} with shape {a[2]} and dtype {a[3]}" if a else "no more tensors")
                    raise DpoolValueError(
                        f"rank {r} wraps a different model than rank 0: its {i}th tensor: {what}, where rank 0 has "
                        f"{was}. Every node must wrap the same architecture (cross-node mode keeps them in sync)")
        self.mask_len = len(params)
        self.workers = [int(e["workers"]) for e in everyone]
        with torch.no_grad():
            self._broadcast_tensors([p for _, p in params] + [b for _, b in buffers], "taking rank 0's parameters")

    def _all_gather_bytes(self, data: bytes, doing: str) -> list[bytes]:
        dist, dev = self.dist, self.comm_device
        n = torch.tensor([len(data)], dtype=torch.int64, device=dev)
        sizes = [torch.zeros_like(n) for _ in range(self.size)]
        self.peers.wait(dist.all_gather(sizes, n, group=self.group, async_op=True), doing, self.step)
        most = int(max(int(s) for s in sizes))
        buf = torch.zeros(most, dtype=torch.uint8, device=dev)
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else buf[:0]
        outs = [torch.zeros_like(buf) for _ in range(self.size)]
        self.peers.wait(dist.all_gather(outs, buf, group=self.group, async_op=True), doing, self.step)
        self.collectives += 2
        return [bytes(o[:int(s)].cpu().numpy().tobytes()) for o, s in zip(outs, sizes)]

    def _broadcast_tensors(self, tensors: Sequence[torch.Tensor], doing: str) -> None:
        """Rank 0's values into ``tensors``, one broadcast per dtype (DDP's ``_sync_module_states``)."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for dtype, ts in by_dtype.items():
            flat = torch.cat([t.detach().reshape(-1) for t in ts]).to(self.device)
            self.broadcast(flat, doing)
            off = 0
            for t in ts:
                t.data.copy_(flat[off:off + t.numel()].view(t.shape))
                off += t.numel()

    # ------------------------------------------------------------------ per step
    def header(self, kind: int, at: int, mask: bytes | bytearray = b"") -> bytearray:
        """Agree with every rank on where the job is; return the union of the ``used`` masks.

        Raises:
            CollectiveDesyncError: the ranks are at different collectives (on every rank alike).
        """
        work, doing = self.start_header(kind, at, mask)
        self.peers.wait(work, doing, self.step)
        return self.check_header()

    def start_header(self, kind: int, at: int, mask: bytes | bytearray = b"") -> tuple[Any, str]:
        """Launch the header's all-gather; :meth:`check_header` reads it once the work completed."""
        if self._header is None:  # made once: the header's size is fixed by the model
            self._header = torch.zeros(4 + self.mask_len, dtype=torch.int64, device=self.comm_device)
            self._headers = [torch.zeros_like(self._header) for _ in range(self.size)]
        h = self._header
        h.zero_()
        h[0], h[1], h[2] = kind, self.seq, at
        if mask:
            h[4:4 + len(mask)].copy_(torch.frombuffer(bytearray(mask), dtype=torch.uint8))
        doing = f"starting {_KINDS[kind]} (collective {self.seq})"
        work = self.dist.all_gather(self._headers, h, group=self.group, async_op=True)
        self.seq += 1
        self.collectives += 1
        return work, doing

    def check_header(self) -> bytearray:
        rows_all = torch.stack(self._headers).cpu()
        where = [tuple(int(v) for v in row[:3]) for row in rows_all]
        if len(set(where)) > 1:
            def say(w: tuple[int, ...]) -> str:
                k, seq, f = w
                what = f"training forward {f}" if k == FORWARD else f"the backward of training forward {f}"
                return f"{what} (collective {seq})"

            odd = next(r for r, w in enumerate(where) if w != where[0])
            lines = "; ".join(f"rank {r}: {say(w)}" for r, w in enumerate(where))
            p = self.peers.peers[odd]
            raise CollectiveDesyncError(
                f"the nodes are out of step: {lines}. Every rank must run the same training forwards and backwards "
                "(an extra backward, a training forward outside no_sync() on one rank only, or a rank that skipped "
                "a batch). Nothing was combined; the master module is unchanged.",
                rank=odd, host=p.host, pid=p.pid, step=self.step)
        return bytearray(rows_all[:, 4:].amax(0).to(torch.uint8).numpy().tobytes())

    def broadcast(self, t: torch.Tensor, doing: str) -> None:
        """Rank 0's ``t`` into every rank's ``t`` (bounded wait)."""
        self.peers.wait(self.dist.broadcast(t, 0, group=self.group, async_op=True), doing, self.step)
        self.collectives += 1

    def all_reduce(self, t: torch.Tensor, doing: str) -> None:
        """SUM of ``t`` over the ranks, in place (bounded wait)."""
        self.peers.wait(self.dist.all_reduce(t, group=self.group, async_op=True), doing, self.step)
        self.collectives += 1

    def fail(self, exc: BaseException) -> None:
        """This rank failed a synchronised call: every other rank learns it within a heartbeat tick."""
        self.peers.fail(exc, self.step)

    def close(self) -> None:
        self.peers.stop()


class CrossNodeReducer(Reducer):
    """:class:`dpool.reduce.Reducer` whose groups are averaged over the nodes (1/N, then a SUM all-reduce).

    Every group is combined, whether or not a local shard used it, so that every rank issues the
    same collectives: the header (with the "used" mask) first, then each group's buckets, each
    launched as soon as its local sum is made, so the next bucket's sum overlaps it. The union of
    the masks decides which parameters get a gradient: one used on any node gets the average (the
    nodes that did not use it contribute zeros), one used nowhere stays ``None`` on every node.

    With two nodes a bucket's SUM is an all-gather and one local add (in rank order, so every rank
    holds the same bytes, equal to the all-reduce's: a sum of two terms does not depend on their
    order). The traffic is the same as a ring all-reduce's at N = 2, and gloo's all-gather has a
    fifth of its all-reduce's latency on loopback (0.4 ms against 2 ms, measured).
    """

    def __init__(self, layout: Layout, params: Sequence[torch.Tensor], strides: Sequence[Sequence[int] | None],
                 device: torch.device, nodes: CrossNode) -> None:
        super().__init__(layout, params, strides, device)
        self.nodes = nodes
        self.groups = [g for g, (_, _, _, idxs) in enumerate(layout.param_groups) if idxs]
        self._pairs: dict[tuple[int, int], list[torch.Tensor]] = {}  # all-gather outputs, made once per bucket

    def combine(self, slots: Sequence[Sequence[torch.Tensor]], mask: bytearray, at: int
                ) -> tuple[list[int], list[torch.Tensor], bytearray]:
        nodes = self.nodes
        dist, group = nodes.dist, nodes.group
        gather = nodes.size == 2
        header, doing = nodes.start_header(BACKWARD, at, mask)
        scale = 1.0 / nodes.size
        works: list[tuple[Any, torch.Tensor, list[torch.Tensor] | None]] = []
        totals = []
        for g in self.groups:
            views = [s[g].to(self.device) for s in slots]
            total = torch.empty_like(views[0])
            for bi, (a, b) in enumerate(_buckets(views[0].numel(), views[0].element_size())):
                out = total[a:b]
                if len(views) > 1:
                    torch.add(views[0][a:b], views[1][a:b], out=out)
                    for v in views[2:]:
                        out.add_(v[a:b])
                else:
                    out.copy_(views[0][a:b])
                out.mul_(scale)  # DDP's order: 1/N first (no overflow in half precision), then the SUM
                if gather:
                    pair = self._pairs.get((g, bi))
                    if pair is None:
                        pair = self._pairs[(g, bi)] = [torch.empty_like(out) for _ in range(2)]
                    works.append((dist.all_gather(pair, out, group=group, async_op=True), out, pair))
                else:
                    works.append((dist.all_reduce(out, group=group, async_op=True), out, None))
                nodes.collectives += 1
            totals.append(total)
        nodes.peers.wait(header, doing, nodes.step)
        union = nodes.check_header()  # out of step: raises before any gradient exists
        for work, out, pair in works:
            nodes.peers.wait(work, "combining the gradients", nodes.step)
            if pair is not None:
                torch.add(pair[0], pair[1], out=out)
        return self.groups, totals, union


def _buckets(numel: int, elsize: int) -> list[tuple[int, int]]:
    """Element ranges of one group's buckets, from its end (the last parameters' gradients come first in
    backward): 1 MiB, then 25 MiB each, as DDP's."""
    out = []
    end = numel
    cap = max(1, FIRST_BUCKET_BYTES // elsize)
    while end > 0:
        start = max(0, end - cap)
        out.append((start, end))
        end = start
        cap = max(1, BUCKET_BYTES // elsize)
    return out
