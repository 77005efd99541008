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
* at every backward outside ``no_sync()`` (:class:`CrossNodeReducer`): a header, launched as the
  workers' round starts; then the gradient groups in buckets (DDP's sizes: 1 MiB first, then
  25 MiB, from the last parameter), each launched as soon as every local worker reported it
  complete during its backward (``bucket_ready``), so the exchange runs behind the rest of the
  backward, as DDP's does; the last bucket carries a *trailer* in front of it. Two nodes of CPU
  masters swap each bucket point to point (:meth:`CrossNode.exchange`), and there a model whose
  training forwards exchange nothing carries the header behind its first bucket instead;
* SyncBatchNorm's statistics, all-reduced across nodes after the node's own sum.

The header is three int64, all-gathered (or carried in the first bucket): (kind, collective number,
training forward number).
Every rank compares them and raises :class:`~dpool.errors.CollectiveDesyncError` (naming where each
rank is) when they differ, before any bucket leaves. The trailer is this rank's "late" flag and its
parameters' local "used" mask, carried in front of the last bucket (as bytes in a two-node swap, as 0/1
values summed with the bucket otherwise): their union is which parameters get a gradient.

Every wait is bounded by :class:`dpool.peers.Peers` (heartbeats, abort key, ``peer_timeout_s``).
Gradients reach ``.grad`` only after every collective of the step completed, so a failed step
leaves the master untouched on every node.
"""
from __future__ import annotations

import ctypes
import datetime
import functools
import itertools
import json
import logging
import os
import struct
import weakref
from typing import Any, Callable, Sequence, TypeVar

import torch
from torch import nn

from .config import Config
from .cpus import NoWakeupPreemption, threads_named
from .errors import CollectiveDesyncError, DpoolValueError, UnsupportedError
from .policies import gloo_loop_policy
from .layout import Layout
from .peers import Peer, Peers
from .progress import Progress
from .reduce import Reducer

__all__ = ["CrossNode", "CrossNodeReducer", "resolve_group", "gloo_loops", "FORWARD", "BACKWARD"]

log = logging.getLogger("dpool")

FORWARD, BACKWARD = 1, 2
_T = TypeVar("_T")
_KINDS = {FORWARD: "a training forward", BACKWARD: "a backward"}
FIRST_BUCKET_BYTES = 1 << 20  # DDP's kDefaultFirstBucketBytes
BUCKET_BYTES = 25 << 20  # DDP's bucket_cap_mb=25
_HEADER_BYTES = 24  # a header: three int64
_HEADER = struct.Struct("=3q")  # its bytes, as the int64 tensor of an all-gathered header holds them
_TAG = 0x64706F00  # point-to-point tags of the buckets' swaps: this plus the bucket's index
_BREAK_TAG = _TAG - 1  # a receive nothing sends: its timeout ends a blocked swap (_break_swap)
_WRAPS = itertools.count()  # per process: the wrap number in the store namespace (same on every rank)
_GLOO_LOOP_THREAD = "gloo_tcp_loop"  # the name torch gives the thread of gloo's TCP device

# NOTE [ gloo's loop thread ]
# gloo's TCP transport reads its sockets on a thread of its own (``gloo_tcp_loop``) that waits in
# level-triggered ``epoll`` and, when a socket is readable, only *tries* its pair's lock, returning to
# ``epoll_wait`` when it cannot take it. An ``isend``/``irecv`` holds that lock while it posts. When the peer's
# bytes arrive meanwhile (they do: both ranks post their swap at the same moment), the loop thread wakes,
# preempts the posting thread if they share a core, and spins on the lock it holds until the scheduler's
# next tick: with each rank bound to one core a small swap took several times as long, and some cross-node
# probe steps a whole tick more (docs/performance.md). So :meth:`CrossNode.exchange` posts with the loop
# threads under ``SCHED_BATCH``, whose wake-ups never preempt (:class:`dpool.cpus.NoWakeupPreemption`), and
# puts them back right after, before any wait. Only around the posting: a loop thread left under
# ``SCHED_BATCH`` also waited for ticks behind busy processes in every other collective.
# ``DPOOL_GLOO_LOOP=none`` turns it off.


def gloo_loops(policy: str) -> NoWakeupPreemption:
    """gloo's loop threads of this process, to post a swap with (none under ``policy="none"``); found when
    called, so after the process group made them."""
    return NoWakeupPreemption(threads_named(_GLOO_LOOP_THREAD) if policy == "batch" else ())


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

        self._loop_policy = gloo_loop_policy()  # (a bad value fails here, before anything starts)
        self.dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        # torch.distributed names a broadcast's source and a send's peer by their rank in the default
        # group, also for a smaller group
        self._root = dist.get_global_rank(group, 0)
        self._other = dist.get_global_rank(group, 1 - self.rank) if self.size == 2 else -1
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
        self.progress = Progress()  # the runtime's step counter, for messages (see serve())
        self._leave: Callable[[], Callable[[BaseException], None] | None] = lambda: None
        self.seq = 0  # collectives points (headers) issued
        self.collectives = 0  # every collective issued (tests count them)
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        ns = f"dpool/{getattr(group, 'group_name', 'pg')}/{restart}/{next(_WRAPS)}"
        self.peers = Peers(store=_store_of(group), namespace=ns, rank=self.rank, size=self.size,
                           interval_s=config.peer_heartbeat_s, silence_s=config.peer_heartbeat_timeout_s,
                           timeout_s=config.peer_timeout_s)
        self.peers.timed_waits = self.comm_device.type == "cpu" and device.type == "cpu"  # gloo on CPU tensors
        self.mask_len = 0
        if self._other >= 0 and device.type == "cpu":  # the swaps' receives block: the heartbeat can end them
            self.peers.breaker = functools.partial(_break_swap, dist, self._other, group)  # (holds no self)
        # close() also when the model is dropped unclosed and at exit: no dpool thread may still be in a
        # torch call when the interpreter finalizes (see Peers.stop)
        self._closer = weakref.finalize(self, self.peers.stop)
        self._header: torch.Tensor | None = None
        self._headers: list[torch.Tensor] = []
        self._loops: NoWakeupPreemption | None = None  # found at the first swap (see NOTE [ gloo's loop thread ])
        self.quiet_posts = 0  # swaps posted with gloo's loop threads kept from preempting (tests count them)
        if auto and self.rank == 0:
            log.warning("dpool: cross-node mode over the default process group (%d nodes, %s); pass "
                        "process_group=None to stay on one node", self.size, self.backend)

    def serve(self, progress: Progress, leave: Callable[[], Callable[[BaseException], None] | None]) -> None:
        """Serve a runtime: count steps with its ``progress``, and leave the job through ``leave()`` (a weak
        reference to what ends the runtime's part in the job: see :meth:`synced`)."""
        self.progress, self._leave = progress, leave

    def synced(self, run: Callable[[], _T]) -> _T:
        """Run a call that takes part in the nodes' collectives; a failure ends this node's part in the job
        (the other nodes are told, the runtime's workers stop: its ``leave``)."""
        try:
            return run()
        except BaseException as exc:
            leave = self._leave()
            if leave is not None:
                leave(exc)
            raise

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
        self.peers.wait(self.launch(lambda: dist.all_gather(sizes, n, group=self.group, async_op=True), doing), doing,
                        self.progress.step)
        most = int(max(int(s) for s in sizes))
        buf = torch.zeros(most, dtype=torch.uint8, device=dev)
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else buf[:0]
        outs = [torch.zeros_like(buf) for _ in range(self.size)]
        self.peers.wait(self.launch(lambda: dist.all_gather(outs, buf, group=self.group, async_op=True), doing), doing,
                        self.progress.step)
        self.collectives += 2
        return [bytes(o[:int(s)].tolist()) for o, s in zip(outs, sizes)]  # (uint8 values; torch needs no numpy)

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
    def header(self, kind: int, at: int) -> None:
        """Agree with every rank on where the job is.

        Raises:
            CollectiveDesyncError: the ranks are at different collectives (on every rank alike).
        """
        work, doing = self.start_header(kind, at)
        self.peers.wait(work, doing, self.progress.step)
        self.check_header()

    def next_header(self, kind: int, at: int) -> torch.Tensor:
        """This rank's next header (three int64: kind, collective number, training forward number), in a
        tensor made once: launched alone by :meth:`start_header`, or carried behind a bucket's swap."""
        if self._header is None:  # made once
            self._header = torch.zeros(3, dtype=torch.int64, device=self.comm_device)
            self._headers = [torch.zeros_like(self._header) for _ in range(self.size)]
        h = self._header
        h[0], h[1], h[2] = kind, self.seq, at
        self.seq += 1
        return h

    def next_header_bytes(self, kind: int, at: int) -> bytes:
        """This rank's next header as bytes (those of :meth:`next_header`'s tensor), to carry behind a swap."""
        self.seq += 1
        return _HEADER.pack(kind, self.seq - 1, at)

    def start_header(self, kind: int, at: int) -> tuple[Any, str]:
        """Launch the header's all-gather; :meth:`check_header` reads it once the work completed."""
        doing = f"starting {_KINDS[kind]} (collective {self.seq})"
        h = self.next_header(kind, at)
        work = self.launch(lambda: self.dist.all_gather(self._headers, h, group=self.group, async_op=True), doing)
        self.collectives += 1
        return work, doing

    def check_header(self) -> None:
        self.check_rows([tuple(int(v) for v in row) for row in torch.stack(self._headers).cpu()])

    def check_rows(self, where: Sequence[tuple[int, ...]]) -> None:
        """Raise :class:`CollectiveDesyncError` unless every rank's header (``where[rank]``) is the same."""
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
                rank=odd, host=p.host, pid=p.pid, step=self.progress.step)

    def broadcast(self, t: torch.Tensor, doing: str) -> None:
        """Rank 0's ``t`` into every rank's ``t`` (bounded wait)."""
        self.peers.wait(self.launch(lambda: self.dist.broadcast(t, self._root, group=self.group, async_op=True), doing),
                        doing, self.progress.step)
        self.collectives += 1

    def all_reduce(self, t: torch.Tensor, doing: str) -> None:
        """SUM of ``t`` over the ranks, in place (bounded wait)."""
        self.peers.wait(self.launch(lambda: self.dist.all_reduce(t, group=self.group, async_op=True), doing), doing,
                        self.progress.step)
        self.collectives += 1

    def exchange(self, mine: torch.Tensor, theirs: torch.Tensor, slot: int) -> tuple[Any, Any]:
        """Two ranks, CPU tensors: send ``mine`` to the other rank and receive its ``theirs``, as a
        point-to-point pair (gloo's ``isend``/``irecv``). Returns the send's and the receive's works, a
        swap to be waited for with :meth:`Peers.wait <dpool.peers.Peers.wait>`.

        gloo runs an asynchronous collective on a thread of its own, which made a 2-rank all-gather
        cost about twice as much as an isend/irecv pair posted and waited for from this thread
        (docs/performance.md). A receive cannot be waited for
        in ticks (gloo closes the connection when a timed wait on it runs out), so this thread blocks in
        it, and the heartbeat thread ends that wait if a failure shows meanwhile (:func:`_break_swap`).
        ``slot`` keeps a step's exchanges apart (gloo matches them by tag). gloo's loop threads may not
        preempt this one while it posts (see NOTE [ gloo's loop thread ]).
        """
        dist, other = self.dist, self._other
        tag = _TAG + slot
        if self._loops is None:
            self._loops = gloo_loops(self._loop_policy)
        with self._loops:
            works = self.launch(lambda: (dist.isend(mine, other, group=self.group, tag=tag),
                                         dist.irecv(theirs, other, group=self.group, tag=tag)), "combining the gradients")
        if self._loops.tids:
            self.quiet_posts += 1
        return works

    def launch(self, start: Callable[[], Any], doing: str) -> Any:
        """Start a collective (``start`` makes gloo's or NCCL's call): the only way dpool starts one. gloo raises
        at once where a peer's connection closed before (a bare ``RuntimeError``, "Connection closed by peer"):
        that is a :class:`PeerLostError` naming the rank, as a loss found while waiting is
        (:meth:`Peers.wait <dpool.peers.Peers.wait>`)."""
        try:
            return start()
        except RuntimeError as exc:
            raise self.peers.lost(str(exc), doing, self.progress.step) from None

    def fail(self, exc: BaseException) -> None:
        """This rank failed a synchronised call: every other rank learns it within a heartbeat tick."""
        self.peers.fail(exc, self.progress.step)

    def close(self) -> None:
        """Stop the heartbeat thread and wait for it (see :meth:`Peers.stop`)."""
        self._closer()


def _break_swap(dist: Any, other: int, group: Any) -> None:
    """End a swap with rank ``other`` that this rank's main thread is blocked in (the heartbeat thread calls it
    when the other rank aborted, froze or lost the store, or ``peer_timeout_s`` ran out): a receive that
    nothing will answer, waited for a millisecond, runs out, and gloo then closes every connection of the group, so
    the blocked receive raises at once. The group is unusable afterwards; the job is over anyway."""
    try:
        dist.irecv(torch.empty(1), other, group=group, tag=_BREAK_TAG).wait(datetime.timedelta(milliseconds=1))
    except RuntimeError:
        pass


class CrossNodeReducer(Reducer):
    """:class:`dpool.reduce.Reducer` whose groups are averaged over the nodes (1/N, then a SUM all-reduce).

    A backward's collectives, the same on every rank whatever the timing:

    1. a *header* (its kind and position, checked before the first bucket leaves, so ranks that are out
       of step never combine anything), launched as the round starts. With two nodes of CPU masters
       and a model whose training forwards exchange nothing (no buffers, no SyncBatchNorm: ``fold``),
       every collective of the job is a backward's bucket, so ranks out of step still make exchanges of
       the same sizes: the header then rides behind the first bucket (bytes in a swap arrive unchanged)
       and is checked once that bucket arrived, before anything reaches ``.grad``. That saves one collective
       per step, which on a small model is most of the cross-node time (gloo's latency on loopback);
    2. every bucket (:func:`_buckets`, groups in order), whether or not a local shard used it;
    3. with the last bucket (the group's first parameters, whose gradients come last), a *trailer* in
       front of it: whether a shard was ``late``, and the "used" mask (their union decides which
       parameters get a gradient: one used on any node gets the average, the nodes that did not use it
       contribute zeros, one used nowhere stays ``None`` everywhere). A two-node swap (``p2p``) carries
       it as bytes, which each rank reads from the other's receive buffer (:meth:`_finish`); a summing
       collective carries it as 0/1 values, unscaled, so the SUM counts the nodes that used each
       parameter. The last bucket therefore always leaves after the round; the trailer costs no
       collective of its own.

    With ``overlap``, a bucket is summed and launched *during* the round, as soon as every local shard
    reported it complete (``bucket_ready``) and the buckets before it left, so its exchange runs while
    the workers compute the rest of the backward; the rest leave when the round ends. A shard whose
    gradient grew after it reported the bucket (a parameter reused across reentrant checkpoints) is
    ``late``: then every rank combines every bucket again from the complete slots and turns overlap
    off for the rest of the run (as DDP insists on one gradient per parameter per backward, but
    without the error).

    With two nodes a bucket's SUM is a swap and one local add (in rank order, so every rank holds the
    same bytes, equal to the all-reduce's: a sum of two terms does not depend on their order). The
    traffic is the same as a ring all-reduce's at N = 2. CPU masters swap point to point
    (:meth:`CrossNode.exchange`), CUDA masters with an all-gather (gloo's, cheaper than its all-reduce,
    as measured in docs/performance.md).

    Args:
        nodes: this node among the others.
        overlap: exchange buckets during the backward (the workers report them).
        fold: whether the model's training forwards issue no collective (the header may then ride in
            the first bucket, with two nodes of CPU masters).
    """

    def __init__(self, layout: Layout, params: Sequence[torch.Tensor], strides: Sequence[Sequence[int] | None],
                 device: torch.device, nodes: CrossNode, overlap: bool, fold: bool = False) -> None:
        super().__init__(layout, params, strides, device)
        self.nodes = nodes
        self.overlap = overlap
        self.groups = [g for g, (_, _, _, idxs) in enumerate(layout.param_groups) if idxs]
        # the buckets in the order every rank exchanges them: (position in groups, element range), and
        # the parameters each one holds (a parameter may straddle two)
        self.plan: list[tuple[int, int, int]] = []
        self.members: list[list[int]] = []
        for gi, g in enumerate(self.groups):
            dtype, start, end, idxs = layout.param_groups[g]
            el = self.params[idxs[0]].element_size()
            first = [self._views[i][2] for i in idxs]  # each parameter's element offset in its group
            for a, b in _buckets((end - start) // el, el):
                self.plan.append((gi, a, b))
                self.members.append([i for i, f in zip(idxs, first) if f < b and f + self.params[i].numel() > a])
        self._pairs: list[list[torch.Tensor] | None] = [None] * len(self.plan)  # all-gather outputs, made once
        # two nodes of CPU masters swap each bucket point to point (CrossNode.exchange): its receive
        # buffer, made once
        self.p2p = nodes.size == 2 and device.type == "cpu"
        self._recvs: list[torch.Tensor | None] = [None] * len(self.plan)
        self._pre = 1 + len(self.params)  # the trailer: late flag, then one "used" value per parameter
        # the folded header: 24 bytes behind the first bucket (the end of the first group), in its dtype's
        # elements. CPU masters only: the CUDA path keeps the header it was verified with on a GPU
        el = layout.param_groups[self.groups[0]][0].itemsize if self.plan else 1
        self._post = -(-_HEADER_BYTES // el) if fold and self.p2p and self.plan else 0
        self._mask = bytearray()
        self._late = False
        self._slots: Sequence[Sequence[torch.Tensor]] | None = None
        self._call = -1
        self._counts: list[int] = []
        self._next = 0  # the next bucket to launch
        self._totals: list[torch.Tensor] = []
        self._works: list[tuple[Any, torch.Tensor, list[torch.Tensor] | None]] = []
        self._header_checked = False
        self._sent_header = b""  # the folded header this rank sent with the step's first bucket
        self.early = 0  # buckets launched while the workers still ran (the overlap; tests and benchmarks read it)

    def bucket_members(self) -> list[list[int]]:
        return self.members if self.overlap else []

    def begin(self, slots: Sequence[Sequence[torch.Tensor]], call: int, at: int
              ) -> Callable[[int, int, int], None] | None:
        nodes = self.nodes
        self._slots = slots
        if self._post:  # rides in the first bucket (written by _launch), checked in _finish
            self._header_at = at
            self._header_checked = True
        else:
            self._header = nodes.start_header(BACKWARD, at)
            self._header_checked = False
        # memory nobody holds (the master's gradients are views of it: dpool.reduce.Totals). The last
        # group's starts with the trailer's room: the last bucket to leave carries this rank's late flag
        # and "used" mask with it
        self._totals = []
        for gi, g in enumerate(self.groups):
            numel = (self.layout.param_groups[g][2] - self.layout.param_groups[g][1]) // slots[0][g].element_size()
            pre = self._pre if gi == len(self.groups) - 1 else 0
            post = self._post if gi == 0 else 0
            self._totals.append(self.totals.take(key=g, numel=numel, dtype=slots[0][g].dtype, device=self.device,
                                                 pre=pre, post=post))
        self._works = []
        self._next = 0
        if not self.overlap:
            return None
        self._call = call
        self._counts = [0 if m else len(slots) for m in self.members]
        return self._ready

    def _ready(self, shard: int, call: int, bucket: int) -> None:
        """A shard reported ``bucket`` complete: launch what is ready, in order."""
        if call != self._call or self._slots is None or not 0 <= bucket < len(self._counts):
            return  # a report from an abandoned round
        self._counts[bucket] += 1
        k = len(self._slots)
        while self._next < len(self.plan) - 1 and self._counts[self._next] >= k:  # the last carries the trailer
            self._launch(self._next)
            self.early += 1

    def _launch(self, j: int) -> None:
        """Sum bucket ``j`` over the local shards, scale it by 1/N, start its exchange."""
        nodes = self.nodes
        if not self._header_checked:  # ranks out of step exchange nothing
            work, doing = self._header
            nodes.peers.wait(work, doing, nodes.progress.step)
            nodes.check_header()
            self._header_checked = True
        assert self._slots is not None
        gi, a, b = self.plan[j]
        g = self.groups[gi]
        total = self._totals[gi]
        mine = [s[g][a:b] for s in self._slots]
        # DDP's order: 1/N first (no overflow in half precision), then the SUM
        if len(mine) == 1 and self.p2p:  # one op: x * (1/N) into the total, as copying and then scaling gives
            out = torch.mul(mine[0], 1.0 / nodes.size, out=total[a:b])
        else:
            out = self._sum(mine, total[a:b])
            out.mul_(1.0 / nodes.size)
        last, header = j == len(self.plan) - 1, j == 0 and self._post > 0
        start, stop = a, b
        if last:  # the trailer rides in front of the last bucket (which starts its group: a == 0)
            start = -self._pre
            if not self.p2p:  # as 0/1 values, unscaled: the SUM counts the nodes that used each parameter
                trailer = total.as_strided((self._pre,), (1,), total.storage_offset() - self._pre)
                trailer[0] = float(self._late)
                trailer[1:].copy_(torch.frombuffer(self._mask, dtype=torch.uint8))
        if header:  # the folded header rides behind the first bucket (its group's end: b); p2p only
            stop = b + self._post
        if start != a or stop != b:
            out = total.as_strided((stop - start,), (1,), total.storage_offset() + start)
        if self.p2p:
            if last or header:  # written as bytes: a swap delivers them unchanged (see _finish)
                raw = _raw(out)
                if last:
                    raw[0] = int(self._late)
                    raw[1:self._pre] = self._mask
                if header:
                    self._sent_header = nodes.next_header_bytes(BACKWARD, self._header_at)
                    at = (stop - start - self._post) * out.element_size()
                    raw[at:at + _HEADER_BYTES] = self._sent_header
            theirs = self._recvs[j]
            if theirs is None:  # (a bucket's size, with its trailer and header, is fixed by the plan)
                theirs = self._recvs[j] = torch.empty_like(out)
            pair = [out, theirs] if nodes.rank == 0 else [theirs, out]  # in rank order
            self._works.append((nodes.exchange(out, theirs, j), out, pair))
        elif nodes.size == 2:
            outs = self._pairs[j]
            if outs is None:
                outs = self._pairs[j] = [torch.empty_like(out) for _ in range(2)]
            self._works.append((nodes.launch(lambda: nodes.dist.all_gather(outs, out, group=nodes.group, async_op=True),
                                             "combining the gradients"), out, outs))
        else:
            self._works.append((nodes.launch(lambda: nodes.dist.all_reduce(out, group=nodes.group, async_op=True),
                                             "combining the gradients"), out, None))
        nodes.collectives += 1
        self._next = j + 1

    def _finish(self) -> tuple[bytearray, bool]:
        """Launch the buckets not launched yet; wait for all of them. Returns the trailer: the union of
        the ranks' "used" masks and whether any rank was late.

        Two nodes of CPU masters (``p2p``) swap the trailer and the header as bytes: each rank reads the
        other's from the receive buffer (through :func:`_raw`, which costs far less than torch ops on a few
        bytes) before the add, which makes no sense of them; the union of the masks is their OR. Otherwise
        the trailer is 0/1 values that the SUM counts.
        """
        nodes = self.nodes
        while self._next < len(self.plan):
            self._launch(self._next)
        last = len(self._works) - 1
        late, union = False, self._mask
        for i, (work, out, pair) in enumerate(self._works):
            nodes.peers.wait(work, "combining the gradients", nodes.progress.step)
            if pair is not None:
                if self.p2p and (i == last or i == 0 and self._post):
                    raw = _raw(self._recvs[i])  # the other rank's bucket, as it sent it
                    if i == 0 and self._post:  # it carried the ranks' headers: in step?
                        at = (raw.nbytes // out.element_size() - self._post) * out.element_size()
                        self._check_folded(bytes(raw[at:at + _HEADER_BYTES]))
                    if i == last:
                        n = self._pre
                        late = self._late or raw[0] != 0
                        union = bytearray((int.from_bytes(self._mask, "little") | int.from_bytes(raw[1:n], "little"))
                                          .to_bytes(n - 1, "little"))
                torch.add(pair[0], pair[1], out=out)
        self._works = []
        if not self.plan or self.p2p:
            return union, late
        total = self._totals[-1]
        trailer = total.as_strided((self._pre,), (1,), total.storage_offset() - self._pre)
        used = (trailer > 0).to(torch.uint8)
        return bytearray(used[1:].tolist()), bool(used[0])

    def _check_folded(self, theirs: bytes) -> None:
        if theirs != self._sent_header:
            heads = [_HEADER.unpack(h) for h in (self._sent_header, theirs)]
            self.nodes.check_rows(heads if self.nodes.rank == 0 else heads[::-1])

    def combine(self, slots: Sequence[Sequence[torch.Tensor]], mask: bytearray, at: int, late: bool = False
                ) -> tuple[list[int], list[torch.Tensor], bytearray]:
        if self._slots is None:  # no begin(): a round without reports
            self.begin(slots, -1, at)
            self._call = -1
        try:
            self._mask, self._late = mask, late and self.overlap  # (once off, every rank ignores it)
            union, late = self._finish()
            if late:  # what some rank sent early was stale: every rank combines the complete slots again
                if self.overlap:
                    log.info("dpool: a parameter's gradient grew after its bucket was exchanged (a parameter used "
                             "in several reentrant checkpoints?): the step's gradients were combined again, and "
                             "buckets are exchanged after the backward from now on")
                self.overlap = False
                self._next = 0
                self._finish()
            return self.groups, self._totals, union
        finally:
            self._slots = None
            self._call = -1


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of contiguous CPU tensor ``t``, writable, without a torch op (``t`` must outlive them)."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


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
