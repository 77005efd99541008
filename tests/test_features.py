"""Beyond DataParallel: checkpoints, autocast dtype, buffer policies, balanced shards, synchronized BatchNorm, stats,
logging and torch.compile (no_sync and the loss on the workers have files of their own)."""
from __future__ import annotations

import copy
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
