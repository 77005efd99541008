"""Beyond DataParallel: checkpoints, autocast dtype, buffer policies, balanced shards, no_sync."""
from __future__ import annotations

import copy
import functools
import os
import time

import psutil
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import dpool
from tests import models
from tests.helpers import dataparallel
from tests.reference import split


def test_checkpoints_load_both_ways(wrap, tmp_path):
    net = models.make("cnn")
    model = wrap(net)
    (x,), _ = models.batch("cnn", 6)
    model(x).sum().backward()  # running stats move away from their initial values
    path = tmp_path / "ckpt.pt"
    torch.save(model.state_dict(), path)  # module.-prefixed, like nn.DataParallel
    sd = torch.load(path)
    # dpool -> plain module (recommended: save model.module.state_dict(); prefixed works via consume_prefix)
    plain = models.make("cnn", seed=3)
    torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(sd, "module.")
    plain.load_state_dict(sd)
    plain2 = models.make("cnn", seed=4)
    plain2.load_state_dict(model.module.state_dict())
    # dpool -> nn.DataParallel
    dp = dataparallel(models.make("cnn", seed=5))
    dp.load_state_dict(model.state_dict())
    for other in (plain, plain2, dp.module):
        for a, b in zip(other.state_dict().values(), net.state_dict().values()):
            assert torch.equal(a, b)
    # plain keys and DataParallel keys -> dpool; the workers see the new values
    for source in (models.make("cnn", seed=6).state_dict(), dataparallel(models.make("cnn", seed=7)).state_dict()):
        model.load_state_dict(source)
        ref = models.make("cnn")
        ref.load_state_dict({k.removeprefix("module."): v for k, v in source.items()})
        model.eval()
        ref.eval()
        with torch.no_grad():
            torch.testing.assert_close(model(x), ref(x))
        model.train()
    with pytest.raises(RuntimeError, match="Missing key"):
        model.load_state_dict({"head.weight": torch.zeros(5, 16)})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_dtype_reaches_replicas(wrap, dtype):
    net = models.make("mlp", dtype=torch.float32)
    ref = copy.deepcopy(net)
    model = wrap(net)
    x = torch.randn(9, 12)
    with torch.autocast("cpu", dtype=dtype):
        out = model(x)
        rout = ref(x)
    assert out.dtype == dtype == rout.dtype  # DataParallel would lose the dtype in its threads
    torch.testing.assert_close(out, rout)
    out.float().sum().backward()
    rout.float().sum().backward()
    for p, rp in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, rp.grad, rtol=2e-2, atol=2e-2)


def test_buffer_policy_average(wrap):
    net = models.make("cnn")
    ref = copy.deepcopy(net)
    model = wrap(net, buffers="average")
    (x,), _ = models.batch("cnn", 11)
    model(x)
    # reference: each shard from the same start, then the shard-size weighted mean
    start = copy.deepcopy(ref)
    results = []
    for part in split(x, [6, 5]):
        r = copy.deepcopy(start)
        r(part)
        results.append(dict(r.named_buffers()))
    for name, b in net.named_buffers():
        if b.is_floating_point():
            torch.testing.assert_close(b, (6 * results[0][name] + 5 * results[1][name]) / 11)
        else:
            assert torch.equal(b, results[0][name])


class TwoBranches(nn.Module):
    """Two BatchNorms whose inputs do not depend on another BatchNorm's normalisation."""

    def __init__(self, momentum):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn2d = nn.BatchNorm2d(4, momentum=momentum)
        self.lin = nn.Linear(3 * 8 * 8, 6)
        self.bn1d = nn.BatchNorm1d(6, momentum=momentum)

    def forward(self, x):
        return self.bn2d(self.conv(x)).mean(dim=(2, 3)), self.bn1d(self.lin(x.flatten(1)))


@pytest.mark.parametrize("momentum", [0.1, None])
def test_buffer_policy_sync_equals_full_batch_statistics(wrap, momentum):
    """Running statistics equal one BatchNorm over the whole batch (for BatchNorms whose inputs do
    not depend on an earlier BatchNorm; for those, use dpool.convert_sync_batchnorm)."""
    torch.manual_seed(0)
    net = TwoBranches(momentum).double()
    ref = copy.deepcopy(net)
    model = wrap(net, ["cpu"] * 3, buffers="sync")
    for step in range(3):
        x = torch.randn(10, 3, 8, 8, dtype=torch.float64) * (step + 1) + step
        model(x)
        ref(x)  # one BatchNorm over the whole batch
        for (n, b), rb in zip(net.named_buffers(), ref.buffers()):
            torch.testing.assert_close(b, rb, msg=lambda m: f"{n}: {m}")
    model.eval()
    ref.eval()
    with torch.no_grad():  # eval forwards leave the statistics alone
        model(x)
    for b, rb in zip(net.buffers(), ref.buffers()):
        torch.testing.assert_close(b, rb)


class RowCounter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.slow = False

    def forward(self, x):
        if self.slow:
            time.sleep(0.002 * x.shape[0])  # a deliberately slow worker: 2 ms per row
        return self.lin(x), x.shape[0]


def test_shard_weights_by_hand(wrap):
    net = RowCounter().double()
    ref = copy.deepcopy(net)
    model = wrap(net, shard_weights=[3, 1])
    x = torch.randn(8, 3, dtype=torch.float64)
    out, rows = model(x)
    assert rows == [6, 2]
    torch.testing.assert_close(out, ref(x)[0])
    out.sum().backward()
    ref(x)[0].sum().backward()
    torch.testing.assert_close(net.lin.weight.grad, ref.lin.weight.grad)
    with pytest.raises(ValueError, match="positive numbers"):
        dpool.wrap(RowCounter(), ["cpu", "cpu"], shard_weights=[1, 0])


def test_balance_auto_gives_a_slow_worker_less(wrap):
    net = RowCounter()
    model = wrap(net, balance="auto")
    slow_pid = model.pids[1]
    model.worker_states(lambda m, p=slow_pid: setattr(m, "slow", os.getpid() == p))
    x = torch.randn(64, 3)
    rows = None
    for _ in range(8):
        out, rows = model(x)
        out.sum().backward()
    assert sum(rows) == 64 and rows[1] < rows[0] // 2, rows


def test_no_sync_transfers_once_and_equals_plain_accumulation(wrap):
    net = models.make("mlp")
    ref = copy.deepcopy(net)
    model = wrap(net)
    xs = [torch.randn(7, 12, dtype=torch.float64) for _ in range(3)]
    with model.no_sync():
        for x in xs[:2]:
            model(x).pow(2).sum().backward()
        assert not any(p.grad.any() for p in net.parameters())  # nothing transferred yet: zero markers
    model(xs[2]).pow(2).sum().backward()  # the step that leaves the context transfers the sum
    for x in xs:
        ref(x).pow(2).sum().backward()
    for p, rp in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, rp.grad)
    # and the next accumulation starts from zero on the workers
    for p in net.parameters():
        p.grad = None
    for p in ref.parameters():
        p.grad = None
    model(xs[0]).sum().backward()
    ref(xs[0]).sum().backward()
    for p, rp in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, rp.grad)


class SparseBag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(30, 6, sparse=True)
        self.lin = nn.Linear(6, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lin(self.emb(ids).mean(1))


class DenseAndSparse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(30, 6, sparse=True)
        self.lin = nn.Linear(6, 3)
        self.head = nn.Linear(3, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.lin(self.emb(ids).mean(1))))


@pytest.mark.parametrize("gather", [True, False], ids=["gathered", "loss_on_workers"])
def test_no_sync_then_a_batch_with_fewer_rows_than_workers_keeps_every_held_gradient(wrap, gather):
    """Accumulation whose last micro-batch is small (a dataset's last batch): it has fewer rows than
    there are workers, so its backward runs on fewer shards than the no_sync() backwards before it.
    The held sums of the workers without a shard were silently left out of the step and stayed on those
    workers, to be added to a later step after zero_grad(); and a zero_grad() between micro-batches reached
    only the workers with a shard in the next one, so the others kept what it cleared. Workers without a
    shard now take part in those backwards without backpropagating (Backward of call HELD_ONLY). Dense and
    sparse gradients, micro-batches of 7, 5, 2 and 1 rows on 3 workers, zero_grad() between micro-batches
    (before a larger and before a smaller one), momentum steps against one process."""
    torch.manual_seed(0)
    net = DenseAndSparse().double()
    ref = copy.deepcopy(net)
    model = wrap(net, ["cpu"] * 3, gather=gather)
    crit = dpool.criterion(nn.CrossEntropyLoss())
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    plans = [[7, 1], [7, 5, 2], [2, 1], [5, 7, 1], [1, 7], [7, 1, 2]]  # micro-batch rows; the last synchronizes
    for step, rows in enumerate(plans):
        batches = [(torch.randint(0, 30, (r, 5), generator=g), torch.randint(0, 4, (r,), generator=g)) for r in rows]
        cleared = step in (3, 5)  # zero_grad() after the first micro-batch: it is dropped, here as in one process
        for i, (x, y) in enumerate(batches):
            out = model(x)
            loss = crit(out, y) if not gather else F.cross_entropy(out, y)
            if i < len(batches) - 1:
                with model.no_sync():
                    loss.backward()
            else:
                loss.backward()
            if cleared and i == 0:
                opt.zero_grad()
        ref_opt.zero_grad()
        for x, y in batches[1:] if cleared else batches:
            F.cross_entropy(ref(x), y).backward()
        for (name, p), rp in zip(net.named_parameters(), ref.parameters()):
            got, want = p.grad, rp.grad
            torch.testing.assert_close(got.to_dense() if got.is_sparse else got,
                                       want.to_dense() if want.is_sparse else want,
                                       msg=lambda m: f"step {step} (rows {rows}), {name}: {m}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
    for p, rp in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p, rp)


@pytest.mark.parametrize("gather", [True, False], ids=["gathered", "loss_on_workers"])
def test_no_sync_with_loss_terms_on_the_masters_parameters(wrap, gather):
    """A loss term computed on the master's parameters outside the model's forward (an L2 penalty by hand,
    a head that reuses a weight) makes autograd add to the zero markers during no_sync(). That was refused
    as a gradient "changed (not cleared)", where one process and DDP just accumulate. Such accumulation
    now becomes the new marker; scaling a gradient there is still refused. Three steps with a zero_grad()
    between micro-batches once and a last micro-batch smaller than the worker count, against one process."""
    torch.manual_seed(0)
    net = models.MLP(d_out=4).double()
    ref = copy.deepcopy(net)
    model = wrap(net, ["cpu"] * 3, gather=gather)
    crit = dpool.criterion(nn.CrossEntropyLoss())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (net, ref)]
    g = torch.Generator().manual_seed(1)

    def loss(mod, params, x, y):
        out = mod(x)
        main = crit(out, y) if isinstance(out, dpool.ShardedOutput) else F.cross_entropy(out, y)
        tied = F.linear(x, params[0]).pow(2).mean()  # the first layer's weight, used outside the model
        return main + 1e-2 * sum(p.pow(2).sum() for p in params) + 1e-3 * tied

    for step in range(3):
        batches = [(torch.randn(r, 12, generator=g, dtype=torch.float64), torch.randint(0, 4, (r,), generator=g))
                   for r in (7, 5, 2)]
        for mod, params, opt in ((model, list(net.parameters()), opts[0]), (ref, list(ref.parameters()), opts[1])):
            opt.zero_grad()
            for i, (x, y) in enumerate(batches):
                if mod is model and i < len(batches) - 1:
                    with model.no_sync():
                        loss(mod, params, x, y).backward()
                else:
                    loss(mod, params, x, y).backward()
                if step == 1 and i == 0:
                    opt.zero_grad()
            opt.step()
        for (name, p), rp in zip(net.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, rp, msg=lambda m: f"step {step}, {name}: {m}")
    opts[0].zero_grad()
    params = list(net.parameters())
    with model.no_sync():
        loss(model, params, *batches[0]).backward()
        params[0].grad.mul_(0.5)  # not an accumulation: the held part cannot be scaled alike
        with pytest.raises(dpool.UnsupportedError, match="was changed \\(not cleared\\) while model.no_sync"):
            loss(model, params, *batches[1]).backward()


@pytest.mark.parametrize("gather", [True, False], ids=["gathered", "loss_on_workers"])
def test_no_sync_with_hooks_on_the_masters_parameters_equals_one_process(wrap, gather):
    """Hooks on the master's parameters see each backward's gradient in one process: a tensor hook that
    clamps it, a post-accumulate hook that clamps the sum in place, an optimizer step in the backward.
    Under no_sync() a held backward called them with None (a hook's `g.clamp` raised), and the backward
    that ended it ran them once on the held sum: other numbers. With such hooks no_sync() now holds
    nothing, so the numbers are one process's, hook calls included. A hook registered while the workers
    hold its parameter's gradient is refused at the next backward; after zero_grad() it is fine."""
    torch.manual_seed(0)
    net = models.MLP(d_out=4).double()
    ref = copy.deepcopy(net)
    model = wrap(net, gather=gather)
    crit = dpool.criterion(nn.MSELoss(reduction="sum"))
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(r, 12, generator=g, dtype=torch.float64) for r in (6, 5, 1, 6)]

    def loss(mod, x):
        out = mod(x)
        target = torch.zeros(len(x), 4, dtype=torch.float64)
        return crit(out, target) if isinstance(out, dpool.ShardedOutput) else (out - target).pow(2).sum()

    def accumulate(mod, batches):
        for i, x in enumerate(batches):
            if mod is model and i < len(batches) - 1:
                with model.no_sync():
                    loss(mod, x).backward()
            else:
                loss(mod, x).backward()

    calls: dict = {net: {}, ref: {}}  # per parameter, what each call of its hook saw (autograd's order of
    handles = []                      # the parameters may differ: dpool's backward returns them all at once)
    for m in (net, ref):
        for i, p in enumerate(m.parameters()):
            seen = calls[m][i] = []
            if i % 2:
                hook = functools.partial(lambda seen, g: (seen.append(g.norm()), g.clamp(-0.3, 0.3))[1], seen)
                handles.append(p.register_hook(hook))
            else:
                hook = functools.partial(lambda seen, q: seen.append(q.grad.clamp_(-0.2, 0.2).norm()), seen)
                handles.append(p.register_post_accumulate_grad_hook(hook))
    for m in (model, ref):
        accumulate(m, xs[:3])
    for i, seen in calls[ref].items():
        assert len(seen) == len(calls[net][i]) == 3
        torch.testing.assert_close(torch.stack(calls[net][i]), torch.stack(seen))
    for (name, p), rp in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, rp.grad, msg=lambda m: f"clamping hooks, {name}: {m}")
    for h in handles:
        h.remove()

    # an optimizer step in the backward, per parameter (torch's "optimizer in backward" recipe)
    for m in (net, ref):
        m.zero_grad(set_to_none=True)
        opts = {p: torch.optim.SGD([p], lr=0.05, momentum=0.9) for p in m.parameters()}

        def step(q, opts=opts):
            opts[q].step()
            opts[q].zero_grad()

        handles += [p.register_post_accumulate_grad_hook(step) for p in m.parameters()]
    for _ in range(2):
        for m in (model, ref):
            accumulate(m, xs[:3])
    for (name, p), rp in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, rp, msg=lambda m: f"optimizer in the backward, {name}: {m}")
    for h in handles:
        h.remove()

    # a hook registered while the workers hold its parameter's gradient
    net.zero_grad()
    w = net.net[0].weight
    with model.no_sync():
        loss(model, xs[0]).backward()
    h = w.register_hook(lambda g: g * 2)
    with pytest.raises(dpool.UnsupportedError, match=r"hook was registered on 1 parameter\(s\) \('net\.0\.weight'\) "
                                                     r"while model\.no_sync\(\) held"):
        loss(model, xs[1]).backward()
    net.zero_grad()  # drops the held gradients: the hook is fine now
    ref.zero_grad()
    rh = ref.net[0].weight.register_hook(lambda g: g * 2)
    for m in (model, ref):
        accumulate(m, xs[1:])
    h.remove()
    rh.remove()
    for (name, p), rp in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, rp.grad, msg=lambda m: f"a hook after zero_grad(), {name}: {m}")


def test_a_parameter_frozen_while_no_sync_holds_its_gradient_is_refused(wrap):
    """A parameter frozen between micro-batches, or before the backward that ends no_sync(), keeps its
    accumulated .grad in one process; the workers bring only the gradients of parameters that require
    grad, so it got None, silently. That is now an UnsupportedError at the next forward or backward, the
    accumulation goes on once it is undone, and freezing after zero_grad() (nothing held) is fine."""
    torch.manual_seed(0)
    net = models.MLP(d_out=4).double()
    ref = copy.deepcopy(net)
    model = wrap(net)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(6, 12, generator=g, dtype=torch.float64) for _ in range(4)]
    w = net.net[0].weight
    refused = r"1 parameter\(s\) \('net\.0\.weight'\) stopped requiring grad while model\.no_sync\(\) holds"
    with model.no_sync():
        model(xs[0]).pow(2).sum().backward()
        w.requires_grad_(False)
        with pytest.raises(dpool.UnsupportedError, match=refused):
            model(xs[1])
        w.requires_grad_(True)
        model(xs[1]).pow(2).sum().backward()
    out = model(xs[2])
    w.requires_grad_(False)
    with pytest.raises(dpool.UnsupportedError, match=refused):
        out.pow(2).sum().backward()
    w.requires_grad_(True)
    model(xs[2]).pow(2).sum().backward()
    for x in xs[:3]:
        ref(x).pow(2).sum().backward()
    for (name, p), rp in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, rp.grad, msg=lambda m: f"{name}: {m}")
    net.zero_grad()
    ref.zero_grad()
    with model.no_sync():
        model(xs[3]).pow(2).sum().backward()
    net.zero_grad()  # the held gradients dropped: freezing is fine now
    w.requires_grad_(False)
    ref.net[0].weight.requires_grad_(False)
    model(xs[0]).pow(2).sum().backward()
    ref(xs[0]).pow(2).sum().backward()
    for (name, p), rp in zip(net.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (rp.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, rp.grad, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("gather", [True, False], ids=["gathered", "loss_on_workers"])
def test_no_sync_holds_only_what_one_process_accumulates(wrap, gather):
    """Inside no_sync(), backward(inputs=[x]), backward(inputs=[some parameters]) and torch.autograd.grad of
    the inputs (an adversarial example's gradient) accumulate nothing, or only those parameters, into .grad
    in one process; the workers added every parameter's gradient to what they hold, silently. They now hold
    only what autograd accumulates. torch.autograd.grad of the parameters there is refused (the workers
    return no gradient under no_sync()), and the accumulation goes on. Against one process."""
    torch.manual_seed(0)
    net = models.MLP(d_out=4).double()
    ref = copy.deepcopy(net)
    model = wrap(net, ["cpu"] * 3, gather=gather)
    crit = dpool.criterion(nn.CrossEntropyLoss())
    g = torch.Generator().manual_seed(1)

    def loss(mod, x, y):
        out = mod(x)
        return crit(out, y) if isinstance(out, dpool.ShardedOutput) else F.cross_entropy(out, y)

    def micro_batches(mod, params, batches):
        (x0, y0), (x1, y1), (x2, y2), (x3, y3), (x4, y4) = batches
        x1, x3 = x1.clone().requires_grad_(), x3.clone().requires_grad_()
        loss(mod, x0, y0).backward()
        loss(mod, x1, y1).backward(inputs=[x1])
        loss(mod, x2, y2).backward(inputs=[params[0], params[3]])
        gx, = torch.autograd.grad(loss(mod, x3, y3), [x3])
        return [x1.grad, gx, x4, y4]

    for step in range(2):
        batches = [(torch.randn(r, 12, generator=g, dtype=torch.float64), torch.randint(0, 4, (r,), generator=g))
                   for r in (7, 5, 6, 4, 2)]
        with model.no_sync():
            got = micro_batches(model, list(net.parameters()), batches)
            with pytest.raises(dpool.UnsupportedError, match=r"torch\.autograd\.grad of a dpool model's parameters "
                               r"inside model\.no_sync\(\)"):
                torch.autograd.grad(loss(model, *batches[0]), list(net.parameters()))
        want = micro_batches(ref, list(ref.parameters()), batches)
        for a, b in zip(got[:2], want[:2]):
            torch.testing.assert_close(a, b)
        loss(model, *got[2:]).backward()  # 2 rows on 3 workers: the held sums of the third join it too
        loss(ref, *want[2:]).backward()
        for (name, p), rp in zip(net.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, rp.grad, msg=lambda m: f"step {step}, {name}: {m}")
            p.grad, rp.grad = None, None


@pytest.mark.filterwarnings("ignore:Using backward.. with create_graph=True")  # torch's advice, both sides
@pytest.mark.parametrize("rows", [[8, 8], [8, 1]], ids=["same_rows", "fewer_rows_than_workers"])
def test_no_sync_then_a_create_graph_backward_adds_the_held_gradients(wrap, rows):
    """Accumulation whose last backward builds the gradients' graph (a gradient penalty on the accumulated
    .grad). The create_graph backward wrote its gradients over the held sums, so they were silently lost,
    and the workers went on holding, so the next plain step added to stale slots. Now the held sums are
    added, as one process adds to .grad, and the penalty's backward differentiates the new part only.
    Three steps of accumulate, penalty and a plain step, against one process."""
    torch.manual_seed(0)
    net = models.MLP(d_out=4).double()
    ref = copy.deepcopy(net)
    model = wrap(net)
    opts = [torch.optim.SGD(net.parameters(), lr=1e-3), torch.optim.SGD(ref.parameters(), lr=1e-3)]
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        first, last = (torch.randn(r, 12, generator=g, dtype=torch.float64) for r in rows)
        for mod, params, opt in ((model, list(net.parameters()), opts[0]), (ref, list(ref.parameters()), opts[1])):
            opt.zero_grad()
            if mod is model:
                with model.no_sync():
                    mod(first).pow(2).sum().backward()
            else:
                mod(first).pow(2).sum().backward()
            mod(last).pow(2).sum().backward(create_graph=True)
            sum(p.grad.pow(2).sum() for p in params).backward()
            opt.step()
            opt.zero_grad()
            mod(first).sum().backward()
            opt.step()
        for (name, p), rp in zip(net.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, rp, msg=lambda m: f"step {step}, {name}: {m}")


@pytest.mark.parametrize("make", [SparseBag, lambda: nn.Embedding(30, 6, sparse=True)], ids=["bag", "bare"])
def test_no_sync_sparse_gradients_accumulate_and_are_dropped_by_zero_grad(wrap, make):
    """nn.Embedding(sparse=True) under no_sync(). Two silently wrong gradients, against one process:
    - the held sparse gradient viewed the worker's input shard (its indices) and, where the embedding's
      output is the model's (``bare``), the output gradient's segment (its values); the next step's shards
      were placed there, so the held part changed before it was summed. Held sparse gradients now own
      their memory;
    - it had no marker on the master, so zero_grad() between micro-batches did not drop it. It now gets a
      sparse marker with no entries, seen like a dense one.
    Accumulation with and without clearing, and a step over the held gradients."""
    torch.manual_seed(0)
    net = make()
    ref = copy.deepcopy(net)
    model = wrap(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    xs = [torch.randint(0, 30, (8, 5)) for _ in range(3)]
    emb = net.emb if isinstance(net, SparseBag) else net
    n = len(list(net.parameters()))

    def dense(g):
        return g.to_dense() if g.is_sparse else g

    def check(batches, what):
        ref.zero_grad()
        for x in batches:
            ref(x).pow(2).sum().backward()
        for (name, p), rp in zip(net.named_parameters(), ref.parameters()):
            torch.testing.assert_close(dense(p.grad), dense(rp.grad), msg=lambda m: f"{what}, {name}: {m}")

    for clear in (None, "zero_grad", "zero_grad(set_to_none=False)"):
        with model.no_sync():
            model(xs[0]).pow(2).sum().backward()
        assert emb.weight.grad.is_sparse and emb.weight.grad._nnz() == 0  # the marker
        if clear == "zero_grad":
            opt.zero_grad()
        elif clear is not None:
            opt.zero_grad(set_to_none=False)
        with model.no_sync():
            model(xs[1]).pow(2).sum().backward()
        model(xs[2]).pow(2).sum().backward()
        assert emb.weight.grad.is_sparse
        check(xs if clear is None else xs[1:], clear)
        opt.zero_grad()
    with model.no_sync():
        model(xs[0]).pow(2).sum().backward()
    with pytest.raises(dpool.UnsupportedError, match=rf"SGD\.step\(\) over {n} parameter\(s\)"):
        opt.step()
    model(xs[1]).pow(2).sum().backward()
    check(xs[:2], "after the refused step")
    opt.step()


def test_no_sync_gradients_are_dropped_by_zero_grad_and_never_stepped_without(wrap):
    """DistributedDataParallel accumulates no_sync() gradients in .grad, so a loop written for it drops
    them with zero_grad() (at an epoch's start, after a skipped batch). dpool holds them on the workers,
    where zero_grad() did not reach: they were added to the next synchronized backward, silently. Now
    the master's .grad has a zero marker while they are held; clearing it drops them, changing it
    otherwise is an error, a step over them is an error, and so is shipping a changed model meanwhile."""
    torch.manual_seed(0)
    net = models.make("mlp")
    ref = copy.deepcopy(net)
    model = wrap(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    xs = [torch.randn(7, 12, dtype=torch.float64) for _ in range(3)]

    def ref_grads(*batches):
        ref.zero_grad()
        for x in batches:
            ref(x).pow(2).sum().backward()
        return [p.grad for p in ref.parameters()]

    for clear in ("zero_grad", "zero_grad(set_to_none=False)", "grad = None"):
        with model.no_sync():
            model(xs[0]).pow(2).sum().backward()
        if clear == "zero_grad":
            opt.zero_grad()
        elif clear == "zero_grad(set_to_none=False)":
            opt.zero_grad(set_to_none=False)
        else:
            for p in net.parameters():
                p.grad = None
        with model.no_sync():
            model(xs[1]).pow(2).sum().backward()
        model(xs[2]).pow(2).sum().backward()
        for p, want in zip(net.parameters(), ref_grads(xs[1], xs[2])):
            torch.testing.assert_close(p.grad, want, msg=lambda m: f"{clear}: {m}")
        opt.zero_grad()

    before = [p.detach().clone() for p in net.parameters()]
    with model.no_sync():
        model(xs[0]).pow(2).sum().backward()
    n = len(list(net.parameters()))
    with pytest.raises(dpool.UnsupportedError, match=rf"SGD\.step\(\) over {n} parameter\(s\) whose gradients "
                                                    r"model\.no_sync\(\) still holds"):
        opt.step()
    net.net[0].inplace_flag = True  # a change that would ship the model again
    with pytest.raises(dpool.UnsupportedError, match=r"changed after dpool\.wrap\(\) while model\.no_sync\(\) holds"):
        model(xs[1])
    del net.net[0].inplace_flag
    model(xs[1]).pow(2).sum().backward()  # leaves the accumulation: the held gradients count
    for p, want in zip(net.parameters(), ref_grads(xs[0], xs[1])):
        torch.testing.assert_close(p.grad, want)
    opt.step()  # fine now
    for p, b, r in zip(net.parameters(), before, ref_grads(xs[0], xs[1])):
        torch.testing.assert_close(p, b - 0.1 * r)

    opt.zero_grad()
    with torch.no_grad():
        for r, p in zip(ref.parameters(), net.parameters()):
            r.copy_(p)
    with model.no_sync():
        model(xs[0]).pow(2).sum().backward()
    net.net[0].weight.grad.add_(1.0)  # a change the held part cannot follow
    with pytest.raises(dpool.UnsupportedError, match=r"gradient of parameter 'net\.0\.weight' was changed"):
        model(xs[1]).pow(2).sum().backward()
    opt.zero_grad()  # dropped, as with DDP
    model(xs[2]).pow(2).sum().backward()
    for p, want in zip(net.parameters(), ref_grads(xs[2])):
        torch.testing.assert_close(p.grad, want)


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn1 = nn.BatchNorm2d(4)
        self.lin = nn.Linear(4, 5)
        self.bn2 = nn.BatchNorm1d(5, momentum=None)

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv(x))).mean(dim=(2, 3))
        return self.bn2(self.lin(h))


@pytest.mark.parametrize("n_workers, convert", [(2, "dpool"), (3, "torch")])
def test_sync_batchnorm_equals_full_batch_batchnorm(wrap, n_workers, convert):
    """dpool's layer, and torch's as scripts written for DDP convert to it (which in a worker without a
    process group would normalise each shard alone: the workers run it as dpool's)."""
    torch.manual_seed(0)
    ref = BNNet().double()
    if convert == "dpool":
        net = dpool.convert_sync_batchnorm(copy.deepcopy(ref))
        assert isinstance(net.bn1, dpool.SyncBatchNorm) and isinstance(net.bn2, dpool.SyncBatchNorm)
    else:
        net = nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(ref))
        assert type(net.bn1) is nn.SyncBatchNorm and type(net.bn2) is nn.SyncBatchNorm
    model = wrap(net, ["cpu"] * n_workers)
    if convert == "torch":  # the master keeps torch's class; its replicas are dpool's
        assert type(net.bn1) is nn.SyncBatchNorm
        assert model.worker_states(lambda r: type(r.bn1).__name__ + type(r.bn2).__module__) == \
            ["SyncBatchNormdpool.sync_batchnorm"] * n_workers
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        x = torch.randn(11, 3, 6, 6, dtype=torch.float64) * (step + 1)
        out, rout = model(x), ref(x)
        torch.testing.assert_close(out, rout)  # normalised with whole-batch statistics
        out.pow(3).sum().backward()
        rout.pow(3).sum().backward()
        for (n, p), rp in zip(net.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, rp.grad, msg=lambda m: f"grad {n}: {m}")
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
    for (n, b), rb in zip(net.named_buffers(), ref.buffers()):
        torch.testing.assert_close(b, rb, msg=lambda m: f"buffer {n}: {m}")
    model.eval()
    ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x))


class FailsOnShard1(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = dpool.SyncBatchNorm(3)

    def forward(self, x):
        if x[0, 0] > 100:
            raise ValueError("shard 1 fails before the collective")
        return self.bn(x)


class _BatchNormAct(nn.BatchNorm2d):
    """As timm's BatchNormAct2d: a BatchNorm whose forward adds an activation."""

    def __init__(self, c: int) -> None:
        super().__init__(c)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(super().forward(x))


def test_batchnorms_dpool_cannot_synchronize_as_asked_are_refused():
    """torch's layer with its own process group (a subset of DDP's ranks), or a subclass of it (its own
    forward), would run per shard in the workers: refused at wrap(), before any worker starts. And
    dpool.convert_sync_batchnorm refuses a BatchNorm with a forward of its own, whose additions the
    replacement would drop (torch's converter drops them), before it replaces anything."""
    class MyBN(nn.SyncBatchNorm):
        pass

    net = nn.Sequential(nn.BatchNorm2d(3), nn.Conv2d(3, 4, 3), _BatchNormAct(4))
    with pytest.raises(dpool.UnsupportedError, match=r"model\.2 is a _BatchNormAct, a BatchNorm with a forward of "
                                                     r"its own.*silently drop"):
        dpool.convert_sync_batchnorm(net)
    assert type(net[0]) is nn.BatchNorm2d and type(net[2]) is _BatchNormAct  # nothing half converted

    grouped = nn.Sequential(nn.Linear(3, 4), nn.SyncBatchNorm(4, process_group=object()))
    with pytest.raises(dpool.UnsupportedError, match=r"model\.1 is a torch\.nn\.SyncBatchNorm given its own "
                                                     r"process_group.*dpool\.convert_sync_batchnorm"):
        dpool.wrap(grouped, ["cpu", "cpu"])
    with pytest.raises(NotImplementedError, match=r"model\.1 is a torch\.nn\.SyncBatchNorm subclass \(.*MyBN\)"):
        dpool.wrap(nn.Sequential(nn.Linear(3, 4), MyBN(4)), ["cpu", "cpu"])
    converted = dpool.convert_sync_batchnorm(nn.Sequential(nn.Linear(3, 4), MyBN(4)))  # the way out it names
    assert type(converted[1]) is dpool.SyncBatchNorm
    assert psutil.Process().children() == []


def test_sync_batchnorm_failure_on_one_shard_does_not_hang(wrap):
    """H4: the other shards wait in the collective; they are released and the real error surfaces."""
    model = wrap(FailsOnShard1())
    x = torch.randn(8, 3)
    x[4, 0] = 1000.0
    with pytest.raises(ValueError, match="shard 1 fails") as info:
        model(x)
    assert info.value.worker == 1
    model(torch.randn(8, 3)).sum().backward()  # the pool is fine afterwards


def _same_loss_and_gradients(loss: torch.Tensor, rloss: torch.Tensor, net: nn.Module, ref: nn.Module) -> None:
    """The loss equals the reference's, and so do the gradients its backward gives the parameters."""
    torch.testing.assert_close(loss, rloss)
    loss.backward()
    rloss.backward()
    for p, rp in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, rp.grad)


@pytest.mark.parametrize("loss_fn", [
    nn.CrossEntropyLoss(),
    nn.CrossEntropyLoss(weight=torch.tensor([1.0, 3.0, 0.5, 2.0], dtype=torch.float64), ignore_index=2),
    nn.CrossEntropyLoss(reduction="sum", label_smoothing=0.1),
    nn.MSELoss(),
], ids=["ce", "ce_weighted_ignore", "ce_sum_smoothing", "mse"])
def test_loss_on_the_workers_equals_full_batch(wrap, loss_fn):
    torch.manual_seed(0)
    net = models.MLP(d_out=4).double()
    ref = copy.deepcopy(net)
    model = wrap(net, ["cpu"] * 3, gather=False)
    crit = dpool.criterion(loss_fn)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(10, 12, dtype=torch.float64)  # 10 rows on 3 workers: unequal shards 4, 3, 3
        y = torch.randint(0, 4, (10,)) if not isinstance(loss_fn, nn.MSELoss) else torch.randn(10, 4, dtype=torch.float64)
        out = model(x)
        assert isinstance(out, dpool.ShardedOutput) and out.shard_sizes == [4, 3, 3]
        _same_loss_and_gradients(crit(out, y), loss_fn(ref(x), y), net, ref)
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
    x = torch.randn(7, 12, dtype=torch.float64)
    out = model(x)
    gathered = out.gather()  # the usual output, still differentiable
    torch.testing.assert_close(gathered, ref(x))
    gathered.sum().backward()
    ref(x).sum().backward()
    for p, rp in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, rp.grad)


class FlatLM(nn.Module):
    """A language model that returns its logits flattened, (batch * positions, vocabulary)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.out = nn.Linear(6, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(ids)).view(-1, 10)


class FlatTargets(nn.CrossEntropyLoss):
    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return super().forward(logits, target.reshape(-1))


def test_a_model_that_flattens_its_output_gets_targets_split_like_its_inputs(wrap):
    """Targets are split like the inputs, row for row. A flattened target (one row per output row) once
    raised "target has 24 rows along dim 0, the output 8", though the output has 24 rows: the error now
    says the inputs had 8 and what to do; the unflattened target, flattened in the loss, trains like one
    process."""
    torch.manual_seed(0)
    net = FlatLM().double()
    ref = copy.deepcopy(net)
    model = wrap(net, gather=False)
    ids, y = torch.randint(0, 10, (8, 3)), torch.randint(0, 10, (8, 3))
    with pytest.raises(dpool.DpoolValueError, match=r"24 rows along dim 0, but the model's inputs had 8 \(shards "
                       r"of \[4, 4\] rows\)(.|\n)*one row per input row and flatten it in the loss"):
        dpool.criterion(nn.CrossEntropyLoss())(model(ids), y.view(-1))
    _same_loss_and_gradients(dpool.criterion(FlatTargets())(model(ids), y), FlatTargets()(ref(ids), y), net, ref)


def test_a_sharded_output_used_as_a_tensor_says_what_to_do(wrap):
    """With gather=False the model returns a ShardedOutput. Passing it to a torch function (the usual loss on
    the gathered output) or using a tensor's attribute on it says why it is not a tensor and what to do; the
    output is still good for its criterion afterwards."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    ref = copy.deepcopy(net)
    model = wrap(net, gather=False)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    out = model(x)
    advice = (r"The dpool model was wrapped with gather=False.*dpool\.criterion\(loss_fn\)\(out, target\)"
              r".*out\.gather\(\)")
    for use in (lambda: nn.functional.cross_entropy(out, y), lambda: nn.CrossEntropyLoss()(out, y),
                lambda: torch.softmax(out, 1)):
        with pytest.raises(TypeError, match=r"\(\) got a ShardedOutput where it takes a tensor\. " + advice):
            use()
    for name in ("backward", "shape", "argmax", "detach"):
        with pytest.raises(AttributeError, match=f"no attribute '{name}'. " + advice):
            getattr(out, name)
    assert getattr(out, "not_a_tensor_attribute", None) is None
    dpool.criterion(nn.CrossEntropyLoss())(out, y).backward()
    nn.CrossEntropyLoss()(ref(x), y).backward()
    for p, rp in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, rp.grad)


def _torch_losses(n: int) -> list:
    """(loss module, targets) for every torch.nn loss that takes a batch of outputs, with ``n`` rows."""
    f64 = dict(dtype=torch.float64)
    w = torch.tensor([1.0, 3.0, 0.5, 2.0, 0.25], **f64)
    ones = lambda *shape: torch.randint(0, 2, shape, **f64) * 2 - 1  # noqa: E731  (targets of ±1)
    return [
        (nn.CrossEntropyLoss(weight=w, ignore_index=2, label_smoothing=0.1), (torch.randint(0, 5, (n,)),)),
        (nn.CrossEntropyLoss(weight=w), (torch.softmax(torch.randn(n, 5, **f64), 1),)),  # class probabilities
        (nn.NLLLoss(reduction="sum"), (torch.randint(0, 5, (n,)),)),
        (nn.KLDivLoss(reduction="mean"), (torch.softmax(torch.randn(n, 5, **f64), 1),)),
        (nn.PoissonNLLLoss(full=True), (torch.rand(n, 5, **f64) * 3,)),
        (nn.GaussianNLLLoss(), (torch.randn(n, 5, **f64), torch.rand(n, 1, **f64) + 0.1)),
        (nn.MultiLabelSoftMarginLoss(weight=w), (torch.randint(0, 2, (n, 5), **f64),)),
        (nn.MultiLabelMarginLoss(), (torch.randint(-1, 5, (n, 5)),)),
        (nn.MultiMarginLoss(p=2, weight=w), (torch.randint(0, 5, (n,)),)),
        (nn.HingeEmbeddingLoss(), (ones(n, 5),)),
        (nn.SoftMarginLoss(), (ones(n, 5),)),
        (nn.BCEWithLogitsLoss(pos_weight=w), (torch.rand(n, 5, **f64),)),
        (nn.HuberLoss(delta=0.5), (torch.randn(n, 5, **f64),)),
        (nn.L1Loss(reduction="sum"), (torch.randn(n, 5, **f64),)),
        (nn.CosineEmbeddingLoss(margin=0.1), (torch.randn(n, 5, **f64), ones(n))),
        (nn.MarginRankingLoss(margin=0.2), (torch.randn(n, 5, **f64), ones(n, 5))),
        (nn.TripletMarginLoss(), (torch.randn(n, 5, **f64), torch.randn(n, 5, **f64))),
        (nn.TripletMarginWithDistanceLoss(margin=0.3), (torch.randn(n, 5, **f64), torch.randn(n, 5, **f64))),
    ]


class _Subclassed:
    """Makes a subclass of a loss's type that changes nothing: dpool checks such a loss on every shard."""

    @staticmethod
    def of(loss_fn: nn.Module) -> nn.Module:
        sub = type(f"My{type(loss_fn).__name__}", (type(loss_fn),), {})
        other = sub.__new__(sub)
        other.__dict__.update(copy.deepcopy(loss_fn).__dict__)
        return other


class _IgnoresReduction(nn.Module):
    reduction = "mean"

    def forward(self, out, target):
        return nn.functional.cross_entropy(out, target)  # always the shard's mean


class _NoReduction(nn.Module):
    def forward(self, out, target):
        return nn.functional.cross_entropy(out, target)


class _WithPenalty(nn.CrossEntropyLoss):
    def forward(self, out, target):
        return super().forward(out, target) + 0.1 * out.pow(2).mean()  # a mean whatever self.reduction says


class _BatchFirstCTC(nn.CTCLoss):
    def forward(self, log_probs, targets, input_lengths, target_lengths):
        return super().forward(log_probs.log_softmax(-1).transpose(0, 1), targets, input_lengths, target_lengths)


@pytest.mark.filterwarnings("ignore:reduction. 'mean'")  # KLDivLoss's advice to use 'batchmean'
def test_a_criterion_gives_the_batch_loss_for_every_torch_loss_or_a_clear_error(wrap):
    """Each worker computes its shard's loss with reduction='sum' and the coordinator divides by the summed
    denominators: exact for torch.nn's losses, also on unequal shards, also for their subclasses (checked on
    every shard). A loss that does not split so (its forward ignores `reduction`, a term that is a mean
    whatever it says, CTCLoss's division by target lengths) used to give a mean of the shards' means or a
    wrong sum silently; now it is an error that says so, and the pool and the master are untouched."""
    torch.manual_seed(0)
    net = models.MLP(d_in=6, d_out=5).double()
    ref = copy.deepcopy(net)
    model = wrap(net, ["cpu"] * 2, gather=False)
    x = torch.randn(7, 6, dtype=torch.float64)  # 7 rows on 2 workers: shards of 4 and 3
    for loss_fn, targets in _torch_losses(7):
        for fn in (loss_fn, _Subclassed.of(loss_fn)):
            name = type(fn).__name__
            loss, rloss = dpool.criterion(fn)(model(x), *targets), copy.deepcopy(fn)(ref(x), *targets)
            torch.testing.assert_close(loss, rloss, msg=lambda m: f"{name}: {m}")
            loss.backward()
            rloss.backward()
            for p, rp in zip(net.parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, rp.grad, msg=lambda m: f"{name}: {m}")
                p.grad, rp.grad = None, None

    for bad in (_NoReduction(), lambda out, target: nn.functional.cross_entropy(out, target)):
        with pytest.raises(dpool.DpoolValueError, match="needs a loss with a `reduction` attribute"):
            dpool.criterion(bad)
    y = torch.randint(0, 5, (7,))
    with pytest.raises(ValueError, match=r"_IgnoresReduction\) with reduction='none' returned one value") as info:
        dpool.criterion(_IgnoresReduction())(model(x), y)
    assert "out.gather()" in str(info.value) and info.value.worker in (0, 1)
    with pytest.raises(ValueError, match=r"_WithPenalty\) does not split over shards"):
        dpool.criterion(_WithPenalty())(model(x), y)
    ctc = (torch.randint(1, 5, (7, 3)), torch.full((7,), 7), torch.randint(1, 4, (7,)))
    with pytest.raises(ValueError, match=r"_BatchFirstCTC\) does not split over shards"):
        dpool.criterion(_BatchFirstCTC())(model(x.unsqueeze(1).expand(7, 7, 6)), *ctc)
    # the loss on the gathered output, as the errors advise, is CTCLoss's own mean
    torch.testing.assert_close(_BatchFirstCTC()(model(x.unsqueeze(1).expand(7, 7, 6)).gather(), *ctc),
                               _BatchFirstCTC()(ref(x.unsqueeze(1).expand(7, 7, 6)), *ctc))
    assert all(p.grad is None for p in net.parameters())  # the master is untouched
    for p, rp in zip(net.parameters(), ref.parameters()):
        assert torch.equal(p, rp)

    # a mean over no target at all is nan in one process, with zero gradients: the same here
    ignored = torch.full((7,), -100)
    loss, rloss = dpool.criterion(nn.CrossEntropyLoss())(model(x), ignored), nn.CrossEntropyLoss()(ref(x), ignored)
    assert loss.isnan() and rloss.isnan()
    loss.backward()
    rloss.backward()
    for p, rp in zip(net.parameters(), ref.parameters()):
        assert torch.equal(p.grad, rp.grad) and not p.grad.any()


class _MarginLoss(nn.Module):
    """A loss with a classifier of its own (ArcFace's, CosFace's) and a counter its forward keeps."""

    def __init__(self, d: int, classes: int, count: bool = False, assign: bool = False) -> None:
        super().__init__()
        self.reduction = "mean"
        self.weight = nn.Parameter(torch.randn(classes, d, dtype=torch.float64))
        self.register_buffer("seen", torch.zeros((), dtype=torch.float64))
        self.count, self.assign = count, assign

    def forward(self, emb, target):
        if self.count:
            self.seen += target.numel()
        if self.assign:
            self.seen = self.seen + target.numel()
        logits = nn.functional.normalize(emb) @ nn.functional.normalize(self.weight).T * 8
        return nn.functional.cross_entropy(logits, target, reduction=self.reduction)


def test_a_criterion_that_learns_or_keeps_state_is_refused_not_left_behind(wrap):
    """The workers compute the loss with copies of it. A loss with parameters that train (ArcFace's
    classifier) used to get no gradient at all, and a loss whose forward updates its own tensors used to
    update the copies only, which drifted apart: both silently. The first is refused at the call, the
    second on the workers; a frozen loss, or one under no_grad, still runs there and equals one process."""
    torch.manual_seed(0)
    net = models.MLP(d_in=6, d_out=4).double()
    ref = copy.deepcopy(net)
    model = wrap(net, ["cpu"] * 2, gather=False)
    x, y = torch.randn(7, 6, dtype=torch.float64), torch.randint(0, 5, (7,))
    loss_fn = _MarginLoss(4, 5)
    with pytest.raises(dpool.UnsupportedError, match=r"_MarginLoss\): the loss has parameters that require grad "
                                                    r"\(weight\).*out\.gather\(\).*requires_grad_\(False\)"):
        dpool.criterion(loss_fn)(model(x), y)
    # the gathered output, as the error advises: the loss's own parameters train as in one process
    rloss_fn = copy.deepcopy(loss_fn)
    loss, rloss = loss_fn(model(x).gather(), y), rloss_fn(ref(x), y)
    loss.backward()
    rloss.backward()
    torch.testing.assert_close(loss_fn.weight.grad, rloss_fn.weight.grad)
    for p, rp in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, rp.grad)
    loss_fn.weight.grad = rloss_fn.weight.grad = None
    net.zero_grad(), ref.zero_grad()
    loss_fn.requires_grad_(False)  # frozen: computed on the workers
    _same_loss_and_gradients(dpool.criterion(loss_fn)(model(x), y), loss_fn(ref(x), y), net, ref)
    loss_fn.requires_grad_(True)
    with torch.no_grad():  # evaluation: nothing to train
        torch.testing.assert_close(dpool.criterion(loss_fn)(model(x), y), loss_fn(ref(x), y))

    for how in ("count", "assign"):
        counting = _MarginLoss(4, 5, **{how: True}).requires_grad_(False)
        with pytest.raises(ValueError, match=rf"_MarginLoss\): the loss's forward changed its tensor 'seen' "
                                             rf"\({'in place' if how == 'count' else 'assigned anew'}\)") as info:
            dpool.criterion(counting)(model(x), y)
        assert info.value.worker in (0, 1) and counting.seen.item() == 0
    torch.testing.assert_close(model(x).gather(), ref(x))  # the pool goes on, the master untouched
    for p, rp in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, rp.grad)


@pytest.mark.parametrize("change", ["label_smoothing", "weight_in_place", "weight_data", "weight_replaced", "reduction"])
def test_a_criterion_changed_after_it_was_made_is_followed(wrap, change):
    """Users schedule their loss (label smoothing warm-up, class weights re-balanced each epoch): the
    workers must compute the loss as it is now, not as it was pickled, both the loss and its backward."""
    torch.manual_seed(0)
    net = models.MLP(d_out=4).double()
    ref = copy.deepcopy(net)
    model = wrap(net, ["cpu"] * 3, gather=False)
    loss_fn = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 3.0, 0.5, 2.0], dtype=torch.float64))
    ref_fn = copy.deepcopy(loss_fn)
    crit = dpool.criterion(loss_fn)
    for step in range(3):
        if step == 1:
            for f in (loss_fn, ref_fn):
                if change == "label_smoothing":
                    f.label_smoothing = 0.2
                elif change == "weight_in_place":
                    f.weight.mul_(torch.tensor([2.0, 1.0, 1.0, 0.25], dtype=torch.float64))
                elif change == "weight_data":  # (.data has a version counter of its own)
                    f.weight.data[0] = 7.0
                elif change == "weight_replaced":
                    f.weight = torch.tensor([0.5, 0.5, 4.0, 1.0], dtype=torch.float64)
                else:
                    f.reduction = "sum"
        x = torch.randn(10, 12, dtype=torch.float64)
        y = torch.randint(0, 4, (10,))
        loss, rloss = crit(model(x), y), ref_fn(ref(x), y)
        torch.testing.assert_close(loss, rloss, msg=lambda m: f"step {step}: {m}")
        loss.backward()
        rloss.backward()
        for p, rp in zip(net.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, rp.grad)
            p.grad, rp.grad = None, None


def test_stats_report_timings_shards_restarts_and_bytes(wrap):
    model = wrap(nn.Linear(4, 2), ["cpu", "cpu"])
    for _ in range(3):
        model(torch.randn(7, 4)).sum().backward()
    st = model.stats()
    assert st["steps"] == 3 and st["restarts"] == 0 and st["shard_rows"] == [4, 3]
    assert [w["pid"] for w in st["workers"]] == model.pids
    assert all(w["forward_ms"] > 0 and w["backward_ms"] > 0 for w in st["workers"])
    assert st["bytes_per_step"] == {"inputs": 7 * 4 * 4, "outputs": 7 * 2 * 4, "output_grads": 7 * 2 * 4,
                                    "param_grads": (8 + 2) * 4 * 2}  # each worker's slot: weight and bias


def test_outputs_kept_on_the_workers_are_not_copied_until_gathered(wrap):
    """With gather=False the outputs stay on the workers. A training step with dpool.criterion copies none of
    them into shared memory: each worker's output segment keeps its first size (1 MiB) though a shard's
    output is 2.5 MiB, and stats() counts no output bytes. It trains as one process does, and out.gather()
    then fetches the outputs, equal to one process's, and counts them."""
    torch.manual_seed(0)
    net = nn.Linear(8, 40_000).double()
    ref = copy.deepcopy(net)
    model = wrap(net, ["cpu", "cpu"], gather=False)
    crit = dpool.criterion(nn.CrossEntropyLoss())
    x, y = torch.randn(16, 8, dtype=torch.float64), torch.randint(0, 40_000, (16,))
    for _ in range(2):
        loss, rloss = crit(model(x), y), F.cross_entropy(ref(x), y)
        loss.backward()
        rloss.backward()
        torch.testing.assert_close(loss, rloss)
        for p, rp in zip(net.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, rp.grad)
            p.grad, rp.grad = None, None
        io = model._runtime.io
        assert [io.segment(s, "out").size for s in range(2)] == [1 << 20] * 2
        assert model.stats()["bytes_per_step"]["outputs"] == 0
    with torch.no_grad():
        full = model(x).gather()
    torch.testing.assert_close(full, ref(x))
    assert model.stats()["bytes_per_step"]["outputs"] == 16 * 40_000 * 8


def test_stats_split_each_round_into_request_handler_and_reply(wrap):
    """Each round's wall time is split per worker on the clock all processes share: the request's way there,
    the handler, the reply's way back. The three parts of every worker fit inside the round; a backward the
    loss round already ran has no round of its own."""
    model = wrap(nn.Linear(4, 2), ["cpu", "cpu"])
    for _ in range(3):
        model(torch.randn(7, 4)).sum().backward()
    st = model.stats()
    for kind in ("forward", "backward"):
        whole = st["round_ms"][kind]
        assert whole > 0, st
        for w in st["workers"]:
            there, busy, back = w[f"{kind}_request_ms"], w[f"{kind}_ms"], w[f"{kind}_reply_ms"]
            assert there > 0 and busy > 0 and back > 0, (kind, w)
            assert there + busy + back <= whole + 0.003, (kind, w, whole)  # each rounded to 1 us
    loss_model = wrap(nn.Linear(4, 3), ["cpu", "cpu"], gather=False)
    crit = dpool.criterion(nn.CrossEntropyLoss())
    crit(loss_model(torch.randn(8, 4)), torch.randint(0, 3, (8,))).backward()
    st = loss_model.stats()
    assert st["backward_rounds_saved"] == 1 and st["round_ms"]["backward"] == 0.0
    assert st["round_ms"]["forward"] > 0
    assert all(w["backward_request_ms"] == 0.0 and w["backward_reply_ms"] == 0.0 for w in st["workers"])


def test_logging_goes_to_the_dpool_logger(wrap, caplog):
    import logging

    with caplog.at_level(logging.DEBUG, logger="dpool"):
        model = wrap(nn.Linear(4, 2), ["cpu", "cpu"])
        model(torch.randn(4, 4))
        model.close()
    text = caplog.text
    assert "started 2 worker(s)" in text and "step 1: forward of 2 shards" in text and "closing the pool" in text


def test_torch_compile_outside_and_inside(wrap, recwarn):
    """torch.compile(dpool.wrap(net)) runs dpool's dispatch eagerly without Dynamo graph-break warnings;
    dpool.wrap(torch.compile(net)) compiles the replicas' work. Both give the reference outputs and grads.
    (backend="eager": Dynamo's tracing without a C++ compiler.)"""
    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    ref = copy.deepcopy(net)
    x = torch.randn(6, 4)
    compiled = torch.compile(wrap(net), backend="eager")
    compiled(x).sum().backward()
    ref(x).sum().backward()
    torch.testing.assert_close(net.weight.grad, ref.weight.grad)
    assert not [w for w in recwarn if "Dynamo" in str(w.message) or "graph break" in str(w.message).lower()]
    inner = wrap(torch.compile(copy.deepcopy(ref), backend="eager"), ["cpu"])  # one worker compiles: enough
    torch.testing.assert_close(inner(x), ref(x))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_replicas_train_through_a_new_batch_size(wrap, backend):
    """dpool.wrap(torch.compile(net)) with an AOTAutograd backend: a new batch size recompiles a dynamic-shape
    graph that donates its buffers, whose backward torch refuses under retain_graph=True. The workers keep a
    graph only when the coordinator's backward keeps it, so a short last batch trains as in one process; a
    backward with retain_graph=True still raises torch's error, as one process does. Against one process:
    outputs, gradients, and the parameters after each SGD step. With the loss on the workers the graph of kept
    outputs stays (several losses may backpropagate it, a round each), and its backward runs without donated
    buffers."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 4))
    ref = copy.deepcopy(net)
    ref_c = torch.compile(ref, backend=backend)
    model = wrap(torch.compile(net, backend=backend))
    opt, ref_opt = torch.optim.SGD(net.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for n in (9, 7, 7, 5):
        x = torch.randn(n, 10)
        out, ref_out = model(x), ref_c(x)
        torch.testing.assert_close(out, ref_out)
        out.square().sum().backward()
        ref_out.square().sum().backward()
        for p, q in zip(net.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)
    with pytest.raises(RuntimeError, match="donated buffers"):
        model(torch.randn(11, 10)).sum().backward(retain_graph=True)
    assert model(torch.randn(4, 10)).shape == (4, 4)  # the pool is still usable
    kept = wrap(torch.compile(copy.deepcopy(ref), backend=backend), gather=False)
    crit = dpool.criterion(nn.MSELoss())
    for n in (6, 3):  # a new size after the first: kept outputs keep their graph, compiled without donation
        x, y = torch.randn(n, 10), torch.randn(n, 4)
        crit(kept(x), y).backward()
        nn.MSELoss()(ref_c(x), y).backward()
        for p, q in zip(kept.module.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
            p.grad = q.grad = None


def test_backward_with_the_loss_gives_the_backward_rounds_numbers(wrap):
    """A criterion's workers run loss.backward()'s backward in the loss round when they can tell its gradient
    in advance (one round per step less). Against a pool that backpropagates in rounds of its own
    (backward_with_loss=False): bitwise the same gradients and parameters, step after step, through every way
    back to the backward round (a scaled loss, two losses, retain_graph, no_sync, a loss never backpropagated,
    an unpredictable loss) and with an elementwise loss; against one process: the same numbers. stats() counts the rounds saved, so each
    path is known to have been taken."""
    torch.manual_seed(0)
    net = models.MLP(d_out=4).double()
    plain, ref = copy.deepcopy(net), copy.deepcopy(net)
    fast = wrap(net, ["cpu"] * 3, gather=False)
    slow = wrap(plain, ["cpu"] * 3, gather=False)
    weight = torch.tensor([1.0, 3.0, 0.5, 2.0], dtype=torch.float64)
    losses = {"mean": nn.CrossEntropyLoss(weight=weight, ignore_index=2),  # per-shard denominators
              "sum": nn.CrossEntropyLoss(reduction="sum"), "mse": nn.MSELoss(),  # mse: elements of the output
              "soft": nn.CrossEntropyLoss(),  # with class probabilities: not predicted
              "ce": nn.CrossEntropyLoss(),  # every target counts: the number of targets, predicted
              "ignore": nn.CrossEntropyLoss(ignore_index=2)}  # some targets ignored: counted once a round showed it
    crits = [{k: dpool.criterion(v, backward_with_loss=b) for k, v in losses.items()} for b in (True, False)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (net, plain, ref)]

    def saved():
        assert slow.stats()["backward_rounds_saved"] == 0
        return fast.stats()["backward_rounds_saved"]

    def step(kind, expect_saved):
        x = torch.randn(10, 12, dtype=torch.float64)  # 10 rows on 3 workers: shards of 4, 3, 3
        y, y2 = torch.randint(0, 4, (10,)), torch.randn(10, 4, dtype=torch.float64)
        y3 = torch.softmax(torch.randn(10, 4, dtype=torch.float64), dim=1)
        y4 = y.clone()
        y4[[0, 5]] = 2  # ignored, on two shards
        before = saved()
        xs = [x.clone().requires_grad_(kind == "input_grad") for _ in range(3)]
        for xi, model, crit in zip(xs, (fast, slow, ref), (*crits, None)):
            loss_of = (lambda name, out, t: crit[name](out, t)) if crit else (lambda name, out, t: losses[name](out, t))
            if kind == "no_sync" and crit:
                with model.no_sync():
                    loss_of("mean", model(xi), y).backward()
            elif kind == "no_sync":
                loss_of("mean", model(xi), y).backward()
            out = model(xi)
            if kind == "scaled":
                (loss_of("mean", out, y) * 0.5).backward()
            elif kind == "two_losses":
                (loss_of("mean", out, y) + loss_of("sum", out, y)).backward()
            elif kind == "retain_graph":
                loss = loss_of("sum", out, y)
                loss.backward(retain_graph=True)
                loss.backward()
            elif kind == "unused":
                loss_of("mean", out, y)  # computed with grad enabled, never backpropagated
                loss_of("mean", model(xi), y).backward()
            elif kind == "mse":
                loss_of("mse", out, y2).backward()
            elif kind == "soft":
                loss_of("soft", out, y3).backward()
            elif kind == "ce":
                loss_of("ce", out, y).backward()
            elif kind == "ignored":
                loss_of("ignore", out, y4).backward()
            elif kind == "frozen_between":  # a forward that freezes a parameter zeroes its slot on the workers
                loss = loss_of("mean", out, y)
                w0 = dict(zip((fast, slow, ref), (net, plain, ref)))[model].net[0].weight
                w0.requires_grad_(False)
                model(xi)
                w0.requires_grad_(True)
                model(xi)  # the replicas take the flag back before the backward, as the master has it
                loss.backward()
            else:
                loss_of("mean", out, y).backward()
        assert saved() - before == expect_saved, kind
        for p, q, r in zip(net.parameters(), plain.parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad), kind
            torch.testing.assert_close(p.grad, r.grad)
        if kind == "input_grad":
            assert torch.equal(xs[0].grad, xs[1].grad)
            torch.testing.assert_close(xs[0].grad, xs[2].grad)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for p, q in zip(net.parameters(), plain.parameters()):
            assert torch.equal(p, q), kind

    step("plain", 1)
    step("plain", 1)
    step("scaled", 0)  # its backward ran with the loss, unused: the round runs it again, same numbers
    step("plain", 0)  # off after the miss; this backward would have used it, so it is on again
    step("plain", 1)
    step("two_losses", 1)  # the second loss's backward overwrote the first's slots: only one is used
    step("retain_graph", 1)  # the second backward of the same loss runs a round of its own
    step("input_grad", 1)
    step("no_sync", 0)  # nothing runs early inside no_sync(), nor while the workers hold its gradients
    step("plain", 1)
    step("unused", 0)  # a loss never backpropagated turns it off until a backward would have used it
    step("plain", 1)
    step("mse", 1)
    step("soft", 0)
    step("plain", 1)
    step("frozen_between", 0)
    step("ce", 1)
    step("ignored", 0)  # predicted with every target counted; the shards' denominators said otherwise
    step("ignored", 1)  # counted before the round from then on
    step("plain", 1)


class _BackwardFailsIf(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, fail):
        ctx.fail = fail
        return y.clone()

    @staticmethod
    def backward(ctx, g):
        if ctx.fail:
            raise ArithmeticError("backward exploded")
        return g, None


class FailsInForward(nn.Module):
    """Its forward raises on a shard whose first column holds a value over 100."""

    def __init__(self):
        super().__init__()
        self.net = models.MLP(d_in=4, d_out=3)

    def forward(self, x):
        if bool((x[:, 0] > 100).any()):
            raise ValueError("forward exploded")
        return self.net(x)


def test_an_unused_forward_that_fails_names_itself_in_the_next_calls_error(wrap):
    """With gather=False, a model(x) whose output never gets a loss runs at the next call. If it fails there, the
    error says it is that earlier forward (the call that raises is fine); the pool trains on, as one process."""
    torch.manual_seed(0)
    net = FailsInForward()
    ref = copy.deepcopy(net)
    model = wrap(net, gather=False)
    crit, ce = dpool.criterion(nn.CrossEntropyLoss()), nn.CrossEntropyLoss()
    bad = torch.randn(8, 4)
    bad[6, 0] = 1000.0  # shard 1
    model(bad)  # nothing runs yet, and its output is dropped
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    with pytest.raises(ValueError, match=r"forward of an earlier model\(x\) call, which with gather=False waited for "
                                         r"its loss and ran only now, before this call \(shard 1\) .*forward exploded"
                       ) as info:
        model(x)
    assert info.value.worker == 1
    crit(model(x), y).backward()
    ce(ref(x), y).backward()
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_a_forward_goes_to_the_workers_with_its_loss(wrap, monkeypatch):
    """With gather=False, model(x) waits for its loss and the workers get the forward and the loss in one
    request (stats() counts the rounds saved). Against one process, step after step: plain steps, two forwards
    before their losses, a gathered output, a forward whose loss is never taken. The forward's error comes from
    the criterion, as the forward's; a parameter changed in place before the loss is refused; the pool trains on
    after both. DPOOL_FORWARD_WITH_LOSS=off runs every forward at once, with the same numbers."""
    torch.manual_seed(0)
    net = FailsInForward()
    ref, plain = copy.deepcopy(net), copy.deepcopy(net)
    model = wrap(net, gather=False)
    monkeypatch.setenv("DPOOL_FORWARD_WITH_LOSS", "off")
    eager = wrap(plain, gather=False)
    monkeypatch.setenv("DPOOL_FORWARD_WITH_LOSS", "sometimes")
    with pytest.raises(ValueError, match="DPOOL_FORWARD_WITH_LOSS='sometimes' is not a policy"):
        wrap(copy.deepcopy(net))
    monkeypatch.delenv("DPOOL_FORWARD_WITH_LOSS")
    ce = nn.CrossEntropyLoss()
    crit = dpool.criterion(ce)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (net, plain, ref)]

    def step(kind):
        n = 200_000 if kind == "big" else 10  # big: outputs larger than their segment, fetched before the loss
        x, x2 = torch.randn(n, 4), torch.randn(6, 4)
        y, y2 = torch.randint(0, 3, (n,)), torch.randint(0, 3, (6,))
        for m, opt in zip((model, eager, ref), opts):
            loss_of = ce if m is ref else crit
            opt.zero_grad()
            if kind == "two_forwards":
                out, out2 = m(x), m(x2)
                (loss_of(out2, y2) + loss_of(out, y)).backward()
            elif kind == "gathered":
                out = m(x)
                got = out if m is ref else out.gather()
                torch.testing.assert_close(got, ref.net(x))
                ce(got, y).backward()
            elif kind == "unused":
                m(x2)  # never used: it runs when the next call comes
                loss_of(m(x), y).backward()
            else:
                loss_of(m(x), y).backward()
            opt.step()
        for p, q, r in zip(net.parameters(), plain.parameters(), ref.parameters()):
            assert torch.equal(p, q), kind
            torch.testing.assert_close(p, r)

    for kind in ("plain", "plain", "two_forwards", "gathered", "unused", "big", "plain"):
        before = model.stats()["forward_rounds_saved"]
        step(kind)
        saved = model.stats()["forward_rounds_saved"] - before
        assert saved == (kind != "gathered"), (kind, saved)
    assert model.stats()["forward_rounds_saved"] == 6
    assert eager.stats()["forward_rounds_saved"] == 0

    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    bad, y_bad = torch.randn(400_000, 4), torch.randint(0, 3, (400_000,))  # the targets need a new segment
    bad[300_000, 0] = 1000.0  # shard 1
    out = model(bad)  # deferred: nothing ran yet
    with pytest.raises(ValueError, match="forward exploded") as info:
        crit(out, y_bad)
    assert info.value.worker == 1 and "forward" in str(info.value)
    with pytest.raises(RuntimeError, match="no longer on the workers"):
        crit(out, y_bad)
    out = model(x)
    with torch.no_grad():
        net.net.net[0].weight.add_(1.0)  # an optimizer step before the loss
    with pytest.raises(dpool.ModelChangedError, match=r"net\.net\.0\.weight .*changed in place after model\(x\)"):
        crit(out, y)
    out = model(x)
    with torch.no_grad():
        net.net.net[0].bias.add_(1.0)
    model(x)  # runs nothing of the first: it did not run, and its output says so when used
    with pytest.raises(dpool.ModelChangedError, match=r"net\.net\.0\.bias .*it did not run"):
        out.gather()
    small = x.clone()
    small[6, 0] = 1000.0  # shard 1
    with pytest.raises(ValueError, match="forward exploded"):
        eager(small)  # off: at once
    for m in (model, eager):
        crit(m(x), y).backward()
    assert model.stats()["forward_rounds_saved"] == 7
    assert all(p.grad is not None for p in model.parameters())


class FailsInBackward(nn.Module):
    """Its backward raises on a shard whose first column holds a value over 100."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return _BackwardFailsIf.apply(self.lin(x), bool((x[:, 0] > 100).any()))


def test_error_in_the_backward_with_the_loss_is_raised_by_loss_backward(wrap):
    """The backward the workers run with the loss fails on one shard: the loss still comes back, and
    loss.backward() runs the backward round, which raises the model's error, master untouched; the next
    step runs the backward with the loss again."""
    model = wrap(FailsInBackward(), gather=False)
    crit = dpool.criterion(nn.CrossEntropyLoss())
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    x[5, 0] = 1000.0  # shard 1
    loss = crit(model(x), y)
    with pytest.raises(ArithmeticError, match="backward exploded") as info:
        loss.backward()
    assert info.value.worker == 1
    assert all(p.grad is None for p in model.parameters())
    assert model.stats()["backward_rounds_saved"] == 0
    crit(model(torch.randn(8, 4)), y).backward()
    assert model.stats()["backward_rounds_saved"] == 1
    assert all(p.grad is not None for p in model.parameters())
