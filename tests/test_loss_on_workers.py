"""The loss on the workers (gather=False, dpool.criterion): the full batch's loss and gradients for every torch
loss or a clear error, criteria that change or keep state, and one round a step with the forward sent with its
loss."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import dpool
from tests import models


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
