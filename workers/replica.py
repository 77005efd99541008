"""The replica a worker holds for the life of the pool, and the requests it serves.

State kept across steps:

* ``model``: unpickled once at ``init``. Its parameters are views of the
  coordinator's shared parameter segment, so optimizer steps on the master are
  visible here with no copy. Its buffers are private views in this worker's
  state segment; before each forward they are refreshed from the master's
  buffers (one memcpy), as DataParallel's per-step replication would.
* ``calls``: the autograd graphs of forwards the coordinator may still
  backpropagate through, by call id, until it sends ``release``.
* mapped segments by role (``in``, ``out``, ``gout``, ``gin``): remapped only
  when the coordinator announces a new (grown) segment.

The requests are served by handlers grouped by what they do: this module (init, forward, fetch, call,
inspect), :mod:`.replica_backward` (backward, sparse gradients) and :mod:`.replica_loss` (the loss on the
workers); :mod:`.buckets` reports cross-node gradient buckets during a backward.
"""
from __future__ import annotations

import io
import os
import pickle
import sys
import time
from typing import Any, Callable

import cloudpickle
import torch

from dpool import tree as _tree
from dpool import protocol as P
from dpool.tensors import DTYPES, Placer, check_tensor, describe, meta_nbytes, read
from dpool.transport import attach
from dpool.transport.base import standalone
from dpool.transport.shm import Mapped
from dpool.replicate import REBOUND
from dpool.sync_batchnorm import _set_collective
from .assigned import AssignedBuffers
from .attributes import AttributeWatch
from .buckets import BucketReporter
from .libraries import prepare
from .randomness import Streams
from .replica_backward import BULK_GRAD_COPY_MAX, BackwardHandlers, Call
from .replica_loss import LossHandlers

def cuda_stream() -> torch.cuda.Stream:
    """This GPU worker's current stream: the one GPU it sees is device 0 (``CUDA_VISIBLE_DEVICES``).

    ``torch.cuda.current_stream()`` without a device looks the current device up first, through
    NVML's device count, over twice the cost of this call, three calls a request.
    """
    return torch.cuda.current_stream(0)


_size = torch.Tensor.size
_data_ptr = torch.Tensor.data_ptr



class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, load: Callable[[Any], Any]) -> None:
        super().__init__(io.BytesIO(data))
        self._load = load

    def persistent_load(self, pid: Any) -> Any:
        return self._load(pid)


class _Sentinel:
    """The first and last element of each parameter, read before and after a CPU worker's forward.

    A replica's parameters are the master's memory. A forward that changes one in place
    (``self.weight.data.mul_(0.9)``) therefore changes the master once per shard, where one process
    changes it once: a wrong number unless the change is idempotent. A change of almost any
    element moves the first or the last, so comparing those few bytes (two ``index_select`` of a few
    bytes per parameter, microseconds) turns it into an error. Only forwards of several shards check: one
    shard changes the master once, as one process does. Even an idempotent change is not safe there:
    two shards that change the same elements at once read them half changed (see ``_refuse_renorm``).
    GPU workers do not check (it would cost a synchronisation per forward).
    """

    def __init__(self, u8: torch.Tensor, layout: list, params: list[torch.Tensor]) -> None:
        index: list[int] = []
        self.owner: list[int] = []
        for i, ((dt, shape, off, _, strides), p) in enumerate(zip(layout, params)):
            if p.numel() == 0:
                continue
            size = DTYPES[dt].itemsize
            span = p.numel() - 1 if strides is None else sum((n - 1) * st for n, st in zip(shape, strides))
            last = off + span * size
            for start in sorted({off, last}):
                index.extend(range(start, start + size))
                self.owner.extend([i] * size)
        self.u8 = u8
        self.index = torch.tensor(index, dtype=torch.long)

    def read(self) -> torch.Tensor:
        return self.u8.index_select(0, self.index)

    def check(self, before: torch.Tensor, names: list[str], world: int) -> None:
        if torch.equal(before, self.read()):
            return
        moved = sorted({names[self.owner[j]] for j in (before != self.read()).nonzero().flatten().tolist()})
        raise RuntimeError(
            f"the forward changed parameter(s) {', '.join(moved)} in place. A replica's parameters are the "
            f"master's memory, so each of the {world} shard(s) applied the change to the master (it is "
            "changed now), where one process applies it once. Make the change outside the forward (after "
            "optimizer.step()), or assign new data (self.weight.data = ...), which dpool writes to the master "
            "once."
        )


class Replica(BackwardHandlers, LossHandlers):
    """Serves one worker's requests (see :mod:`dpool.protocol`)."""

    def __init__(self, index: int, device: str, shm_dir: str) -> None:
        self.index = index
        self.device = device
        self.on_gpu = device.startswith("cuda")
        self.shm_dir = shm_dir
        self.stage = "starting"
        self.model: torch.nn.Module | None = None
        self._buffer_shapes: list[torch.Size] = []
        self._assigned: AssignedBuffers | None = None
        self._watch: AttributeWatch | None = None
        self.streams: Streams | None = None
        self.known: set[str] = set()
        self.segs: dict[str, Mapped] = {}
        self.calls: dict[int, Call] = {}
        self.unfetched: dict[int, tuple[list[torch.Tensor], bool]] = {}
        self.unfetched_sparse: dict[int, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
        self._to_release: list[int] = []
        self.collective: Any = None
        self.notify: Callable[[P.Message], None] | None = None  # sends a message mid-request (bucket_ready)
        self._holding = False
        self._to_slot = False  # inside a backward whose gradients go to the slot (the hooks act)
        self._written = bytearray()  # per parameter: its slot holds a gradient (since the last reduced backward)
        self.buckets = BucketReporter([], 0)  # cross-node overlap (see .buckets)
        self._training = b""
        self._requires_grad = b""
        self._flags_now = b""  # the parameters' requires_grad flags now (a backward's, while it runs)
        self._reduced: dict[tuple[int, str], tuple[Any, Any]] = {}  # criterion copies with another reduction
        # The coordinator's interprocess event: recorded before each request, waited on by our stream
        # before we touch its memory (NOTE [ CUDA ownership ] in dpool.transport.cuda_ipc).
        self.event: Any = None
        self._event_handle: bytes | None = None
        # The coordinator's event we record before replying to a forward or a fetch, without waiting for our
        # GPU (DPOOL_CUDA_ASYNC_REPLIES, unverified): its streams wait on it. None: we reply once it ran them.
        self.reply_event: Any = None
        self._reply_handle: bytes | None = None
        self._handlers = {
            "init": self.init,
            "forward": self.forward,
            "fetch": self.fetch,
            "backward": self.backward,
            "fetch_sparse": self.fetch_sparse,
            "inspect": self.inspect,
            "call": self.call,
            "criterion": self.criterion,
            "forward_criterion": self.forward_criterion,
        }

    # ---------------------------------------------------------------- plumbing
    def _seg(self, role: str, ref: list) -> Mapped:
        cur = self.segs.get(role)
        seg = attach(self.shm_dir, ref, cur)
        if seg is not cur:
            self.known.add(seg.name)
            self.segs[role] = seg
        return seg

    def handle(self, msg: P.Message) -> P.Message:
        handler = self._handlers.get(msg.op)
        if handler is None:
            raise P.ProtocolError(f"worker {self.index} does not serve {msg.op!r} requests")
        if msg.op != "init" and self.model is None:
            raise P.ProtocolError(f"worker {self.index} got {msg.op!r} before init")
        if self.event is not None:
            self.event.wait(cuda_stream())  # on our stream: no host wait, and never the other way round
        return handler(msg)

    # ---------------------------------------------------------------- init
    def init(self, msg: P.Init) -> P.Message:
        """Build the replica: map the shared memory, unpickle the model onto it, and bind its parameters'
        gradients to the slot. A second init re-syncs a changed model."""
        self.stage = "unpickling the model"
        # A second init re-syncs a changed model: the old replica's graphs and flags go with it.
        self.calls.clear()
        self.unfetched.clear()
        self.unfetched_sparse.clear()
        self._holding = False
        self.buckets.stop()
        self._training = self._requires_grad = self._flags_now = b""
        for p in msg.sys_path:
            if isinstance(p, str) and p not in sys.path:
                sys.path.append(p)
        handle = msg.options.get("event")
        if self.on_gpu and handle is not None and handle != self._event_handle:  # opened once per coordinator
            self.event = torch.cuda.Event.from_ipc_handle(torch.device("cuda", 0), handle)
            self._event_handle = handle
            self.event.wait(cuda_stream())
        handle = msg.options.get("reply_event")
        if self.on_gpu and handle is not None and handle != self._reply_handle:
            self.reply_event = torch.cuda.Event.from_ipc_handle(torch.device("cuda", 0), handle)
            self._reply_handle = handle
        master = self._map(msg)
        model, params, viewed = self._unpickle(msg)
        self._bind(msg, model, params, viewed, master)
        self.stage = "idle"
        return P.InitDone(n_params=len(self.params), n_buffers=len(self.buffer_views))

    def _map(self, msg: P.Init) -> Mapped:
        """Map the master's parameters and this worker's state segment: the views the model is built on."""
        master = self._seg("params", msg.params)
        state = self._seg("state", msg.state)
        self.param_views = [master.standalone(off, DTYPES[dt], shape, st) for dt, shape, off, _, st in msg.param_layout]
        self.grad_views = [state.standalone(off, DTYPES[dt], shape, st) for dt, shape, off, _, st in msg.param_layout]
        self.buffer_views = [state.standalone(off, DTYPES[dt], shape) for dt, shape, off in msg.buffer_layout]
        self._buffer_shapes = list(map(_size, self.buffer_views))
        if msg.buffer_layout:
            start = min(off for _, _, off in msg.buffer_layout)
            end = max(off + meta_nbytes([dt, shape, off, False]) for dt, shape, off in msg.buffer_layout)
            self._buf_src = master.u8[start:end]
            self._buf_dst = state.u8[start:end]
            self._buf_dst.copy_(self._buf_src)
        else:
            self._buf_src = self._buf_dst = None
        return master

    def _unpickle(self, msg: P.Init) -> tuple[torch.nn.Module, dict[int, torch.nn.Parameter], set[int]]:
        """The model, its tensors resolved to the mapped views: the model, its parameters by layout index,
        and the buffers another tensor of the replica views."""
        params: dict[int, torch.nn.Parameter] = {}
        viewed: set[int] = set()

        def load(pid: Any) -> Any:
            kind, i = pid[0], pid[1]
            if kind == "p":
                if i not in params:
                    params[i] = torch.nn.Parameter(self.param_views[i], requires_grad=bool(pid[2]))
                return params[i]
            if kind == "b":
                return self.buffer_views[i]
            if kind == "a":  # a plain tensor attribute viewing a parameter's or buffer's memory
                _, of, i, offset, dt, shape, strides = pid
                base = self.param_views[i] if of == "p" else self.buffer_views[i]
                if of != "p":
                    viewed.add(i)
                first = base.storage_offset() * base.element_size() + offset
                return standalone(storage=base.untyped_storage(), device=base.device, offset=first, dtype=DTYPES[dt],
                                  shape=shape, strides=list(strides))
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")

        model = _Unpickler(msg.model, load).load()
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"expected an nn.Module, got {type(model).__name__}")
        prepare(model)  # (what the model's classes' __init__ set up in the coordinator's process)
        missing = [i for i in range(len(self.param_views)) if i not in params]
        if missing:
            raise RuntimeError(f"parameters {missing} of the layout did not appear in the pickled model")
        return model, params, viewed

    def _bind(self, msg: P.Init, model: torch.nn.Module, params: dict[int, torch.nn.Parameter], viewed: set[int],
              master: Mapped) -> None:
        """Take the unpickled model as this replica's: its checks, its gradients' way to the slot, its hooks."""
        self.streams = Streams(model, self.on_gpu)
        self.params = [params[i] for i in range(len(self.param_views))]
        self._param_ptrs = [v.data_ptr() for v in self.param_views]
        names = {id(p): n for n, p in model.named_parameters()}
        self._param_names = [names.get(id(p), f"parameter {i}") for i, p in enumerate(self.params)]
        self._sentinel = None if self.on_gpu else _Sentinel(master.u8, msg.param_layout, self.params)
        self._renorms = [n or "the model" for n, m in model.named_modules()
                         if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.max_norm is not None]
        self._written = bytearray(len(self.params))
        buckets = msg.options.get("buckets") or []
        # The two ways to the slot (see .replica_backward): a Python hook per parameter per backward costs
        # several times one copy for many small parameters (docs/performance.md), but frees each gradient at
        # once, which counts most on a GPU, and reports buckets in a cross-node pool.
        param_bytes = sum(v.numel() * v.element_size() for v in self.param_views)
        if self.on_gpu or buckets or param_bytes > BULK_GRAD_COPY_MAX:
            for i, p in enumerate(self.params):
                frozen = not p.requires_grad  # torch takes a hook only on a tensor that requires grad, and
                p.requires_grad_(True)        # keeps it while the flag is off: it acts once the parameter
                p.register_post_accumulate_grad_hook(self._to_slot_hook(i))  # is unfrozen
                p.requires_grad_(not frozen)
        self.buckets = BucketReporter(buckets, len(self.params))
        self.modules = list(model.modules())
        self.model = model
        self._assigned = AssignedBuffers(model, self.buffer_views, viewed)
        self._watch = AttributeWatch(model)
        self._bn_counts: list[int] = []
        if msg.options.get("bn_counts"):
            bns = [m for m in self.modules
                   if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.running_mean is not None]
            self._bn_counts = [0] * len(bns)
            for j, bn in enumerate(bns):
                bn.register_forward_pre_hook(self._counter(j))

    def _enter_collective(self, world: int) -> None:
        coll = self.collective
        if coll is not None:
            coll.world = world
            coll.seq = 0  # every shard numbers the collectives of this request alike
        _set_collective(coll)

    def _counter(self, j: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple) -> None:
            x = args[0]
            self._bn_counts[j] = x.numel() // x.shape[1]  # values per channel BatchNorm normalises

        return hook

    # ---------------------------------------------------------------- forward
    def _apply_flags(self, training: bytes, requires_grad: bytes) -> None:
        if training != self._training:
            for m, flag in zip(self.modules, training):
                m.training = bool(flag)
            self._training = training
        if requires_grad != self._requires_grad:
            for i, (p, flag) in enumerate(zip(self.params, requires_grad)):
                p.requires_grad_(bool(flag))
                if not flag:  # frozen: its slot holds zeros, not a stale gradient, in every sum
                    self.grad_views[i].zero_()
                    self._written[i] = 0
            self._requires_grad = self._flags_now = requires_grad

    def _sync(self) -> None:
        """On a GPU: wait for this request's CUDA work, so that ``busy`` times it (the reply waits anyway)."""
        if self.on_gpu:
            self.stage += " (waiting for its CUDA work)"
            cuda_stream().synchronize()
            self.stage = "idle"

    def after_reply(self) -> None:
        """Work kept off the critical path: runs after the reply is sent."""
        if self._to_release:
            for c in self._to_release:
                self.calls.pop(c, None)
                self.unfetched.pop(c, None)
            self._to_release = []

    def _put_back_assigned(self) -> None:
        """Buffers assigned a new tensor since the last look, into their views (see :mod:`.assigned`)."""
        if self._assigned is not None and self._assigned.assigned:
            self._assigned.put_back()

    def _refuse_renorm(self, world: int) -> None:
        """``nn.Embedding(max_norm=...)`` renormalises the rows it looks up in place, in the master's memory
        (the replicas' parameters): shards that look up the same row at once read it half scaled and scale it
        again (measured: rows 0.35 off). Refused before the forward writes anything."""
        raise RuntimeError(
            f"{', '.join(self._renorms)}: nn.Embedding(max_norm=...) renormalises the rows it looks up in place "
            f"during the forward, and the {world} shards of this call would do it at once in the master's memory, "
            "which their replicas share: rows that two shards look up would come out wrong. Renormalise in the "
            "training loop instead (after optimizer.step(): with torch.no_grad(): emb.weight.data = "
            "torch.renorm(emb.weight, 2, 0, max_norm)) and set max_norm=None, or run this model on one worker."
        )

    def _rebound(self) -> list[int]:
        """Parameters whose ``.data`` the forward replaced (``self.weight.data = torch.renorm(...)``, a max-norm
        constraint): in one process the master's parameter now holds the new values. Here the replica's
        parameter would have left the master's memory for good (never to see an optimizer step again). So
        it is bound to that memory again at once, and its new values are kept for the coordinator, which
        writes the first shard's into the master after every shard's forward (the backward then reads
        them there, as the forward used them): the forwards of all shards start from the same values."""
        kept: dict[int, torch.Tensor] = {}
        for i, (p, view) in enumerate(zip(self.params, self.param_views)):
            if p.data_ptr() == self._param_ptrs[i]:
                continue
            new = p.data
            p.data = view
            if new.shape != view.shape or new.dtype != view.dtype or new.device != view.device:
                raise RuntimeError(
                    f"the forward replaced the data of parameter {self._param_names[i]} "
                    f"({tuple(view.shape)}/{view.dtype}/{view.device}) with {tuple(new.shape)}/{new.dtype}/"
                    f"{new.device}. dpool keeps each parameter at a fixed size in shared memory: keep its shape "
                    "and dtype, or change the module before dpool.wrap()."
                )
            kept[i] = new
        assert self.model is not None
        self.model.__dict__[REBOUND] = kept
        return sorted(kept)

    def _refuse_resized_buffer(self) -> None:
        """A forward resized a buffer in place (``resize_``, as QAT's per-channel observers do on their first
        forward). Growing one over shared memory fails in torch on a CPU; shrinking one, or growing one inside
        a GPU arena, would silently part it from the master's copy or overlap its neighbours: an error, which
        the coordinator completes with the buffer's name and the fix."""
        i = next(i for i, (b, shape) in enumerate(zip(self.buffer_views, self._buffer_shapes)) if b.shape != shape)
        raise RuntimeError(f"the forward resized buffer {i} in place from {tuple(self._buffer_shapes[i])} to "
                           f"{tuple(self.buffer_views[i].shape)}")

    def forward(self, msg: P.Forward) -> P.Message:
        if msg.release:
            self._to_release = msg.release  # freeing graphs can wait until the reply is out
        self.stage = f"running forward on shard {msg.shard}"
        t0 = time.monotonic()  # the clock the coordinator reads too: it splits the round's time with it
        inp = self._seg("in", msg.inputs)
        self._seg("out", msg.outputs)
        self._apply_flags(msg.training, msg.requires_grad)
        self._put_back_assigned()  # (assigned outside a forward: worker_states)
        if msg.sync_buffers and self._buf_dst is not None:
            self._buf_dst.copy_(self._buf_src)
        tensors: list[torch.Tensor] = []
        leaves: list[torch.Tensor | None] = []
        for meta in msg.tensors:
            t = read(inp.views, meta)
            if msg.grad and meta.requires_grad:
                t = t.detach().requires_grad_(True)
                leaves.append(t)
            else:
                leaves.append(None)
            tensors.append(t)
        args, kwargs = _tree.unflatten(msg.tree, tensors.__getitem__)
        assert self.model is not None
        # this shard's own streams, derived from the coordinator's draw (dropout, random augmentation)
        self.streams.seed(msg.seed + 0x9E3779B97F4A7C15 * (msg.shard + 1))
        if msg.world > 1 and self._renorms:
            self._refuse_renorm(msg.world)
        sentinel = self._sentinel if msg.world > 1 else None  # (one shard changes the master once: fine)
        before = sentinel.read() if sentinel is not None else None
        watched = self._watch is not None and self._watch.start(msg.grad)
        self._enter_collective(msg.world)
        try:
            with torch.set_grad_enabled(msg.grad):
                if msg.autocast:
                    device_type, dtype, cache = msg.autocast
                    with torch.autocast(device_type, dtype=DTYPES[dtype], cache_enabled=cache):
                        out = self.model(*args, **kwargs)
                else:
                    out = self.model(*args, **kwargs)
        finally:
            _set_collective(None)
        self._put_back_assigned()  # (a buffer given a new tensor: see .assigned)
        rebound = self._rebound() if list(map(_data_ptr, self.params)) != self._param_ptrs else []
        if sentinel is not None and before is not None:
            sentinel.check(before, self._param_names, msg.world)
        if self._buffer_shapes and list(map(_size, self.buffer_views)) != self._buffer_shapes:
            self._refuse_resized_buffer()
        attributes = self._watch.assigned() if watched and self._watch is not None else []
        self.stage = f"returning outputs of shard {msg.shard}"
        outs: list[torch.Tensor] = []
        spec = _tree.flatten(out, outs, output=True)
        for i, t in enumerate(outs):
            check_tensor(t, f"output tensor {i}")
        differentiable = msg.grad and any(t.requires_grad for t in outs)
        if differentiable or msg.keep:
            self.calls[msg.call] = Call(outs, leaves, msg.world, out if msg.keep else None)
        if msg.keep:  # gather=False: the outputs stay here (a later gather fetches them); only what they are
            # travels (dtype, shape, requires_grad: the loss's dtype, its denominator)
            metas = [describe(t, 0, msg.grad and t.requires_grad) for t in outs]
        else:
            placer = Placer()
            offsets = [placer.reserve(t) for t in outs]
            if placer.offset > msg.outputs[1]:
                self.unfetched[msg.call] = (outs, msg.grad)
                return P.ForwardDone(call=msg.call, tree=spec, tensors=[], need=placer.offset,
                                     stats=list(self._bn_counts), busy=time.monotonic() - t0, started=t0,
                                     rebound=rebound, attributes=attributes)
            out_seg = self.segs["out"]
            metas = [Placer.write(out_seg.views, off, t, msg.grad and t.requires_grad) for off, t in zip(offsets, outs)]
        self.stage = "idle"
        if self.reply_event is None:  # (otherwise busy is the time to queue the forward's kernels)
            self._sync()
        return P.ForwardDone(call=msg.call, tree=spec, tensors=metas, need=0, stats=list(self._bn_counts),
                             busy=time.monotonic() - t0, started=t0, rebound=rebound, attributes=attributes)

    def fetch(self, msg: P.Fetch) -> P.Message:
        if msg.call in self.unfetched:
            outs, grad = self.unfetched.pop(msg.call)
        else:  # outputs kept on the worker (gather=False), gathered later
            kept = self.calls[msg.call]
            outs, grad = kept.outputs[: kept.n_out], any(t.requires_grad for t in kept.outputs)
        seg = self._seg("out", msg.outputs)
        placer = Placer()
        metas = [Placer.write(seg.views, placer.reserve(t), t, grad and t.requires_grad) for t in outs]
        return P.FetchDone(call=msg.call, tensors=metas)

    # ---------------------------------------------------------------- misc
    def inspect(self, msg: P.Inspect) -> P.Message:
        for c in msg.release:
            self.calls.pop(c, None)
            self.unfetched.pop(c, None)
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return P.InspectDone(graphs=len(self.calls), rss=rss)

    def call(self, msg: P.Call) -> P.Message:
        self.stage = "running a function on the replica"
        fn = cloudpickle.loads(msg.fn)
        result = fn(self.model)
        self.stage = "idle"
        return P.CallDone(result=cloudpickle.dumps(result))
