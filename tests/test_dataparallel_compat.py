"""What DataParallel users rely on: calls from several threads, unwrapping by type, copies and saves, the
containers gather rebuilds, HF models' caches and outputs."""
from __future__ import annotations

import copy
import threading


import pytest
import torch
from torch import nn

import dpool
from tests import models


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
