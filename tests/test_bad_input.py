"""Bad input: odd dtypes and layouts, unsupported tensors, shared memory too small, hostile messages."""
from __future__ import annotations

import copy
import os
import pickle
import re

import msgpack
import pytest
import torch
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import dpool
from tests.conftest import leak_check
from dpool import protocol as P
from dpool.tensors import DTYPES
from dpool.errors import AuthError, ProtocolError


class Identity(nn.Module):
    """Returns its inputs (a parameter makes the call differentiable)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, *xs):
        return xs


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.numel() else t.reshape(-1).view(torch.uint8)


@pytest.fixture(scope="module")
def identity_pool():
    """One pool for the many bad-input tests; checked for leaks when it closes."""
    check = leak_check()
    next(check)
    model = dpool.wrap(Identity(), ["cpu", "cpu"], heartbeat_timeout_s=30.0)
    yield model
    model.close()
    next(check, None)


@pytest.fixture(autouse=True)
def no_leaks(request):
    """The module-scoped pool outlives each test that uses it; every other test is checked as usual."""
    if "identity_pool" in request.fixturenames:
        yield
    else:
        yield from leak_check()


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_every_dtype_round_trips_bitwise(identity_pool, name):
    dtype = DTYPES[name]
    high = 2 if dtype == torch.bool else 256  # a bool tensor only holds 0 and 1
    raw = torch.randint(0, high, (6, 5 * dtype.itemsize), dtype=torch.uint8)
    x = raw.view(dtype)  # arbitrary bit patterns, NaNs included; never through numpy
    with torch.no_grad():
        (y,) = identity_pool(x)
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(_bits(y), _bits(x))


@pytest.mark.parametrize("layout", ["transposed", "strided_slice", "expanded", "channels_last", "offset",
                                    "zero_dim", "zero_size", "high_rank"])
def test_odd_layouts_round_trip(identity_pool, layout):
    base = torch.randn(8, 6, 4, 5)
    x = {
        "transposed": base[:, :, 0, 0].t().contiguous().t(),
        "strided_slice": base[:, ::2, 1],
        "expanded": torch.randn(1, 5).expand(8, 5),
        "channels_last": base.to(memory_format=torch.channels_last),
        "offset": base.reshape(-1)[7:7 + 8 * 3].view(8, 3),
        "zero_dim": torch.tensor(3.5),
        "zero_size": torch.randn(8, 0, 3),
        "high_rank": torch.randn(4, *([1] * 10), 2),
    }[layout]
    with torch.no_grad():
        out = identity_pool(x)
    y = out[0] if layout != "zero_dim" else out[0]
    if layout == "zero_dim":  # nothing to split: one shard; its 0-dim output gathers to a vector
        assert torch.equal(y, torch.tensor([3.5]))
    else:
        assert y.shape == x.shape and torch.equal(y, x)
        assert y.is_contiguous()  # documented: results arrive in row-major layout


def test_requires_grad_leaf_and_parameter_inputs(identity_pool):
    x = torch.randn(6, 3, requires_grad=True)
    p = nn.Parameter(torch.randn(6, 3))
    a, b = identity_pool(x, p)
    (a * 2 + b * 3).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0)) and torch.equal(p.grad, torch.full_like(p, 3.0))


@pytest.mark.parametrize("kind", ["sparse", "nested", "quantized", "meta", "subclass"])
def test_unsupported_tensors_raise_type_error(identity_pool, kind):
    class Sub(torch.Tensor):
        pass

    x = {
        "sparse": lambda: torch.eye(4).to_sparse(),
        "nested": lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
        "quantized": lambda: torch.quantize_per_tensor(torch.ones(4, 2), 0.1, 0, torch.qint8),
        "meta": lambda: torch.empty(4, 2, device="meta"),
        "subclass": lambda: torch.ones(4, 2).as_subclass(Sub),
    }[kind]()
    with pytest.raises(TypeError, match="dpool"):
        identity_pool(x)
    with torch.no_grad():
        identity_pool(torch.ones(4, 1))  # still usable


def test_empty_batch_is_a_clear_value_error(identity_pool):
    with pytest.raises(ValueError, match="empty batch"):
        identity_pool(torch.zeros(0, 3))


@pytest.mark.parametrize("transform", ["vmap", "vmap_same", "grad", "jacrev"])
def test_torch_func_transforms_are_refused_before_anything_is_sent(identity_pool, transform):
    """Inside vmap or grad the inputs are the transform's wrapped tensors: torch failed deep inside their copy
    into shared memory, and a vmap(randomness="same") as a pool's first call left it failing at every call."""
    x = torch.randn(2, 4, 3)
    run = {
        "vmap": lambda: torch.func.vmap(identity_pool)(x),
        "vmap_same": lambda: torch.func.vmap(identity_pool, randomness="same")(x),
        "grad": lambda: torch.func.grad(lambda t: identity_pool(t)[0].sum())(x[0]),
        "jacrev": lambda: torch.func.jacrev(lambda t: identity_pool(t)[0])(x[0]),
    }[transform]
    with pytest.raises(dpool.UnsupportedError, match=r"inside a torch\.func transform.*dpool\.unwrap\(model\)"):
        run()
    with torch.no_grad():
        assert torch.equal(identity_pool(x[0])[0], x[0])  # still usable


def test_a_round_whose_messages_fail_to_build_leaves_the_pool_usable(wrap):
    """A backward whose output gradient fails to copy into a worker's new gradient segment: the segment was
    never named to the worker, but the next request unlinked its name, and every later backward failed
    ("No such file or directory"). The segments made for a round that was not sent are forgotten now."""
    class Unwritable(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func is torch.Tensor.copy_:
                raise RuntimeError("this gradient cannot be copied")
            return super().__torch_function__(func, types, args, kwargs or {})

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    ref = copy.deepcopy(net)
    model = wrap(net)
    out = model(torch.randn(6, 4, dtype=torch.float64))  # the pool's first backward makes its segments
    with pytest.raises(RuntimeError, match="cannot be copied"):
        out.backward(torch.ones(6, 3, dtype=torch.float64).as_subclass(Unwritable))
    for _ in range(2):
        x = torch.randn(6, 4, dtype=torch.float64)
        for m in (net, ref):
            m.zero_grad()
        model(x).pow(2).sum().backward()
        ref(x).pow(2).sum().backward()
        for (n, p), rp in zip(net.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, rp.grad, msg=n)


class ConstantOnSmallShards(nn.Module):
    """A shard of at most 5 rows gets an output that does not depend on the parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) if x.shape[0] > 5 else torch.zeros(x.shape[0], 3)


@pytest.mark.parametrize("forward_with_loss", ["auto", "off"])
def test_a_loss_that_fails_on_the_workers_leaves_the_pool_usable(wrap, monkeypatch, forward_with_loss):
    """A worker maps a segment when a request first names it, and the name is unlinked after that request.
    A first loss with a target of the wrong shape failed on the workers before they mapped the segment for
    the backward that runs with the loss; the retry with the right target, and every later backward, then
    failed ("No such file or directory") although the error said the pool was still usable. So did a shard
    whose output does not depend on the parameters: it runs no backward with the loss, and did not map that
    segment either. Now a failed worker gets new segments, and the criterion maps its segments first. Against
    one process, with the forward waiting for its loss and without."""
    monkeypatch.setenv("DPOOL_FORWARD_WITH_LOSS", forward_with_loss)
    torch.manual_seed(0)
    for net in (nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)), ConstantOnSmallShards()):
        ref = copy.deepcopy(net)
        model = wrap(net, gather=False)
        crit, ce = dpool.criterion(nn.CrossEntropyLoss()), nn.CrossEntropyLoss()
        opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (net, ref)]
        x = torch.randn(11, 4)  # shards of 6 and 5 rows
        out = model(x)
        with pytest.raises(RuntimeError, match="target") as info:
            crit(out, torch.randint(0, 3, (11, 2, 5)))
        assert info.value.worker == 0 and "criterion" in str(info.value)
        for step in range(3):
            y = torch.randint(0, 3, (11,))
            for opt in opts:
                opt.zero_grad()
            if step:
                out = model(x)
            crit(out, y).backward()
            ce(torch.cat([ref(x[:6]), ref(x[6:])]), y).backward()
            for opt in opts:
                opt.step()
            for (n, p), q in zip(net.named_parameters(), ref.parameters()):
                torch.testing.assert_close(p, q, msg=f"{type(net).__name__} {n}, step {step}")
            x = torch.randn(11, 4)


def test_shared_memory_too_small_is_reported_before_writing(identity_pool):
    shm = os.environ.get("DPOOL_SHM_DIR", "/dev/shm")
    free = os.statvfs(shm).f_bavail * os.statvfs(shm).f_frsize
    huge = torch.zeros(1, dtype=torch.uint8).expand(free + (1 << 30))  # no real memory behind it
    # (split in two shards, each would fit alone: the check covers the whole call, before any segment)
    before = set(os.listdir(shm))
    with pytest.raises(dpool.SharedMemoryError,
                       match=rf"needs .* MiB of shared memory in {re.escape(shm)}, but only .* free"):
        with torch.no_grad():
            identity_pool(huge)
    assert set(os.listdir(shm)) == before  # nothing partial left
    with torch.no_grad():
        identity_pool(torch.ones(4, 1))


# ---------------------------------------------------------------- protocol
KEY = b"k" * 32


def _frame(payload: bytes, key: bytes = KEY) -> list[bytes]:
    return [P.mac(key, payload) + payload]


V = P.PROTOCOL_VERSION
HOSTILE = [
    b"\xc1",  # never-used msgpack byte
    msgpack.packb([V, "forward", 1])[:-1],  # truncated
    msgpack.packb([V, "hello", 1, 0, [0, 1, 1, "t", "p"]]) + b"\x00",  # trailing bytes
    b"\xdd\xff\xff\xff\xff",  # array header claiming 2^32-1 items
    b"\x91" * 100_000 + b"\xc0",  # 100k nesting
    msgpack.packb([V, "hello", 1, 0, [0, 1, 1, b"\xff\xfe".decode("latin-1"), "p"]]).replace(b"\xc3\xbf", b"\xff"),
    msgpack.packb({1: 2}),  # int map key / not an array
    msgpack.packb(msgpack.ExtType(42, b"x")),  # unknown ExtType
    msgpack.packb([V, "hello", 1, 0, ["zero", 1, 1, "t", "p"]]),  # wrong field type
    msgpack.packb([V, "hello", 1, 0, [0, 1]]),  # missing fields
    msgpack.packb([V, "fetch", 1, 0, [True, ["seg", 64]]]),  # a bool where an int is expected
    msgpack.packb([V, "backward_done", 1, 0, [1, b"\x01", [], 1, [], 0, False]]),  # an int where a float is expected
    msgpack.packb([V, "fetch", 1, 0, [3, b"seg"]]),  # bytes where a list is expected
    msgpack.packb([V, "nope", 1, 0, []]),  # unknown op
    msgpack.packb([V + 1, "hello", 1, 0, [0, 1, 2, "t", "p"]]),  # other protocol version
    msgpack.packb([V, "hello", -5, 0, [0, 1, 1, "t", "p"]]),  # bad sequence number
    msgpack.packb([V, "hello", 1, -1, [0, 1, 1, "t", "p"]]),  # bad reply number
    msgpack.packb([V, "hello", 1, True, [0, 1, 1, "t", "p"]]),  # a bool where the reply number is expected
    msgpack.packb([V, "hello", 1, [0, 1, 1, "t", "p"]]),  # the envelope of protocol 11 (no reply number)
    msgpack.packb([V, "fetch_done", 1, 0, [3, [["float32", [2], 0]]]]),  # tensor meta with a missing field
    msgpack.packb([V, "fetch_done", 1, 0, [3, [["float32", [2], "0", False]]]]),  # tensor meta offset not an int
    msgpack.packb([V, "fetch_done", 1, 0, [3, {"a": 1}]]),  # metas not a list
]


@pytest.mark.parametrize("payload", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_payloads_are_protocol_errors(payload):
    codec = P.Codec(KEY)
    with pytest.raises(ProtocolError):
        codec.decode(_frame(payload))


def test_wrong_key_missing_mac_and_oversize():
    codec = P.Codec(KEY, max_bytes=1024)
    good = msgpack.packb([P.PROTOCOL_VERSION, "shutdown", 1, 0, []])
    assert isinstance(codec.decode(_frame(good))[2], P.Shutdown)
    with pytest.raises(AuthError):
        codec.decode(_frame(good, key=b"x" * 32))
    with pytest.raises(AuthError):
        codec.decode([good])
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        codec.decode(_frame(b"\x00" * 2048))
    with pytest.raises(ProtocolError, match="frame"):
        codec.decode([b"a", b"b"])
    other = P.PROTOCOL_VERSION + 1
    with pytest.raises(ProtocolError, match=f"protocol {other} peer cannot talk to protocol {P.PROTOCOL_VERSION}"):
        codec.decode(_frame(msgpack.packb([other, "shutdown", 1, 0, []])))


def test_tensor_metas_arrive_typed():
    """Tensor metas travel as arrays and come out of decode() as TensorMeta (None kept)."""
    codec = P.Codec(KEY)
    meta = P.TensorMeta("float32", [2, 3], 64, True)
    seq, re_, msg = codec.decode([codec.encode(P.BackwardDone(1, b"\x01", [meta, None], 0.5, [], 0, False, 12.5), 7, 5)])
    assert (seq, re_) == (7, 5)  # the reply names the request it answers
    assert msg.input_grads == [meta, None] and isinstance(msg.input_grads[0], P.TensorMeta)
    assert msg.input_grads[0].requires_grad is True and msg.input_grads[0].shape == [2, 3]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_fuzz_decode_authenticated_garbage(payload):
    """Even with a valid MAC, nothing but ProtocolError escapes decode()."""
    try:
        P.Codec(KEY).decode(_frame(payload))
    except ProtocolError:
        pass


_leaf = st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=8) | st.binary(max_size=8)
_obj = st.recursive(_leaf, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=4), c, max_size=4),
                    max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, P.PROTOCOL_VERSION + 1), st.sampled_from(sorted(P.MESSAGES)), st.integers(-2, 2**40),
       st.integers(-2, 2**40), _obj)
def test_fuzz_decode_structured(version, op, seq, re_, body):
    try:
        P.Codec(KEY).decode(_frame(msgpack.packb([version, op, seq, re_, body])))
    except ProtocolError:
        pass


def test_a_message_inside_another_is_checked_as_a_whole_one():
    """forward_criterion carries a forward's and a criterion's fields: the worker checks them as decode()
    checks a message, and only those ops (and their replies) may travel inside another."""
    fwd = P.Forward(3, 1, True, b"\x01", b"\x01", False, ["in", 64], ["out", 64], ["T", 0],
                    [P.TensorMeta("float32", [2, 2], 0, False)], 0, 2, True, None, [], 7, [])
    body = msgpack.unpackb(msgpack.packb(P.values_of(fwd)), raw=False)
    assert P.inner("forward", body) == fwd
    with pytest.raises(ProtocolError, match="'shutdown' cannot travel inside another message"):
        P.inner("shutdown", [])
    with pytest.raises(ProtocolError, match="forward: expected 17 fields"):
        P.inner("forward", body[:3])
    body[4] = "not a bool"
    with pytest.raises(ProtocolError, match="forward.requires_grad: unexpected str"):
        P.inner("forward", body)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=256), st.binary(min_size=32, max_size=32))
def test_fuzz_unauthenticated_frames_never_decoded(payload, mac):
    with pytest.raises(AuthError):
        P.Codec(KEY).decode([mac + payload])


def test_foreign_peer_cannot_break_or_feed_the_pool(tmp_path):
    """A process without the key connects to the pool's socket: its messages (a canary pickle
    among them) are dropped unread, and the pool keeps training."""
    canary = tmp_path / "canary"

    class Canary:
        def __reduce__(self):
            return (open, (str(canary), "w"))

    model = dpool.wrap(Identity(), ["cpu", "cpu"], max_message_bytes=1 << 20)
    try:
        pool = model._runtime.pool
        ctx = zmq.Context()
        rogue = ctx.socket(zmq.DEALER)
        rogue.setsockopt(zmq.LINGER, 0)
        rogue.setsockopt(zmq.ROUTING_ID, pool.workers[0].ident)  # even claiming a worker's identity
        rogue.connect(pool.endpoint)
        evil = pickle.dumps(Canary())
        payload = msgpack.packb([P.PROTOCOL_VERSION, "call_done", 99, 0, [evil]])
        oversized = [b"\x00" * 32 + b"\x00" * (2 << 20)]  # past ZMQ_MAXMSGSIZE: the peer is cut off
        for frame in ([b"\x00" * 32 + payload], [payload], [b"junk", b"more"], oversized):
            rogue.send_multipart(frame)
        x = torch.randn(6, 2)
        for _ in range(3):
            with torch.no_grad():
                assert torch.equal(model(x)[0], x)
        assert not canary.exists()
        rogue.close()
        ctx.term()
    finally:
        model.close()
    assert not canary.exists()
