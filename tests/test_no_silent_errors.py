"""Uses that once gave wrong numbers with no error: each now gives the reference result or a clear error."""
from __future__ import annotations

import contextlib
import copy
import functools
import os
import random
import threading
import types

from random import uniform as _py_uniform
from typing import Any

import numpy
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

import dpool
from tests import models
from tests.helpers import sigkill


def test_concurrent_calls_from_threads_match_the_reference(wrap):
    """Several threads call one model at once: every output equals the single-process one, and the
    pool stays usable (calls are serialised, never mixed)."""
    torch.manual_seed(0)
    net = models.make("mlp")
    ref = copy.deepcopy(net)
    model = wrap(net)
    inputs = [torch.randn(5 + i, 12, dtype=torch.float64) for i in range(4)]
    expected = [ref(x).detach() for x in inputs]
    failures: list[str] = []

    def hammer(i: int) -> None:
        for _ in range(15):
            with torch.no_grad():
                y = model(inputs[i])
            if not torch.allclose(y, expected[i], rtol=1e-12, atol=1e-12):
                failures.append(f"thread {i}: wrong output")
            y = model(inputs[i])  # with a graph, then backward, in the same thread
            y.sum().backward()

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=100)
    assert not any(t.is_alive() for t in threads) and not failures, failures
    # gradients: 15 backward passes per thread add up, in any order, to the reference's sum
    net.zero_grad()
    ref.zero_grad()
    model(inputs[0]).sum().backward()
    ref(inputs[0]).sum().backward()
    for p, rp in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, rp.grad)


@pytest.mark.parametrize("kind", ["wgan_gp", "r1_nonlinear", "param_grad_penalty"])
def test_higher_order_gradients_match_the_reference(wrap, kind):
    """Gradient penalties need double backward through the workers' graphs: WGAN-GP (gradient w.r.t. an
    interpolated input), R1 through a non-linear function of the output (the incoming gradients then
    require grad too), and a penalty on the parameters' own gradients (Jacobian regularisation, MAML)."""
    torch.manual_seed(0)
    net = models.make("mlp")
    ref = copy.deepcopy(net)
    model = wrap(net)
    for step in range(2):
        real = torch.randn(7, 12, dtype=torch.float64)
        for m in (model, ref):
            m.zero_grad()
            if kind == "wgan_gp":
                x = (0.3 * real + 0.7 * torch.randn(7, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(step))).requires_grad_()
                out = m(x)
                (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
                loss = out.mean() + ((g.norm(2, dim=1) - 1) ** 2).mean()
            elif kind == "r1_nonlinear":
                x = real.clone().requires_grad_()
                out = m(x)
                (g,) = torch.autograd.grad(torch.nn.functional.softplus(out).sum(), x, create_graph=True)
                loss = g.pow(2).sum() + out.pow(2).mean()
            else:
                out = m(real)
                gs = torch.autograd.grad(out.pow(2).mean(), list(m.parameters()), create_graph=True)
                loss = sum(gr.pow(2).sum() for gr in gs) + out.mean()
            loss.backward()
        for (n, p), rp in zip(net.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, rp.grad, msg=f"{kind}: {n}")


def test_third_order_gradients_raise_instead_of_a_wrong_number(wrap):
    model = wrap(models.make("mlp"))
    x = torch.randn(6, 12, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(model(x).pow(3).sum(), x, create_graph=True)
    (h,) = torch.autograd.grad(g.sum(), x, retain_graph=True)  # second order: supported
    ref = copy.deepcopy(model.module)
    (rg,) = torch.autograd.grad(ref(x).pow(3).sum(), x, create_graph=True)
    torch.testing.assert_close(h, torch.autograd.grad(rg.sum(), x)[0])
    with pytest.raises(dpool.UnsupportedError, match="third- and higher-order") as info:
        torch.autograd.grad(g.sum(), x, create_graph=True)  # a graph of the second derivative
    assert isinstance(info.value, RuntimeError)


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


class _Constants(nn.Module):
    """A forward that makes tensors of the default dtype: what torch.set_default_dtype changes."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 4)

    def forward(self, x):
        h = self.lin(x)
        return h + (torch.arange(h.shape[1]) * 1e6 + 0.1)  # float32 would keep 1000000.125, not .1


@pytest.mark.parametrize("when", ["before_wrap", "after_wrap"])
def test_the_default_dtype_and_deterministic_mode_reach_the_workers(wrap, when):
    """torch.set_default_dtype(torch.float64) changes what a forward computes, and DataParallel's replicas,
    in its one process, follow it; so must dpool's workers, whether it was set before wrap() or after.
    The same for torch.use_deterministic_algorithms."""
    torch.manual_seed(0)
    net = _Constants().double()
    ref = copy.deepcopy(net)
    x = torch.randn(5, 6, dtype=torch.float64)
    try:
        if when == "before_wrap":
            torch.set_default_dtype(torch.float64)
            torch.use_deterministic_algorithms(True, warn_only=True)
        model = wrap(net)
        if when == "after_wrap":
            torch.testing.assert_close(model(x), ref(x))  # (float32 in both)
            torch.set_default_dtype(torch.float64)
            torch.use_deterministic_algorithms(True, warn_only=True)
        torch.testing.assert_close(model(x), ref(x), rtol=0, atol=1e-9)
        assert model.worker_states(lambda r: (torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled(),
                                              torch.is_deterministic_algorithms_warn_only_enabled())) == \
            [(torch.float64, True, True)] * 2
    finally:
        torch.set_default_dtype(torch.float32)
        torch.use_deterministic_algorithms(False)
    torch.testing.assert_close(model(x), ref(x))  # and back


def test_the_float32_precision_reaches_the_workers(wrap):
    """torch.set_float32_matmul_precision("medium"), or torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    (torch's newer API, whose use makes the legacy getter raise), lets a CPU with AVX512-BF16 or AMX compute
    float32 matmuls with bf16. DataParallel's replicas, in its one process, follow it; the workers ignored
    it (a difference of 6e-7 here) and must follow it. Their settings are read back, and the outputs equal
    the coordinator's on the same shards bitwise."""
    from dpool.numerics import CPU_PRECISION_OPS, fp32_precision, precision_state, set_precision_state

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256))
    ref = copy.deepcopy(net)
    model = wrap(net)
    x = torch.randn(8, 256)
    saved = precision_state()
    try:
        for setting in ("legacy", "new", "back"):
            set_precision_state(saved)
            if setting == "legacy":
                torch.set_float32_matmul_precision("medium")
            elif setting == "new":
                torch.backends.mkldnn.matmul.fp32_precision = "bf16"
            out = model(x)
            assert model.worker_states(lambda r: fp32_precision(CPU_PRECISION_OPS)) == \
                [fp32_precision(CPU_PRECISION_OPS)] * 2, setting
            assert (fp32_precision(CPU_PRECISION_OPS)[2] == "bf16") == (setting != "back")
            torch.testing.assert_close(out, torch.cat([ref(x[:4]), ref(x[4:])]), rtol=0, atol=0,
                                       msg=lambda m: f"{setting}: {m}")
    finally:
        set_precision_state(saved)


def _precision_as_libraries_read_it(_model=None) -> tuple:
    """torch's legacy getters, which libraries read (and which raise where the two APIs disagree)."""
    answers = []
    for get in (torch.get_float32_matmul_precision, lambda: torch.backends.cuda.matmul.allow_tf32,
                lambda: torch.backends.cudnn.allow_tf32):
        try:
            answers.append(get())
        except RuntimeError:
            answers.append("raises")
    return tuple(answers)


class _ReadsThePrecision(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        fast = torch.get_float32_matmul_precision() != "highest"  # as a library picks a kernel
        return self.lin(x) * (2.0 if fast else 1.0)


def test_torchs_legacy_precision_getters_answer_in_the_workers_as_in_one_process(wrap):
    """torch keeps the legacy precision settings (torch.set_float32_matmul_precision, cudnn.allow_tf32) beside
    the per-operation ones, and its legacy getters raise where the two disagree. Workers were given only the
    per-operation values: after torch.set_float32_matmul_precision("high") in the script, a forward that
    called torch.get_float32_matmul_precision() raised in the workers alone (found on a GPU machine, where
    torch.backends.cuda.matmul.allow_tf32 raised too). The workers' getters must answer as the coordinator's:
    with its values, or raising where it mixed the two APIs itself."""
    from dpool.numerics import precision_state, set_precision_state

    torch.manual_seed(0)
    net = _ReadsThePrecision()
    model = wrap(net)
    x = torch.randn(4, 4)
    saved, before = precision_state(), _precision_as_libraries_read_it()
    try:
        for setting in ("high", "cudnn_off", "highest", "mixed"):
            if setting in ("high", "highest"):
                torch.set_float32_matmul_precision(setting)
            elif setting == "cudnn_off":
                torch.backends.cudnn.allow_tf32 = False
            else:  # the per-operation API alone: the coordinator's own legacy getters raise
                torch.backends.cuda.matmul.fp32_precision = "tf32"
            here = _precision_as_libraries_read_it()
            assert ("raises" in here) == (setting == "mixed"), (setting, here)
            if setting == "mixed":  # the forward raises as it does in one process, and the pool stays usable
                for run in (net, model):
                    with pytest.raises(RuntimeError, match="mix of the legacy and new APIs"):
                        run(x)
            else:
                torch.testing.assert_close(model(x), net(x), msg=setting)
            assert model.worker_states(_precision_as_libraries_read_it) == [here] * 2, setting
    finally:
        set_precision_state(saved)
    assert _precision_as_libraries_read_it() == before


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)  # 3 × (batch, heads, length, 8)
        return self.out(nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))


def test_the_attention_backend_choice_reaches_the_workers(wrap):
    """`with sdpa_kernel(SDPBackend.MATH):` sets scaled_dot_product_attention's backends for the process, so
    DataParallel's replicas follow it. On a CPU it picks the math kernel over flash, whose backward has no
    derivative: a gradient penalty through attention works only under it. The workers ignored it, so the
    penalty failed there ("derivative ... not implemented") and outputs differed from one process's. Now the
    outputs equal the reference's on the same shards bitwise, and the penalty's gradients match."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from dpool.numerics import sdp_settings

    torch.manual_seed(0)
    net = _Attention()
    ref = copy.deepcopy(net)
    model = wrap(net)
    x = torch.randn(4, 24, 16)
    for kernel in ("math", "default"):
        with (sdpa_kernel(SDPBackend.MATH) if kernel == "math" else contextlib.nullcontext()):
            with torch.no_grad():
                torch.testing.assert_close(model(x), torch.cat([ref(x[:2]), ref(x[2:])]), rtol=0, atol=0,
                                           msg=lambda m: f"{kernel}: {m}")
            assert model.worker_states(lambda r: sdp_settings()) == [sdp_settings()] * 2, kernel
            if kernel == "math":  # a gradient penalty, as WGAN-GP's
                for m in (model, ref):
                    xi = x.clone().requires_grad_()
                    g, = torch.autograd.grad(m(xi).sum(), xi, create_graph=True)
                    g.pow(2).sum().backward()
                for (n, p), rp in zip(net.named_parameters(), ref.parameters()):
                    torch.testing.assert_close(p.grad, rp.grad, msg=n)


def test_the_transformer_fast_path_setting_reaches_the_workers(wrap):
    """`torch.backends.mha.set_fastpath_enabled(False)` keeps nn.TransformerEncoder off its inference fast
    path, which returns zeros at padded positions where the other path returns values. The workers kept
    the fast path: outputs apart by 2.5 there."""
    torch.manual_seed(0)
    net = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 1).eval()
    model = wrap(net)
    x, mask = torch.randn(4, 6, 16), torch.zeros(4, 6, dtype=torch.bool)
    mask[:, 4:] = True
    try:
        for fast in (False, True):
            torch.backends.mha.set_fastpath_enabled(fast)
            with torch.no_grad():
                out, ref = model(x, src_key_padding_mask=mask), net(x, src_key_padding_mask=mask)
            torch.testing.assert_close(out, ref, msg=lambda m: f"fast path {fast}: {m}")
    finally:
        torch.backends.mha.set_fastpath_enabled(True)



def test_the_cpu_convolution_backend_setting_reaches_the_workers(wrap):
    """`torch.backends.mkldnn.enabled = False` (a common work-around for a oneDNN bug) moves convolutions to
    torch's own kernels, whose values differ in the last bits (7e-7): the workers kept oneDNN. Now the
    outputs equal the reference's on the same shards bitwise."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(8, 8, 3), nn.Tanh(), nn.Conv2d(8, 4, 3))
    model = wrap(net)
    x = torch.randn(4, 8, 16, 16)
    from dpool.numerics import numerics

    try:
        for enabled in (False, True):
            torch.backends.mkldnn.enabled = enabled
            torch.utils.deterministic.fill_uninitialized_memory = enabled
            with torch.no_grad():
                torch.testing.assert_close(model(x), torch.cat([net(x[:2]), net(x[2:])]), rtol=0, atol=0,
                                           msg=lambda m: f"mkldnn {enabled}: {m}")
            assert model.worker_states(lambda r: numerics()) == [numerics()] * 2
    finally:
        torch.backends.mkldnn.enabled = True
        torch.utils.deterministic.fill_uninitialized_memory = True


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


def test_the_gpu_settings_are_read_after_torchs_newer_precision_api_was_used():
    """A GPU pool reads the coordinator's TF32 settings before each forward. It read them through
    torch.get_float32_matmul_precision(), which raises once torch.backends.cuda.matmul.fp32_precision (the
    API torch's docs now advise) has been set: every forward of a GPU pool failed. These are plain process
    settings, read and written the same way on a CPU-only machine."""
    from dpool.numerics import CUDA_PRECISION_OPS, apply_numerics, fp32_precision, legacy_precision, numerics
    from dpool.numerics import precision_state, set_precision_state

    saved, before = precision_state(), numerics()
    try:
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        torch.backends.cudnn.conv.fp32_precision = "ieee"
        values = numerics()
        assert values != before and values[5][-4:] == fp32_precision(CUDA_PRECISION_OPS)
        apply_numerics(before, legacy=saved[0])
        assert numerics() == before
        apply_numerics(values, legacy=legacy_precision())
        assert numerics() == values and torch.backends.cuda.matmul.fp32_precision == "tf32"
    finally:
        set_precision_state(saved)


class _NaNBackward(nn.Module):
    """A finite forward whose backward makes a NaN (sqrt's gradient at 0 is inf, times 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 4)

    def forward(self, x):
        h = self.lin(x)
        return h + torch.sqrt(h - h) * 0


def test_anomaly_detection_reaches_the_workers_backward(wrap):
    """torch.autograd.set_detect_anomaly(True) makes a backward that produces NaN raise, naming the
    function, in one process and in DataParallel's replicas; dpool's workers follow it (without it, the
    NaN would reach the master's gradients silently)."""
    model = wrap(_NaNBackward())
    x = torch.randn(5, 6)
    model(x).sum().backward()
    assert torch.isnan(model.module.lin.weight.grad).all()  # the case anomaly detection is for
    try:
        torch.autograd.set_detect_anomaly(True)
        with pytest.raises(RuntimeError, match="SqrtBackward0.*returned nan values"):
            model(x).sum().backward()
    finally:
        torch.autograd.set_detect_anomaly(False)
    model(x).sum().backward()  # the pool goes on, and the workers follow the switch back
    assert model.worker_states(lambda r: torch.is_anomaly_enabled()) == [False, False]


class _Dropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.lin(x))


def _dropout_run(wrap, **kw) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = wrap(_Dropout(), **kw)
    outs = [model(torch.ones(8, 16)).detach() for _ in range(3)]
    model.close()
    return outs


def test_the_same_seed_gives_the_same_run(wrap):
    """Workers' generators are seeded from the coordinator's: torch.manual_seed makes dropout repeat."""
    a, b = _dropout_run(wrap), _dropout_run(wrap)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], a[1])  # each forward draws new masks
    assert not torch.equal(a[0][:4], a[0][4:])  # and the two shards draw different ones


def test_dpool_does_not_change_the_users_random_sequence(wrap):
    """Seeding the workers draws nothing from the script's generator: a shuffled DataLoader without a generator
    of its own yields the same batches epoch after epoch with dpool as without, so a model without randomness
    trains to the same parameters (SGD, 3 epochs)."""

    def run(use_dpool: bool):
        torch.manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(24, 6), torch.randn(24, 2))
        loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)
        net = nn.Linear(6, 2)
        model = wrap(net) if use_dpool else net
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        batches = []
        for _ in range(3):
            for x, y in loader:
                batches.append(x)
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
        return batches, [p.detach().clone() for p in net.parameters()], torch.rand(3)

    plain, pooled = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(plain[0], pooled[0]))
    for a, b in zip(plain[1], pooled[1]):
        torch.testing.assert_close(a, b)
    assert torch.equal(plain[2], pooled[2])  # and the generator is where the script left it


class _LayerDrop(nn.Module):
    """LayerDrop drawn from Python's and NumPy's global generators, as HF's data2vec-audio and MusicGen do."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(8))

    def forward(self, x):
        for layer in self.layers:
            if not (self.training and (random.random() < 0.3 or numpy.random.uniform(0, 1) < 0.3)):
                x = layer(x)
        return x


def test_python_and_numpy_randomness_in_the_models_code_repeats_under_the_same_seeds(wrap):
    """Each worker's Python and NumPy generators were seeded by the OS at its start, so a run whose forward
    draws from them (LayerDrop) did not repeat under `random.seed`, `numpy.random.seed` and
    `torch.manual_seed` (as `transformers.set_seed` does). They are now seeded per shard at each forward."""
    runs = []
    for _ in range(2):
        random.seed(0)
        numpy.random.seed(0)
        torch.manual_seed(0)
        model = wrap(_LayerDrop())
        runs.append(torch.stack([model(torch.ones(4, 4)).detach() for _ in range(4)]))
        model.close()
    assert torch.equal(*runs)
    assert len({tuple(out.flatten().tolist()) for out in runs[0]}) > 1  # (layers were dropped differently)


def _drop_half(x):
    return x if _py_uniform(0, 1) < 0.5 else x * 0


class _DropsThroughAHelper(nn.Linear):
    def forward(self, x):
        return _drop_half(super().forward(x))


def test_the_global_generators_a_models_code_draws_from_are_found():
    """Only models whose code names Python's or NumPy's global generator pay for seeding them per forward:
    found through `random.x()`, `numpy.random.x()`, a function imported from `random`, and the functions
    the methods call."""
    from dpool_workers.randomness import global_streams_used

    assert global_streams_used(_LayerDrop()) == (True, True)
    assert global_streams_used(nn.Sequential(_DropsThroughAHelper(4, 4))) == (True, False)
    assert global_streams_used(nn.Sequential(nn.Linear(4, 4), nn.Dropout(), nn.TransformerEncoderLayer(8, 2))) == (
        False, False)


class _Noise(nn.Module):
    """Noise from generators the model holds: torch's, Python's and NumPy's."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.gen = torch.Generator().manual_seed(0)
        self.rng = random.Random(0)
        self.np_rng = numpy.random.default_rng(0)

    def forward(self, x):
        rows = [[self.rng.random(), self.np_rng.random()] for _ in range(len(x))]
        return self.lin(x) + torch.randn(x.shape, generator=self.gen), torch.tensor(rows)


def test_generators_the_model_holds_give_each_shard_its_own_numbers(wrap):
    """Every worker holds a copy of each generator in the same state, so each shard drew the same numbers as
    the others: the batch's rows came in identical groups, which one process never gives. Each shard
    now seeds its copies from the forward's draw, as its default generator."""
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        model = wrap(_Noise())
        x = torch.zeros(8, 16)
        runs.append([torch.cat([out - model.module.lin(x), other], 1).detach()
                     for out, other in (model(x) for _ in range(2))])
        model.close()
    (a, b), (a2, b2) = runs
    for cols, what in ((slice(0, 16), "torch.Generator"), (16, "random.Random"), (17, "numpy's Generator")):
        assert not torch.allclose(a[:4, cols], a[4:, cols]), f"the two shards drew the same numbers from {what}"
        assert not torch.allclose(a[:, cols], b[:, cols]), what  # each forward draws new numbers
    assert torch.equal(a, a2) and torch.equal(b, b2)  # and the same seed repeats them
    assert abs(float(a[:, :16].std()) - 1) < 0.3


def test_isinstance_dataparallel_unwraps_like_torch(wrap):
    """HF Trainer, timm and Lightning unwrap with isinstance(model, nn.DataParallel) → model.module."""
    net = models.make("mlp")
    model = wrap(net)
    assert isinstance(model, nn.DataParallel) and isinstance(model, dpool.DataParallel)
    unwrapped = model.module if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)) else model
    assert unwrapped is net and dpool.unwrap(model) is net
    assert list(model.state_dict()) == ["module." + k for k in net.state_dict()]


def test_deepcopy_and_torch_save_give_a_plain_master_copy_and_ema_matches(wrap, tmp_path):
    """AveragedModel (EMA/SWA) deep-copies the model: a plain copy of the master, with a warning, that
    averages exactly as torch's own does on the single-process reference."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    torch.manual_seed(0)
    net = models.make("mlp")
    ref = copy.deepcopy(net)
    model = wrap(net)
    with pytest.warns(UserWarning, match="plain copy of its master module"):
        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    ref_ema = AveragedModel(ref, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    assert not dpool.is_wrapped(ema.module) and type(ema.module) is type(net)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        x = torch.randn(9, 12, dtype=torch.float64)
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
        ema.update_parameters(model)
        ref_ema.update_parameters(ref)
    for p, rp in zip(ema.parameters(), ref_ema.parameters()):
        torch.testing.assert_close(p, rp)
    path = tmp_path / "whole.pt"
    with pytest.warns(UserWarning, match="plain copy"):
        torch.save(model, path)
    loaded = torch.load(path, weights_only=False)
    assert type(loaded) is type(net)
    for p, q in zip(loaded.parameters(), net.parameters()):
        assert torch.equal(p, q) and p.data_ptr() != q.data_ptr()


NO_NUMPY = """
import sys
try:
    import numpy
    raise SystemExit("numpy is still importable")
except ImportError:
    pass
import copy, torch, dpool
from tests.test_features import BNNet

torch.manual_seed(0)
ref = BNNet().double()
net = dpool.convert_sync_batchnorm(copy.deepcopy(ref))
with dpool.wrap(net, ["cpu", "cpu"]) as model:
    for step in range(2):
        x = torch.randn(9, 3, 6, 6, dtype=torch.float64)
        model(x).pow(2).sum().backward()
        ref(x).pow(2).sum().backward()
    same = all(torch.allclose(p.grad, q.grad) for p, q in zip(net.parameters(), ref.parameters()))
    workers_without_numpy = model.worker_states(lambda r: "numpy" not in sys.modules or sys.modules["numpy"] is None)
print("RESULT", same, all(workers_without_numpy))
"""


def test_sync_batchnorm_needs_no_numpy(tmp_path):
    """A plain `pip install dpool` brings torch without numpy: SyncBatchNorm's collective must not need it."""
    from tests.helpers import run_script

    fake = tmp_path / "numpy"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ModuleNotFoundError('numpy is not installed here (test)', name='numpy')\n")
    import os

    from tests.helpers import PYPATH

    res = run_script(NO_NUMPY, env={"PYTHONPATH": os.pathsep.join([str(tmp_path), PYPATH])})
    assert res.returncode == 0 and "RESULT True True" in res.stdout, res.stdout + res.stderr[-3000:]


def dataparallel_gather(outputs: list, dim: int = 0):
    """torch.nn.parallel.scatter_gather.gather's gather_map, with Gather (a device transfer) swapped
    for torch.cat: what nn.DataParallel returns for these shard outputs."""
    from torch.nn.parallel.scatter_gather import _is_namedtuple

    def gather_map(outs):
        out = outs[0]
        if isinstance(out, torch.Tensor):
            return torch.cat(outs, dim)
        if out is None:
            return None
        if isinstance(out, dict):
            return type(out)((k, gather_map([d[k] for d in outs])) for k in out)
        if _is_namedtuple(out):
            return type(out)._make(map(gather_map, zip(*outs, strict=True)))
        return type(out)(map(gather_map, zip(*outs, strict=True)))

    return gather_map(outputs)


class LayerCache:
    """Shaped like HuggingFace's DynamicCache: iterates over per-layer (key, value) pairs and is built
    from them (its ddp_cache_data argument exists for DataParallel's gather)."""

    def __init__(self, layers=()):
        self.layers = [tuple(kv) for kv in layers]

    def __iter__(self):
        return iter(self.layers)

    def __len__(self):
        return len(self.layers)


class Shape(tuple):
    pass


class _CustomOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        cache = LayerCache([(h, h * 2), (h + 1, h - 1)])
        return {"logits": h, "cache": cache, "pair": Shape((h.sum(1), h.mean(1))), "tag": "ok",
                "it": iter([1, 2])}


def test_gather_rebuilds_custom_containers_like_dataparallel(wrap):
    torch.manual_seed(0)
    net = _CustomOutputs()
    model = wrap(net)
    x = torch.randn(6, 4)
    out = model(x)
    expected = dataparallel_gather([{k: v for k, v in net(s).items() if k not in ("tag", "it")}
                                    for s in x.split(3)])
    assert type(out["cache"]) is LayerCache and len(out["cache"]) == 2
    for (k, v), (ek, ev) in zip(out["cache"], expected["cache"]):
        torch.testing.assert_close(k, ek)
        torch.testing.assert_close(v, ev)
    assert type(out["pair"]) is Shape and all(torch.allclose(a, b) for a, b in zip(out["pair"], expected["pair"]))
    torch.testing.assert_close(out["logits"], expected["logits"])
    # where DataParallel would crash (a string, an iterator): one entry per shard
    assert out["tag"] == ["ok", "ok"] and len(out["it"]) == 2
    # the rebuilt containers carry gradients back to the workers
    sum(k.sum() + v.sum() for k, v in out["cache"]).backward()
    ref = copy.deepcopy(net)
    sum(sum(k.sum() + v.sum() for k, v in ref(s)["cache"]) for s in x.split(3)).backward()
    for p, rp in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, rp.grad)


class _ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 4, 1)
        self.t = nn.Parameter(torch.randn(6, 4).t())  # a dense, non-row-major (transposed) parameter

    def forward(self, x):
        h = self.conv2(torch.relu(self.conv(x))).mean(dim=(2, 3))
        return h @ self.t


def test_memory_format_of_parameters_and_gradients_is_kept(wrap):
    """channels_last (and transposed) parameters keep their strides in shared memory, and gradients
    get the layout autograd gives them in one process (PyTorch's test_strided_grad_layout)."""
    torch.manual_seed(0)
    net = _ConvNet().double().to(memory_format=torch.channels_last)
    ref = copy.deepcopy(net)
    strides = [p.stride() for p in net.parameters()]
    assert net.conv.weight.is_contiguous(memory_format=torch.channels_last)
    model = wrap(net)
    assert [p.stride() for p in net.parameters()] == strides
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), torch.optim.SGD(ref.parameters(),
                                                                                             lr=0.1, momentum=0.9)
    for _ in range(3):
        x = torch.randn(6, 3, 5, 5, dtype=torch.float64).to(memory_format=torch.channels_last)
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(x).pow(2).sum().backward()
        for (n, p), rp in zip(net.named_parameters(), ref.parameters()):
            assert p.grad.stride() == rp.grad.stride(), n
            torch.testing.assert_close(p.grad, rp.grad)
        opt.step()
        ref_opt.step()
    for p, rp in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p, rp)
    # another memory format given after wrap(): the values are followed, the layout is not, and a warning says so
    for m in (net, ref):
        m.to(memory_format=torch.contiguous_format)
    x = torch.randn(6, 3, 5, 5, dtype=torch.float64)
    opt.zero_grad()
    ref_opt.zero_grad()
    with pytest.warns(UserWarning, match=r"conv\.weight, conv2\.weight of the master module got another memory "
                                         r"format after dpool\.wrap\(\).*before dpool\.wrap\(\)"):
        model(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    for (n, p), rp in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, rp.grad, msg=n)
        torch.testing.assert_close(p, rp, msg=n)
    assert [p.stride() for p in net.parameters()] == strides
    model.close()
    assert [p.stride() for p in net.parameters()] == strides  # and after close, in private memory


class _SparseNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 8, sparse=True)
        self.bag = nn.EmbeddingBag(30, 8, mode="sum", sparse=True)
        self.out = nn.Linear(8, 3)

    def forward(self, tokens, bags):
        return self.out(self.emb(tokens).mean(1) + self.bag(bags))


def test_sparse_gradients_reach_the_master_as_sparse_and_sparse_adam_trains_like_the_reference(wrap):
    torch.manual_seed(0)
    net = _SparseNet().double()
    ref = copy.deepcopy(net)
    model = wrap(net)

    def optimizers(m):
        return (torch.optim.SparseAdam([m.emb.weight, m.bag.weight], lr=0.05),
                torch.optim.SGD(m.out.parameters(), lr=0.1))

    opts, ref_opts = optimizers(net), optimizers(ref)
    g = torch.Generator().manual_seed(3)
    for step in range(3):
        tokens = torch.randint(0, 50, (10, 6), generator=g)
        bags = torch.randint(0, 30, (10, 4), generator=g)
        for m, os_ in ((model, opts), (ref, ref_opts)):
            for o in os_:
                o.zero_grad()
            m(tokens, bags).pow(2).sum().backward()
        for (n, p), rp in zip(net.named_parameters(), ref.parameters()):
            assert p.grad.layout == rp.grad.layout, n  # sparse stays sparse, dense stays dense
            torch.testing.assert_close(p.grad.to_dense(), rp.grad.to_dense(), msg=n)
        for o in opts + ref_opts:
            o.step()
    for (n, p), rp in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, rp, msg=n)


def test_huggingface_gpt2_with_cache_returns_one_dynamic_cache(wrap):
    """A real HuggingFace model (random weights, built from a config: nothing is downloaded)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32, bos_token_id=0,
                     eos_token_id=0)
    net = GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 100, (5, 8))
    with torch.no_grad():
        ref = net(input_ids=ids, use_cache=True)
        out = wrap(net)(input_ids=ids, use_cache=True)
    assert type(out) is type(ref) and type(out.past_key_values) is type(ref.past_key_values)
    torch.testing.assert_close(out.logits, ref.logits)
    for layer, ref_layer in zip(out.past_key_values.layers, ref.past_key_values.layers):
        torch.testing.assert_close(layer.keys, ref_layer.keys)
        torch.testing.assert_close(layer.values, ref_layer.values)


def test_huggingface_hidden_states_and_config_changes_reach_the_workers(wrap):
    """transformers 5 captures hidden states with hooks: their registry is filled in a model's __init__, which
    a replica never runs (dpool returned `hidden_states=None`), and the hooks, once installed on the model
    (by any forward that asked for them), refer to their module's context variable (dpool could not
    ship such a model at all). And HF's forward reads its config, so a change to it after wrap() counts."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32, bos_token_id=0,
                     eos_token_id=0)
    ids = torch.randint(0, 100, (5, 8))
    net = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        ref = net(input_ids=ids, output_hidden_states=True)  # (installs the hooks on the model)
        model = wrap(net)
        out = model(input_ids=ids, output_hidden_states=True)
        assert out.hidden_states is not None and len(out.hidden_states) == len(ref.hidden_states) == 3
        torch.testing.assert_close(out.hidden_states, ref.hidden_states)
        assert model(input_ids=ids).hidden_states is None
        net.config.output_hidden_states = True  # HF's forward reads its config: DataParallel follows it
        torch.testing.assert_close(model(input_ids=ids).hidden_states, ref.hidden_states)


class _Routed(nn.Module):
    """Rows whose first feature is positive also go through ``extra``: which shards use it depends on the data."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4, dtype=torch.float64)
        self.extra = nn.Linear(4, 4, dtype=torch.float64)

    def forward(self, x):
        h = self.body(x)
        routed = x[:, 0] > 0
        if routed.any():
            h = h + torch.zeros_like(h).index_add(0, routed.nonzero()[:, 0], self.extra(h[routed]))
        return h


def test_a_parameter_one_shard_stops_using_gets_no_stale_gradient_from_its_slot(wrap):
    """Step 1: both shards use ``extra``; step 2: only the first does. The second worker's slot still holds
    its step-1 gradient for ``extra``; summed in, it would silently add a stale term. It is zeroed instead."""
    from tests.reference import per_shard

    torch.manual_seed(0)
    net = _Routed()
    ref = copy.deepcopy(net)
    model = wrap(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(8, 4, dtype=torch.float64)
    for step, first in enumerate((torch.ones(8), torch.tensor([1.0] * 4 + [-1.0] * 4))):  # rows 4-7: shard 2
        xs = x.clone()
        xs[:, 0] = first * xs[:, 0].abs()
        model(xs).pow(2).sum().backward()
        per_shard(ref, (xs,), {}, 2, 8).pow(2).sum().backward()
        for (name, p), r in zip(net.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, r.grad, msg=f"{name} at step {step}")
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()


class _Parametrized(nn.Module):
    """torch.nn.utils.parametrize in its common forms: weight norm, spectral norm (its power iteration
    updates buffers in every training forward) and an orthogonal map; and the older hook-based weight norm."""

    def __init__(self) -> None:
        super().__init__()
        P = nn.utils.parametrizations
        self.wn = P.weight_norm(nn.Linear(6, 8, dtype=torch.float64))
        self.sn = P.spectral_norm(nn.Linear(8, 8, dtype=torch.float64))
        self.orth = P.orthogonal(nn.Linear(8, 8, dtype=torch.float64))
        with pytest.warns(FutureWarning):
            self.old = nn.utils.weight_norm(nn.Linear(8, 3, dtype=torch.float64))

    def forward(self, x):
        return self.old(torch.tanh(self.orth(torch.tanh(self.sn(torch.tanh(self.wn(x)))))))


def test_parametrized_modules_train_like_one_process(wrap):
    """torch refuses to pickle a parametrized module ("only supported through state_dict()"), so wrap() used to
    fail with UnpicklableModelError; it ships as its original class and the worker parametrizes it again.
    Outputs, gradients (through the parametrizations to the original tensors), buffers and parameters after
    momentum steps equal one process on the same shards."""
    from tests.reference import per_shard

    torch.manual_seed(0)
    net = _Parametrized()
    torch.manual_seed(0)
    ref = _Parametrized()  # built again: the hook-based weight norm refuses deepcopy
    model = wrap(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        x = torch.randn(8, 6, dtype=torch.float64)
        out, rout = model(x), per_shard(ref, (x,), {}, 2, 8)
        torch.testing.assert_close(out, rout, msg=f"output at step {step}")
        out.pow(2).mean().backward()
        rout.pow(2).mean().backward()
        for (name, p), r in zip(net.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, r.grad, msg=f"{name} at step {step}")
        for (name, b), r in zip(net.named_buffers(), ref.buffers()):
            torch.testing.assert_close(b, r, msg=f"{name} at step {step}")
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
    for (name, p), r in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, r, msg=name)
    assert nn.utils.parametrize.is_parametrized(dpool.unwrap(model).wn)  # the master is left as it was


def test_huggingface_wav2vec2_with_its_weight_norm_parametrization(wrap):
    """A real HuggingFace model whose positional convolution is weight-normed through a parametrization
    (random weights from a config: nothing is downloaded): per-shard losses and gradients as one process."""
    from transformers import Wav2Vec2Config, Wav2Vec2ForSequenceClassification

    cfg = Wav2Vec2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                         conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                         num_conv_pos_embedding_groups=4, num_labels=3, mask_time_prob=0.0, layerdrop=0.0,
                         hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
                         final_dropout=0.0)
    torch.manual_seed(0)
    net = Wav2Vec2ForSequenceClassification(cfg).double()
    ref = copy.deepcopy(net)
    assert nn.utils.parametrize.is_parametrized(net.wav2vec2.encoder.pos_conv_embed.conv)
    model = wrap(net)
    x, y = torch.randn(4, 800, dtype=torch.float64), torch.tensor([0, 1, 2, 1])
    out = model(input_values=x, labels=y)
    refs = [ref(input_values=x[i:i + 2], labels=y[i:i + 2]).loss for i in (0, 2)]
    torch.testing.assert_close(out.loss, torch.stack(refs))  # one loss per shard, as nn.DataParallel gathers
    out.loss.mean().backward()
    torch.stack(refs).mean().backward()
    for (name, p), r in zip(net.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (r.grad is None), name
        if r.grad is not None:
            torch.testing.assert_close(p.grad, r.grad, msg=name)


@pytest.mark.parametrize("path", ["gathered", "loss_on_workers"])
def test_requires_grad_changed_between_forward_and_backward_follows_one_process(wrap, path):
    """One process accumulates into the parameters that require grad when the backward runs. A parameter
    frozen after the forward used to crash the backward ("BridgeBackward returned an incorrect number of
    gradients"); one frozen for a forward in between and unfrozen before the backward came back with no
    gradient at all. Both now give one process's gradients, gathered or with the loss on the workers."""
    torch.manual_seed(0)
    net = models.make("mlp")
    ref = copy.deepcopy(net)
    model = wrap(net, gather=path == "gathered")
    crit = dpool.criterion(nn.CrossEntropyLoss())
    x, y = torch.randn(6, 12, dtype=torch.float64), torch.randint(0, 4, (6,))

    def loss_of(m, out):
        return crit(out, y) if m is model and path != "gathered" else nn.functional.cross_entropy(out, y)

    for case in ("frozen_after_forward", "frozen_for_a_forward_between"):
        for m, n in ((model, net), (ref, ref)):
            n.zero_grad(set_to_none=True)
            w = n.net[0].weight
            loss = loss_of(m, m(x))
            w.requires_grad_(False)
            if case == "frozen_for_a_forward_between":
                m(x)  # the replicas see the flag: their graphs of the first forward hold it
                w.requires_grad_(True)
            loss.backward()
            w.requires_grad_(True)
            m(x)  # flags back on the replicas too
        for (name, p), r in zip(net.named_parameters(), ref.parameters()):
            assert (p.grad is None) == (r.grad is None), (case, name)
            if r.grad is not None:
                torch.testing.assert_close(p.grad, r.grad, msg=f"{case}: {name}")


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


class _FailsOnMarkedRows(torch.autograd.Function):
    """Identity whose backward raises on a shard whose first row is marked (> 100)."""

    @staticmethod
    def forward(ctx, y, x):
        ctx.marked = float(x[0, 0]) > 100
        return y.clone()

    @staticmethod
    def backward(ctx, g):
        if ctx.marked:
            raise ValueError("this shard's backward fails")
        return g, None


class _FailingBackward(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return _FailsOnMarkedRows.apply(self.lin(x), x)


@pytest.mark.parametrize("failing", ["first_held", "later_held", "synchronizing"])
def test_a_backward_that_fails_while_no_sync_holds_gradients_never_joins_them(wrap, failing):
    """One shard's backward fails, the other's ran: that worker added its part to the gradients it holds.
    One process adds nothing for a failed backward. The next backward used to add that part, silently
    (even after zero_grad(), when the failed backward was the accumulation's first); now it raises until
    the loop clears the gradients, and after zero_grad() training equals one process."""
    torch.manual_seed(0)
    net = _FailingBackward().double()
    ref = copy.deepcopy(net)
    model = wrap(net)
    good = [torch.randn(8, 4, dtype=torch.float64) for _ in range(3)]
    bad = torch.randn(8, 4, dtype=torch.float64)
    bad[4, 0] = 1000.0  # the second shard fails, the first runs

    if failing != "first_held":
        with model.no_sync():
            model(good[0]).sum().backward()
        ref(good[0]).sum().backward()
    with pytest.raises(ValueError, match="this shard's backward fails"):
        if failing == "synchronizing":
            model(bad).sum().backward()
        else:
            with model.no_sync():
                model(bad).sum().backward()
    with pytest.raises(dpool.UnsupportedError, match=r"the backward at step \d+ failed \(RemoteValueError\).*"
                                                     r"zero_grad\(\)"):
        model(good[1]).sum().backward()
    net.zero_grad()
    ref.zero_grad()
    with model.no_sync():
        model(good[1]).sum().backward()
    model(good[2]).sum().backward()
    ref(good[1]).sum().backward()
    ref(good[2]).sum().backward()
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)


class _DiesOnMarkedRows(nn.Module):
    """A worker whose shard's first row is marked (> 100) exits in the forward, as a killed one would."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        if float(x[0, 0]) > 100:
            os._exit(3)
        return self.lin(x)


@pytest.mark.parametrize("cleared", [False, True])
def test_a_worker_restarted_while_no_sync_holds_gradients_never_joins_what_is_left(wrap, cleared):
    """A worker dies in a forward during gradient accumulation and max_restarts respawns it: its held part
    is gone. The next synchronizing backward used to sum what the other worker held with the new
    backward, silently short of the lost part; now it raises until zero_grad(), as after a failed
    backward. Gradients the loop had cleared before the death need nothing more."""
    torch.manual_seed(0)
    net = _DiesOnMarkedRows().double()
    ref = copy.deepcopy(net)
    model = wrap(net, max_restarts=1)
    good = [torch.randn(8, 4, dtype=torch.float64) for _ in range(4)]
    bad = torch.randn(8, 4, dtype=torch.float64)
    bad[4, 0] = 1000.0  # worker 1 dies

    with model.no_sync():
        model(good[0]).sum().backward()
    if cleared:
        net.zero_grad()
    else:
        ref(good[0]).sum().backward()
    with pytest.raises(dpool.WorkerDiedError, match=r"restarted.*"
                       + ("" if cleared else r"no_sync\(\) had accumulated on them were lost")):
        with model.no_sync():
            model(bad)
    if not cleared:
        with pytest.raises(dpool.UnsupportedError, match=r"worker\(s\) \[1\] were restarted at step \d+ while "
                                                         r"model.no_sync\(\) held .*lost.*zero_grad\(\)"):
            model(good[1]).sum().backward()
        net.zero_grad()
        ref.zero_grad()
    with model.no_sync():
        model(good[2]).sum().backward()
    model(good[3]).sum().backward()
    ref(good[2]).sum().backward()
    ref(good[3]).sum().backward()
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)


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
