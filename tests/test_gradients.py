"""Gradients that once came out wrong: higher orders, memory formats, sparse gradients, parameters a shard stops
using, parametrizations, requires_grad changed mid-step, and failures while no_sync holds gradients."""
from __future__ import annotations

import copy
import os


import pytest
import torch
from torch import nn

import dpool
from tests import models


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
