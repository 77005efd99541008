"""no_sync(): gradients held on the workers during accumulation equal plain accumulation in one process, with
fewer rows than workers, loss terms and hooks on the master, sparse gradients, zero_grad and frozen parameters."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import dpool
from tests import models


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
