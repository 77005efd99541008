"""The model changed after wrap(): what the workers follow (attributes, hooks, parameters, buffers, objects the
model holds, run-time patches of its code), and what is refused instead of silently diverging."""
from __future__ import annotations

import copy
import functools
import threading
import types

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

import dpool
from tests.helpers import sigkill


class _BufferRequiringGrad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("t", torch.randn(3, requires_grad=True))

    def forward(self, x):
        return self.lin(x) * self.t


def test_buffer_requiring_grad_is_refused_at_wrap():
    with pytest.raises(dpool.UnsupportedError, match="buffer t requires grad.*nn.Parameter"):
        dpool.wrap(_BufferRequiringGrad(), ["cpu", "cpu"])


def _train(model, opt, batches, targets):
    for x, y in zip(batches, targets):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


@pytest.mark.parametrize("change", ["same_shape_head", "new_parameter", "other_shape_head", "activation",
                                    "load_state_dict_assign"])
def test_changes_to_the_model_after_wrap_are_followed(wrap, change):
    """DataParallel re-replicates every forward, so it follows a new head or parameter assigned after
    wrapping; dpool must too (not train the workers' stale copy)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    ref = copy.deepcopy(net)
    model = wrap(net)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(7, 6, generator=g, dtype=torch.float64) for _ in range(3)]
    ys = [torch.randn(7, 3, generator=g, dtype=torch.float64) for _ in range(3)]
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    _train(model, opt, xs[:1], ys[:1])
    _train(ref, ref_opt, xs[:1], ys[:1])

    def apply(m: nn.Sequential, seed: int) -> None:
        torch.manual_seed(seed)
        if change == "same_shape_head":
            m[2] = nn.Linear(8, 3).double()
        elif change == "new_parameter":
            m[0].weight = nn.Parameter(torch.randn(8, 6, dtype=torch.float64))
        elif change == "other_shape_head":
            m[2] = nn.Sequential(nn.Linear(8, 5), nn.ReLU(), nn.Linear(5, 3)).double()
        elif change == "activation":
            m[1] = nn.ReLU()
        elif change == "load_state_dict_assign":
            m.load_state_dict({k: v * 0.5 for k, v in m.state_dict().items()}, assign=True)

    apply(net, 5)
    apply(ref, 5)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    _train(model, opt, xs[1:], ys[1:])
    _train(ref, ref_opt, xs[1:], ys[1:])
    for (n, p), rp in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, rp, msg=f"{change}: {n}")
    with torch.no_grad():
        torch.testing.assert_close(model(xs[0]), ref(xs[0]))


def test_a_parameter_changed_in_place_between_forward_and_backward_is_refused(wrap):
    """An optimizer.step() (or an update under no_grad) between a forward and its backward: one process raises
    for the weights its graph saved; the workers' graphs hold the shared weights, whose versions the master's
    update does not move, so they would backpropagate with the new values. dpool raises, names the parameter
    and writes no gradient. A change through .data is tracked by neither, and both use the new values."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    ref = copy.deepcopy(net)
    model = wrap(net)
    x = torch.randn(6, 4, dtype=torch.float64)
    out, rout = model(x), ref(x)
    with torch.no_grad():
        net[2].weight.mul_(2)
        ref[2].weight.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        rout.sum().backward()  # one process
    with pytest.raises(dpool.ModelChangedError, match=r"modified by an inplace operation: parameter 2\.weight of "
                                                      r"the dpool model changed in place after its forward") as info:
        out.sum().backward()
    assert isinstance(info.value, RuntimeError)
    assert all(p.grad is None for p in net.parameters())  # nothing written
    for m in (net, ref):  # a frozen weight that the graph saves (for the first layer's gradient)
        m[2].weight.requires_grad_(False)
    out, rout = model(x), ref(x)
    with torch.no_grad():
        net[2].weight.mul_(2)
        ref[2].weight.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        rout.sum().backward()
    with pytest.raises(dpool.ModelChangedError, match=r"parameter 2\.weight of the dpool model"):
        out.sum().backward()
    assert all(p.grad is None for p in net.parameters())
    for m in (net, ref):
        m[2].weight.requires_grad_(True)
    # through .data: untracked in one process too, where the backward reads the new values as well
    out, rout = model(x), ref(x)
    net[2].weight.data.mul_(0.5)
    ref[2].weight.data.mul_(0.5)
    out.sum().backward()
    rout.sum().backward()
    for (n, p), rp in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, rp.grad, msg=n)
    # the loss on the workers (its backward may run with the loss): the same refusal
    net2 = copy.deepcopy(ref)
    model2 = wrap(net2, gather=False)
    loss = dpool.criterion(nn.MSELoss())(model2(x), torch.zeros(6, 3, dtype=torch.float64))
    opt = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    for p in net2.parameters():  # a step that moves the second layer (torch's own check sees the first)
        p.grad = torch.ones_like(p) if p.shape[0] == 3 else None
    opt.step()
    with pytest.raises(dpool.ModelChangedError, match=r"parameters 2\.weight, 2\.bias of the dpool model"):
        loss.backward()


class _Knobs(nn.Module):
    """A model whose forward reads plain attributes: a scale, a dropout probability, hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 8)
        self.act = nn.Tanh()
        self.drop = nn.Dropout(1.0)  # all zeros: deterministic, as p=0 is
        self.out = nn.Linear(8, 3)
        self.scale = 1.0
        self.gain = torch.ones(3)  # a plain tensor attribute, not a buffer

    def forward(self, x):
        return self.out(self.drop(self.act(self.lin(x))) + self.act(self.lin(x))) * self.scale * self.gain


@pytest.mark.parametrize("change", ["attribute", "dropout_p", "forward_hook", "forward_pre_hook",
                                    "backward_pre_hook", "hook_removed", "tensor_in_place"])
def test_attributes_and_hooks_changed_after_wrap_are_followed(wrap, change):
    """DataParallel's replicas share the master's attributes and hooks, so `model.scale = 0.5`,
    `dropout.p = 0` or a hook registered (or removed) after wrapping take effect at the next forward.
    dpool's replicas are persistent: it must ship the model again, once, not train a stale copy."""
    torch.manual_seed(0)
    net = _Knobs().double()
    ref = copy.deepcopy(net)
    handles = [m.act.register_forward_hook(lambda mod, i, o: o * 2) for m in (net, ref)] if change == "hook_removed" else []
    model = wrap(net)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(7, 6, generator=g, dtype=torch.float64) for _ in range(4)]
    ys = [torch.randn(7, 3, generator=g, dtype=torch.float64) for _ in range(4)]
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    _train(model, opt, xs[:1], ys[:1])
    _train(ref, ref_opt, xs[:1], ys[:1])
    replicas = model.worker_states(id)

    def apply(m: _Knobs, i: int) -> None:
        if change == "attribute":
            m.scale = 0.5
        elif change == "dropout_p":
            m.drop.p = 0.0
        elif change == "forward_hook":
            m.act.register_forward_hook(lambda mod, i, o: o * 2)
        elif change == "forward_pre_hook":
            m.out.register_forward_pre_hook(lambda mod, args: (args[0] + 1,))
        elif change == "backward_pre_hook":
            m.out.register_full_backward_pre_hook(lambda mod, go: (go[0] * 3,))
        elif change == "hook_removed":  # registered before wrap()
            handles[i].remove()
        elif change == "tensor_in_place":  # DataParallel's replicas share the tensor object itself
            m.gain[1] = 0.5

    apply(net, 0)
    apply(ref, 1)
    _train(model, opt, xs[1:2], ys[1:2])
    _train(ref, ref_opt, xs[1:2], ys[1:2])
    shipped = model.worker_states(id)
    assert all(a != b for a, b in zip(replicas, shipped)), "the replicas were not re-synced"
    _train(model, opt, xs[2:], ys[2:])
    _train(ref, ref_opt, xs[2:], ys[2:])
    assert model.worker_states(id) == shipped, "re-synced again with nothing changed"
    for (n, p), rp in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, rp, msg=f"{change}: {n}")
    with torch.no_grad():
        torch.testing.assert_close(model(xs[0]), ref(xs[0]))


class _Aliased(nn.Module):
    """Plain tensor attributes that view a parameter's and a buffer's memory, as in one process they do."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.register_buffer("shift", torch.linspace(-1, 1, 12))
        self.w_t = self.lin.weight.detach().t()  # a transposed view: follows every optimizer step
        self.half_shift = self.shift[6:]  # a slice of a buffer, which forward updates in place
        self.extra = torch.zeros(6)

    def forward(self, x):
        if self.training:
            self.shift.mul_(0.9)
        return torch.tanh(self.lin(x)) @ self.w_t + self.half_shift + self.extra


def test_a_tensor_attribute_viewing_a_parameter_follows_it(wrap):
    """`self.w_t = self.lin.weight.detach().t()` shares the weight's memory in one process. dpool once
    pickled it by value and rebound the weight to shared memory, so master and workers both computed with
    the initial weight while it trained (outputs apart by 4.7 after one step, 2211 after four). It must see
    every step with no re-sync (an alias set after wrap(): one), and still view the weight after close()."""
    torch.manual_seed(0)
    net = _Aliased().double()
    ref = copy.deepcopy(net)
    for m in (net, ref):  # (.double() and deepcopy make new tensors)
        m.w_t, m.half_shift = m.lin.weight.detach().t(), m.shift[6:]
    model = wrap(net)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(8, 6, generator=g, dtype=torch.float64) for _ in range(6)]
    ys = [torch.randn(8, 6, generator=g, dtype=torch.float64) for _ in range(6)]
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    replicas = model.worker_states(id)
    for i in range(6):
        if i == 4:
            assert model.worker_states(id) == replicas, "re-synced, where the aliases changed with their bases"
            net.extra, ref.extra = net.lin.bias.detach(), ref.lin.bias.detach()
        _train(model, opt, xs[i:i + 1], ys[i:i + 1])
        _train(ref, ref_opt, xs[i:i + 1], ys[i:i + 1])
        with torch.no_grad():
            torch.testing.assert_close(model(xs[0]), ref(xs[0]), msg=f"step {i}")
    assert all(a != b for a, b in zip(replicas, model.worker_states(id))), "an alias set after wrap() was not shipped"
    torch.testing.assert_close(net.lin.weight, ref.lin.weight)
    torch.testing.assert_close(net.shift, ref.shift)
    torch.testing.assert_close(model.worker_states(lambda m: m.w_t), [ref.w_t, ref.w_t])
    model.close()
    assert net.w_t.data_ptr() == net.lin.weight.data_ptr() and net.half_shift.data_ptr() == net.shift[6:].data_ptr()
    assert net.extra.data_ptr() == net.lin.bias.data_ptr()


class _Settings:
    """A plain settings object, as a model's config is (HF's PretrainedConfig is one)."""

    def __init__(self) -> None:
        self.scale = 1.0
        self.act = "tanh"
        self.extra = types.SimpleNamespace(shift=0.0)


class _Holder(nn.Module):
    """A forward that reads objects the model holds: a config, a list, a dict of tensors, a list with a view of
    the weight, and a frozen module kept in a list (out of ``parameters()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.config = _Settings()
        self.gains = [1.0, 1.0]
        self.masks = {"keep": torch.ones(6)}
        self.views = [self.lin.weight.detach()]
        self.frozen = [nn.Linear(6, 6).requires_grad_(False)]

    def forward(self, x):
        h = getattr(torch, self.config.act)(self.lin(x)) * self.config.scale * self.gains[0]
        return (h + self.config.extra.shift) * self.masks["keep"] + x @ self.views[0] + self.frozen[0](x)


def test_objects_the_model_holds_changed_in_place_after_wrap_are_followed(wrap):
    """`model.config.output_hidden_states = True`, `self.gains[0] = 2` or `self.masks["keep"][0] = 0` change
    what one process computes, and DataParallel's replicas share those objects. dpool's workers computed
    with their copies from wrap() (outputs apart by up to 18 after one change): each change must re-ship the
    model once, and a list holding a view of the weight must follow the optimizer's steps with no re-ship."""
    torch.manual_seed(0)
    net = _Holder().double()
    ref = copy.deepcopy(net)
    for m in (net, ref):  # (.double() and deepcopy make new tensors)
        m.views = [m.lin.weight.detach()]
        m.frozen[0].double()
    net.history = list(range(60_000))  # more than dpool compares before each forward: said once
    with pytest.warns(RuntimeWarning, match=r"model\.history holds more than dpool follows"):
        model = wrap(net)
    changes = [
        lambda m: setattr(m.config, "scale", 0.5),
        lambda m: setattr(m.config, "act", "sigmoid"),
        lambda m: setattr(m.config.extra, "shift", 0.25),
        lambda m: m.gains.__setitem__(0, 2.0),
        lambda m: m.masks["keep"].__setitem__(2, 0.0),
        lambda m: m.masks.__setitem__("keep", torch.full((6,), 0.5, dtype=torch.float64)),
        lambda m: m.frozen[0].weight.mul_(2),
        None,
    ]
    g = torch.Generator().manual_seed(1)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    replicas = model.worker_states(id)
    for i, change in enumerate(changes):
        if change is not None:
            change(net)
            change(ref)
        x, y = torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randn(8, 6, generator=g, dtype=torch.float64)
        _train(model, opt, [x], [y])
        _train(ref, ref_opt, [x], [y])
        shipped = model.worker_states(id)
        assert (shipped != replicas) == (change is not None), f"change {i}: re-synced {shipped != replicas}"
        replicas = shipped
        with torch.no_grad():
            torch.testing.assert_close(model(x), ref(x), msg=f"change {i}")
    torch.testing.assert_close(net.lin.weight, ref.lin.weight)
    model.close()
    assert net.views[0].data_ptr() == net.lin.weight.data_ptr()


class _HoldsItsTrainingLoop(nn.Module):
    def __init__(self, read_lr: bool = False) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))
        self.read_lr = read_lr

    def forward(self, x):
        scale = self.sched.get_last_lr()[0] if self.read_lr else 1.0
        return self.body(x) * scale


def test_an_optimizer_and_scheduler_the_model_holds_stay_with_the_coordinator(wrap):
    """`self.opt = Adam(self.parameters())` with a scheduler and a GradScaler on the model: they change at
    every step, so dpool shipped the model again before every forward, the optimizer's state tensors by value
    (200 ms a step instead of 16 for 8 layers of 512x512). Workers now get a stand-in for them: training
    equals one process with no re-ship, and a forward that uses one gets an error naming it and the fix."""
    torch.manual_seed(0)
    net = _HoldsItsTrainingLoop().double()
    ref = copy.deepcopy(net)
    for m in (net, ref):
        m.opt = torch.optim.Adam(m.parameters(), lr=0.05)
        m.sched = torch.optim.lr_scheduler.StepLR(m.opt, step_size=2, gamma=0.5)
        m.scaler = torch.amp.GradScaler("cpu", enabled=False)
        m.state = {"opt": m.opt, "steps": 0}  # the optimizer inside a dict the walk follows
    model = wrap(net)
    replicas = model.worker_states(id)
    g = torch.Generator().manual_seed(1)
    for i in range(5):
        x, y = torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randn(8, 6, generator=g, dtype=torch.float64)
        for m, run in ((net, model), (ref, ref)):
            m.opt.zero_grad()
            nn.functional.mse_loss(run(x), y).backward()
            m.opt.step()
            m.sched.step()
        with torch.no_grad():
            torch.testing.assert_close(model(x), ref(x), msg=f"step {i}")
        assert model.worker_states(id) == replicas, f"step {i}: the model was shipped again"
    net.state["steps"] = ref.state["steps"] = 5  # what the walk follows still re-ships
    model(x)
    assert model.worker_states(id) != replicas
    model(x)  # (no change: three changed forwards in a row would warn)
    assert model.worker_states(lambda m: repr(m.opt)) == ["<a torch.optim.adam.Adam: left with dpool's coordinator>"] * 2
    for a, b in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(net.opt.state_dict()["state"][0]["exp_avg"], ref.opt.state_dict()["state"][0]["exp_avg"])

    net.read_lr = True  # a forward that reads the scheduler
    with pytest.raises(dpool.RemoteError, match=r"UnsupportedError in worker 0 .*the model holds a torch\.optim\.lr_scheduler\.StepLR, which "
                                                  r"stays with dpool's coordinator .*\(\.get_last_lr\)\. Pass what "
                                                  r"forward\(\) needs from it .* as an argument of forward\(\)"):
        model(x)
    net.read_lr = False
    torch.testing.assert_close(model(x), ref(x))  # the pool is still usable


@pytest.mark.parametrize("case", ["flat_attribute", "buffer_view", "parameter_view"])
def test_tensors_that_share_memory_in_ways_dpool_cannot_keep_are_refused(wrap, case):
    """dpool gives each parameter and buffer its own place in shared memory. A flat tensor the parameters
    are slices of (apex-style flat weights), a buffer that views a weight, or two parameters over the same
    memory would part from what they view in one process: a clear error at wrap(), not a stale copy.
    (Parameters that are disjoint slices of one tensor, the flat case's a and b, are fine.)"""
    net = nn.Module()
    net.flat = torch.zeros(12)
    net.a, net.b = nn.Parameter(net.flat[:6]), nn.Parameter(net.flat[6:])
    if case == "flat_attribute":
        match = r"model\.flat is a plain tensor attribute that views part of a's memory .*Register it as a buffer"
    elif case == "buffer_view":
        del net.flat
        net.register_buffer("a_view", net.a.detach()[1:3])
        match = r"a and a_view share memory .*a_view changes with a;.*plain attribute \(self\.a_view = \.\.\."
    else:
        del net.flat
        net.c = nn.Parameter(net.b.detach()[2:])
        match = r"b and c share memory .*they change together.*same nn\.Parameter object"
    with pytest.raises(dpool.UnsupportedError, match=match):
        wrap(net)


def test_a_trainable_tensor_that_is_not_a_parameter_is_refused(wrap):
    """`self.alpha = torch.tensor(2.0, requires_grad=True)`, handed to the optimizer by hand, trains in one
    process and in DataParallel (its replicas share it). dpool's workers computed its gradient on their
    copies and never returned it, so it silently stayed 2.0. Now: an error at wrap(), or at each forward
    once one is set after it, with the pool and the master untouched (set together with a new submodule,
    it broke the pool: PoolBrokenError)."""
    net = _Knobs()
    net.alpha = torch.tensor(2.0, requires_grad=True)
    with pytest.raises(dpool.UnsupportedError, match=r"model\.alpha is a tensor that requires grad but is not an "
                                                     r"nn\.Parameter.*Register it as an nn\.Parameter"):
        wrap(net)
    del net.alpha
    model = wrap(net)
    x = torch.randn(4, 6)
    before = model(x).detach()
    replicas = model.worker_states(id)
    net.act.alpha = torch.ones(1, requires_grad=True)
    _refused_until_undone(model, x, before, r"model\.act\.alpha is a tensor that requires grad",
                          lambda: delattr(net.act, "alpha"))
    assert model.worker_states(id) == replicas
    # with a new submodule too, the check ran only after the old shared memory was given up: the pool broke
    net.tail = nn.Identity()
    net.act.alpha = torch.ones(1, requires_grad=True)
    _refused_until_undone(model, x, before, r"model\.act\.alpha is a tensor that requires grad",
                          lambda: delattr(net.act, "alpha"))


def _refused_until_undone(model, x, before, match, undo):
    """Each forward raises ``match`` with the pool and the master untouched, until ``undo()``."""
    for _ in range(2):
        with pytest.raises(dpool.UnsupportedError, match=match):
            model(x)
    undo()
    torch.testing.assert_close(model(x), before)


class _AssignsBuffers(nn.Module):
    """Buffers a forward assigns anew instead of updating in place: a running average (persistent), a
    table rebuilt at the length asked for (non-persistent: a cache, as rotary-embedding tables were), and,
    when told to, a persistent one given another shape."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3, dtype=torch.float64)
        self.register_buffer("avg", torch.zeros(3, dtype=torch.float64))
        self.register_buffer("table", torch.zeros(1, dtype=torch.float64), persistent=False)
        self.register_buffer("grows", torch.zeros(2))
        self.grow = False

    def forward(self, x: torch.Tensor, length: int) -> torch.Tensor:
        y = self.lin(x)
        if self.training:
            self.avg = 0.9 * self.avg + 0.1 * y.detach().mean(0)
        if self.table.numel() != length:
            self.register_buffer("table", torch.linspace(0, 1, length, dtype=x.dtype, device=x.device),
                                 persistent=False)
        if self.grow:
            self.grows = torch.zeros(3)
        return y - self.avg + self.table.mean()


def test_buffers_a_forward_assigns_anew_reach_the_master_like_in_place_updates(wrap):
    """``self.avg = 0.9 * self.avg + ...`` in a forward: the replica held the new tensor apart from its
    shared view, so the master never got the update and each worker drifted on its own value (eval on the
    workers then disagreed with the master they came from). Now the update reaches the master by the buffer
    policy, as BatchNorm's in-place one does: one worker trains as one process; two follow DataParallel's
    "first" (each shard starts from the master's buffers, the first shard's update is kept)."""
    torch.manual_seed(0)
    net = _AssignsBuffers()
    ref = copy.deepcopy(net)
    one = wrap(net, ["cpu"])
    opt, ropt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (net, ref))
    for step in range(3):
        x = torch.randn(8, 3, dtype=torch.float64)
        out, rout = one(x, 4 + step % 2), ref(x, 4 + step % 2)
        torch.testing.assert_close(out, rout)
        out.pow(2).sum().backward()
        rout.pow(2).sum().backward()
        opt.step(), ropt.step()
        opt.zero_grad(), ropt.zero_grad()
    for (name, t), r in zip(net.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(t, r, msg=lambda m: f"{name}: {m}")
    one.close()

    torch.manual_seed(1)
    net = _AssignsBuffers()
    two = wrap(net, ["cpu", "cpu"])
    for step in range(3):
        x = torch.randn(8, 3, dtype=torch.float64)
        shards = [copy.deepcopy(net) for _ in range(2)]  # DataParallel's replicas of the master as it is now
        want = torch.cat([shards[0](x[:4], 5), shards[1](x[4:], 5)])
        torch.testing.assert_close(two(x, 5), want)
        torch.testing.assert_close(net.avg, shards[0].avg)  # the first shard's update, on the master
    assert not torch.equal(net.avg, torch.zeros(3, dtype=torch.float64))
    two.eval()
    net.eval()
    x = torch.randn(8, 3, dtype=torch.float64)
    with torch.no_grad():  # every worker runs with the master's buffers, not a value of its own
        torch.testing.assert_close(two(x, 5), copy.deepcopy(net)(x, 5))
    two.train()

    before = copy.deepcopy(net.state_dict())
    net.grow = True
    with pytest.raises(dpool.RemoteError, match=r"replaced buffer grows \(\(2,\)/torch.float32/cpu\) with "
                                                 r"\(3,\)/torch.float32/cpu.*persistent=False"):
        two(torch.randn(8, 3, dtype=torch.float64), 5)
    for name, t in net.state_dict().items():  # a failed forward commits nothing
        torch.testing.assert_close(t, before[name], msg=lambda m: f"{name}: {m}")
    net.grow = False
    x = torch.randn(8, 3, dtype=torch.float64)
    shards = [copy.deepcopy(net) for _ in range(2)]
    torch.testing.assert_close(two(x, 5), torch.cat([shards[0](x[:4], 5), shards[1](x[4:], 5)]))
    assert two.worker_states(lambda r: tuple(r.grows.shape)) == [(2,), (2,)]  # back in the layout

    # something else holding the old tensor: in one process it would keep the old values, but an update
    # put into the buffer's shared memory would change them too, so it is an error rather than that
    aliased = _AssignsBuffers()
    aliased.before = aliased.avg
    with pytest.raises(dpool.RemoteError, match=r"assigned buffer avg a new tensor while the model still holds the "
                                                 r"old one elsewhere"):
        wrap(aliased, ["cpu"])(torch.randn(4, 3, dtype=torch.float64), 5)


class _BackwardHookStat(nn.Module):
    """Buffers a module's backward hook updates: statistics of the gradients (in place) and a count
    (assigned anew)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3, dtype=torch.float64)
        self.register_buffer("gsum", torch.zeros(3, dtype=torch.float64))
        self.register_buffer("gseen", torch.zeros((), dtype=torch.int64))
        self.lin.register_full_backward_hook(self._record)

    def _record(self, module: nn.Module, grad_input: Any, grad_output: Any) -> None:
        self.gsum.add_(grad_output[0].sum(0))
        self.gseen = self.gseen + 1  # (assigned anew, in the backward)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class _Checkpointed(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, x, use_reentrant=False)


def test_buffers_a_backward_hook_updates_in_place_reach_the_master(wrap):
    """The workers' backward ran the hook on their own buffers, and the next forward's refresh overwrote
    them with the master's: the updates were lost. Now the workers report the buffers their backward
    changed and the coordinator commits them as a forward's updates: one worker as one process (the
    gradient round, the loss on the workers, a BatchNorm that checkpointing runs again in the backward),
    two by the buffer policy."""
    for loss_on_workers in (False, True):
        torch.manual_seed(0)
        net = _BackwardHookStat()
        ref = copy.deepcopy(net)
        model = wrap(net, ["cpu"], gather=not loss_on_workers)
        crit = dpool.criterion(nn.MSELoss())
        opt, ropt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (net, ref))
        for _ in range(3):
            x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
            loss = crit(model(x), y) if loss_on_workers else F.mse_loss(model(x), y)
            loss.backward()
            F.mse_loss(ref(x), y).backward()
            opt.step(), ropt.step()
            opt.zero_grad(), ropt.zero_grad()
            torch.testing.assert_close(net.gsum, ref.gsum)
        assert not torch.equal(net.gsum, torch.zeros(3, dtype=torch.float64))
        assert int(net.gseen) == 3
        if loss_on_workers:  # the backward the workers ran with the loss reported its buffers too
            assert model.stats()["backward_rounds_saved"] == 3
        model.close()

    # BatchNorm run again by torch.utils.checkpoint in the backward: one process updates its running
    # statistics twice, the second time inside the kernel (no version counter moves; num_batches_tracked's does)
    torch.manual_seed(2)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).double()
    ref = copy.deepcopy(net)
    model = wrap(nn.Sequential(_Checkpointed(net)), ["cpu"])
    for _ in range(2):
        x = torch.randn(8, 3, dtype=torch.float64)
        model(x).pow(2).sum().backward()
        checkpoint(ref, x, use_reentrant=False).pow(2).sum().backward()
    for (name, t), r in zip(net.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(t, r, msg=lambda m: f"checkpointed {name}: {m}")
    assert int(net[1].num_batches_tracked) == 4
    model.close()

    for policy in ("first", "average"):
        torch.manual_seed(1)
        net = _BackwardHookStat()
        model = wrap(net, ["cpu", "cpu"], buffers=policy)
        for _ in range(2):
            x = torch.randn(8, 3, dtype=torch.float64)
            shards = [copy.deepcopy(net) for _ in range(2)]  # each shard starts from the master's buffers
            for shard, rows in zip(shards, (x[:4], x[4:])):
                shard(rows).pow(2).sum().backward()
            model(x).pow(2).sum().backward()
            want = shards[0].gsum if policy == "first" else (shards[0].gsum + shards[1].gsum) / 2
            torch.testing.assert_close(net.gsum, want)


class _MaxNormLinear(nn.Linear):
    """A max-norm constraint as braindecode's EEG layers write it: the weight's data replaced in the forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.weight.data = torch.renorm(self.weight.data, p=2, dim=0, maxnorm=0.5)
        return super().forward(x)


def test_a_parameter_whose_data_the_forward_replaces_stays_the_masters(wrap):
    """``self.weight.data = torch.renorm(...)`` in a forward left the replica's parameter off the master's
    memory for good: the workers trained on a stale copy that never saw another optimizer step, and the
    master never got the constraint (parameters 100 apart after three steps). Now the worker binds it
    back and the coordinator writes the new values into the master once: as one process, over steps."""
    torch.manual_seed(0)
    net = _MaxNormLinear(4, 3, dtype=torch.float64)
    ref = copy.deepcopy(net)
    model = wrap(net, ["cpu", "cpu"])
    opt, ropt = (torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9) for m in (net, ref))
    for _ in range(4):
        x = torch.randn(8, 4, dtype=torch.float64)
        out, rout = model(x), ref(x)
        torch.testing.assert_close(out, rout)
        out.pow(2).sum().backward()
        rout.pow(2).sum().backward()
        torch.testing.assert_close(net.weight.grad, ref.weight.grad)
        opt.step(), ropt.step()
        opt.zero_grad(), ropt.zero_grad()
    torch.testing.assert_close(net.weight, ref.weight)
    assert net.weight.norm(dim=1).max() > 0.5  # (the step after the last forward's constraint)

    net.weight.data.zero_()  # the constraint again, now on zeros: the workers see the master's memory
    with torch.no_grad():
        torch.testing.assert_close(model(x), net.bias.expand(8, 3))


class _ShrinksInPlace(nn.Linear):
    """Weight decay written into the forward, in place: one process shrinks the weight once per step."""

    shrink = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shrink:
            self.weight.data.mul_(0.9)
        return super().forward(x)


class _RenormedEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, max_norm=0.5)
        self.lin = nn.Linear(4, 2)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.lin(self.emb(t).mean(1))


def test_a_parameter_the_forward_changes_in_place_is_an_error(wrap):
    """The replicas' parameters are the master's memory: ``self.weight.data.mul_(0.9)`` in a forward ran
    once per shard on it (0.81 a step with two workers where one process gives 0.9), silently, and
    ``nn.Embedding(max_norm=...)``'s renorm of the rows it looks up, run by two shards on the same row at
    once, gave rows 0.35 off. Both are errors now when a call has several shards (one shard changes the
    master once, as one process does)."""
    net = _ShrinksInPlace(4, 3)
    model = wrap(net, ["cpu", "cpu"])
    with pytest.raises(dpool.RemoteError, match=r"changed parameter\(s\) weight in place.*each of the 2 "
                                                 r"shard\(s\) applied the change to the master"):
        model(torch.randn(8, 4))
    net.shrink = False  # the pool stays usable (an attribute changed after wrap() is followed)
    x = torch.randn(8, 4)
    torch.testing.assert_close(model(x), nn.functional.linear(x, net.weight, net.bias))
    net.shrink = True
    torch.manual_seed(0)
    ref = copy.deepcopy(net)
    one = wrap(_ShrinksInPlace(4, 3), ["cpu"])
    dpool.unwrap(one).load_state_dict(ref.state_dict())
    for _ in range(2):  # one worker: as one process
        x = torch.randn(4, 4)
        torch.testing.assert_close(one(x), ref(x))
    torch.testing.assert_close(dpool.unwrap(one).weight, ref.weight)

    torch.manual_seed(0)
    net = _RenormedEmbedding()
    before = copy.deepcopy(net.state_dict())
    model = wrap(net, ["cpu", "cpu"])
    with pytest.raises(dpool.RemoteError, match=r"emb: nn\.Embedding\(max_norm=\.\.\.\) renormalises the rows "
                                                 r"it looks up in place.*torch\.renorm"):
        model(torch.tensor([[0, 1, 2], [3, 4, 0], [0, 1, 2], [3, 4, 0]]))
    for name, t in net.state_dict().items():  # refused before the forward wrote anything
        torch.testing.assert_close(t, before[name])


def test_a_buffer_viewing_a_parameter_registered_after_wrap_is_refused(wrap):
    """It was silently parted from the weight at the re-sync, as wrap() refuses it for."""
    net = _Knobs()
    model = wrap(net)
    x = torch.randn(4, 6)
    before = model(x).detach()
    net.lin.register_buffer("w_view", net.lin.weight.detach()[:2])
    _refused_until_undone(model, x, before, r"lin\.weight and lin\.w_view share memory",
                          lambda: delattr(net.lin, "w_view"))


def test_an_unpicklable_attribute_set_after_wrap_is_named_and_breaks_nothing(wrap):
    """A logger, writer or lock hung on the model after wrap() cannot be shipped: every forward says which
    attribute, the pool and the master stay as they were, and deleting it lets training go on."""
    net = _Knobs()
    model = wrap(net)
    x = torch.randn(4, 6)
    before = model(x).detach()
    replicas = model.worker_states(id)
    net.act.lock = threading.Lock()
    for _ in range(2):  # not once only: the replicas would be stale from then on
        with pytest.raises(dpool.UnpicklableModelError, match=r"(?s)model\.act\.lock changed after dpool\.wrap\(\).*"
                                                              r"culprit is model\.act\.lock"):
            model(x)
    del net.act.lock
    torch.testing.assert_close(model(x), before)
    assert model.worker_states(id) == replicas


def test_train_eval_switches_and_hooks_elsewhere_ship_nothing(wrap):
    """The modes travel with every forward, and a hook on a tensor is not the model's: neither re-ships it."""
    net = _Knobs()
    model = wrap(net)
    x = torch.randn(4, 6, requires_grad=True)
    replicas = model.worker_states(id)
    for mode in (False, True, False, True):
        model.train(mode)
        out = model(x)
        out.register_hook(lambda grad: grad * 1)
        x.register_hook(lambda grad: grad * 1)
        out.sum().backward()
    assert model.worker_states(id) == replicas


def test_an_attribute_changed_before_every_forward_is_followed_with_a_warning(wrap):
    """Correct, but every forward ships the model again: after three in a row dpool says so, once, naming the
    attribute and what to do instead."""
    net = _Knobs().double()
    ref = copy.deepcopy(net)
    model = wrap(net)
    x = torch.randn(5, 6, dtype=torch.float64)
    with pytest.warns(UserWarning, match=r"dpool: model\.scale changed before each of the last 3 forwards.*"
                                         r"argument of forward\(\)") as caught:
        for step in range(5):
            net.scale = ref.scale = 1.0 + step
            with torch.no_grad():
                torch.testing.assert_close(model(x), ref(x))
    assert sum("changed before each" in str(w.message) for w in caught) == 1
    assert caught[0].filename == __file__


@pytest.mark.parametrize("when", ["before_wrap", "after_wrap"])
def test_global_module_hooks_are_named_in_a_warning(wrap, when):
    """A global module hook runs in DataParallel's replicas (same process) but never in dpool's workers: say
    so, once, rather than let a hook that changes outputs be silently skipped."""
    from torch.nn.modules.module import register_module_forward_hook

    net = _Knobs()
    handle = register_module_forward_hook(lambda m, i, o: o) if when == "before_wrap" else None
    try:
        with pytest.warns(UserWarning, match=r"register_module_forward_hook.*not in dpool's workers") as caught:
            model = wrap(net)
            if handle is None:
                model(torch.randn(3, 6))  # no hook yet: no warning
                assert not any("global module hooks" in str(w.message) for w in caught)
                handle = register_module_forward_hook(lambda m, i, o: o)
            model(torch.randn(3, 6))
            model(torch.randn(3, 6))
        assert sum("global module hooks" in str(w.message) for w in caught) == 1
    finally:
        if handle is not None:
            handle.remove()


class _Patchable(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.act, self.out, self.gelu = nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3), nn.GELU()

    def forward(self, x):
        return self.gelu(self.out(self.act(self.lin(x))))


@pytest.mark.parametrize("patch", ["class_method", "library_function", "wrapped_method", "unpicklable"])
def test_run_time_patches_of_the_models_code_reach_the_workers(wrap, monkeypatch, patch):
    """A script that patches a library before training (`LlamaAttention.forward = my_forward`,
    `F.gelu = my_gelu`, as Liger Kernel and many research scripts do) runs the patched code in one process
    and in DataParallel's replicas. dpool's workers import the library from disk and silently ran the
    original (outputs apart by 0.1 here). The patch must reach them, a restarted worker too, and one that
    cannot be pickled must be named in a warning."""
    torch.manual_seed(0)
    net = _Patchable()
    ref = copy.deepcopy(net)
    if patch == "class_method":
        monkeypatch.setattr(nn.Tanh, "forward", lambda self, x: torch.tanh(x) * 2)
    elif patch == "library_function":  # nn.GELU.forward calls F.gelu
        monkeypatch.setattr(nn.functional, "gelu", lambda x, approximate="none": x * torch.sigmoid(1.702 * x))
    elif patch == "wrapped_method":  # functools.wraps copies the original's name: it must travel by value
        original = nn.Linear.forward

        @functools.wraps(original)
        def forward(self, x):
            return original(self, x) * 0.5

        monkeypatch.setattr(nn.Linear, "forward", forward)
    else:
        lock = threading.Lock()
        monkeypatch.setattr(nn.Tanh, "forward", lambda self, x: torch.tanh(x) * 2 if lock else None)
        with pytest.warns(RuntimeWarning, match=r"workers run other code than this process for "
                                                r"torch\.nn\.modules\.activation\.Tanh\.forward \(cannot be pickled"):
            wrap(net)
        return
    model = wrap(net, max_restarts=1)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(8, 6, generator=g) for _ in range(3)]
    ys = [torch.randn(8, 3, generator=g) for _ in range(3)]
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for i in range(3):
        if i == 2:  # a restarted worker imports the library afresh
            sigkill(model.pids[1])
            with pytest.raises(dpool.WorkerDiedError):
                model(xs[0])
        _train(model, opt, xs[i:i + 1], ys[i:i + 1])
        _train(ref, ref_opt, xs[i:i + 1], ys[i:i + 1])
        with torch.no_grad():
            torch.testing.assert_close(model(xs[0]), ref(xs[0]), msg=lambda m: f"step {i}: {m}")
    for (n, p), rp in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, rp, msg=n)


def test_attention_functions_registered_with_huggingface_reach_the_workers(wrap, monkeypatch):
    """`AttentionInterface.register("mine", fn)` is HF's way to plug in an attention function, which the
    config then names: the workers, which import transformers afresh, lacked it (a KeyError there), and
    one registered over a built-in name ("sdpa") silently ran the built-in in them."""
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def halved(module, query, key, value, attention_mask, **kw):
        out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kw)
        return out * 0.5, weights

    ids = torch.randint(0, 100, (4, 8), generator=torch.Generator().manual_seed(0))
    for name in ("dpool_test_halved", "sdpa"):
        monkeypatch.setitem(AttentionInterface._global_mapping, name, halved)
        torch.manual_seed(0)
        net = LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                           intermediate_size=64, vocab_size=100, attn_implementation=name))
        with torch.no_grad():
            ref = net(input_ids=ids).logits
            torch.testing.assert_close(wrap(net)(input_ids=ids).logits, ref, msg=name)


class _StoresKL(nn.Module):
    """A Bayesian layer as blitz writes it: the forward keeps its KL term on the module, and the training
    loop reads it after the call. Also a style-transfer loss's `self.loss` (set by the forward only) and a
    cache that does not require grad."""

    def __init__(self, returns: bool = False) -> None:
        super().__init__()
        self.mu = nn.Parameter(torch.randn(3, 6, dtype=torch.float64))
        self.rho = nn.Parameter(torch.full((3, 6), -3.0, dtype=torch.float64))
        self.kl = torch.zeros((), dtype=torch.float64)
        self.cache = None
        self.returns = returns

    def forward(self, x):
        w = self.mu + F.softplus(self.rho)
        kl = 0.01 * w.pow(2).sum()
        self.cache = w.detach()
        if self.returns:
            return x @ w.T, kl
        self.kl = kl
        self.loss = kl * 2
        return x @ w.T


def test_a_tensor_the_forward_keeps_on_the_model_for_the_loss_is_warned_about(wrap):
    """The forward sets `self.kl` on the workers' replicas, and the master's `net[0].kl` stays what it
    was: a loop adding it to the loss trained without the term, silently (nn.DataParallel's replicas lose
    it too). dpool now warns, once, at the user's line; returning the value from forward, as the warning
    advises, trains as one process does."""
    import warnings

    torch.manual_seed(0)
    # torch's hook-based weight norm and pruning recompute `weight` before each forward: not warned about
    from torch.nn.utils import prune

    pruned = prune.l1_unstructured(nn.Linear(3, 3, dtype=torch.float64), "weight", 0.5)
    net = nn.Sequential(_StoresKL(), nn.utils.weight_norm(nn.Linear(3, 3, dtype=torch.float64)), pruned)
    model = wrap(net)
    x = torch.randn(8, 6, dtype=torch.float64)
    with pytest.warns(UserWarning, match=r"the forward set the attribute '0\.kl' of model\.module to a tensor "
                                         r"that requires grad.*Return the value from forward\(\)") as got:
        model(x)
    assert [w.filename for w in got if "attribute" in str(w.message)] == [__file__]
    assert not net[0].kl.requires_grad and not hasattr(net[0], "loss")  # the master's: stale, or loud
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x)  # once
        with torch.no_grad():
            model(x)

    # the advice: the term returned from forward (one copy per shard, gathered like any 0-dim output)
    torch.manual_seed(0)
    net = nn.Sequential(_StoresKL(returns=True))
    ref = copy.deepcopy(net)
    model = wrap(net)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", "Was asked to gather along dimension 0")
        out, kl = model(x)
    rout, rkl = ref(x)
    (out.pow(2).mean() + kl.mean()).backward()
    (rout.pow(2).mean() + rkl).backward()
    for p, r in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad)


class _KeepsALog(nn.Module):
    """A module whose __getstate__ drops what a replica never needs (as LightningModule sends its trainer as
    None), and sends a copy of a setting."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.log_rows: list = []  # changed every step, never read by forward
        self.trainer = object()
        self.scale = [1.0]

    def forward(self, x):
        return self.lin(x) * self.scale[0]

    def __getstate__(self):
        state = super().__getstate__()
        state.pop("log_rows")
        state["trainer"] = None
        state["scale"] = list(self.scale)
        return state


def test_what_a_modules_getstate_does_not_send_is_not_followed_and_what_it_sends_is(wrap):
    """A LightningModule's trainer changed at every step: followed, it shipped the model again each step, and
    inside no_sync() the step was refused. What __getstate__ drops or sends as None never reaches a replica."""
    net = _KeepsALog()
    model = wrap(net)
    x = torch.randn(4, 3)
    model(x)
    with model.no_sync():
        for i in range(3):
            net.log_rows.append(i)  # dropped by __getstate__: not a change of the replicas
            net.trainer = object()  # sent as None: not one either
            model(x).sum().backward()
    model(x).sum().backward()
    assert model.stats()["restarts"] == 0
    net.scale[0] = 3.0  # sent (as a copy): followed, as before
    torch.testing.assert_close(model(x), net(x))
