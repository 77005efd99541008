"""The modules a step is built from, in process: no worker is started, each is called directly.

These run in milliseconds and pin down each building block's contract (tree, scatter, gather, reduce,
the I/O regions, the codec and the channel); the step's own decisions are tests/test_step_units.py's,
and the end-to-end tests check that they compose into a step that matches a single-process reference.
"""
from __future__ import annotations

import collections
import dataclasses
import os
import secrets

import msgpack
import pytest
import torch
import zmq

import dpool
from dpool import gather, protocol as P, scatter, tree
from dpool.bridge import Graphs
from dpool.channel import Channel
from dpool.layout import Layout
from dpool.reduce import Reducer, sum_sparse
from dpool.regions import MIN_IO, IORegions
from dpool.tensors import Placer, dense_strides, read
from dpool.transport import new_region
from dpool.transport.shm import segment_prefix

Pair = collections.namedtuple("Pair", "a b")


@dataclasses.dataclass
class Box:
    x: torch.Tensor
    tag: str


# ---------------------------------------------------------------------------- tree
def test_tree_round_trips_nested_structures_and_keeps_tensors_out_of_the_spec():
    t1, t2, t3 = torch.randn(4, 2), torch.arange(3), torch.ones(())
    obj = ({"a": [t1, 3, "s"], "b": Pair(t2, None)}, Box(t3, "tag"), (1.5, b"raw"))
    tensors: list[torch.Tensor] = []
    spec = tree.flatten(obj, tensors)
    assert [t.data_ptr() for t in tensors] == [t1.data_ptr(), t2.data_ptr(), t3.data_ptr()]
    msgpack.packb(spec, use_bin_type=True)  # the spec travels as msgpack: no tensor, no pickle inside
    back = tree.unflatten(msgpack.unpackb(msgpack.packb(spec, use_bin_type=True), raw=False), tensors.__getitem__)
    assert back[0]["a"][0] is t1 and back[0]["a"][1:] == [3, "s"]
    assert isinstance(back[0]["b"], Pair) and back[0]["b"].a is t2 and back[0]["b"].b is None
    assert isinstance(back[1], Box) and back[1].x is t3 and back[1].tag == "tag"
    assert back[2] == (1.5, b"raw")


# ---------------------------------------------------------------------------- scatter
def test_scatter_plans_even_non_empty_shards_and_gives_small_tensors_whole():
    x, scalar, y = torch.randn(9, 3), torch.tensor(2.0), torch.randn(9)
    k, splits = scatter.plan([x, scalar, y], 4, 0)
    assert k == 4 and splits == [[3, 2, 2, 2], None, [3, 2, 2, 2]]  # chunk would give 3, 3, 3
    shards = scatter.shard_views([x, scalar, y], splits, k, 0)
    assert torch.equal(torch.cat([s[0] for s in shards]), x)
    assert all(s[1] is scalar for s in shards)
    assert shards[1][0].data_ptr() == x[3:].data_ptr()  # views, no copy
    assert scatter.plan([torch.randn(2, 5)], 4, 0)[0] == 2  # fewer rows than workers: fewer shards
    with pytest.raises(ValueError, match="empty batch"):
        scatter.plan([torch.randn(0, 5)], 2, 0)


def test_balancer_weights_fixed_measured_and_refused():
    assert scatter.Balancer(2).weights() is None
    assert scatter.Balancer(2, [3, 1]).weights() == [3.0, 1.0]
    auto = scatter.Balancer(2, balance="auto")
    assert auto.weights() is None  # nothing measured yet: even shards
    auto.observe(0, [0.010, 0.030], [10, 10])
    auto.observe(1, [0.010, 0.030], [10, 10])
    w = auto.weights()
    assert w is not None and w[0] == pytest.approx(3 * w[1])  # the 3× slower worker gets a third of the rows
    assert scatter.weighted_sizes(40, w) == [30, 10]
    with pytest.raises(ValueError, match="positive"):
        scatter.Balancer(2, [1, 0])
    with pytest.raises(ValueError, match="not both"):
        scatter.Balancer(2, [1, 1], "auto")
    with pytest.raises(ValueError, match="only balancing mode"):
        scatter.Balancer(2, balance="fast")


# ---------------------------------------------------------------------------- gather
def test_gather_groups_tensors_across_shards_and_rebuilds_the_structure():
    shards = [({"y": torch.randn(2, 3), "n": 1}, [torch.randn(2)]), ({"y": torch.randn(1, 3), "n": 2}, [torch.randn(1)])]
    specs, per_shard = [], []
    for out in shards:
        ts: list[torch.Tensor] = []
        specs.append(tree.flatten(out, ts, output=True))
        per_shard.append(ts)
    groups = gather.tensor_groups(specs)
    assert groups == [[0, 0], [1, 1]]
    cats = [torch.cat([per_shard[s][g[s]] for s in range(2)]) for g in groups]
    built = gather.build(specs, iter(cats))
    assert torch.equal(built[0]["y"], torch.cat([shards[0][0]["y"], shards[1][0]["y"]]))
    assert built[0]["n"] == [1, 2]  # non-tensor leaves: one per shard
    assert torch.equal(built[1][0], cats[1])
    mismatched = [tree.flatten({"a": torch.ones(1)}, [], output=True), tree.flatten({"b": torch.ones(1)}, [], output=True)]
    with pytest.raises(dpool.GatherError):
        gather.tensor_groups(mismatched)


# ---------------------------------------------------------------------------- reduce
def _slots(params, k, seed):
    """k gradient slots laid out like ``params`` (random values), and the per-parameter gradients they hold."""
    layout = Layout(params, [])
    g = torch.Generator().manual_seed(seed)
    slots, grads = [], []
    for _ in range(k):
        u8 = torch.zeros(layout.size, dtype=torch.uint8)
        mine = []
        for p, off in zip(params, layout.param_offsets):
            v = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)
            st = dense_strides(p)
            view = u8[off:off + v.numel() * v.element_size()].view(p.dtype)
            if st:
                view.as_strided(p.shape, st).copy_(v)
            else:
                view.view(p.shape).copy_(v)
            mine.append(v)
        slots.append([u8[a:b].view(dt) for dt, a, b, _ in layout.param_groups])
        grads.append(mine)
    return layout, slots, grads


def test_reducer_sums_slots_per_dtype_group_in_each_parameters_memory_format():
    params = [torch.zeros(3, 4), torch.zeros(5, dtype=torch.float64), torch.zeros(2, 3, 4, 4).to(memory_format=torch.channels_last),
              torch.zeros(7)]
    layout, slots, grads = _slots(params, 3, 0)
    used = [bytes([1, 1, 1, 0])] * 2 + [bytes([1, 0, 1, 0])]  # shard 2 did not use param 1; nobody used param 3
    red = Reducer(layout, params, [dense_strides(p) for p in params], torch.device("cpu"))
    out = red.reduce(slots, used)
    assert out[3] is None
    for i in range(3):
        want = sum(grads[s][i] for s in range(3))  # an unused parameter's slot is zero-filled by the worker
        torch.testing.assert_close(out[i], want)
        assert out[i].dtype == params[i].dtype and out[i].stride() == params[i].stride()
    assert out[2].is_contiguous(memory_format=torch.channels_last)
    assert all(out[i].data_ptr() != slots[0][0].data_ptr() for i in range(3))  # new memory: slots are reused


def test_reducer_hooks_see_every_group_before_any_gradient():
    params = [torch.zeros(4), torch.zeros(2, dtype=torch.float64)]
    layout, slots, grads = _slots(params, 2, 1)
    seen = []

    class Doubling(Reducer):  # what a cross-node reducer does: combine the local sums, widen the mask
        def combine(self, slots, mask, at, late=False):
            seen.append((bytes(mask), at, late))
            groups = [0, 1]
            return groups, [2 * (s0 + s1) for s0, s1 in zip(*slots)], bytearray(b"\x01\x01")

    out = Doubling(layout, params, [None, None], torch.device("cpu")).reduce(slots, [b"\x01\x00"] * 2, at=7)
    assert seen == [(b"\x01\x00", 7, False)]  # parameter 1 had a gradient on another node only
    torch.testing.assert_close(out[0], 2 * (grads[0][0] + grads[1][0]))
    torch.testing.assert_close(out[1], 2 * (grads[0][1] + grads[1][1]))


def test_sparse_gradients_are_summed_as_sparse_tensors():
    params = [torch.zeros(5, 2)]
    grads: list = [None]
    i1, v1 = torch.tensor([[0, 3]]), torch.ones(2, 2)
    i2, v2 = torch.tensor([[3]]), torch.full((1, 2), 2.0)
    sum_sparse(grads, [(0, i1, v1), (0, i2, v2)], params, torch.device("cpu"))
    assert grads[0].is_sparse
    want = torch.zeros(5, 2)
    want[0] += 1
    want[3] += 3
    torch.testing.assert_close(grads[0].to_dense(), want)


# ---------------------------------------------------------------------------- I/O regions
@pytest.fixture
def regions(tmp_path):
    made = []
    prefix = segment_prefix()

    def new(w, size):
        seg = new_region(torch.device("cpu"), str(tmp_path), f"{prefix}-{len(made)}", 1 << (size - 1).bit_length())
        made.append(seg)
        return seg

    io = IORegions(2, new)
    yield io, made
    io.clear()
    while made:  # unlinked, and unmapped once the last reference goes
        seg = made.pop()
        seg.unlink()
        seg.close_fd()
    del seg


def test_regions_grow_by_doubling_and_keep_inputs_of_live_calls(regions):
    io, made = regions
    out = io.ensure(0, "out", 10)
    assert out.size == MIN_IO and io.ensure(0, "out", MIN_IO) is out
    assert io.ensure(0, "out", MIN_IO + 1).size == 2 * MIN_IO
    seg, start = io.input_region(1, 1000)
    assert start == 0
    io.keep(1, 7, (seg, 0, 1000))  # call 7's graph may have saved these inputs
    seg2, start2 = io.input_region(1, 1000)
    assert seg2 is seg and start2 == 1000  # placed after the kept span, not over it
    assert io.input_growth(1, MIN_IO) == 2 * MIN_IO
    io.release(7)
    assert io.input_region(1, 1000) == (seg, 0)
    io.keep(1, (8, "targets", 0, 0), (seg, 0, 64))
    io.release(8)
    assert io.kept(1, (8, "targets", 0, 0)) is None
    io.reset(1)
    assert io.segment(1, "in") is None and io.segment(0, "out") is not None


def test_placer_writes_and_reads_back_through_metas(regions):
    io, _ = regions
    seg = io.ensure(0, "in", 4096)
    ts = [torch.randn(3, 5), torch.arange(6, dtype=torch.int64).view(2, 3).t(), torch.tensor(True)]
    placer = Placer()
    offs = [placer.reserve(t) for t in ts]
    metas = [Placer.write(seg.views, o, t, i == 0) for i, (o, t) in enumerate(zip(offs, ts))]
    assert all(m.offset % 64 == 0 for m in metas) and metas[0].requires_grad and not metas[1].requires_grad
    for t, m in zip(ts, metas):
        assert torch.equal(read(seg.views, m), t)


# ---------------------------------------------------------------------------- graph lifetimes
def test_graphs_release_calls_whose_owner_is_gone_and_lose_all_on_restart():
    class Owner:
        saved_tensors = ()

    g = Graphs()
    released = []
    a, b = g.new_call(), g.new_call()
    owner_a, owner_b = Owner(), Owner()
    g.track(a, owner_a)
    g.track(b, owner_b)
    assert g.collect(released.append) == [] and g.kept(a)
    del owner_a
    assert g.collect(released.append) == [a] and released == [a] and not g.kept(a)
    g.release(99)
    assert g.collect(released.append) == [99]
    g.lose_all()
    assert g.lost(b) and not g.kept(b) and g.collect(released.append) == [b]
    assert not g.lost(g.new_call())


# ---------------------------------------------------------------------------- codec and channel
def test_codec_round_trips_typed_messages_and_rejects_tampering():
    key = secrets.token_bytes(32)
    codec = P.Codec(key, 1 << 20)
    meta = P.TensorMeta("float32", [2, 3], 64, True)
    msg = P.FetchDone(5, [meta, None])
    seq, re_, back = codec.decode([codec.encode(msg, 3)])
    assert seq == 3 and re_ == 0 and back == msg and isinstance(back.tensors[0], P.TensorMeta)
    frame = bytearray(codec.encode(msg, 4))
    frame[-1] ^= 1
    with pytest.raises(dpool.AuthError):
        codec.decode([bytes(frame)])
    with pytest.raises(dpool.AuthError):
        P.Codec(secrets.token_bytes(32)).decode([codec.encode(msg, 5)])
    bad = msgpack.packb([P.PROTOCOL_VERSION, "fetch_done", 1, 0, [5, [["float32", "not a shape", 0, True]]]])
    with pytest.raises(dpool.ProtocolError, match="not a tensor meta"):
        P.Codec._validate(msgpack.unpackb(bad, raw=False))
    with pytest.raises(dpool.ProtocolError, match="exceeds"):
        P.Codec(key, 16).decode([codec.encode(msg, 6)])


def test_boot_message_is_typed_and_validated():
    boot = P.Boot("embedded", b"k" * 32, "ipc:///x", 1, b"w1.0", "cpu", os.getpid(), 2, "/dev/shm", "p", [3, 4096],
                  None, 0.2, 1 << 20)
    assert P.Boot.unpack(boot.pack()) == boot
    with pytest.raises(dpool.ProtocolError):
        P.Boot.unpack(b"\xc1 not msgpack")
    with pytest.raises(dpool.ProtocolError):
        P.Boot.unpack(msgpack.packb([P.PROTOCOL_VERSION, "boot", 0, 0, ["embedded"]]))
    with pytest.raises(dpool.ProtocolError, match="expected a boot"):
        P.Boot.unpack(msgpack.packb([P.PROTOCOL_VERSION, "shutdown", 0, 0, []]))


def test_channel_authenticates_orders_and_counts_rejections():
    ctx = zmq.Context()
    key = secrets.token_bytes(32)
    rejected = []
    router = Channel(ctx, True, key, 1 << 16, on_reject=lambda peer, exc: rejected.append((peer, str(exc))))
    dealer = Channel(ctx, False, key, 1 << 16, ident=b"w0.0")
    rogue = Channel(ctx, False, secrets.token_bytes(32), 1 << 16, ident=b"rogue")  # a peer without the key
    try:
        endpoint = f"inproc://stages-{secrets.token_hex(4)}"
        router.bind(endpoint)
        dealer.connect(endpoint)
        dealer.send(P.Hello(0, 1, P.PROTOCOL_VERSION, "t", "p"))
        assert router.poll(5000)
        peer, msg = router.recv()
        assert peer == b"w0.0" and isinstance(msg, P.Hello)
        router.send(P.Shutdown(), peer)
        assert dealer.poll(5000) and isinstance(dealer.recv()[1], P.Shutdown)
        # a replayed frame (a valid MAC, an old sequence number) is dropped and counted
        replay = dealer.codec.encode(P.Hello(0, 1, P.PROTOCOL_VERSION, "t", "p"), 1)
        dealer.sock.send(replay)
        rogue.connect(endpoint)
        rogue.send(P.Hello(0, 1, P.PROTOCOL_VERSION, "t", "p"))
        dealer.send(P.Shutdown())
        got = []
        while not got or router.rejected < 2:
            assert router.poll(5000), (got, rejected)
            got += router.drain()
        assert [type(m) for _, m in got] == [P.Shutdown]
        assert router.rejected == 2 and len(rejected) == 2
        assert "replayed" in rejected[0][1] + rejected[1][1]
    finally:
        for ch in (router, dealer, rogue):
            ch.close()
        ctx.term()


def test_a_send_cut_by_ctrl_c_anywhere_loses_or_glues_no_other_message():
    """A ROUTER message is two frames; Ctrl-C between them used to leave half a message queued, and the
    next send was glued to it. At every instruction of the send path, the cut message either arrives
    whole or not at all, the next messages to both peers arrive, and nothing is rejected."""
    from dpool import channel
    from tests.helpers import CtrlC

    ctx = zmq.Context()
    key = secrets.token_bytes(32)
    router = Channel(ctx, True, key, 1 << 16, send_timeout_ms=1000)
    dealers = {name: Channel(ctx, False, key, 1 << 16, ident=name) for name in (b"a", b"b")}
    try:
        endpoint = f"inproc://cut-{secrets.token_hex(4)}"
        router.bind(endpoint)
        for d in dealers.values():
            d.connect(endpoint)
            d.send(P.Hello(0, 1, P.PROTOCOL_VERSION, "t", "p"))
            assert router.poll(5000) and isinstance(router.recv()[1], P.Hello)
        sends = [Channel.send, Channel.next_seq, channel._end_cut_message]
        positions = CtrlC.positions(sends, lambda: router.send(P.Call(b"first"), b"a"))
        assert dealers[b"a"].poll(5000) and dealers[b"a"].recv()[1] == P.Call(b"first")
        assert len(positions) >= 5
        for i, (code, offset) in enumerate(positions):
            cut_msg = P.Call(b"cut %d" % i)
            with CtrlC(code, offset) as cut:
                try:
                    router.send(cut_msg, b"a")
                except KeyboardInterrupt:
                    pass
            assert cut.hit
            router.send(P.Call(b"b %d" % i), b"b")
            router.send(P.Call(b"a %d" % i), b"a")
            got = {}
            for name, d in dealers.items():
                got[name] = []
                while not got[name] or got[name][-1].fn[:1] != name:
                    assert d.poll(5000), (i, code.co_name, offset, got)
                    got[name].append(d.recv()[1])
            assert got[b"b"] == [P.Call(b"b %d" % i)]
            assert got[b"a"] in ([P.Call(b"a %d" % i)], [cut_msg, P.Call(b"a %d" % i)])
        assert router.rejected == 0 and all(d.rejected == 0 for d in dealers.values())
    finally:
        for ch in (router, *dealers.values()):
            ch.close()
        ctx.term()

# ---------------------------------------------------------------------------- the house
def _dpool_imports() -> dict[str, set[str]]:
    """module → the dpool modules it imports at run time (anywhere in it, functions included), from the source."""
    import ast
    import pathlib

    root = pathlib.Path(dpool.__file__).parent
    graph: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root.parent).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        package = name if rel.name == "__init__" else name.rpartition(".")[0]
        deps: set[str] = set()
        tree_ = ast.parse(path.read_text())
        for block in ast.walk(tree_):  # imports for type checkers only are not imports at run time
            if isinstance(block, ast.If) and getattr(block.test, "id", None) == "TYPE_CHECKING":
                block.body = []
        for node in ast.walk(tree_):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    target = f"{base}.{node.module}" if node.module else base
                else:
                    target = node.module or ""
                for a in node.names:  # `from . import gather` imports the module dpool.gather
                    sub = f"{target}.{a.name}"
                    is_module = (root.parent / (sub.replace(".", "/") + ".py")).exists() \
                        or (root.parent / sub.replace(".", "/")).is_dir()
                    deps.add(sub if is_module else target)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        graph[name] = {d for d in deps if d.split(".")[0] in ("dpool", "dpool_workers", "workers") and d != name}
    return graph


def test_dpool_imports_go_one_way_without_cycles():
    graph = _dpool_imports()
    assert not [m for m, deps in graph.items() if any(d.split(".")[0] != "dpool" for d in deps)], \
        "dpool must not import the worker package"
    # the API module imports lazily by design; every other edge must be acyclic
    edges = {m: {d for d in deps if d in graph and d != "dpool"} for m, deps in graph.items() if m != "dpool"}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in edges.get(m, ()):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " → ".join(path[path.index(d):] + [d]))
            if d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in edges:
        if m not in state:
            visit(m, [m])
    assert "dpool.step.parts" in edges and "dpool.pool" in edges["dpool.step.parts"]  # (the graph has its edges)


def test_the_workers_unpickling_cache_is_bounded():
    """A criterion changed every step is pickled anew every step: the workers' cache of unpickled objects
    (output types, criteria) must keep a bounded number of them, and still give each its object."""
    import cloudpickle

    from dpool import tree

    blobs = [cloudpickle.dumps(torch.nn.CrossEntropyLoss(label_smoothing=i / 1000)) for i in range(tree._LOAD_CACHE_SIZE + 40)]
    for i, b in enumerate(blobs):
        assert tree.load_type(b).label_smoothing == i / 1000
    assert len(tree._LOAD_CACHE) <= tree._LOAD_CACHE_SIZE
    assert tree.load_type(blobs[-1]) is tree.load_type(blobs[-1])  # kept while in use


def test_the_workers_copies_of_losses_are_bounded():
    """The copies of each loss with another reduction (and the check counts) are kept per loss object, and a
    criterion changed every step arrives as a new object every step: they must not pile up either."""
    from dpool.loss import split_loss

    class Smoothed(torch.nn.CrossEntropyLoss):
        pass

    cache: dict = {}
    out, y = torch.randn(6, 4), torch.randint(0, 4, (6,))
    for i in range(300):
        fn = Smoothed(label_smoothing=i / 1000)
        total, denom = split_loss(fn, out, (y,), cache)
        torch.testing.assert_close(total / denom, torch.nn.CrossEntropyLoss(label_smoothing=i / 1000)(out, y))
        assert len(cache) <= 256
