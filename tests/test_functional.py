"""The wrapper's signature, the functional form ``dpool.data_parallel``, and patches the model cannot reach."""
from __future__ import annotations

import copy
import gc
import inspect
import pickle

import psutil
import pytest
import torch
from torch import nn

import dpool
from tests.conftest import wait_for
from tests.helpers import run_script, script_result

pytestmark = pytest.mark.timeout(120)


class _Named(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, labels=None):
        out = self.lin(input_ids)
        return out if attention_mask is None else out * attention_mask


def test_the_models_forward_has_the_wrapped_modules_signature(wrap):
    net = _Named()
    model = wrap(net)
    assert inspect.signature(model.forward) == inspect.signature(net.forward)
    assert list(inspect.signature(model.forward).parameters) == ["input_ids", "attention_mask", "labels"]
    x, mask = torch.randn(6, 4), torch.rand(6, 3)
    torch.testing.assert_close(model(x, attention_mask=mask), net(x, attention_mask=mask))
    torch.testing.assert_close(model.forward(x), net(x))
    # a library may still assign forward (accelerate does, for autocast), and delete it again
    calls = []
    model.forward = lambda *a, **k: calls.append(a) or net(*a, **k)
    model(x)
    assert len(calls) == 1
    del model.forward
    torch.testing.assert_close(model(x), net(x))


class _Generator(nn.Module):
    """pytorch/examples' DCGAN pattern: the functional form called inside forward."""

    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Sequential(nn.Linear(5, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor, parallel: bool = True) -> torch.Tensor:
        if parallel:
            return dpool.data_parallel(self.main, x, device_ids=["cpu", "cpu"])
        return self.main(x)


def test_data_parallel_trains_like_dataparallels_functional_form_and_keeps_one_pool():
    torch.manual_seed(0)
    net, ref = _Generator(), _Generator()
    ref.load_state_dict(net.state_dict())
    opt, ref_opt = torch.optim.SGD(net.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    pids = None
    for step in range(4):
        x = torch.randn(8, 5)
        out = net(x)
        # DataParallel's semantics: each shard's BatchNorm sees its own rows (two shards of 4)
        shards = [ref.main(half) for half in x.chunk(2)]
        ref_out = torch.cat(shards)
        torch.testing.assert_close(out, ref_out, msg=f"step {step}")
        for o, model, optimizer in ((out, net, opt), (ref_out, ref, ref_opt)):
            optimizer.zero_grad()
            o.pow(2).mean().backward()
            optimizer.step()
        holder = net.main.__dict__["_dpool_functional_pool"]
        pids = pids or holder.model.pids
        assert holder.model.pids == pids  # the same workers at every call
    for (name, p), rp in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, rp, msg=name)
    # a copy or a pickle of the module has no pool; the module still runs on its own
    assert copy.deepcopy(net).main.__dict__["_dpool_functional_pool"].model is None
    assert pickle.loads(pickle.dumps(net)).main.__dict__["_dpool_functional_pool"].model is None
    # the pool goes with the module
    workers = [psutil.Process(p) for p in pids]
    del net, opt, out, holder
    gc.collect()
    assert wait_for(lambda: not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers))


def test_data_parallel_with_other_arguments_replaces_the_pool_and_takes_module_kwargs():
    net = _Named()
    x, mask = torch.randn(6, 4), torch.rand(6, 3)
    out = dpool.data_parallel(net, x, ["cpu", "cpu"], module_kwargs={"attention_mask": mask})
    torch.testing.assert_close(out, net(x, attention_mask=mask))
    first = net.__dict__["_dpool_functional_pool"].model
    out = dpool.data_parallel(net, (x,), ["cpu", "cpu", "cpu"])
    torch.testing.assert_close(out, net(x))
    model = net.__dict__["_dpool_functional_pool"].model
    assert model is not first and first._runtime is None and len(model.pids) == 3
    model.close()
    with pytest.raises(dpool.DpoolTypeError, match="expects an nn.Module"):
        dpool.data_parallel(lambda t: t, x)


def test_a_patch_the_models_code_cannot_reach_warns_nothing():
    """Lightning replaces torch.compile when imported. nn.Module.compile names it, but no forward calls
    that method: wrapping any model after `import lightning` warned that the workers run other code for
    torch.compile. A patch the forward reaches is still followed (the last check)."""
    res = run_script("""
        import json, warnings
        warnings.simplefilter("error")
        import lightning  # noqa: F401  (replaces torch.compile)
        import torch, dpool
        import torch.nn.functional as F
        net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.GELU())
        with dpool.wrap(net, ["cpu", "cpu"]) as model:
            x = torch.randn(4, 3)
            ok = torch.allclose(model(x), net(x))
        original = F.gelu
        torch.nn.modules.activation.F.gelu = lambda t, approximate="none": original(t) * 2
        with dpool.wrap(torch.nn.Sequential(torch.nn.GELU()), ["cpu", "cpu"]) as model:
            doubled = torch.allclose(model(x), original(x) * 2)
        print("RESULT " + json.dumps({"ok": ok, "doubled": doubled}))
    """, timeout=110)
    assert script_result(res) == {"ok": True, "doubled": True}
