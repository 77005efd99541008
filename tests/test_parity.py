"""dpool against single-process reference runs: outputs, gradients, parameters after steps, buffers."""
from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.nn.functional as F

from tests import models
from tests.reference import per_shard

MODELS = ["mlp", "cnn", "lstm", "dict"]


def assert_tree_close(a, b, **kw):
    if isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, **kw)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_tree_close(a[k], b[k], **kw)
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), (type(a), type(b))
        for x, y in zip(a, b):
            assert_tree_close(x, y, **kw)
    else:
        assert a == b


def clone_inputs(args, kwargs):
    return copy.deepcopy(args), copy.deepcopy(kwargs)


@pytest.fixture(scope="module")
def daemon_pools():
    """Warm dpool-workers pools (2 and 3 workers) for the attached-mode runs; stopped afterwards."""
    import subprocess
    import sys
    import uuid


    from tests.conftest import wait_for
    from tests.helpers import running
    from tests.helpers import ROOT

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "dpool_workers.cli", *args], capture_output=True, text=True,
                              timeout=120, cwd=ROOT)

    names = {n: f"parity{n}-{uuid.uuid4().hex[:6]}" for n in (2, 3)}
    started = []
    try:
        for n, name in names.items():
            res = cli("start", "--name", name, "--device-ids", ",".join(["cpu"] * n))
            assert res.returncode == 0, res.stderr
            started.append(name)
        yield names
    finally:
        from dpool.daemon_client import read_pool

        pids = []
        for name in started:
            try:
                pids.append(read_pool(name)[0]["pid"])
            except Exception:
                pass
            cli("stop", "--name", name)
        assert wait_for(lambda: not any(running(p) for p in pids), timeout=10)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("n_workers", [2, 3])
@pytest.mark.parametrize("mode", ["embedded", "attached"])
def test_training_matches_reference(wrap, name, n_workers, mode, request):
    """N steps with SGD+momentum equal N single-process (DataParallel-semantics) steps, with an
    embedded pool and with a pool attached from a warm dpool-workers daemon."""
    net = models.make(name)
    ref = copy.deepcopy(net)
    if mode == "attached":
        model = wrap(net, pool=request.getfixturevalue("daemon_pools")[n_workers], device_ids=None)
    else:
        model = wrap(net, ["cpu"] * n_workers)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for step, batch in enumerate([11, 7, 2, 9]):  # uneven, and smaller than the worker count
        args, kwargs = models.batch(name, batch, seed=step)
        rargs, rkwargs = clone_inputs(args, kwargs)
        out = model(*args, **kwargs)
        rout = per_shard(ref, rargs, rkwargs, n_workers, batch)
        assert_tree_close(out, rout)
        models.loss_of(name, out).backward()
        models.loss_of(name, rout).backward()
        for (n, p), rp in zip(net.named_parameters(), ref.parameters()):
            assert (p.grad is None) == (rp.grad is None), n
            if p.grad is not None:
                torch.testing.assert_close(p.grad, rp.grad, msg=lambda m: f"grad of {n}: {m}")
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
    for (n, p), rp in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, rp, msg=lambda m: f"param {n}: {m}")
    for (n, b), rb in zip(net.named_buffers(), ref.buffers()):
        torch.testing.assert_close(b, rb, msg=lambda m: f"buffer {n}: {m}")
    # Momentum buffers of the optimizer evolved identically.
    for p, rp in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], ropt.state[rp]["momentum_buffer"])


def _reduce_helpers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("dpool-reduce")]


@pytest.mark.parametrize("n_workers", [2, 3])
def test_large_gradients_summed_in_chunks_on_helper_threads_match_reference(wrap, n_workers):
    """A model with ≥ 4 MiB of gradients sums its slots in chunks on helper threads (the workers are
    idle then): the same gradients and parameters as the reference after momentum steps, and
    ``close()`` stops the threads."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(800, 800), torch.nn.Tanh(), torch.nn.Linear(800, 3)).double()
    ref = copy.deepcopy(net)
    model = wrap(net, ["cpu"] * n_workers)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for batch in [9, 7, 2]:  # the last smaller than 3 workers: fewer slots than workers
        x = torch.randn(batch, 800, dtype=torch.float64, generator=g)
        out = model(x)
        rout = per_shard(ref, (x.clone(),), {}, n_workers, batch)
        torch.testing.assert_close(out, rout)
        out.pow(2).mean().backward()
        rout.pow(2).mean().backward()
        for (n, p), rp in zip(net.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, rp.grad, msg=lambda m: f"grad of {n}: {m}")
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
    assert _reduce_helpers(), "the sum of 5 MiB slots did not use the helper threads"
    for p, rp in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p, rp)
    model.close()
    assert not _reduce_helpers()


@pytest.mark.parametrize("pattern", ["set_to_none", "accumulate", "kept"])
def test_the_summed_gradients_reuse_only_memory_nobody_holds(wrap, pattern):
    """The gradients' memory is reused from step to step only once nothing holds it: with
    ``zero_grad()`` every step gets the same memory; with ``zero_grad(set_to_none=False)`` the gradients
    accumulate into the first step's as in one process; gradients the user kept are never overwritten.
    Each against the reference after momentum steps."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).double()
    ref = copy.deepcopy(net)
    model = wrap(net, ["cpu"] * 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    kept, where = [], set()
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        x = torch.randn(9, 5, dtype=torch.float64, generator=g)
        model(x).pow(2).mean().backward()
        per_shard(ref, (x.clone(),), {}, 2, 9).pow(2).mean().backward()
        where.add(net[0].weight.grad.data_ptr())
        for (n, p), rp in zip(net.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, rp.grad, msg=lambda m: f"grad of {n}: {m}")
        if pattern == "kept":
            kept.append([(p.grad, p.grad.clone()) for p in net.parameters()])
        opt.step()
        ropt.step()
        opt.zero_grad(set_to_none=pattern != "accumulate")
        ropt.zero_grad(set_to_none=pattern != "accumulate")
    for p, rp in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p, rp)
    for step in kept:
        for grad, then in step:
            assert torch.equal(grad, then), "a gradient the user kept was overwritten by a later step"
    # .grad stays the first step's tensor when accumulating, and the kept ones stay distinct
    assert len(where) == (5 if pattern == "kept" else 1), where
    # the memory the sums were written to: set_to_none, one buffer for every step; accumulate, a second
    # one (the first is .grad); kept, new memory each step
    assert model._runtime.reducer.totals.made == {"set_to_none": 1, "accumulate": 2, "kept": 5}[pattern]


@pytest.mark.parametrize("name", ["mlp", "lstm", "dict"])
def test_equals_full_batch_single_process(wrap, name):
    """Without batch-coupled layers, dpool equals the plain full-batch single-process run."""
    net = models.make(name)
    ref = copy.deepcopy(net)
    model = wrap(net)
    args, kwargs = models.batch(name, 13)
    out = model(*args, **kwargs)
    rout = ref(*clone_inputs(args, kwargs)[0], **clone_inputs(args, kwargs)[1])
    if name == "dict":  # Python numbers come back as one entry per shard
        assert out["n"] == [7, 6] and rout["n"] == 13
        rout["n"] = out["n"]
    assert_tree_close(out, rout)
    models.loss_of(name, out).backward()
    models.loss_of(name, rout).backward()
    for p, rp in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, rp.grad)


def test_cnn_eval_mode_equals_full_batch(wrap):
    net = models.make("cnn")
    ref = copy.deepcopy(net)
    model = wrap(net)
    (x,), _ = models.batch("cnn", 10)
    model(x).sum().backward()  # one training step updates running stats
    ref_out = per_shard(ref, (x,), {}, 2, 10)
    ref_out.sum().backward()
    model.eval()
    ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x))
    for b, rb in zip(net.buffers(), ref.buffers()):
        torch.testing.assert_close(b, rb)
    assert int(net.bn1.num_batches_tracked) == 1


def test_float32_training(wrap):
    net = models.make("cnn", dtype=torch.float32)
    ref = copy.deepcopy(net)
    model = wrap(net)
    # Not Adam: it divides by sqrt(v), so a gradient that is zero in exact arithmetic (a conv bias
    # before BatchNorm) turns float32 rounding noise, which differs with the thread count, into
    # lr-sized steps.
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    ropt = torch.optim.SGD(ref.parameters(), lr=1e-2, momentum=0.9)
    for step in range(3):
        (x,), _ = models.batch("cnn", 8, dtype=torch.float32, seed=step)
        out = model(x)
        rout = per_shard(ref, (x,), {}, 2, 8)
        torch.testing.assert_close(out, rout, rtol=1e-4, atol=1e-5)
        out.pow(2).mean().backward()
        rout.pow(2).mean().backward()
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
    for p, rp in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p, rp, rtol=1e-4, atol=1e-5)


def test_the_same_seed_gives_the_same_dropout_embedded_and_attached(wrap, daemon_pools):
    """Workers seed their generators from the coordinator's: the same torch.manual_seed gives the same
    run whether the pool is embedded or attached from a warm daemon."""
    from tests.test_randomness import _Dropout

    runs = []
    for pool in (None, daemon_pools[2]):
        torch.manual_seed(0)
        net = _Dropout()
        model = wrap(net, pool=pool) if pool else wrap(net)
        runs.append([model(torch.ones(8, 16)).detach() for _ in range(3)])
        model.close()
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_an_attached_session_does_not_inherit_the_last_sessions_default_dtype(wrap, daemon_pools):
    """A daemon's workers outlive a session: one that ran under torch.set_default_dtype(torch.float64)
    must not leave the next session's forwards computing in float64."""
    from tests.test_worker_settings import _Constants

    torch.manual_seed(0)
    net = _Constants().double()
    x = torch.randn(5, 6, dtype=torch.float64)
    try:
        torch.set_default_dtype(torch.float64)
        model = wrap(copy.deepcopy(net), pool=daemon_pools[2], device_ids=None)
        model(x)
        model.close()
    finally:
        torch.set_default_dtype(torch.float32)
    model = wrap(net, pool=daemon_pools[2], device_ids=None)
    torch.testing.assert_close(model(x), copy.deepcopy(net)(x), rtol=0, atol=1e-9)


class _Reuse(torch.nn.Module):
    """Gradient paths in one model: a layer applied twice (two accumulations into its gradient in one
    backward), a parameter no forward uses, one that is frozen, and optionally a large one (a big table
    read through a slice, as an embedding would be) that puts the model over the bulk-copy limit."""

    def __init__(self, big: int = 0) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(6, 8)
        self.shared = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 3)
        self.unused = torch.nn.Linear(3, 3)
        self.frozen = torch.nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.big = torch.nn.Parameter(torch.randn(big) * 1e-2) if big else None

    def forward(self, x):
        h = torch.tanh(self.shared(torch.tanh(self.shared(self.inp(x)))))
        h = h + self.frozen(h)
        if self.big is not None:
            h = h + self.big[:8]
        return self.out(h)


@pytest.mark.parametrize("big", [0, 17_000_000], ids=["bulk-copy", "hooks"])
def test_both_gradient_paths_of_a_cpu_worker_match_one_process(wrap, big):
    """A CPU worker copies its gradients to the slot in one pass after the backward, or, for models of over
    BULK_GRAD_COPY_MAX bytes of parameters, with a hook per parameter as each is accumulated. Either way:
    a reused layer's two accumulations summed, no gradient for the unused parameter, none for the frozen one
    until it is unfrozen (frozen when the pool started: the hooks path once failed to start on it), no_sync
    accumulation, and the parameters after momentum steps equal to one process on the same shards."""
    from workers.replica import BULK_GRAD_COPY_MAX

    torch.manual_seed(0)
    net = _Reuse(big)
    assert (sum(p.numel() * p.element_size() for p in net.parameters()) > BULK_GRAD_COPY_MAX) == bool(big)
    ref = copy.deepcopy(net)
    model = wrap(net)
    hooked = model.worker_states(lambda r: sum(bool(p._post_accumulate_grad_hooks) for p in r.parameters()))
    assert hooked == [len(list(net.parameters())) if big else 0] * 2  # the path this case is about
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        if step == 2:  # frozen at wrap, unfrozen now: its gradient arrives (the hook, when hooked, acts now)
            net.frozen.requires_grad_(True)
            ref.frozen.requires_grad_(True)
        xs = [torch.randn(10, 6, generator=g) for _ in range(2)]
        with model.no_sync():
            model(xs[0]).pow(2).mean().backward()
        model(xs[1]).pow(2).mean().backward()
        for x in xs:
            per_shard(ref, (x,), {}, 2, 10).pow(2).mean().backward()
        for name, p in net.named_parameters():
            rp = dict(ref.named_parameters())[name]
            if rp.grad is None:
                assert p.grad is None, name
            else:
                torch.testing.assert_close(p.grad, rp.grad, msg=f"{name} at step {step}")
        assert (net.frozen.weight.grad is not None) == (step == 2)
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
    assert net.unused.weight.grad is None
    for (name, p), rp in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, rp, msg=name)


class _TiedLM(torch.nn.Module):
    """A language model's layout: the output projection is the embedding's matrix (tied weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.LayerNorm(16))
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.body(self.emb(ids)))


class _Checkpointed(torch.nn.Module):
    """A block under non-reentrant activation checkpointing (recomputed in the worker's backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 32)
        self.b = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32))
        self.c = torch.nn.Linear(32, 3)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return self.c(checkpoint(self.b, torch.relu(self.a(x)), use_reentrant=False))


@pytest.mark.parametrize("pattern", ["tied-adamw", "tied-accumulate-clip", "checkpointed", "gradscaler-bf16"])
def test_training_loops_users_write_match_one_process(wrap, pattern):
    """Whole training loops as users write them, against one process on the same shards: tied embedding and
    output weights under AdamW (and with gradient accumulation over two batches and clip_grad_norm_),
    non-reentrant activation checkpointing, and a CPU GradScaler (unscale_, clip, step, update) under bf16
    autocast. The parameters and the optimizer's state must agree after every step, and the tie survive.

    autocast runs with ``cache_enabled=False`` here: with the cache, the one-process reference shares one
    bf16 copy of each weight across its shards and sums their gradients in bf16, where dpool's workers
    (like DataParallel's replicas) cast their own and sum in float32, a difference of bf16 rounding."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if pattern.startswith("tied"):
        net: torch.nn.Module = _TiedLM()
        batches = [(torch.randint(0, 50, (7, 5), generator=g), torch.randint(0, 50, (7, 5), generator=g))
                   for _ in range(4)]

        def loss_fn(out, y):
            return F.cross_entropy(out.reshape(-1, 50), y.reshape(-1))
    else:
        net = _Checkpointed()
        batches = [(torch.randn(10, 8, generator=g), torch.randint(0, 3, (10,), generator=g)) for _ in range(4)]
        loss_fn = F.cross_entropy
    ref = copy.deepcopy(net)
    model = wrap(net, ["cpu"] * 3)
    if pattern.startswith("tied"):
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ropt: torch.optim.Optimizer = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    amp = pattern == "gradscaler-bf16"
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) if amp else None for _ in range(2)]
    accumulate = 2 if pattern == "tied-accumulate-clip" else 1
    clip = 0.5 if accumulate > 1 or amp else None
    for step, (x, y) in enumerate(batches):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp, cache_enabled=False):
            losses = [loss_fn(model(x), y) / accumulate, loss_fn(per_shard(ref, (x,), {}, 3, x.shape[0]), y) / accumulate]
        for loss, scaler in zip(losses, scalers):
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if (step + 1) % accumulate:
            continue
        for o, scaler, m in ((opt, scalers[0], net), (ropt, scalers[1], ref)):
            if scaler is not None:
                scaler.unscale_(o)
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
            if scaler is not None:
                scaler.step(o)
                scaler.update()
            else:
                o.step()
            o.zero_grad()
        for (name, p), rp in zip(net.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, rp, msg=lambda m: f"{name} after step {step}: {m}")
            for key, v in opt.state[p].items():
                torch.testing.assert_close(v, ropt.state[rp][key], msg=lambda m: f"{key} of {name}: {m}")
    if amp:
        assert scalers[0].get_scale() == scalers[1].get_scale()
    if pattern.startswith("tied"):
        assert net.head.weight is net.emb.weight  # one parameter, as before wrap()
        assert len(list(model.parameters())) == len(list(ref.parameters()))
