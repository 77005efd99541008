"""CUDA workers against a single-process CUDA reference, on a real GPU.

With one GPU the workers run as ``device_ids=[0, 0]`` (two worker processes on GPU 0), which
drives the whole CUDA IPC protocol; ``dpool.step.replicas.ALIAS_SAME_GPU = False`` forces the copy path that workers on
other GPUs take. Paths that need two distinct GPUs (cross-device reduce, peer copies) are tested
only where two exist. On a machine without a GPU every test here is skipped.
"""
from __future__ import annotations

import copy
import gc
import os
import signal
import types

import pytest
import torch
from torch import nn
import torch.nn.functional as F

import dpool
from dpool.step import replicas as step_replicas
from dpool.transport import cuda_ipc
from tests.helpers import run_scripts, running
from tests.models import CNN, MLP, batch, gpu_numerics, loss_of, make
from tests.reference import per_shard

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (one is enough: [0, 0])")

DEV = "cuda:0"
IDS = [0, 0]
TOL = dict(rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module", autouse=True)
def cuda_started():
    """One wrap/close cycle first: CUDA's driver opens its files (/dev/nvidia*, eventfds, an IPC
    shm file) once per process, at first use; the per-test leak check must not count those."""
    with dpool.wrap(MLP().to(DEV), IDS) as model:
        model(torch.randn(4, 12, device=DEV)).sum().backward()
    yield


@pytest.fixture(autouse=True)
def deterministic():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def _gpu_memory() -> tuple[int, int]:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(0), torch.cuda.memory_reserved(0)


def test_gpu_memory_back_at_baseline_after_close():
    """Arenas, grown regions included, are freed at close(): every export's counter released once."""
    def run() -> None:
        net = MLP().to(DEV)
        model = dpool.wrap(net, IDS)
        for rows in (8, 200_000, 8):
            model(torch.randn(rows, 12, device=DEV)).sum().backward()
        model.close()

    base = _gpu_memory()
    exports, releases = cuda_ipc.STATS["exports"], cuda_ipc.STATS["releases"]
    run()
    assert _gpu_memory() == base
    assert cuda_ipc.STATS["exports"] - exports == cuda_ipc.STATS["releases"] - releases > 0


def _per_shard_buffers(module: nn.Module, x: torch.Tensor, k: int, policy: str) -> dict[str, torch.Tensor]:
    """The master's buffers after one training forward under ``policy``, computed in one process."""
    start = {n: b.detach().clone() for n, b in module.named_buffers()}
    params = dict(module.named_parameters())
    shards = x.chunk(k)
    after = []
    for xs in shards:
        bufs = {n: b.clone() for n, b in start.items()}
        torch.func.functional_call(module, {**params, **bufs}, (xs,))
        after.append(bufs)
    if policy == "first":
        return after[0]
    if policy == "sync":
        bufs = {n: b.clone() for n, b in start.items()}
        torch.func.functional_call(module, {**params, **bufs}, (x,))
        return bufs
    rows = [xs.shape[0] / x.shape[0] for xs in shards]
    return {n: (sum(a[n] * r for a, r in zip(after, rows)) if start[n].is_floating_point() else after[0][n])
            for n in start}


def _reference_step(ref: nn.Module, x: torch.Tensor, y: torch.Tensor, k: int) -> torch.Tensor:
    """nn.DataParallel's forward in one process: each shard from the same buffers, outputs concatenated."""
    start = {n: b.detach().clone() for n, b in ref.named_buffers()}
    params = dict(ref.named_parameters())
    outs = [torch.func.functional_call(ref, {**params, **{n: b.clone() for n, b in start.items()}}, (xs,))
            for xs in x.chunk(k)]
    return torch.cat(outs)


_TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (cross-device reduce, peer copies)")


@pytest.mark.parametrize("ids", [IDS, pytest.param([0, 1], marks=_TWO_GPUS), pytest.param([0, 1, 1], marks=_TWO_GPUS)],
                         ids=["0,0", "0,1", "0,1,1"])
@pytest.mark.parametrize("policy", ["first", "average", "sync"])
def test_training_matches_single_process_reference(policy, ids, wrap):
    """Also, where two GPUs exist: replicas on another GPU (copied parameters, gradients reduced
    across devices, some workers sharing a GPU) train like one process."""
    torch.manual_seed(0)
    net = CNN().to(DEV)
    ref = copy.deepcopy(net)
    model = wrap(net, ids, buffers=policy)
    assert model.output_device == torch.device(DEV)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    k = len(ids)
    rows = 16 - 16 % k  # equal shards, so that torch.chunk splits as dpool does
    for step in range(3):
        x = torch.randn(rows, 3, 8, 8, device=DEV)
        y = torch.randint(0, 5, (rows,), device=DEV)
        want_buffers = _per_shard_buffers(ref, x, k, policy)
        out = model(x)
        want = _reference_step(ref, x, y, k)
        assert out.device == torch.device(DEV)
        torch.testing.assert_close(out, want, **TOL)
        F.cross_entropy(out, y).backward()
        F.cross_entropy(want, y).backward()
        for (name, p), q in zip(net.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **TOL, msg=f"grad of {name}, step {step}")
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
        with torch.no_grad():
            for n, b in ref.named_buffers():
                b.copy_(want_buffers[n])
        for (name, b), c in zip(net.named_buffers(), ref.buffers()):
            if policy == "sync" and name.startswith("bn2"):
                continue  # "sync" is exact for a BatchNorm whose input does not depend on an earlier one
            torch.testing.assert_close(b, c, **TOL, msg=f"buffer {name}, step {step}")
        if policy == "sync":
            with torch.no_grad():
                for b, c in zip(net.buffers(), ref.buffers()):
                    c.copy_(b)
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, **TOL)
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], ref_opt.state[q]["momentum_buffer"], **TOL)


def test_a_parameter_frozen_when_the_pool_starts_and_unfrozen_later(wrap):
    """Fine-tuning with a frozen layer: GPU workers hook every parameter (frozen ones included, which torch
    refuses unless the flag is on while hooking: the pool once failed to start), and a parameter unfrozen
    later gets its gradient, as in one process."""
    torch.manual_seed(0)
    net = MLP().to(DEV)
    first = next(net.parameters())
    first.requires_grad_(False)
    ref = copy.deepcopy(net)
    model = wrap(net, IDS)
    for step in range(2):
        if step == 1:
            first.requires_grad_(True)
            next(ref.parameters()).requires_grad_(True)
        x = torch.randn(8, 12, device=DEV)
        model(x).pow(2).mean().backward()
        per_shard(ref, (x,), {}, 2, 8).pow(2).mean().backward()
        assert (first.grad is not None) == (step == 1)
        for (name, p), q in zip(net.named_parameters(), ref.parameters()):
            if q.grad is None:
                assert p.grad is None, name
            else:
                torch.testing.assert_close(p.grad, q.grad, **TOL, msg=f"grad of {name}, step {step}")
            p.grad = q.grad = None


def test_copy_path_for_workers_off_the_master_gpu(wrap, monkeypatch):
    """Workers on another GPU get the master's parameters copied before each forward (forced here on one GPU)."""
    monkeypatch.setattr(step_replicas, "ALIAS_SAME_GPU", False)
    torch.manual_seed(1)
    net = MLP().to(DEV)
    ref = copy.deepcopy(net)
    model = wrap(net, IDS)
    assert model._runtime.replicas.memory.arenas[0] is not None
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for _ in range(3):
        x = torch.randn(10, 12, device=DEV)
        out, want = model(x), ref(x)
        torch.testing.assert_close(out, want, **TOL)
        out.square().mean().backward()
        want.square().mean().backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, **TOL)


@pytest.mark.parametrize("where", ["cpu", "pinned", "cuda"])
def test_inputs_from_anywhere_and_output_device(where, wrap):
    torch.manual_seed(2)
    net = MLP().to(DEV)
    ref = copy.deepcopy(net)
    model = wrap(net, IDS, output_device="cpu" if where == "cpu" else None)
    x = torch.randn(9, 12)
    x = x.pin_memory() if where == "pinned" else x.to(DEV) if where == "cuda" else x
    x.requires_grad_(True)
    out = model(x)
    assert out.device == (torch.device("cpu") if where == "cpu" else torch.device(DEV))
    xr = x.detach().to(DEV).requires_grad_(True)
    want = ref(xr)
    torch.testing.assert_close(out.to(DEV), want, **TOL)
    out.sum().backward()
    want.sum().backward()
    assert x.grad.device == x.device  # input gradients come back to the input's device, as with DataParallel
    torch.testing.assert_close(x.grad.to(DEV), xr.grad, **TOL)
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL)


def test_structures_no_grad_inference_and_autocast(wrap):
    torch.manual_seed(3)
    net = MLP().to(DEV)
    ref = copy.deepcopy(net)
    model = wrap(net, IDS)
    x = torch.randn(8, 12, device=DEV)
    with torch.no_grad():
        out = model(x)
        assert not out.requires_grad
        torch.testing.assert_close(out, ref(x), **TOL)
    with torch.inference_mode():
        torch.testing.assert_close(model(x), ref(x), **TOL)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, want = model(x), ref(x)
    assert out.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
    out.float().sum().backward()
    want.float().sum().backward()
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=2e-2)


def test_loss_on_workers_no_sync_and_worker_states(wrap):
    torch.manual_seed(4)
    net = MLP(d_out=5).to(DEV)
    ref = copy.deepcopy(net)
    model = wrap(net, IDS, gather=False)
    crit = dpool.criterion(nn.CrossEntropyLoss())
    xs = [torch.randn(12, 12, device=DEV) for _ in range(3)]
    ys = [torch.randint(0, 5, (12,), device=DEV) for _ in range(3)]
    with model.no_sync():
        for x, y in zip(xs[:2], ys[:2]):
            loss = crit(model(x), y)
            loss.backward()
            F.cross_entropy(ref(x), y).backward()
        assert not any(p.grad.any() for p in net.parameters())  # kept on the workers: zero markers here
    loss = crit(model(xs[2]), ys[2])
    want = F.cross_entropy(ref(xs[2]), ys[2])
    assert loss.device == torch.device(DEV)
    torch.testing.assert_close(loss, want, **TOL)
    loss.backward()
    want.backward()
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL)
    devices = model.worker_states(lambda m: (str(next(m.parameters()).device), os.environ["CUDA_VISIBLE_DEVICES"]))
    assert devices == [("cuda:0", "0"), ("cuda:0", "0")]


@pytest.mark.filterwarnings("ignore:Using backward.. with create_graph=True")  # torch's advice, both sides
def test_no_sync_small_micro_batches_zero_grad_and_create_graph_on_gpu_workers(wrap):
    """no_sync() on GPU workers, whose held gradients live in the slot (the post-accumulate hook), not in
    .grad: a last micro-batch of 1 row (one worker's shard; the other only adds what it holds), a
    zero_grad() before a 1-row micro-batch, and a create_graph=True backward that ends the accumulation,
    each against one process (session 37's fixes, written for CPU workers)."""
    torch.manual_seed(5)
    net = MLP(d_out=4).to(DEV)
    ref = copy.deepcopy(net)
    model = wrap(net, IDS)
    xs = [torch.randn(r, 12, device=DEV) for r in (8, 1, 8, 1, 8)]

    def check(what):
        for (name, p), q in zip(net.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **TOL, msg=lambda m: f"{what}, {name}: {m}")
        net.zero_grad()
        ref.zero_grad()

    with model.no_sync():
        model(xs[0]).pow(2).sum().backward()
    model(xs[1]).pow(2).sum().backward()
    for x in xs[:2]:
        ref(x).pow(2).sum().backward()
    check("a last micro-batch of 1 row")
    with model.no_sync():
        model(xs[2]).pow(2).sum().backward()
        net.zero_grad()
        model(xs[3]).pow(2).sum().backward()
    model(xs[4]).pow(2).sum().backward()
    for x in xs[3:]:
        ref(x).pow(2).sum().backward()
    check("zero_grad() before a micro-batch of 1 row")
    with model.no_sync():
        model(xs[0]).pow(2).sum().backward()
    model(xs[2]).pow(2).sum().backward(create_graph=True)
    ref(xs[0]).pow(2).sum().backward()  # (held: no graph, in one process as on the workers)
    ref(xs[2]).pow(2).sum().backward(create_graph=True)
    for m in (net, ref):
        sum(p.grad.pow(2).sum() for p in m.parameters()).backward()
    check("a create_graph backward ending the accumulation, and a penalty on its gradients")


class _GpuDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(256, 256)

    def forward(self, x):
        return F.dropout(torch.ones_like(x), 0.5) + 0 * self.lin(x)


def test_each_gpu_shard_draws_its_own_random_numbers(wrap):
    """Every process's CUDA generator starts from the same constant, and only the CPU's was seeded per
    shard: two GPU workers drew the same dropout masks for their shards. Now each shard seeds the GPU's
    too, from the forward's draw: masks differ between the shards and repeat under the same seed."""
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        model = wrap(_GpuDropout().to(DEV), IDS)
        runs.append(torch.cat([model(torch.zeros(2, 256, device=DEV)).detach() for _ in range(2)]))
        model.close()
    a, b = runs
    assert not torch.equal(a[0], a[1]), "the two shards drew the same dropout mask"
    assert not torch.equal(a[0], a[2])  # each forward draws new masks
    assert torch.equal(a, b)  # and the same seed repeats them


class _HoldsThings(nn.Module):
    """A forward that reads what the model holds outside its parameters: a config object, a list, a dict
    with a GPU tensor, a list with a view of the weight, and a GPU buffer that grows in the first forward."""

    def __init__(self, grow: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.config = types.SimpleNamespace(scale=1.0, act="tanh")
        self.gains = [1.0]
        self.masks = {"keep": torch.ones(6)}
        self.views = [self.lin.weight.detach()]
        self.register_buffer("seen", torch.zeros(0 if grow else 6))

    def forward(self, x):
        if not self.seen.numel():
            self.seen.resize_(x.shape[1])
        h = getattr(torch, self.config.act)(self.lin(x)) * self.config.scale * self.gains[0]
        return h * self.masks["keep"] + x @ self.views[0]


def test_objects_the_model_holds_and_resized_buffers_on_gpu_workers(wrap):
    """Objects the model holds, changed in place after wrap() (a config value, a list entry, a GPU tensor in a
    dict changed in place and replaced), reach GPU workers as they reach CPU ones; a list holding a view of
    the weight follows the optimizer; and a GPU buffer resized by the forward is the error naming it."""
    torch.manual_seed(0)
    net = _HoldsThings().double().to(DEV)
    ref = copy.deepcopy(net)
    for m in (net, ref):
        m.views = [m.lin.weight.detach()]
        m.masks = {"keep": torch.ones(6, dtype=torch.float64, device=DEV)}
    model = wrap(net, IDS)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    changes = [
        None,
        lambda m: setattr(m.config, "scale", 0.5),
        lambda m: setattr(m.config, "act", "sigmoid"),
        lambda m: m.gains.__setitem__(0, 2.0),
        lambda m: m.masks["keep"].__setitem__(2, 0.0),
        lambda m: m.masks.__setitem__("keep", torch.full((6,), 0.5, dtype=torch.float64, device=DEV)),
        None,
    ]
    g = torch.Generator(device=DEV).manual_seed(1)
    for i, change in enumerate(changes):
        if change is not None:
            change(net)
            change(ref)
        x = torch.randn(8, 6, generator=g, dtype=torch.float64, device=DEV)
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            F.mse_loss(m(x), torch.ones_like(x)).backward()
            o.step()
        with torch.no_grad():
            torch.testing.assert_close(model(x), ref(x), msg=f"change {i}")
    torch.testing.assert_close(net.lin.weight, ref.lin.weight)
    model.close()
    assert net.views[0].data_ptr() == net.lin.weight.data_ptr()

    net = _HoldsThings(grow=True).to(DEV)
    net.views = [net.lin.weight.detach()]  # (the one __init__ made is of the CPU weight: .to() leaves it)
    net.masks = {"keep": torch.ones(6, device=DEV)}
    model = wrap(net, IDS)
    with pytest.raises(RuntimeError, match=r"resized a parameter or buffer in place.*seen\..*"
                                           r"one forward on the plain module before dpool\.wrap\(\)"):
        model(torch.randn(4, 6, device=DEV))


def test_buffers_assigned_by_the_forward_or_updated_by_a_backward_hook_on_gpu_workers(wrap):
    """The GPU half of tests/test_model_changes.py's two buffer tests: a persistent buffer the forward
    assigns a new tensor, and one a backward hook updates in place, reach the master of one GPU worker as
    in one process, and of two by the "first" policy."""
    from tests.test_model_changes import _AssignsBuffers, _BackwardHookStat

    for cls in (_AssignsBuffers, _BackwardHookStat):
        torch.manual_seed(0)
        net = cls().to(DEV)
        ref = copy.deepcopy(net)
        model = wrap(net, [0])
        args = (5,) if cls is _AssignsBuffers else ()
        for _ in range(3):
            x = torch.randn(8, 3, dtype=torch.float64, device=DEV)
            model(x, *args).pow(2).sum().backward()
            ref(x, *args).pow(2).sum().backward()
        for (name, t), r in zip(net.state_dict().items(), ref.state_dict().values()):
            torch.testing.assert_close(t, r, msg=lambda m: f"{cls.__name__}.{name}: {m}")
        model.close()

        net = cls().to(DEV)
        model = wrap(net, IDS)
        x = torch.randn(8, 3, dtype=torch.float64, device=DEV)
        first = copy.deepcopy(net)
        first(x[:4], *args).pow(2).sum().backward()
        model(x, *args).pow(2).sum().backward()
        for (name, t), r in zip(net.state_dict().items(), first.state_dict().values()):
            if name != "lin.weight" and name != "lin.bias":
                torch.testing.assert_close(t, r, msg=lambda m: f"{cls.__name__}.{name}, two workers: {m}")
        model.close()


def test_ipc_work_happens_once_not_per_step(wrap):
    """Exports and imports happen at wrap() and when a buffer grows, never in a steady-state step."""
    net = MLP().to(DEV)
    model = wrap(net, IDS)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)

    def step(rows: int) -> None:
        model(torch.randn(rows, 12, device=DEV)).sum().backward()
        opt.step()
        opt.zero_grad()

    step(8)
    exports = cuda_ipc.STATS["exports"]
    imports = model.worker_states(lambda m: __import__("dpool.transport.cuda_ipc").
                                  transport.cuda_ipc.STATS["imports"])
    for _ in range(20):
        step(8)
    assert cuda_ipc.STATS["exports"] == exports
    assert model.worker_states(lambda m: __import__("dpool.transport.cuda_ipc").transport.cuda_ipc.STATS["imports"]) == imports
    step(200_000)  # 4.8 MB of input per shard: the input region (1 MiB) grows once per worker
    grown = cuda_ipc.STATS["exports"] - exports
    assert grown >= 2
    after = model.worker_states(lambda m: __import__("dpool.transport.cuda_ipc").transport.cuda_ipc.STATS["imports"])
    assert [a - b for a, b in zip(after, imports)] == [grown // 2] * 2
    for _ in range(3):
        step(200_000)
    assert cuda_ipc.STATS["exports"] - exports == grown


@pytest.mark.parametrize("name", ["dict", "lstm"])
def test_scatter_gather_structures(name, wrap):
    """Dict/tuple inputs, keyword and non-tensor arguments, structured outputs, integer tokens: as
    DataParallel's scatter and gather, computed in one process."""
    net = make(name, torch.float32).to(DEV)
    ref = copy.deepcopy(net)
    model = wrap(net, IDS)
    args, kwargs = batch(name, 9, torch.float32)
    args, kwargs = _to(args, DEV), _to(kwargs, DEV)
    out = model(*args, **kwargs)
    want = per_shard(ref, args, kwargs, 2, 9)
    torch.testing.assert_close(out, want, **TOL)
    loss_of(name, out).backward()
    loss_of(name, want).backward()
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL)


def _to(obj, dev):
    if isinstance(obj, torch.Tensor):
        return obj.to(dev)
    if isinstance(obj, tuple):
        return tuple(_to(o, dev) for o in obj)
    if isinstance(obj, dict):
        return {k: _to(v, dev) for k, v in obj.items()}
    return obj


def test_shard_weights_and_balance(wrap):
    torch.manual_seed(7)
    net = MLP().to(DEV)
    ref = copy.deepcopy(net)
    model = wrap(net, IDS, shard_weights=[3, 1])
    x = torch.randn(12, 12, device=DEV)
    out = model(x)
    assert model.stats()["shard_rows"] == [9, 3]
    torch.testing.assert_close(out, ref(x), **TOL)
    out.sum().backward()
    ref(x).sum().backward()
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL)


def test_workers_follow_tf32_and_cudnn_settings(wrap):
    """Replicas compute with the coordinator's TF32/cuDNN settings, as DataParallel's threads do."""
    model = wrap(MLP().to(DEV), IDS)
    for tf32 in (True, False):
        torch.backends.cudnn.allow_tf32 = tf32
        torch.set_float32_matmul_precision("high" if tf32 else "highest")
        model(torch.randn(4, 12, device=DEV))
        seen = model.worker_states(gpu_numerics)
        assert seen == [(tf32, "high" if tf32 else "highest")] * 2
    # torch's newer per-operation API: using it made the legacy getters dpool read raise at every forward
    from dpool.numerics import CUDA_PRECISION_OPS, fp32_precision, precision_state, set_precision_state

    saved = precision_state()
    try:
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        torch.backends.cudnn.conv.fp32_precision = "ieee"
        model(torch.randn(4, 12, device=DEV))
        assert model.worker_states(lambda r: fp32_precision(CUDA_PRECISION_OPS)) == \
            [fp32_precision(CUDA_PRECISION_OPS)] * 2
    finally:
        set_precision_state(saved)


def test_master_on_another_device_is_refused():
    net = MLP()
    with pytest.raises(ValueError, match=r"module must have its parameters and buffers on device cuda:0.*"
                                         r"module.to\('cuda:0'\)"):
        dpool.wrap(net, IDS)
    with pytest.raises(ValueError, match="mix CPU and GPU"):
        dpool.wrap(net.to(DEV), ["cpu", 0])
    with pytest.raises(ValueError, match="does not exist"):
        dpool.wrap(net.to(DEV), [0, torch.cuda.device_count()])


@pytest.mark.parametrize("convert", ["dpool", "torch"])
def test_sync_batchnorm_on_gpu_workers(wrap, convert):
    """dpool.SyncBatchNorm normalises every shard with whole-batch statistics: a plain BatchNorm's result.
    So does torch's nn.SyncBatchNorm, which the workers run as dpool's (they have no process group)."""
    torch.manual_seed(5)
    ref = CNN().to(DEV)
    if convert == "dpool":
        net = dpool.convert_sync_batchnorm(copy.deepcopy(ref))
    else:
        net = nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(ref))
    model = wrap(net, IDS)
    x = torch.randn(16, 3, 8, 8, device=DEV)
    out, want = model(x), ref(x)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    out.pow(3).sum().backward()
    want.pow(3).sum().backward()
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-4)
    for b, c in zip(net.buffers(), ref.buffers()):
        torch.testing.assert_close(b, c, rtol=1e-4, atol=1e-5)


def test_restart_after_worker_death_and_checkpoint(wrap):
    torch.manual_seed(6)
    net = MLP().to(DEV)
    model = wrap(net, IDS, max_restarts=1)
    x = torch.randn(8, 12, device=DEV)
    before = model(x).detach()
    pid = model.stats()["workers"][1]["pid"]
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(dpool.WorkerDiedError, match=r"worker 1 \(cuda:0, pid"):
        model(x)
    torch.testing.assert_close(model(x), before)
    sd = model.state_dict()
    assert all(k.startswith("module.") and v.device == torch.device(DEV) for k, v in sd.items())
    model.load_state_dict(sd)
    torch.testing.assert_close(model(x), before)


def test_preflight_refuses_a_gpu_without_room_for_the_workers():
    """Run alone (it takes nearly all of the GPU): a clear error before any worker starts."""
    base = _gpu_memory()
    free, _ = torch.cuda.mem_get_info(0)
    hog = torch.empty(free - (200 << 20), dtype=torch.uint8, device=DEV)  # 200 MiB left: less than two contexts
    try:
        with pytest.raises(dpool.WorkerStartError, match=r"not enough free GPU memory.*cuda:0 has .*2 worker\(s\)"):
            dpool.wrap(MLP().to(DEV), IDS)
    finally:
        del hog
    assert _gpu_memory() == base


# ---------------------------------------------------------------------- the dpool-workers daemon on a GPU
DAEMON_CLIENT_DIES = """
import os, signal, torch, dpool
from tests.models import MLP
model = dpool.wrap(MLP().cuda(), pool=%r)
model(torch.randn(8, 12, device="cuda")).sum().backward()
print("PID", os.getpid(), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_daemon_gpu_workers():
    """``dpool-workers start --device-ids 0,0``: attached training equals a single-process reference;
    close() and a client's SIGKILL give every GPU byte back, and the next client trains."""
    import uuid

    from tests.conftest import wait_for
    from tests.helpers import run_script
    import json
    import subprocess

    from dpool.launch import worker_command

    def cli(*args: str) -> subprocess.CompletedProcess:  # dpool-workers, installed or not (a GPU box's checkout)
        return subprocess.run(worker_command("cli", *args), capture_output=True, text=True, timeout=120)

    def status(name: str) -> dict:
        return json.loads(cli("status", "--name", name, "--json").stdout)

    name = "g" + uuid.uuid4().hex[:8]
    res = cli("start", "--name", name, "--device-ids", "0,0")
    assert res.returncode == 0, res.stderr
    info = status(name)
    pids = [info["pid"]] + [w["pid"] for w in info["workers"]]
    try:
        assert [(w["device"], w["visible"]) for w in info["workers"]] == [("cuda:0", "0")] * 2

        def train() -> None:
            torch.manual_seed(4)
            net = MLP().to(DEV)
            ref = copy.deepcopy(net)
            model = dpool.wrap(net, pool=name)
            assert model.device_ids == ["cuda:0", "cuda:0"] and len(set(model.pids)) == 2
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
            for rows in (8, 13, 8):
                x = torch.randn(rows, 12, device=DEV)
                out, want = model(x), ref(x)
                torch.testing.assert_close(out, want, **TOL)
                out.pow(2).mean().backward()
                want.pow(2).mean().backward()
                for p, q in zip(net.parameters(), ref.parameters()):
                    torch.testing.assert_close(p.grad, q.grad, **TOL)
                opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
            for p, q in zip(net.parameters(), ref.parameters()):
                torch.testing.assert_close(p, q, **TOL)
            model.close()

        ref = MLP().to(DEV)  # the reference's first matmuls here allocate cuBLAS workspaces we keep
        ref(torch.randn(4, 12, device=DEV)).pow(2).mean().backward()
        del ref
        base = _gpu_memory()
        exports, releases = cuda_ipc.STATS["exports"], cuda_ipc.STATS["releases"]
        train()
        # the workers freed their imports themselves (nothing for us to release) and our memory is back
        assert cuda_ipc.STATS["exports"] > exports and cuda_ipc.STATS["releases"] == releases
        assert _gpu_memory() == base
        assert wait_for(lambda: status(name)["client_pid"] is None, timeout=10)

        dead = run_script(DAEMON_CLIENT_DIES % name, timeout=120)
        assert dead.returncode == -signal.SIGKILL, dead.stderr
        client = int(dead.stdout.split("PID", 1)[1].split()[0])
        assert wait_for(lambda: all(w["state"] == "idle" for w in status(name)["workers"]), timeout=15)
        assert [w["pid"] for w in status(name)["workers"]] == pids[1:]  # the workers lived on
        assert wait_for(lambda: not _torch_files(client), timeout=5.0), _torch_files(client)
        train()  # the next client gets a clean pool
    finally:
        cli("stop", "--name", name)
        assert wait_for(lambda: not any(running(p) for p in pids), timeout=15), "daemon or workers left"


# ---------------------------------------------------------------------- faults, one coordinator each
_HEAD = """
import os, signal, threading, time, gc, torch, dpool
from tests.models import Faulty
def mem():
    gc.collect(); torch.cuda.synchronize(); return torch.cuda.memory_allocated(0)
torch.cuda.init()
print("PID", os.getpid(), flush=True)
net = Faulty().cuda()
net(torch.randn(2, 16, device="cuda")).sum().backward()  # cuBLAS's workspace, kept by this process
net.zero_grad(set_to_none=True)
base = mem()
def leftover():
    net.zero_grad(set_to_none=True)
    return mem() - base
"""

_SCENARIOS = {
    "kill_mid_forward": """
model = dpool.wrap(net, [0, 0])
w = {n: p.detach().clone() for n, p in net.named_parameters()}
pid = model.stats()["workers"][1]["pid"]
threading.Timer(1.5, os.kill, (pid, signal.SIGKILL)).start()
try:
    model(torch.randn(8, 16, device="cuda"), mode="sleep"); print("NO ERROR")
except dpool.WorkerDiedError as e:
    assert "worker 1 (cuda:0, pid %d)" % pid in str(e) and "step" in str(e), e
assert all(torch.equal(p, w[n]) for n, p in net.named_parameters())
del w
model.close()
print("MEM", leftover())
print("OK")
""",
    "kill_mid_backward": """
model = dpool.wrap(net, [0, 0])
w = {n: p.detach().clone() for n, p in net.named_parameters()}
out = model(torch.randn(8, 16, device="cuda"), mode="sleep_backward")
pid = model.stats()["workers"][0]["pid"]
threading.Timer(1.5, os.kill, (pid, signal.SIGKILL)).start()
try:
    out.sum().backward(); print("NO ERROR")
except dpool.WorkerDiedError as e:
    assert "worker 0 (cuda:0, pid %d)" % pid in str(e) and "backward" in str(e), e
assert all(torch.equal(p, w[n]) for n, p in net.named_parameters()) and net.lin.weight.grad is None
del w, out
model.close()
print("MEM", leftover())
print("OK")
""",
    "kill_mid_copy": """
import copy
ref = copy.deepcopy(net)
model = dpool.wrap(net, [0, 0], max_restarts=2)
x = torch.randn(8, 16, device="cuda")
w = {n: p.detach().clone() for n, p in net.named_parameters()}
pid = model.stats()["workers"][1]["pid"]
try:  # worker 1 dies with its output copy into our arena still queued on the GPU
    model(x, mode="die_in_copy:%d" % pid); print("NO ERROR")
except dpool.WorkerDiedError as e:
    assert "worker 1 (cuda:0, pid %d)" % pid in str(e) and "step" in str(e), e
assert all(torch.equal(p, w[n]) for n, p in net.named_parameters())
torch.testing.assert_close(model(x), ref(x))
out = model(x, mode="die_in_grad_copy:%d" % model.stats()["workers"][0]["pid"])
pid = model.stats()["workers"][0]["pid"]
try:  # worker 0 dies with its gradient copy into our slots still queued
    out.sum().backward(); print("NO ERROR")
except dpool.WorkerDiedError as e:
    assert "worker 0 (cuda:0, pid %d)" % pid in str(e) and "backward" in str(e), e
assert all(torch.equal(p, w[n]) for n, p in net.named_parameters()) and net.lin.weight.grad is None
model(x).sum().backward()
ref(x).sum().backward()
torch.testing.assert_close(net.lin.weight.grad, ref.lin.weight.grad)
del ref, out, x, w
model.close()
print("MEM", leftover())
print("OK")
""",
    "expandable_segments": """
import copy
ref = copy.deepcopy(net)
model = dpool.wrap(net, [0, 0])
x = torch.randn(8, 16, device="cuda")
out, want = model(x), ref(x)
torch.testing.assert_close(out, want)
out.sum().backward(); want.sum().backward()
torch.testing.assert_close(net.lin.weight.grad, ref.lin.weight.grad)
del ref, out, want, x
model.close()
print("MEM", leftover())
print("OK")
""",
    "sigstop": """
model = dpool.wrap(net, [0, 0], heartbeat_timeout_s=3.0)
pid = model.stats()["workers"][0]["pid"]
os.kill(pid, signal.SIGSTOP)
try:
    model(torch.randn(8, 16, device="cuda")); print("NO ERROR")
except dpool.WorkerTimeoutError as e:
    assert "heartbeat" in str(e) and "worker 0" in str(e), e
model.close()
print("MEM", leftover())
print("OK")
""",
    "device_assert": """
model = dpool.wrap(net, [0, 0], max_restarts=2)  # both shards hit the assert
x = torch.randn(8, 16, device="cuda")
good = model(x).detach()
try:
    model(x, mode="assert"); print("NO ERROR")
except dpool.WorkerDiedError as e:
    assert "CUDA_LAUNCH_BLOCKING=1" in str(e) and "device-side assert" in str(e), e
torch.testing.assert_close(model(x), good)
del x, good
model.close()
print("MEM", leftover())
print("OK")
""",
    "oom": """
model = dpool.wrap(net, [0, 0])
x = torch.randn(8, 16, device="cuda")
good = model(x).detach()
try:
    model(x, mode="oom"); print("NO ERROR")
except torch.OutOfMemoryError as e:
    assert isinstance(e, dpool.RemoteError) and "worker" in str(e), e
    assert "cuda:0: " in str(e) and "GiB free of" in str(e) and "2 worker(s)" in str(e), e
torch.testing.assert_close(model(x), good)
del x, good
model.close()
print("MEM", leftover())
print("OK")
""",
    "ten_restarts": """
model = dpool.wrap(net, [0, 0], max_restarts=10)
x = torch.randn(8, 16, device="cuda")
model(x)
seen = []
for i in range(10):
    os.kill(model.stats()["workers"][i % 2]["pid"], signal.SIGKILL)
    try:
        model(x)
    except dpool.WorkerDiedError:
        pass
    model(x).sum().backward()
    seen.append(mem())
assert len(set(seen[1:])) == 1, seen
del x
model.close()
print("MEM", leftover())
print("OK")
""",
    # DPOOL_CUDA_ASYNC_REPLIES=1: a forward's reply does not wait for its kernels
    "async_device_assert": """
os.environ["DPOOL_CUDA_ASYNC_REPLIES"] = "1"
model = dpool.wrap(net, [0, 0], max_restarts=2)
x = torch.randn(8, 16, device="cuda")
good = model(x).detach()
w = {n: p.detach().clone() for n, p in net.named_parameters()}
try:  # the assert surfaces at the forward, or at the latest at its backward (the step's end)
    model(x, mode="assert").sum().backward(); print("NO ERROR")
except dpool.WorkerDiedError as e:
    assert "CUDA_LAUNCH_BLOCKING=1" in str(e) and "device-side assert" in str(e), e
assert all(torch.equal(p, w[n]) for n, p in net.named_parameters()) and all(p.grad is None for p in net.parameters())
torch.testing.assert_close(model(x), good)
del x, good, w
model.close()
print("MEM", leftover())
print("OK")
""",
    "async_kill_after_reply": """
os.environ["DPOOL_CUDA_ASYNC_REPLIES"] = "1"
model = dpool.wrap(net, [0, 0], max_restarts=1)
x = torch.randn(8, 16, device="cuda")
out = model(x)  # replied at once; the worker dies before its backward
pid = model.stats()["workers"][1]["pid"]
os.kill(pid, signal.SIGKILL)
try:
    out.sum().backward(); print("NO ERROR")
except dpool.WorkerDiedError as e:
    assert "worker 1" in str(e), e
model(x).sum().backward()  # the restarted worker serves, and our stream is not stuck on the dead one's event
torch.cuda.synchronize()
del x, out
model.close()
print("MEM", leftover())
print("OK")
""",
    "coordinator_killed": """
model = dpool.wrap(net, [0, 0])
model(torch.randn(8, 16, device="cuda"))
print("PIDS", os.getpid(), " ".join(str(w["pid"]) for w in model.stats()["workers"]), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
""",
}


def _torch_files(pid: int) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"torch_{pid}_")]


def test_gpu_faults():
    """Worker SIGKILL (mid forward, backward, copy), SIGSTOP, device-side assert, OOM, ten restarts,
    coordinator SIGKILL: in parallel."""

    names = list(_SCENARIOS)
    # the user's allocator setting must not reach dpool's shared arenas (those cannot be expandable)
    pre = {"expandable_segments": "import os; os.environ['PYTORCH_CUDA_ALLOC_CONF'] = 'expandable_segments:True'\n"}
    results = run_scripts([pre.get(n, "") + _HEAD + _SCENARIOS[n] for n in names], timeout=150)
    for name, r in zip(names, results):
        if name == "coordinator_killed":
            assert r.returncode == -signal.SIGKILL, r.stderr
            coordinator, *pids = [int(p) for p in r.stdout.split("PIDS", 1)[1].split()]
            from tests.conftest import wait_for

            assert wait_for(lambda: not any(running(p) for p in pids), timeout=10.0), pids
            # torch's IPC reference-counter file of the dead coordinator is removed too
            assert wait_for(lambda: not _torch_files(coordinator), timeout=5.0), _torch_files(coordinator)
            continue
        assert r.returncode == 0 and "OK" in r.stdout and "NO ERROR" not in r.stdout, \
            f"{name}:\n{r.stdout}\n{r.stderr[-3000:]}"
        assert "Producer process has been terminated" not in r.stderr, f"{name}: {r.stderr[-2000:]}"
        assert not _torch_files(int(r.stdout.split("PID", 1)[1].split()[0])), name
        for line in r.stdout.splitlines():
            if line.startswith("MEM"):
                assert int(line.split()[1]) == 0, f"{name}: GPU memory not back at baseline ({line})"


def test_async_replies_train_like_one_process_without_a_host_sync_in_the_coordinator(wrap, monkeypatch):
    """DPOOL_CUDA_ASYNC_REPLIES=1: the forwards' replies do not wait for their kernels; the numbers are one
    process's, step after step, and dpool's forward never synchronizes this process with its GPU."""
    monkeypatch.setenv("DPOOL_CUDA_ASYNC_REPLIES", "1")
    torch.manual_seed(0)
    net = MLP().to(DEV)
    ref = copy.deepcopy(net)
    model = wrap(net, IDS)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(8, 12, device=DEV)).sum().backward()  # (the first step sends what first steps send)
    net.zero_grad()
    for step in range(5):
        x = torch.randn(16, 12, device=DEV)
        y = torch.randint(0, 3, (16,), device=DEV)
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = model(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        want = ref(x)
        torch.testing.assert_close(out, want, **TOL)
        F.cross_entropy(out, y).backward()
        F.cross_entropy(want, y).backward()
        for (name, p), q in zip(net.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **TOL, msg=f"grad of {name}, step {step}")
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, **TOL)


def _union_reference(world: int, B: int = 12) -> dict:
    """One process on the union batch for the ``cuda_nodes`` scenario (tests/multinode.py), on the CPU."""
    from tests.multinode import batches, make_net, rows_of, state

    net = make_net(bn=False)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    data = batches(4, B)
    for x, y in data[:2]:
        opt.zero_grad()
        F.mse_loss(net(x), y).backward()
        opt.step()
    opt.zero_grad()
    for x, y in data[2:]:
        F.mse_loss(net(x), y).backward()
    x, y = data[0]
    rows0 = rows_of(0, world, B)
    out = net(x)
    out = torch.cat([out[rows0] + net.extra(x[rows0]), out[rows0.stop:]])  # the head on rank 0's rows only
    F.mse_loss(out, y).backward()
    opt.step()
    return state(net)


@pytest.mark.parametrize("backend,workers", [("gloo", [1, 2]), ("nccl", [2])], ids=["gloo-2-nodes", "nccl-1-node"])
def test_cross_node_mode_with_cuda_masters(backend, workers):
    """CUDA masters across "nodes" (coordinator processes on loopback), GPU workers on GPU 0: gloo with two
    nodes of 1 and 2 workers, and NCCL (one GPU cannot hold two NCCL ranks: one node, an explicit group).
    Parameters and gradients after momentum steps, no_sync and a head used on one node equal one process
    on the union batch; no_sync issues no collective."""
    from tests.test_multinode import Run

    run = Run("cuda_nodes", len(workers), backend=backend, workers=workers)
    try:
        run.finish(timeout=150)
        want = _union_reference(len(workers))
        for r in range(len(workers)):
            assert run.codes[r] == 0, f"rank {r} exited {run.codes[r]}:\n{run.outs[r]}\n{run.errs[r]}"
            res = run.result(r)
            assert res["backend"] == backend and res["inside"] == 0, res
            got = run.tensors(r)
            for key in ("params", "grads"):
                for i, (a, b) in enumerate(zip(got[key], want[key])):
                    assert (a is None) == (b is None), (key, i)
                    if a is not None:
                        torch.testing.assert_close(a, b, msg=f"rank {r}: {key} {i}")
    finally:
        run.cleanup()
