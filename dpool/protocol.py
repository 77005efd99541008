"""The wire protocol between the coordinator and its workers, in one place.

A control message is one ZeroMQ frame (plus the routing identity a ROUTER adds)::

    mac (32 bytes: keyed BLAKE2b-256 of payload) ‖ payload (msgpack)

The MAC is BLAKE2b in its keyed mode, which is a MAC by design (RFC 7693; Python's
``hashlib`` documents it as a faster replacement for HMAC): a third of HMAC-SHA256's
cost on a control message, and four of them are computed per worker per step.

One frame rather than two saves a send and a receive per message on the hot path.

The payload is a msgpack array ``[version, op, seq, re, body]`` where ``body`` is
the list of the message's fields in declaration order, and ``re`` is the ``seq``
of the request a message was sent for: a worker's reply, and the collectives and
reports it sends while serving that request, name it; the coordinator's own
answer to a collective names the same request; everything else carries 0. The
coordinator takes a reply as the answer to a worker's latest request only if
``re`` names it, so a reply still owed to a round that Ctrl-C or a failure
abandoned is never taken for the next one's. Tensor bytes never travel here:
messages only say *where* in shared memory a tensor lies (``TensorMeta``).

Receiving is ordered so that nothing from an unauthenticated peer is decoded:

1. frame count and size are checked (ZeroMQ's ``MAXMSGSIZE`` also caps them);
2. the MAC is checked with :func:`hmac.compare_digest`;
3. only then is msgpack run, with size limits and ``strict_map_key``;
4. the body is validated against the message class's field types;
5. ``seq`` must grow strictly (replay protection), checked by the caller.

Every failure in steps 1-4 is a :class:`~dpool.errors.ProtocolError`
(:class:`~dpool.errors.AuthError` for step 2); no other exception escapes
:meth:`Codec.decode`.

Ops follow one naming scheme: a request is a verb (``forward``, ``attach``,
``status``), its reply is the verb with ``_done`` (``forward_done``,
``attach_done``, ``status_done``); any request may instead be answered with
``failed``. Four messages are not replies: ``hello`` (a worker's first word),
``output`` (an attached worker's printed text), ``bucket_ready`` (a progress
report during a backward) and ``shutdown`` (no answer).
"""
from __future__ import annotations

import hashlib
import hmac
import inspect
import operator
import sys
import traceback
from dataclasses import dataclass, field, fields
from typing import Any, Callable, ClassVar, NamedTuple, TypeVar

if sys.version_info >= (3, 11):
    from typing import dataclass_transform
else:  # typing_extensions comes with torch
    from typing_extensions import dataclass_transform

import msgpack

from .errors import AuthError, ProtocolError

__all__ = [
    "PROTOCOL_VERSION",
    "Codec",
    "mac",
    "Message",
    "MESSAGES",
    "Boot",
    "Hello",
    "Init",
    "InitDone",
    "Forward",
    "ForwardDone",
    "Fetch",
    "Backward",
    "FetchSparse",
    "FetchSparseDone",
    "BackwardDone",
    "Criterion",
    "CriterionDone",
    "Inspect",
    "InspectDone",
    "Call",
    "CallDone",
    "AllReduce",
    "AllReduceDone",
    "BucketReady",
    "TensorMeta",
    "HELD_ONLY",
    "FetchDone",
    "Serve",
    "ServeDone",
    "EndServe",
    "Challenge",
    "ChallengeDone",
    "Attach",
    "AttachDone",
    "Detach",
    "DetachDone",
    "Status",
    "StatusDone",
    "Stop",
    "StopDone",
    "Output",
    "Shutdown",
    "Failed",
    "ForwardCriterion",
    "ForwardCriterionDone",
    "inner",
    "values_of",
]

PROTOCOL_VERSION = 16  # 16: every request to a daemon carries the challenge it was given (challenge)
# 15: backward of call HELD_ONLY (the no_sync() gradients of a worker without a shard)
# 14: forward_criterion (a deferred forward and its loss in one request)
# 13: end_serve (the daemon ends a serving worker's session when its client detaches);
# detach names the lease by its attach nonce
# 12: the envelope carries ``re``, the request a message was sent for
# 11: forward_done names the attributes the forward set to tensors requiring grad;
# backward may drop gradients the worker holds (zero_grad() during no_sync())
# 10: backward_done and criterion_done list the buffers the backward updated in place;
# forward_done lists the parameters whose .data the forward replaced
# 9: forward_done and backward_done carry when the worker's handler started;
# forward, backward and criterion may ask the shards to reply together
# 8: criterion may carry a backward seed; criterion_done reports that backward;
# backward and criterion carry the parameters' requires_grad flags of the moment
# 7: keyed BLAKE2b MACs instead of HMAC-SHA256
# 6: bucket_ready (gradient buckets reported during backward); backward_done's late
# 5: a typed boot message; inspect replaces release (used only by tests)
# 3: forward carries a seed drawn from the coordinator's generator; sparse gradients; parameter strides;
#    backward keep_as (higher-order gradients)
# 4: one op-naming scheme (the daemon's ops too; fetch answered by fetch_done); tensor metas validated
MAC_SIZE = 32
# The ``call`` of a :class:`Backward` to a worker that has no shard of the batch (it had fewer rows than there
# are workers) but may hold ``no_sync()`` gradients: it drops those ``drop`` names, then, unless ``hold``, adds the
# rest to the backward's sum and holds none after. Calls are numbered from 1.
HELD_ONLY = 0
CONTEXT_LOST = " [CUDA context lost: the worker exits]"

# How long a worker that finished its shard first may wait for the round's other shards before it replies
# (``together`` in Forward, Backward and Criterion). A CPU pool whose workers fill every core asks for it: then the
# coordinator shares a core with a worker, and waking it for the first reply preempts the slower handler
# there (in a probe round that handler took over twice as long as the other's). Each worker writes the round's
# number into its int64 slot at ``offset + 8 * shard`` of the control segment when its handler ends, and
# one done first waits, on its own core, until shards ``0..shards-1`` all wrote it or this much time
# passed. A dead or hung peer costs a round at most this.
TOGETHER_WAIT_S = 300e-6

# A region reference (see dpool.transport): [name, size] in shared memory, [name, size, export] on a GPU.
SegRef = list
# A list of TensorMeta (``None`` where a message allows no tensor), checked and typed by Codec.
Metas = list


class TensorMeta(NamedTuple):
    """Where one tensor lies in a region: it travels as the array ``[dtype, shape, offset, requires_grad]``.

    Fields typed :data:`Metas` arrive as lists of these (``None`` where a message allows no tensor).
    """

    dtype: str
    """The dtype's name (``"float32"``; see ``dpool.tensors.DTYPES``)."""
    shape: list
    offset: int
    """Byte offset in the region (64-byte aligned)."""
    requires_grad: bool


class Message:
    """Base of all typed messages. Subclasses are slotted dataclasses."""

    op: ClassVar[str]
    # name -> allowed python types, used to validate a decoded body.
    _types: ClassVar[dict[str, tuple[type, ...]]]

    _names: ClassVar[tuple[str, ...]]
    # (index, name, the exact types allowed) of each field Codec checks; ``None`` for a metas field
    _checks: ClassVar[tuple[tuple[int, str, frozenset[type] | None], ...]]
    _values: ClassVar[Callable[[Any], tuple]]  # a staticmethod: _field_getter(_names)

    def body(self) -> list[Any]:
        return list(self._values(self))  # type: ignore[call-arg]


_NONE = type(None)
_STR = (str,)
_INT = (int,)
_BOOL = (bool,)
_BYTES = (bytes,)
_LIST = (list,)
_METAS = (list, "metas")  # a list of TensorMeta (or None), checked and typed by Codec


_M = TypeVar("_M", bound="Message")


def _field_getter(names: tuple[str, ...]) -> Callable[[Any], tuple]:
    """A function that returns a message's field values, in order, as a tuple."""
    if len(names) > 1:
        return operator.attrgetter(*names)
    if names:
        one = operator.attrgetter(names[0])
        return lambda m: (one(m),)
    return lambda m: ()


# What a field's annotation allows to arrive (msgpack's types); ``X | None`` also allows ``None``.
_ALLOWED: dict[str, tuple] = {"int": _INT, "str": _STR, "bool": _BOOL, "bytes": _BYTES, "list": _LIST,
                              "SegRef": _LIST, "Metas": _METAS, "dict": (dict,), "float": (float,), "Any": (object,)}


def _allowed(annotation: str) -> tuple:
    kind, _, optional = annotation.partition(" | ")
    if optional:
        assert optional == "None", annotation
        return (*_ALLOWED[kind], _NONE)
    return _ALLOWED[kind]


@dataclass_transform()
def _message(op: str) -> Callable[[type[_M]], type[_M]]:
    """Make a slotted dataclass message with op name ``op``: each field's annotation is also what a decoded
    body may hold there (see :data:`_ALLOWED`)."""

    def deco(cls: type[_M]) -> type[_M]:
        types = {name: _allowed(ann) for name, ann in inspect.get_annotations(cls).items()}
        cls = dataclass(slots=True)(cls)
        cls.op = op
        cls._types = types
        cls._names = names = tuple(types)
        # msgpack decodes to exact built-in types (never a subclass), so one set lookup per field checks
        # it; bool is its own type, so a bool is refused where only int is allowed
        cls._checks = tuple((i, name, None if allowed is _METAS else frozenset(allowed))
                            for i, (name, allowed) in enumerate(types.items()) if allowed != (object,))
        # the field values in order, as a tuple (attrgetter runs in C)
        cls._values = staticmethod(_field_getter(names))  # type: ignore[assignment]
        assert [f.name for f in fields(cls)] == list(types), cls  # type: ignore[arg-type]
        return cls

    return deco


@_message("boot")
class Boot(Message):
    """Parent → new worker process, on its stdin (a pipe only the parent holds): who it is and whom it serves.

    ``mode`` is ``"embedded"`` (a coordinator's own worker: it serves that coordinator, ``ppid``, and
    exits with it) or ``"daemon"`` (a ``dpool-workers`` worker: it serves one attached client after
    another, each announced by a :class:`Serve`). ``control`` is the heartbeat page of an embedded
    worker, ``steps`` the daemon's steps-served page; ``prefix`` names the coordinator's segments,
    which an embedded worker removes if its coordinator dies.
    """

    mode: str
    key: bytes
    endpoint: str
    index: int
    ident: bytes
    device: str
    ppid: int
    threads: int
    shm_dir: str
    prefix: str
    control: list | None
    steps: list | None
    heartbeat_interval_s: float
    max_message_bytes: int

    def pack(self) -> bytes:
        """The boot message as it travels: not authenticated (the pipe is private), but typed and versioned."""
        return msgpack.packb([PROTOCOL_VERSION, self.op, 0, 0, self.body()], use_bin_type=True)

    @staticmethod
    def unpack(data: bytes) -> "Boot":
        """Decode and validate what :meth:`pack` wrote. Raises :class:`ProtocolError`."""
        try:
            obj = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
        except Exception as exc:
            raise ProtocolError(f"undecodable boot message: {type(exc).__name__}: {exc}") from None
        _, _, msg = Codec._validate(obj)
        if not isinstance(msg, Boot):
            raise ProtocolError(f"expected a boot message, got {msg.op!r}")
        return msg


@_message("hello")
class Hello(Message):
    """Worker → coordinator, first message after connecting."""

    worker: int
    pid: int
    protocol: int
    torch: str
    python: str


@_message("init")
class Init(Message):
    """Coordinator → worker: the pickled model (without tensor data) and the shared layouts.

    ``options``: ``bn_counts`` (report BatchNorm's values per channel), ``event`` (the coordinator's
    CUDA IPC event handle), ``buckets`` (cross-node overlap: per gradient bucket, in the order they are
    exchanged, the indices of the parameters it holds; the worker sends :class:`BucketReady` for each).
    """

    model: bytes
    sys_path: list
    params: SegRef
    state: SegRef
    param_layout: list
    buffer_layout: list
    threads: int
    options: dict


@_message("init_done")
class InitDone(Message):
    n_params: int
    n_buffers: int


@_message("forward")
class Forward(Message):
    """Run the replica on one shard.

    ``tree`` encodes ``(args, kwargs)`` (see :mod:`dpool.tree`); ``tensors`` are
    the metas of its tensors in the ``inputs`` segment. ``release`` lists calls
    whose autograd graphs the coordinator no longer needs. ``seed`` was drawn
    from the coordinator's generator; the shard seeds its own generator from it.
    ``together``: ``[]``, or ``[round, shards, offset]``: reply together with the round's other
    shards (see :data:`TOGETHER_WAIT_S`). ``keep`` (``gather=False``): the outputs stay on the worker,
    which writes none of them into ``outputs``; its reply's metas say only their dtype, shape and
    ``requires_grad`` (offset 0), and a later :class:`Fetch` returns them.
    """

    call: int
    step: int
    grad: bool
    training: bytes
    requires_grad: bytes
    sync_buffers: bool
    inputs: SegRef
    outputs: SegRef
    tree: Any
    tensors: Metas
    shard: int
    world: int
    keep: bool
    autocast: list | None
    release: list
    seed: int
    together: list


@_message("forward_done")
class ForwardDone(Message):
    """The replica's output structure; ``need > 0`` means the outputs segment was too small.

    ``stats`` holds per-BatchNorm value counts when the ``"sync"`` buffer policy needs them;
    ``busy`` is the seconds the worker spent on the request (for ``balance="auto"``), from ``started``,
    its ``time.monotonic()`` when the handler began (the clock every process of a machine shares: the
    coordinator splits a round's time with it, see :meth:`dpool.stats.Stats.split_round`).
    ``rebound``: the parameters whose ``.data`` the forward replaced (a max-norm constraint written
    ``self.weight.data = torch.renorm(...)``); the worker keeps their new values for
    :func:`dpool.replicate.take_rebound`, which the coordinator then calls to commit them.
    ``attributes``: the model's attributes (qualified names) the forward set to a new tensor that requires
    grad, which the master's modules never get (see ``workers/attributes.py``); looked for at the first
    forwards only.
    """

    call: int
    tree: Any
    tensors: Metas
    need: int
    stats: list
    busy: float
    started: float
    rebound: list = field(default_factory=list)
    attributes: list = field(default_factory=list)


@_message("fetch")
class Fetch(Message):
    """Write the kept outputs of ``call`` into a (larger) outputs segment."""

    call: int
    outputs: SegRef


@_message("fetch_done")
class FetchDone(Message):
    """The outputs of ``call``, now in the larger segment (the structure came with ``forward_done``)."""

    call: int
    tensors: Metas


@_message("backward")
class Backward(Message):
    """Backpropagate ``grad_tensors`` (metas in ``grads``, ``None`` for no gradient) through ``call``.

    ``hold`` (``no_sync``): keep the parameter gradients in the worker, accumulating, instead of
    writing them to the gradient slot. ``sparse``: the segment for sparse gradients (see
    :class:`BackwardDone`). ``keep_as > 0`` (``create_graph=True``): build the graph of the
    gradients too and keep it as call ``keep_as``, whose outputs are the gradients of the
    parameters that require grad, then of the input leaves, and whose leaves are the incoming
    gradients, then the inputs; a later ``backward`` of ``keep_as`` differentiates the gradients.
    ``requires_grad``: one byte per parameter, the master's flags when the backward was called; the
    worker backpropagates with those (as one process accumulates only into parameters that require
    grad at backward time) and puts back its own, those of the latest forward, afterwards.
    ``together``: as :class:`Forward`'s. ``drop``: one byte per parameter (or empty), 1 where the worker
    drops the gradient it holds from earlier ``hold`` backwards first: the training loop cleared the
    master's (``zero_grad()`` during ``no_sync()``; see ``dpool.accumulate``). ``call`` :data:`HELD_ONLY`: the
    worker has no shard of this backward's batch; it drops and (unless ``hold``) adds the gradients it holds,
    as a backward of its own would, and backpropagates nothing (``grads``, ``grad_tensors`` and
    ``input_grads`` are not read). ``retain_graph``: keep ``call``'s graph for another backward; ``False``
    when the coordinator's backward frees its own node (no ``retain_graph``, no ``create_graph``, no graph of
    gradients built on it), so the worker frees the graph as it goes, as one process does (a compiled
    AOTAutograd backward that donates its buffers refuses to run with the graph kept).
    """

    call: int
    step: int
    grads: SegRef
    grad_tensors: Metas
    input_grads: SegRef
    hold: bool
    sparse: SegRef
    keep_as: int
    requires_grad: bytes
    together: list
    drop: bytes = b""
    retain_graph: bool = True


@_message("backward_done")
class BackwardDone(Message):
    """Parameter gradients are in the worker's gradient slot; ``param_mask`` says which exist.

    ``param_mask`` is 1 for a dense gradient (in the slot) and 2 for a sparse one
    (``nn.Embedding(sparse=True)``): ``sparse`` lists ``[param index, indices meta,
    values meta]`` of each, coalesced, in the sparse segment; ``sparse_need > 0`` means
    that segment was too small and the gradients wait for :class:`FetchSparse`.
    ``late``: a parameter's gradient grew after its bucket was reported ready
    (:class:`BucketReady`), so what was sent early is stale. ``busy`` and ``started``: as
    :class:`ForwardDone`'s. ``buffers``: the indices of the buffers the backward changed in place
    (a module's backward hook), which the coordinator then commits as a forward's updates.
    """

    call: int
    param_mask: bytes
    input_grads: Metas
    busy: float
    sparse: list
    sparse_need: int
    late: bool
    started: float
    buffers: list = field(default_factory=list)


@_message("fetch_sparse")
class FetchSparse(Message):
    """Write the sparse gradients that ``call``'s backward kept into a (larger) sparse segment."""

    call: int
    sparse: SegRef


@_message("fetch_sparse_done")
class FetchSparseDone(Message):
    """The sparse gradients of ``call``, as in :class:`BackwardDone`."""

    call: int
    sparse: list


@_message("criterion")
class Criterion(Message):
    """Apply a pickled loss module to the outputs ``call`` kept (``gather=False``) and this shard's targets.

    A non-empty ``seed`` (the raw bytes of a 0-dim ``seed_dtype`` tensor) asks the worker to backpropagate
    the shard's loss with it at once, as a :class:`Backward` of the call with that output gradient would
    (gradients into the slot, input gradients into ``input_grads``): the coordinator sends it only when it
    can tell in advance the gradient ``loss.backward()`` will give each shard, and uses the result only
    if that gradient turns out to be bitwise this seed (see ``dpool.loss``), with ``requires_grad`` (as in
    :class:`Backward`) unchanged by then. ``together``: as :class:`Forward`'s.
    """

    call: int
    fn: bytes
    tree: Any
    tensors: Metas
    inputs: SegRef
    seed: bytes
    seed_dtype: str
    input_grads: SegRef
    step: int
    requires_grad: bytes
    together: list


@_message("criterion_done")
class CriterionDone(Message):
    """The shard's summed loss (kept as output ``index`` of the call, for backward) and its denominator.

    ``backward``: whether the backward that ``seed`` asked for ran; then ``param_mask``, ``input_grads``,
    ``busy`` and ``buffers`` are those of its :class:`BackwardDone` (no sparse gradients: a backward that
    makes any does not count as run). It did not run when no seed came, the worker holds ``no_sync``
    gradients, or it raised: the ordinary backward round then runs it again and reports any error.
    """

    call: int
    index: int
    value: float
    denom: float
    backward: bool
    param_mask: bytes
    input_grads: Metas
    busy: float
    buffers: list = field(default_factory=list)


@_message("forward_criterion")
class ForwardCriterion(Message):
    """A deferred :class:`Forward` and the :class:`Criterion` of its outputs in one request (see
    ``dpool.coordinator._Deferred``): the worker runs the forward, then the loss, and answers both at once.

    ``forward`` and ``criterion`` hold the two messages' fields (see :func:`inner`); ``together``: as
    :class:`Forward`'s. A failed forward is answered with :class:`Failed`, and the loss does not run.
    """

    forward: list
    criterion: list
    together: list


@_message("forward_criterion_done")
class ForwardCriterionDone(Message):
    """``forward``: the :class:`ForwardDone`'s fields (the forward keeps its outputs on the worker, so its
    metas say only what they are and ``need`` is 0: see :class:`Forward`'s ``keep``). ``criterion_op``
    names what ``criterion`` holds the fields of: ``"criterion_done"`` (:class:`CriterionDone`) or
    ``"failed"`` (the loss raised: :class:`Failed`)."""

    forward: list
    criterion_op: str
    criterion: list


def inner(op: str, body: list) -> Message:
    """The message ``op`` whose fields another message carries in one of its own (:class:`ForwardCriterion`),
    checked as :meth:`Codec.decode` checks a whole message (the outer one was authenticated)."""
    if op not in ("forward", "forward_done", "criterion", "criterion_done", "failed"):
        raise ProtocolError(f"{op!r} cannot travel inside another message")
    return Codec._validate([PROTOCOL_VERSION, op, 0, 0, body])[2]


def values_of(msg: Message) -> list:
    """``msg``'s field values in order: what :func:`inner` takes back."""
    return list(msg._values(msg))  # type: ignore[call-arg]


@_message("inspect")
class Inspect(Message):
    """Coordinator → worker: what do you hold? (``DataParallel.stats(inspect=True)``). ``release``: calls
    whose graphs to free first, as in :class:`Forward`."""

    release: list


@_message("inspect_done")
class InspectDone(Message):
    """The graphs the worker keeps for the coordinator (calls it can still backpropagate through) and its
    resident memory in bytes."""

    graphs: int
    rss: int


@_message("call")
class Call(Message):
    """Run a pickled ``fn(replica)`` on the worker and return its pickled result."""

    fn: bytes


@_message("call_done")
class CallDone(Message):
    result: bytes


@_message("output")
class Output(Message):
    """Attached (daemon) worker → client, at any time: text the replica printed. ``stream``: 1 stdout, 2 stderr.

    Embedded workers need no message: the coordinator reads their stdout and stderr pipes.
    """

    stream: int
    text: str


@_message("allreduce")
class AllReduce(Message):
    """Worker → coordinator, *during* a forward or backward: sum ``data`` (float64) over the round's shards.

    ``seq`` counts the all-reduces a worker made in the current request; every shard makes the same
    ones in the same order (same model), so equal ``seq`` means the same collective.
    """

    seq: int
    data: bytes


@_message("allreduce_done")
class AllReduceDone(Message):
    """The sum; ``abort`` when another shard failed, so that no worker waits forever."""

    seq: int
    data: bytes
    abort: bool


@_message("bucket_ready")
class BucketReady(Message):
    """Worker → coordinator, *during* a backward: every parameter of gradient bucket ``bucket`` has its
    gradient in the worker's slot (cross-node mode; the buckets come with :class:`Init`'s ``options``).

    Not a reply and not answered: the coordinator starts the bucket's exchange between the nodes once
    every shard reported it (:mod:`dpool.crossnode`). A gradient that grows after its report makes the
    backward's reply ``late``.
    """

    call: int
    bucket: int


# ---------------------------------------------------------------- dpool-workers daemon
@_message("serve")
class Serve(Message):
    """Daemon → warm worker: serve this client (connect to ``endpoint`` with the session ``key``)."""

    endpoint: str
    key: bytes
    ident: bytes
    control: list
    client_pid: int
    max_message_bytes: int


@_message("serve_done")
class ServeDone(Message):
    """Worker → daemon and client: the client session ended; the replica and its memory are gone."""

    steps: int
    reason: str


@_message("end_serve")
class EndServe(Message):
    """Daemon → serving worker: client ``client_pid`` detached; end its session now (as for ``shutdown``).

    A client cut short while attaching (Ctrl-C after the daemon granted the lease, before it had the
    reply) cannot tell workers it never heard of to stop, and it lives on: they served its silent session
    until its process exited, and the daemon refused every other attach as busy.
    """

    client_pid: int


@_message("challenge")
class Challenge(Message):
    """Client → daemon, on a new connection: give me a challenge for my request.

    Every request to a daemon (attach, detach, status, stop) carries the challenge its connection was
    given, which the daemon accepts once, from that connection, for a short while: a recorded request
    replayed later, or from another connection, is dropped unanswered (and counted in the daemon's log).
    """


@_message("challenge_done")
class ChallengeDone(Message):
    challenge: bytes


@_message("attach")
class Attach(Message):
    """Client → daemon: lend me the workers, and have them connect to ``endpoint``.

    The session key is never sent: both sides derive it with :func:`session_key` from the
    pool's key and ``nonce``, so a process squatting on the daemon's endpoint (which does not
    hold the pool key) learns nothing that lets it pose as a worker and receive the model.
    """

    pid: int
    endpoint: str
    nonce: bytes
    control: list
    protocol: int
    max_message_bytes: int
    challenge: bytes = b""  # (see Challenge; filled in by dpool.daemon_client.request)


@_message("attach_done")
class AttachDone(Message):
    """``workers``: ``[index, device, pid, ident]`` each; ``error`` says why not (e.g. the holder's pid)."""

    ok: bool
    workers: list
    error: str
    threads: int
    daemon_pid: int


def mac(key: bytes, payload: bytes) -> bytes:
    """The 32-byte MAC of ``payload`` under ``key`` (16 to 64 bytes): keyed BLAKE2b-256."""
    return hashlib.blake2b(payload, key=key, digest_size=MAC_SIZE).digest()


def session_key(pool_key: bytes, nonce: bytes) -> bytes:
    """The key of one client session: HMAC-SHA256 of ``nonce`` under the pool's key."""
    if len(nonce) < 16:
        raise ProtocolError("attach nonce shorter than 16 bytes")
    return hmac.digest(pool_key, b"dpool session key\x00" + nonce, "sha256")


@_message("detach")
class Detach(Message):
    """Client → daemon: the session of client ``pid`` that its attach with ``nonce`` began is over (its
    workers were told to end it, if it knew them). The nonce names the lease: a second ``wrap()`` of
    the same process, refused or cut short, must not end the first one's."""

    pid: int
    nonce: bytes
    challenge: bytes = b""


@_message("detach_done")
class DetachDone(Message):
    pass


@_message("status")
class Status(Message):
    """Anyone holding the pool key → daemon: what are your workers doing?"""

    challenge: bytes = b""


@_message("status_done")
class StatusDone(Message):
    info: dict


@_message("stop")
class Stop(Message):
    """→ daemon: stop the workers and exit."""

    challenge: bytes = b""


@_message("stop_done")
class StopDone(Message):
    pass


@_message("shutdown")
class Shutdown(Message):
    pass


@_message("failed")
class Failed(Message):
    """Any request may be answered with this: the remote exception as strings.

    A ``stage`` ending in :data:`CONTEXT_LOST` means the worker exits right after this reply (a
    sticky CUDA error left its GPU context unusable): the coordinator treats it as dead.
    """

    stage: str
    module: str
    qualname: str
    message: str
    traceback: str

    @classmethod
    def of(cls, stage: str, exc: BaseException) -> "Failed":
        """``exc``, raised while ``stage``, as strings (its traceback included)."""
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return cls(stage, type(exc).__module__, type(exc).__qualname__, str(exc), tb)


MESSAGES: dict[str, type[Message]] = {
    cls.op: cls  # type: ignore[misc]
    for cls in (
        Boot, Hello, Init, InitDone, Forward, ForwardDone, Fetch, FetchDone, Backward, BackwardDone, FetchSparse,
        FetchSparseDone, Criterion, CriterionDone, ForwardCriterion, ForwardCriterionDone, Inspect, InspectDone, Call,
        CallDone, AllReduce, AllReduceDone, BucketReady,
        Shutdown, Failed, Output, Serve, ServeDone, EndServe, Challenge, ChallengeDone, Attach, AttachDone, Detach,
        DetachDone, Status, StatusDone, Stop,
        StopDone,
    )
}


class Codec:
    """Encodes and authenticates messages with a shared secret key.

    Args:
        key: the pool's secret (32 random bytes), known only to the coordinator
            and its workers.
        max_bytes: largest payload accepted.
    """

    def __init__(self, key: bytes, max_bytes: int = 64 * 1024 * 1024) -> None:
        if not 16 <= len(key) <= 64:
            raise ValueError("dpool auth key must be 16 to 64 bytes")
        self._key = key
        self.max_bytes = max_bytes
        # one packer for every message: msgpack.packb builds a new Packer per call. pack() runs in C
        # under the GIL from start to end, so threads sharing the codec cannot interleave inside it.
        self._pack = msgpack.Packer(use_bin_type=True).pack

    def _mac(self, payload: bytes) -> bytes:
        return mac(self._key, payload)

    def encode(self, msg: Message, seq: int, re: int = 0) -> bytes:
        """The frame of ``msg``, numbered ``seq``; a reply names its request's ``seq`` as ``re``."""
        payload = self._pack([PROTOCOL_VERSION, msg.op, seq, re, msg._values(msg)])  # type: ignore[call-arg]
        return self._mac(payload) + payload

    def decode(self, frames: list[bytes]) -> tuple[int, int, Message]:
        """Authenticate, then decode: ``(seq, re, message)``. Raises :class:`ProtocolError` / :class:`AuthError`."""
        if len(frames) != 1:
            raise ProtocolError(f"expected 1 frame (mac + payload), got {len(frames)}")
        frame = frames[0]
        mac, payload = frame[:MAC_SIZE], frame[MAC_SIZE:]
        if len(payload) > self.max_bytes:
            raise ProtocolError(f"message of {len(payload)} bytes exceeds the limit of {self.max_bytes}")
        if len(mac) != MAC_SIZE or not hmac.compare_digest(self._mac(payload), mac):
            raise AuthError("message failed authentication (wrong or missing key); it was not decoded")
        try:
            obj = msgpack.unpackb(
                payload,
                raw=False,
                strict_map_key=True,
                use_list=True,
            )
        except Exception as exc:  # msgpack raises several unrelated types
            raise ProtocolError(f"undecodable message: {type(exc).__name__}: {exc}") from None
        return self._validate(obj)

    @staticmethod
    def _validate(obj: Any) -> tuple[int, int, Message]:
        if not isinstance(obj, list) or len(obj) != 5:
            raise ProtocolError("message is not a [version, op, seq, re, body] array")
        version, op, seq, re, body = obj
        if version != PROTOCOL_VERSION:
            raise ProtocolError(
                f"dpool protocol {version!r} peer cannot talk to protocol {PROTOCOL_VERSION}; "
                "coordinator and workers run different dpool versions"
            )
        cls = MESSAGES.get(op) if isinstance(op, str) else None
        if cls is None:
            raise ProtocolError(f"unknown op {op!r}")
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
            raise ProtocolError(f"bad sequence number {seq!r}")
        if not isinstance(re, int) or isinstance(re, bool) or re < 0:
            raise ProtocolError(f"bad reply number {re!r}")
        if not isinstance(body, list) or len(body) != len(cls._names):
            raise ProtocolError(f"{op}: expected {len(cls._names)} fields")
        for i, name, exact in cls._checks:
            value = body[i]
            if exact is None:
                body[i] = _metas(op, name, value)
            elif type(value) not in exact:
                raise ProtocolError(f"{op}.{name}: unexpected {type(value).__name__}")
        return seq, re, cls(*body)


def _metas(op: str, name: str, value: Any) -> list:
    """``value`` as a list of :class:`TensorMeta` (``None`` kept), or a :class:`ProtocolError`."""
    if not isinstance(value, list):
        raise ProtocolError(f"{op}.{name}: unexpected {type(value).__name__}")
    out: list = []
    for m in value:
        if m is None:
            out.append(None)
        elif (isinstance(m, list) and len(m) == 4 and isinstance(m[0], str) and isinstance(m[1], list)
              and isinstance(m[2], int) and isinstance(m[3], bool)):
            out.append(TensorMeta(*m))
        else:
            raise ProtocolError(f"{op}.{name}: not a tensor meta: {m!r:.80}")
    return out
