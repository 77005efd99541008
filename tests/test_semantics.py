"""Scatter, gather, autograd, modes and state_dict: nn.DataParallel's semantics, point by point."""
from __future__ import annotations

import copy
import os
import resource
import warnings
from collections import OrderedDict, namedtuple
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import dpool
from dpool.scatter import even_sizes, plan
from tests import models
from tests.helpers import dataparallel


class ShardInfo(nn.Module):
    """Returns what each shard saw: its batch size, the non-tensor args, structure types."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x, nested, *, opt=None, flag="x"):
        info = {
            "rows": x.shape[0],
            "nested_types": [type(nested).__name__, type(nested[0]).__name__, type(nested[1]).__name__],
            "inner_rows": [nested[0][0].shape[0], nested[1]["t"].shape[0], nested[1]["nt"].a.shape[0]],
            "const": nested[1]["const"],
            "flag": flag,
            "opt_rows": None if opt is None else opt.shape[0],
            "scalar": float(nested[1]["scalar"]),
        }
        return x * self.w, info


NT = namedtuple("NT", ["a", "b"])


def test_even_sizes_and_plan():
    assert even_sizes(9, 4) == [3, 2, 2, 2]  # chunk would give [3, 3, 3] and idle a device
    assert even_sizes(10, 4) == [3, 3, 2, 2]
    assert even_sizes(36, 7) == [6, 6, 5, 5, 5, 5, 4] or sum(even_sizes(36, 7)) == 36
    for n in range(1, 40):
        for k in range(1, 9):
            s = even_sizes(n, k)
            assert sum(s) == n and max(s) - min(s) <= 1 and len(s) == k
    k, splits = plan([torch.zeros(3, 2), torch.zeros(()), torch.zeros(5)], 4, 0)
    assert k == 3 and splits == [[1, 1, 1], None, [2, 2, 1]]
    with pytest.raises(ValueError, match="empty batch"):
        plan([torch.zeros(0, 3)], 2, 0)


def test_scatter_nested_structures_and_constants(wrap):
    model = wrap(ShardInfo(), ["cpu"] * 4)
    x = torch.randn(9, 3)
    nested = ([torch.randn(9, 2)], OrderedDict(t=torch.randn(9), nt=NT(torch.randn(9, 1), "b"), const="c",
                                                scalar=torch.tensor(2.5)))
    out, info = model(x, nested, opt=torch.randn(9, 4), flag="kw")
    torch.testing.assert_close(out, x)
    assert info["rows"] == [3, 2, 2, 2]
    # lists are rebuilt element-wise, and each leaf holds one entry per shard
    assert info["inner_rows"] == [[3, 2, 2, 2]] * 3
    assert info["nested_types"] == [["tuple"] * 4, ["list"] * 4, ["OrderedDict"] * 4]
    assert info["const"] == ["c"] * 4 and info["flag"] == ["kw"] * 4
    assert info["opt_rows"] == [3, 2, 2, 2]
    assert info["scalar"] == [2.5] * 4  # 0-dim tensors are given whole to every shard


def test_small_batch_uses_fewer_workers(wrap):
    model = wrap(ShardInfo(), ["cpu"] * 3)
    nested = ([torch.randn(2, 2)], {"t": torch.randn(2), "nt": NT(torch.randn(2, 1), 0), "const": 1,
                                    "scalar": torch.tensor(1.0)})
    _, info = model(torch.randn(2, 3), nested)
    assert info["rows"] == [1, 1]
    _, info = model(torch.randn(1, 3), nested)
    assert info["rows"] == [1]


@dataclass
class Out:
    y: torch.Tensor
    name: str


class Structured(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x):
        y = self.lin(x)
        return {
            "tuple": (y, None),
            "list": [y * 2],
            "nt": NT(y, y.sum(dim=1)),
            "scalar_loss": y.pow(2).mean(),
            "text": "shard",
            "number": 3,
            "dc": Out(y, "n"),
            "ints": x.argmax(dim=1),
        }


def test_gather_structures(wrap):
    net = Structured().double()
    ref = copy.deepcopy(net)
    model = wrap(net)
    x = torch.randn(5, 3, dtype=torch.float64)
    with pytest.warns(UserWarning, match="all input tensors were scalars"):
        out = model(x)
    r = ref(x)
    torch.testing.assert_close(out["tuple"][0], r["tuple"][0])
    assert out["tuple"][1] is None and isinstance(out["tuple"], tuple)
    torch.testing.assert_close(out["list"][0], r["list"][0])
    assert isinstance(out["nt"], NT)
    torch.testing.assert_close(out["nt"].b, r["nt"].b)
    # 0-dim outputs become a vector with one entry per shard, as in DataParallel
    assert out["scalar_loss"].shape == (2,)
    torch.testing.assert_close(out["scalar_loss"][0], ref(x[:3])["scalar_loss"])
    assert out["text"] == ["shard", "shard"] and out["number"] == [3, 3]
    assert isinstance(out["dc"], Out) and out["dc"].name == ["n", "n"]
    torch.testing.assert_close(out["dc"].y, r["dc"].y)
    assert out["ints"].dtype == torch.int64 and not out["ints"].requires_grad
    torch.testing.assert_close(out["ints"], r["ints"])
    # backward through a gathered scalar vector reaches the parameters
    out["scalar_loss"].sum().backward()
    expected = sum(torch.autograd.grad(ref(c)["scalar_loss"], ref.lin.weight)[0] for c in (x[:3], x[3:]))
    torch.testing.assert_close(net.lin.weight.grad, expected)


def test_gather_along_dim1(wrap):
    net = nn.LSTM(4, 5).double()  # seq-first: batch is dim 1
    ref = copy.deepcopy(net)
    model = wrap(net, dim=1)
    x = torch.randn(6, 7, 4, dtype=torch.float64)
    out, (h, c) = model(x)
    rout, (rh, rc) = ref(x)
    torch.testing.assert_close(out, rout)
    torch.testing.assert_close(h, rh)
    (out.sum() + h.sum()).backward()
    (rout.sum() + rh.sum()).backward()
    for p, rp in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, rp.grad)


def test_gradient_accumulation_and_input_grads(wrap):
    net = models.make("mlp")
    ref = copy.deepcopy(net)
    model = wrap(net)
    xs = [torch.randn(7, 12, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    rxs = [x.detach().clone().requires_grad_() for x in xs]
    for x, rx in zip(xs, rxs):
        model(x).sum().backward()
        ref(rx).sum().backward()
    for p, rp in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, rp.grad)
    for x, rx in zip(xs, rxs):
        torch.testing.assert_close(x.grad, rx.grad)


def test_two_forwards_one_backward_and_retain_graph(wrap):
    net = models.make("mlp")
    ref = copy.deepcopy(net)
    model = wrap(net)
    a, b = torch.randn(5, 12, dtype=torch.float64), torch.randn(6, 12, dtype=torch.float64)
    loss = model(a).sum() + (model(b) ** 2).sum()  # two graphs alive on every worker at once
    rloss = ref(a).sum() + (ref(b) ** 2).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    rloss.backward(retain_graph=True)
    rloss.backward()
    for p, rp in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, rp.grad)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()
    assert [w["graphs_kept"] for w in model.stats(inspect=True)["workers"]] == [0, 0]  # both freed


def test_a_graph_is_kept_for_retain_graph_and_freed_after_a_plain_backward_while_the_loss_lives(wrap):
    """The workers free a call's graph as soon as a backward without retain_graph went through it, even
    while the user still holds the loss (its Bridge node alive); with retain_graph they keep it."""
    net = models.make("mlp")
    ref = copy.deepcopy(net)
    model = wrap(net)
    x = torch.randn(6, 12, dtype=torch.float64)
    loss, rloss = model(x).sum(), ref(x).sum()
    loss.backward(retain_graph=True)
    rloss.backward(retain_graph=True)
    assert [w["graphs_kept"] for w in model.stats(inspect=True)["workers"]] == [1, 1]  # a second backward may come
    loss.backward()  # the second one, which frees the graph
    rloss.backward()
    assert [w["graphs_kept"] for w in model.stats(inspect=True)["workers"]] == [0, 0]
    for p, rp in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, rp.grad)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()
    other = model(x).sum()
    torch.autograd.grad(other, list(net.parameters()))  # retain_graph defaults to create_graph=False
    assert [w["graphs_kept"] for w in model.stats(inspect=True)["workers"]] == [0, 0]
    del loss, other


def test_checkpoint_around_the_model_and_saved_tensor_hooks(wrap):
    """torch.utils.checkpoint around the dpool model, in both modes, trains as around the plain module, and a
    dpool forward saves no tensor through saved-tensor hooks: the non-reentrant mode recomputed the forward
    when dpool's node unpacked one (and failed), and save_on_cpu would copy a parameter every step."""
    from torch.utils.checkpoint import checkpoint

    net = models.make("mlp")
    ref = copy.deepcopy(net)
    model = wrap(net)
    for reentrant in (True, False):
        net.zero_grad()
        ref.zero_grad()
        x = torch.randn(6, 12, dtype=torch.float64, requires_grad=True)
        rx = x.detach().clone().requires_grad_()
        checkpoint(model, x, use_reentrant=reentrant).pow(2).sum().backward()
        checkpoint(ref, rx, use_reentrant=reentrant).pow(2).sum().backward()
        torch.testing.assert_close(x.grad, rx.grad)
        for (n, p), rp in zip(net.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, rp.grad, msg=lambda m: f"use_reentrant={reentrant}, {n}: {m}")
        assert [w["graphs_kept"] for w in model.stats(inspect=True)["workers"]] == [0, 0]
    packed: list = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        out = model(torch.randn(6, 12, dtype=torch.float64))
    assert packed == []
    out.sum().backward()


def test_no_grad_inference_mode_and_no_graph_kept(wrap):
    model = wrap(models.make("mlp"))
    x = torch.randn(8, 12, dtype=torch.float64)
    with torch.no_grad():
        y = model(x)
    assert not y.requires_grad
    with torch.inference_mode():
        z = model(x)
    assert z.is_inference()
    torch.testing.assert_close(y, z)
    out = model(x)
    out.sum().backward()
    del out
    with torch.no_grad():
        model(x)  # the release of the earlier graph piggybacks on this call
    workers = model.stats(inspect=True)["workers"]
    assert [w["graphs_kept"] for w in workers] == [0, 0]
    assert all(w["rss_bytes"] > 0 for w in workers)


def test_train_eval_reach_replicas(wrap):
    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Dropout(0.5)
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            return self.lin(x), torch.tensor([float(self.training), float(self.inner.training)])

    model = wrap(Probe())
    x = torch.randn(4, 2)
    assert model(x)[1].tolist() == [1.0, 1.0, 1.0, 1.0]
    model.eval()
    assert model(x)[1].tolist() == [0.0] * 4
    model.train()
    model.module.inner.eval()  # per-submodule flags travel too
    assert model(x)[1].tolist() == [1.0, 0.0, 1.0, 0.0]


def test_frozen_parameters_get_no_grad(wrap):
    net = models.make("mlp")
    ref = copy.deepcopy(net)
    model = wrap(net)
    net.net[0].weight.requires_grad_(False)
    ref.net[0].weight.requires_grad_(False)
    x = torch.randn(6, 12, dtype=torch.float64)
    model(x).sum().backward()
    ref(x).sum().backward()
    assert net.net[0].weight.grad is None
    for p, rp in zip(net.parameters(), ref.parameters()):
        if rp.grad is not None:
            torch.testing.assert_close(p.grad, rp.grad)


class _Partial(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(3, 3)
        self.unused = nn.Linear(3, 3)

    def forward(self, x, both=False):
        return self.used(x) + self.unused(x) if both else self.used(x)


def test_unused_parameter_grad_is_none(wrap):
    net = _Partial()
    model = wrap(net)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model(torch.randn(4, 3)).sum().backward()
    assert net.unused.weight.grad is None and net.used.weight.grad is not None
    assert not [w for w in seen if "got no gradient" in str(w.message)]  # no hooks: nothing to say


def _hook_everything(net: nn.Module, calls: list) -> None:
    """Hooks that tell a call with None from none, and change numbers: a tensor hook that logs and clamps,
    a post-accumulate hook that scales .grad, a multi-grad hook over a used and an unused parameter."""

    def pre(name):
        def hook(g):
            calls.append(("pre", name, None if g is None else g.sum().item()))
            return None if g is None else g.clamp(-0.4, 0.4)
        return hook

    def post(name):
        def hook(q):
            calls.append(("post", name, q.grad is None))
            if q.grad is not None:
                q.grad.mul_(0.5)
        return hook

    for name, p in net.named_parameters():
        p.register_hook(pre(name))
        p.register_post_accumulate_grad_hook(post(name))
    torch.autograd.graph.register_multi_grad_hook(
        (net.used.weight, net.unused.weight), lambda gs: calls.append(("multi", str([g is None for g in gs]), None)))


def test_hooks_of_a_parameter_no_shard_used_run_as_in_one_process(wrap):
    """The master's parameters are all inputs of dpool's autograd node, so autograd runs the accumulation
    of a parameter that no shard used, and would call its hooks (a tensor hook with None, a post-accumulate
    hook that scales the earlier micro-batches' .grad once more). One process calls none: dpool gates them.
    Another path of the same backward (two forwards in one loss, a loss term on the parameter) still brings
    the gradient its hooks see once, summed."""
    net = _Partial()
    ref = copy.deepcopy(net)
    model = wrap(net)
    calls, ref_calls = [], []
    _hook_everything(net, calls)
    _hook_everything(ref, ref_calls)
    own = net.unused.weight._backward_hooks, net.unused.weight._post_accumulate_grad_hooks
    x = torch.randn(4, 3)
    steps = [lambda m, p: m(x, both=True).sum(),  # every parameter
             lambda m, p: m(x * 2).sum(),  # `unused` gets nothing: one micro-batch more of the accumulation
             lambda m, p: (m(x) + m(x * 3, both=True)).sum(),  # siamese: one forward used it
             lambda m, p: m(x).sum() + p.unused.weight.sum()]  # a loss term on the parameter itself
    for i, loss in enumerate(steps):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing to warn about either
            loss(model, net).backward()
        loss(ref, ref).backward()
        got, want = sorted(calls, key=lambda c: c[:2]), sorted(ref_calls, key=lambda c: c[:2])
        assert [c[:2] + (c[2] is None,) for c in got] == [c[:2] + (c[2] is None,) for c in want], i
        values = [[c[2] for c in cs if c[2] is not None] for cs in (got, want)]
        assert values[0] == pytest.approx(values[1], rel=1e-5), i
        for (name, p), q in zip(net.named_parameters(), ref.parameters()):
            assert (p.grad is None) == (q.grad is None), (i, name)
            if q.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, msg=f"{name} after step {i}")
        assert net.unused.weight._backward_hooks is own[0], i  # the parameter's own dicts are back
        assert net.unused.weight._post_accumulate_grad_hooks is own[1], i
        calls.clear()
        ref_calls.clear()
    # A backward that fails after dpool's node (a hook raises) ends without putting the gated dicts back:
    # the next forward does, and close() puts back what is left.
    boom = net.used.bias.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("hook failed")))
    with pytest.raises(RuntimeError, match="hook failed"):
        model(x).sum().backward()
    assert net.unused.weight._backward_hooks is not own[0]  # still gated
    boom.remove()
    model.zero_grad()
    out = model(x)
    assert net.unused.weight._backward_hooks is own[0] and net.unused.weight._post_accumulate_grad_hooks is own[1]
    out.sum().backward()
    assert net.unused.weight._backward_hooks is own[0] and net.unused.weight._post_accumulate_grad_hooks is own[1]
    assert not [c for c in calls if c[0] != "multi" and c[1].startswith("unused")]
    boom = net.used.bias.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("hook failed")))
    with pytest.raises(RuntimeError, match="hook failed"):
        model(x).sum().backward()
    assert net.unused.weight._backward_hooks is not own[0]  # still gated
    model.close()
    assert net.unused.weight._backward_hooks is own[0] and net.unused.weight._post_accumulate_grad_hooks is own[1]


def test_state_dict_prefix_and_interop(wrap):
    net = models.make("cnn")
    model = wrap(net)
    sd = model.state_dict()
    assert all(k.startswith("module.") for k in sd)
    assert sd.keys() == dataparallel(copy.deepcopy(net)).state_dict().keys()
    assert list(model.parameters()) == list(net.parameters())
    assert dpool.unwrap(model) is net and dpool.is_wrapped(model) and dpool.wrap(model) is model
    # a checkpoint from nn.DataParallel loads into dpool, and values reach the workers
    other = models.make("cnn", seed=5)
    model.load_state_dict(dataparallel(other).state_dict())
    model.eval()
    other.eval()
    (x,), _ = models.batch("cnn", 4)
    with torch.no_grad():
        torch.testing.assert_close(model(x), other(x))
    plain = models.make("cnn", seed=9)
    plain.load_state_dict(model.module.state_dict())
    for a, b in zip(plain.state_dict().values(), net.state_dict().values()):
        torch.testing.assert_close(a, b)


def test_replaced_parameter_data_reaches_workers(wrap):
    net = nn.Linear(3, 1, bias=False).double()
    model = wrap(net)
    net.weight.data = torch.ones(1, 3, dtype=torch.float64)  # replaced, not updated in place
    x = torch.randn(4, 3, dtype=torch.float64)
    torch.testing.assert_close(model(x), x.sum(dim=1, keepdim=True))
    net.weight.data = torch.ones(2, 3, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="changed to"):
        model(x)


def test_master_survives_close(wrap):
    net = models.make("mlp")
    model = wrap(net)
    x = torch.randn(4, 12, dtype=torch.float64)
    expected = model(x).detach()
    model.close()
    torch.testing.assert_close(net(x), expected)
    with pytest.raises(dpool.PoolBrokenError, match="closed"):
        model(x)
    model.close()  # idempotent


def test_device_ids_parsing():
    from dpool.devices import parse_devices

    assert parse_devices(["cpu", torch.device("cpu")]) == ["cpu", "cpu"]
    assert parse_devices([0, "cuda:1"]) == ["cuda:0", "cuda:1"]
    if not torch.cuda.is_available():
        import psutil

        assert parse_devices(None) == ["cpu"] * psutil.cpu_count(logical=False)
    with pytest.raises(TypeError):
        parse_devices("cpu")
    with pytest.raises(ValueError):
        parse_devices([])
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="name GPUs, but torch sees none"):
            dpool.wrap(nn.Linear(2, 2), [0, 1])
    with pytest.raises(ValueError, match="mix CPU and GPU"):
        dpool.wrap(nn.Linear(2, 2), ["cpu", 0])


def test_threads_set_and_restored(wrap):
    before = torch.get_num_threads()
    model = wrap(nn.Linear(2, 2), worker_threads=1)
    assert torch.get_num_threads() == 1
    threads = model.worker_states(lambda m: torch.get_num_threads())
    assert threads == [1, 1]
    model.close()
    assert torch.get_num_threads() == before


class BigActivation(nn.Module):
    """Allocates (and frees) 48 MiB per forward: above glibc's largest default mmap threshold."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        big = torch.ones(12 << 20)
        return self.lin(x) * big[0]


def _worker_faults(model) -> list[int]:
    return model.worker_states(lambda m: resource.getrusage(resource.RUSAGE_SELF).ru_minflt)


@pytest.mark.parametrize("user_threshold", [None, "131072"])
def test_workers_keep_freed_memory_instead_of_faulting_it_in_every_step(wrap, monkeypatch, user_threshold):
    if user_threshold is not None:  # the user's own malloc setting wins
        monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", user_threshold)
    model = wrap(BigActivation())
    x = torch.randn(8, 4)
    for _ in range(6):
        model(x).sum().backward()
    before = _worker_faults(model)
    for _ in range(20):
        model(x).sum().backward()
    grown = [a - b for a, b in zip(_worker_faults(model), before)]
    env = model.worker_states(lambda m: __import__("os").environ["MALLOC_MMAP_THRESHOLD_"])
    if user_threshold is None:
        assert env == [str(1 << 30)] * 2
        # The 48 MiB block is reused from the heap. The heap still grows now and then while it
        # settles (fragmentation: up to ~10 blocks over the first ~15 steps, then flat), so this
        # asserts far fewer faults than one block per step, not none.
        assert all(g < 10 * 12288 for g in grown), grown
    else:
        assert env == [user_threshold] * 2
        assert all(g > 19 * 12288 for g in grown), grown  # its 12288 pages fault in again every step


@pytest.mark.parametrize("user_policy,extra_workers,want", [
    (None, 0, "batch"), (None, 1, "other"), ("other", 0, "other"), ("batch", 1, "batch")])
def test_workers_run_under_sched_batch_while_they_have_a_core_each(wrap, monkeypatch, user_policy, extra_workers,
                                                                   want):
    """By default every thread of every worker (main, ZeroMQ's, heartbeat, watchdog) is SCHED_BATCH while
    each worker can have a core (a woken worker must not preempt the coordinator mid-send), and keeps
    Linux's default policy when the workers outnumber the cores. ``DPOOL_WORKER_SCHED`` overrides."""
    from dpool.cpus import physical_cores

    if user_policy is not None:
        monkeypatch.setenv("DPOOL_WORKER_SCHED", user_policy)
    n = min(2, physical_cores()) if extra_workers == 0 else physical_cores() + extra_workers
    model = wrap(nn.Linear(4, 4), ["cpu"] * n)
    model(torch.randn(8, 4)).sum().backward()  # every thread a step needs has started
    policy = {"batch": os.SCHED_BATCH, "other": os.SCHED_OTHER}[want]
    for pid in model.pids:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        assert len(tids) >= 4, tids
        assert {os.sched_getscheduler(t) for t in tids} == {policy}, pid
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the user's own process is left alone


def test_unknown_worker_sched_policy_is_a_clear_error_before_any_worker_starts(monkeypatch):
    monkeypatch.setenv("DPOOL_WORKER_SCHED", "fifo")
    with pytest.raises(dpool.DpoolValueError, match=r"DPOOL_WORKER_SCHED='fifo'.*batch, other"):
        dpool.wrap(nn.Linear(4, 4), ["cpu", "cpu"])


@pytest.mark.parametrize("user_policy,fill,bound", [
    (None, True, True), (None, False, False), ("none", True, False), ("cores", False, True)])
def test_cpu_workers_are_bound_to_cores_of_their_own_when_their_threads_fill_the_cores(wrap, monkeypatch, user_policy,
                                                                                       fill, bound):
    """By default each CPU worker, every thread of it, runs on cores of its own when the workers' threads fill
    exactly the cores the coordinator may use (the default layout); a pool that leaves cores free is not bound
    (a second job would be put on the same first cores). ``DPOOL_WORKER_AFFINITY`` overrides."""
    from dpool.cpus import allowed_cores

    if user_policy is not None:
        monkeypatch.setenv("DPOOL_WORKER_AFFINITY", user_policy)
    cores = allowed_cores()
    assert len(cores) >= 2, "this test needs two cores"
    n, threads = (2, len(cores) // 2) if fill else (1, len(cores) - 1)
    assert (n * threads == len(cores)) == fill
    mine = os.sched_getaffinity(0)
    model = wrap(nn.Linear(4, 4), ["cpu"] * n, worker_threads=threads)
    model(torch.randn(8, 4)).sum().backward()  # every thread a step needs has started
    for k, pid in enumerate(model.pids):
        want = {cpu for core in cores[k * threads:(k + 1) * threads] for cpu in core} if bound else mine
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        assert len(tids) >= 4, tids
        assert all(os.sched_getaffinity(t) == want for t in tids), (k, want)
    assert os.sched_getaffinity(0) == mine  # the user's own process is left alone


@pytest.mark.parametrize("policy", [None, "none"])
def test_under_torchrun_each_coordinators_workers_are_bound_to_its_local_share_of_the_cores(wrap, monkeypatch,
                                                                                            policy):
    """Two coordinators per machine (torchrun's LOCAL_RANK / LOCAL_WORLD_SIZE) whose workers fill the cores
    between them: local rank 1's worker gets the second half, not the first core rank 0's worker has. The
    coordinator joins it there while the pool is open (every thread of it, those started before wrap()
    too: gloo's, ZeroMQ's), and close() puts them back; DPOOL_COORDINATOR_AFFINITY=none leaves it alone."""
    import threading

    from dpool.cpus import allowed_cores

    cores = allowed_cores()
    assert len(cores) >= 2, "this test needs two cores"
    if policy is not None:
        monkeypatch.setenv("DPOOL_COORDINATOR_AFFINITY", policy)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    mine = os.sched_getaffinity(0)
    started = threading.Event()
    done = threading.Event()
    earlier = threading.Thread(target=lambda: (started.set(), done.wait(60)))  # a thread of the user's
    earlier.start()
    started.wait(10)
    try:
        half = len(cores) // 2
        model = wrap(nn.Linear(4, 4), ["cpu"], worker_threads=half)
        model(torch.randn(8, 4)).sum().backward()
        want = {cpu for core in cores[half:2 * half] for cpu in core}
        tids = [int(t) for t in os.listdir(f"/proc/{model.pids[0]}/task")]
        assert all(os.sched_getaffinity(t) == want for t in tids), want
        ours = [int(t) for t in os.listdir("/proc/self/task")]
        assert len(ours) >= 3 and earlier.native_id in ours
        coordinator = want if policy is None else mine
        assert all(os.sched_getaffinity(t) == coordinator for t in ours), coordinator
        model.close()
        left = [int(t) for t in os.listdir("/proc/self/task")]  # (the pool's own threads ended)
        assert earlier.native_id in left and all(os.sched_getaffinity(t) == mine for t in left), mine
    finally:
        done.set()
        earlier.join()


# the default device_ids follow the module (a CPU one gets CPU workers); CUDA is kept out of these runs all the same
_NO_GPU = dict(os.environ, CUDA_VISIBLE_DEVICES="")


def test_a_job_given_one_core_of_the_machine_starts_one_worker_with_one_thread_on_it():
    """Under ``taskset`` (or a Slurm or container cpuset) the defaults count the cores the job may use, as
    torch's own thread count does: not the machine's, which would put every worker and thread on one core."""
    import subprocess
    import sys

    cpu = min(os.sched_getaffinity(0))
    script = (
        "import os, torch, dpool\n"
        "m = dpool.wrap(torch.nn.Linear(4, 4))\n"
        "m(torch.randn(8, 4)).sum().backward()\n"
        "print(len(m.pids), m.worker_states(lambda r: __import__('torch').get_num_threads()),\n"
        "      [sorted(os.sched_getaffinity(p)) for p in m.pids])\n"
        "m.close()\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=90,
                         preexec_fn=lambda: os.sched_setaffinity(0, {cpu}), env=_NO_GPU)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == f"1 [1] [[{cpu}]]", out.stdout


def _fake_cgroups(tmp_path, groups: str, mounts: list[tuple[str, str, str, str]], limits: dict[str, str]) -> str:
    """A /proc/self of ``groups`` (its cgroup file) and ``mounts`` ((root, mountpoint folder, fstype,
    superoptions) each), and cgroup files ``limits`` (path under tmp_path → content). Returns the proc folder."""
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(groups)
    lines = [f"{30 + i} 23 0:{40 + i} {root} {tmp_path / point} rw,relatime - {fstype} cgroup {opts}"
             for i, (root, point, fstype, opts) in enumerate(mounts)]
    (proc / "mountinfo").write_text("\n".join(["22 1 8:1 / / rw - ext4 /dev/root rw", *lines]) + "\n")
    for path, text in limits.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    return str(proc)


V1 = [("/", "cpu", "cgroup", "rw,cpu,cpuacct")]
V2 = [("/", "unified", "cgroup2", "rw")]


@pytest.mark.parametrize("groups,mounts,limits,want", [
    # cgroup v2: the process's own cgroup, an ancestor's tighter limit, no limit anywhere
    ("0::/job\n", V2, {"unified/job/cpu.max": "150000 100000\n", "unified/cpu.max": "max 100000\n"}, 1.5),
    ("0::/a/b\n", V2, {"unified/a/b/cpu.max": "max 100000\n", "unified/a/cpu.max": "50000 100000\n"}, 0.5),
    ("0::/a\n", V2, {"unified/a/cpu.max": "max 100000\n"}, None),
    # cgroup v1 (cpu and cpuacct co-mounted), quota -1 meaning none; a hybrid machine: the smaller of both
    ("4:cpu,cpuacct:/job\n", V1, {"cpu/job/cpu.cfs_quota_us": "400000", "cpu/job/cpu.cfs_period_us": "100000"}, 4.0),
    ("4:cpu,cpuacct:/job\n", V1, {"cpu/job/cpu.cfs_quota_us": "-1", "cpu/job/cpu.cfs_period_us": "100000"}, None),
    ("4:cpu,cpuacct:/j\n0::/k\n", V1 + V2, {"cpu/j/cpu.cfs_quota_us": "300000", "cpu/j/cpu.cfs_period_us": "100000",
                                              "unified/k/cpu.max": "200000 100000"}, 2.0),
    # a container's view: the mount's root is the container's cgroup, which its own path names
    ("0::/docker/c1\n", [("/docker/c1", "unified", "cgroup2", "rw")], {"unified/cpu.max": "200000 100000"}, 2.0),
    # a cgroup namespace: the path is outside the mount's root, so only the mount's root is read
    ("0::/\n", [("/..", "unified", "cgroup2", "rw")], {"unified/cpu.max": "100000 100000"}, 1.0),
    # what cannot be parsed is no limit, never an error
    ("0::/a\n", V2, {"unified/a/cpu.max": "lots\n"}, None),
    ("garbage\n", V2, {"unified/cpu.max": "100000 100000"}, None),
    ("0::/a\n", [], {}, None),
])
def test_cpu_quota_is_read_from_the_process_cgroup_and_its_ancestors(tmp_path, groups, mounts, limits, want):
    from dpool.cpus import cpu_quota

    assert cpu_quota(_fake_cgroups(tmp_path, groups, mounts, limits)) == want


def test_cpu_quota_of_a_process_without_a_readable_proc_is_none(tmp_path):
    from dpool.cpus import cpu_quota

    assert cpu_quota(str(tmp_path / "missing")) is None


def test_threads_kept_from_preempting_are_under_sched_batch_inside_and_back_under_sched_other_after():
    """What the cross-node swap does to gloo's loop threads while it posts (NOTE [ gloo's loop thread ] in
    dpool/crossnode.py), on real threads of this process: found by name, under SCHED_BATCH inside the block and
    SCHED_OTHER after it; one the user put under SCHED_IDLE is not touched; one that ended is dropped."""
    import ctypes
    import threading

    from dpool.cpus import NoWakeupPreemption, threads_named

    stop, named = threading.Event(), threading.Barrier(4)

    def run(name: bytes) -> None:
        ctypes.CDLL(None).prctl(15, name, 0, 0, 0)  # PR_SET_NAME: the thread's comm, as torch names gloo's
        named.wait()
        stop.wait()

    names = [b"dpool-t-loop", b"dpool-t-loop", b"dpool-t-idle"]
    threads = [threading.Thread(target=run, args=(n,)) for n in names]
    for t in threads:
        t.start()
    try:
        named.wait()
        loops, idle = sorted(t.native_id for t in threads[:2]), threads[2].native_id
        assert sorted(threads_named("dpool-t-loop")) == loops
        assert threads_named("dpool-t-idle") == [idle]
        os.sched_setscheduler(idle, os.SCHED_IDLE, os.sched_param(0))  # the user's choice
        quiet = NoWakeupPreemption(loops + [idle])
        assert quiet.tids == loops
        for _ in range(2):
            with quiet:
                assert [os.sched_getscheduler(t) for t in loops] == [os.SCHED_BATCH] * 2
            assert [os.sched_getscheduler(t) for t in loops] == [os.SCHED_OTHER] * 2
            assert os.sched_getscheduler(idle) == os.SCHED_IDLE
    finally:
        stop.set()
        for t in threads:
            t.join()
    with quiet:  # the threads ended: dropped, no error
        pass
    assert quiet.tids == []


def _cpu_cgroup_mount() -> tuple[str, str] | None:
    """A writable hierarchy with the cpu controller: (its mount point, "v1" or "v2"), or None."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            fstype, opts = fields[sep + 1], fields[sep + 3].split(",")
            if fstype == "cgroup" and "cpu" in opts:
                return fields[4], "v1"
            if fstype == "cgroup2":
                try:
                    with open(os.path.join(fields[4], "cgroup.subtree_control")) as g:
                        if "cpu" in g.read().split():
                            return fields[4], "v2"
                except OSError:
                    pass
    return None


def test_a_job_under_a_cgroup_cpu_quota_of_one_cpu_starts_one_worker_with_one_thread():
    """``docker run --cpus=1`` (or a Kubernetes CPU limit) leaves every core in the affinity mask but gives the
    job one CPU's worth of time: the defaults follow the quota, one worker with one thread, not one per core
    (each throttled most of every period). A real cgroup with a real CFS quota."""
    import subprocess
    import sys
    import uuid

    from dpool.cpus import allowed_cores

    found = _cpu_cgroup_mount()
    if found is None or not os.access(found[0], os.W_OK):
        pytest.skip("needs a writable cgroup hierarchy with the cpu controller (root)")
    mount, version = found
    group = os.path.join(mount, f"dpool-test-{uuid.uuid4().hex[:8]}")
    os.mkdir(group)
    try:
        if version == "v1":
            with open(os.path.join(group, "cpu.cfs_quota_us"), "w") as f:
                f.write("100000")  # the default period is 100000 us: one CPU
        else:
            with open(os.path.join(group, "cpu.max"), "w") as f:
                f.write("100000 100000")
        script = (
            "import torch, dpool\n"
            "from dpool.cpus import cpu_quota\n"
            "m = dpool.wrap(torch.nn.Linear(4, 4))\n"
            "m(torch.randn(8, 4)).sum().backward()\n"
            "print(cpu_quota(), len(m.pids), m.worker_states(lambda r: __import__('torch').get_num_threads()))\n"
            "m.close()\n"
        )

        def enter() -> None:
            with open(os.path.join(group, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))

        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=90,
                             preexec_fn=enter, env=_NO_GPU)
        assert out.returncode == 0, out.stderr
        assert len(allowed_cores()) >= 2, "this test needs two cores in the affinity mask"
        assert out.stdout.split("\n")[0] == "1.0 1 [1]", out.stdout
    finally:
        os.rmdir(group)  # fails (EBUSY) if a process of the job were still in it


@pytest.mark.parametrize("policy", [None, "on", "off"])
def test_workers_reply_together_where_the_coordinator_has_no_core_of_its_own(wrap, monkeypatch, policy):
    """By default, when two or more CPU workers' threads fill the cores, every round of several shards asks
    them to reply together: each marks the round done in the control segment (the one done first then waits
    a bounded time for the others). A round of one shard asks nothing. ``DPOOL_REPLY_TOGETHER`` overrides.
    The numbers are a single process's either way."""
    from dpool.cpus import allowed_cores

    if policy is not None:
        monkeypatch.setenv("DPOOL_REPLY_TOGETHER", policy)
    cores = allowed_cores()
    assert len(cores) >= 2, "this test needs two cores"
    threads = len(cores) // 2
    asks = policy == "on" or (policy is None and 2 * threads == len(cores))
    net = models.make("mlp")
    ref = copy.deepcopy(net)
    model = wrap(net, ["cpu", "cpu"], worker_threads=threads)
    x = torch.randn(6, 12, dtype=torch.float64)
    model(x).sum().backward()
    ref(x).sum().backward()
    for p, rp in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, rp.grad)
    rounds = memoryview(model._runtime.pool.control.mmap).cast("q")  # heartbeats, then the rounds marked
    try:
        marked = [rounds[2], rounds[3]]
        assert marked == ([2, 2] if asks else [0, 0]), marked  # the forward's round 1, then the backward's 2
        model(x[:1]).sum().backward()  # one row, one shard: nobody to wait for
        assert [rounds[2], rounds[3]] == marked
        model(x).sum().backward()
        assert [rounds[2], rounds[3]] == ([4, 4] if asks else [0, 0])
    finally:
        rounds.release()
    # the loss on the workers: the loss round (with the backward it runs) asks too
    lossy = wrap(nn.Linear(4, 3), ["cpu", "cpu"], worker_threads=threads, gather=False)
    dpool.criterion(nn.CrossEntropyLoss())(lossy(torch.randn(8, 4)), torch.randint(0, 3, (8,))).backward()
    assert lossy.stats()["backward_rounds_saved"] == 1
    rounds = memoryview(lossy._runtime.pool.control.mmap).cast("q")
    try:
        assert [rounds[2], rounds[3]] == ([2, 2] if asks else [0, 0])  # the forward's round, then the loss's
    finally:
        rounds.release()


@pytest.mark.parametrize("spin_us", [None, "0", "1000000"])
def test_the_coordinator_spins_through_short_rounds_and_still_sees_a_worker_die(wrap, monkeypatch, spin_us):
    """A round whose stage took at most 1 ms last time (or has no time yet) is waited for by polling and
    yielding instead of sleeping (NOTE [ spinning through short rounds ] in dpool.pool): 300 µs past the
    previous round's time by default on CPU, ``DPOOL_WAIT_SPIN_US`` otherwise, ``0`` never. The numbers are a
    single process's either way, and a worker that dies while the coordinator spins is reported as one that
    dies while it sleeps."""
    if spin_us is not None:
        monkeypatch.setenv("DPOOL_WAIT_SPIN_US", spin_us)
    net = models.make("mlp")
    ref = copy.deepcopy(net)
    model = wrap(net, ["cpu", "cpu"])
    assert model._runtime.pool.spin_s == (300e-6 if spin_us is None else float(spin_us) * 1e-6)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(6, 12, dtype=torch.float64)
    for m, o in ((model, opt), (ref, ref_opt)):
        for _ in range(3):
            o.zero_grad()
            m(x).pow(2).sum().backward()
            o.step()
    for p, rp in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p, rp)
    spun = model.stats()["rounds_spun"]
    if spin_us == "0":
        assert spun == 0
    elif spin_us == "1000000":
        assert spun >= 1  # at least the first forward's: no time yet, and a 1 s spin outlasts the round

    class DiesOnItsThirdForward(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            if self.calls == 3:  # only the workers run this module's forward
                os._exit(5)
            return self.lin(x)

    dying = wrap(DiesOnItsThirdForward(), ["cpu", "cpu"])
    for _ in range(2):
        dying(torch.randn(4, 4)).sum().backward()
    with pytest.raises(dpool.WorkerDiedError, match="exited with code 5"):
        dying(torch.randn(4, 4))


def test_unknown_wait_spin_is_a_clear_error_before_any_worker_starts(monkeypatch):
    monkeypatch.setenv("DPOOL_WAIT_SPIN_US", "fast")
    with pytest.raises(dpool.DpoolValueError, match=r"DPOOL_WAIT_SPIN_US='fast'.*microseconds"):
        dpool.wrap(nn.Linear(4, 4), ["cpu", "cpu"])


def test_unknown_reply_together_policy_is_a_clear_error_before_any_worker_starts(monkeypatch):
    monkeypatch.setenv("DPOOL_REPLY_TOGETHER", "maybe")
    with pytest.raises(dpool.DpoolValueError, match=r"DPOOL_REPLY_TOGETHER='maybe'.*auto, on, off"):
        dpool.wrap(nn.Linear(4, 4), ["cpu", "cpu"])


def test_unknown_worker_affinity_policy_is_a_clear_error_before_any_worker_starts(monkeypatch):
    monkeypatch.setenv("DPOOL_WORKER_AFFINITY", "numa")
    with pytest.raises(dpool.DpoolValueError, match=r"DPOOL_WORKER_AFFINITY='numa'.*auto, cores, none"):
        dpool.wrap(nn.Linear(4, 4), ["cpu", "cpu"])


def test_worker_states_reads_replica_attributes(wrap):
    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return self.lin(x)

    net = Counter()
    model = wrap(net)
    for _ in range(3):
        model(torch.randn(4, 2))
    assert model.worker_states(lambda m: m.calls) == [3, 3]
    assert net.calls == 0  # attribute mutations stay in the replicas, as with DataParallel


def test_buffers_grow_with_the_batch(wrap):
    """Input, output and gradient segments grow (new segments) when a larger batch arrives."""
    net = nn.Conv2d(3, 4, 3).double()
    ref = copy.deepcopy(net)
    model = wrap(net)
    rt = model._runtime
    sizes = []
    for n in [2, 64, 300, 8, 300]:
        x = torch.randn(n, 3, 20, 20, dtype=torch.float64, requires_grad=True)
        rx = x.detach().clone().requires_grad_()
        out = model(x)
        rout = ref(rx)
        torch.testing.assert_close(out, rout)
        out.pow(2).sum().backward()
        rout.pow(2).sum().backward()
        torch.testing.assert_close(x.grad, rx.grad)
        sizes.append(tuple(rt.io.segment(0, r).size for r in ("in", "out", "gout", "gin")))
    for p, rp in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, rp.grad)
    assert sizes[2] > sizes[0] and sizes[3] == sizes[2] == sizes[4]  # grown once, then reused
