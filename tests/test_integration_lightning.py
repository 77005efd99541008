"""Lightning's Trainer and Fabric with DpoolStrategy, against the same module trained on one device.

Each scenario runs in a fresh process (side by side): importing Lightning replaces torch.compile in the
process that imports it, which the rest of the suite's processes must not inherit."""
from __future__ import annotations

import pytest

pytest.importorskip("lightning")

from tests.helpers import run_scripts, script_result  # noqa: E402

pytestmark = pytest.mark.timeout(300)

_COMMON = r"""
import contextlib, json, os, tempfile, warnings
import psutil, torch
import lightning as L
from torch import nn
import dpool
from dpool.integrations.lightning import DpoolStrategy
from tests.conftest import dpool_segments, wait_for

MAIN = os.getpid()
g = torch.Generator().manual_seed(0)
X, Y = torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g)

def loader():
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=8)

def biggest_difference(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))

def clean():
    return wait_for(lambda: not [p for p in psutil.Process().children(recursive=True)
                                 if p.status() != psutil.STATUS_ZOMBIE] and not dpool_segments())
"""

_TRAINER = _COMMON + r"""
steps_pids = []
held = []  # micro-batches run inside no_sync(): accumulate_grad_batches=2 holds the first of each pair
_no_sync = dpool.DataParallel.no_sync
dpool.DataParallel.no_sync = lambda self: held.append(1) or _no_sync(self)

class Module(L.LightningModule):
    def __init__(self, width=8):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 1))
    def forward(self, x):
        return self.net(x)
    def training_step(self, batch, i):
        steps_pids.append(os.getpid())
        loss = nn.functional.mse_loss(self(batch[0]), batch[1])
        self.log("train_loss", loss)
        return loss
    def validation_step(self, batch, i):
        self.log("val_loss", nn.functional.mse_loss(self(batch[0]), batch[1]))
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.05)

class Count(L.Callback):
    forwards = 0
    def on_train_batch_end(self, trainer, module, *args):
        if isinstance(trainer.strategy, DpoolStrategy):
            Count.forwards = trainer.strategy._dpool.stats()["steps"]

def fit(root, **kw):
    torch.manual_seed(0)
    module = Module()
    trainer = L.Trainer(max_epochs=2, accumulate_grad_batches=2, logger=False, default_root_dir=root,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Count()], **kw)
    trainer.fit(module, loader(), loader())
    return module, trainer

class Direct(Module):  # calls its child from training_step: that runs here, unparallelised
    def training_step(self, batch, i):
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

def directly(caught):
    return [str(w.message) for w in caught if "directly" in str(w.message)]

with tempfile.TemporaryDirectory() as root, warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    ref, ref_trainer = fit(root + "/ref", accelerator="cpu", devices=1)
    res = {}
    for name, kw in (("instance", dict(strategy=DpoolStrategy(device_ids=["cpu", "cpu"]), accelerator="cpu")),
                     ("by_name", dict(strategy="dpool", accelerator="cpu", devices=2)),
                     ("dp_installed", dict(strategy="dp", accelerator="cpu"))):  # Lightning 1.x's "dp", unchanged
        held.clear()
        with dpool.installed(device_ids=["cpu", "cpu"]) if name == "dp_installed" else contextlib.nullcontext():
            module, trainer = fit(root + "/" + name, **kw)
        best = trainer.checkpoint_callback.best_model_path
        loaded = Module.load_from_checkpoint(best)  # the plain class, the bare keys
        res[name] = {
            "params": biggest_difference(module, ref),
            "val_loss": abs(float(trainer.callback_metrics["val_loss"]) - float(ref_trainer.callback_metrics["val_loss"])),
            "loaded": biggest_difference(loaded, module),
            "keys": sorted(torch.load(best, weights_only=False)["state_dict"]),
            "forwards_on_workers": Count.forwards,
            "closed": trainer.strategy._dpool is None and module.__dict__.get("_compiled_call_impl") is None,
            "held": len(held),
            "strategy": type(trainer.strategy).__name__,
        }
    try:  # uninstalled, "dp" is Lightning 2's error again
        L.Trainer(strategy="dp", accelerator="cpu")
        res["dp_uninstalled"] = "accepted"
    except ValueError as exc:
        res["dp_uninstalled"] = type(exc).__name__
    # bf16-mixed autocasts training_step; the workers follow it
    ref16, _ = fit(root + "/ref16", accelerator="cpu", devices=1, precision="bf16-mixed")
    module16, _ = fit(root + "/bf16", strategy=DpoolStrategy(device_ids=["cpu", "cpu"]), accelerator="cpu",
                      precision="bf16-mixed")
    res["bf16"] = {"vs_one_device": biggest_difference(module16, ref16), "vs_fp32": biggest_difference(module16, ref)}
    res["steps_in_main"] = set(steps_pids) == {MAIN}
    res["direct_warnings_of_self_calls"] = directly(caught)
    caught.clear()
    L.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, strategy=DpoolStrategy(device_ids=["cpu", "cpu"]),
              accelerator="cpu").fit(Direct(), loader())
    res["direct_warnings"] = directly(caught)
    res["clean"] = clean()
print("RESULT " + json.dumps(res))
"""

_FABRIC = _COMMON + r"""
held = []
_no_sync = dpool.DataParallel.no_sync
dpool.DataParallel.no_sync = lambda self: held.append(1) or _no_sync(self)

def run(strategy, devices):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    fabric = L.Fabric(accelerator="cpu", strategy=strategy, devices=devices)
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for x, y in loader():
        for j, (xs, ys) in enumerate(((x[:4], y[:4]), (x[4:], y[4:]))):
            with fabric.no_backward_sync(model, enabled=j == 0):
                fabric.backward(nn.functional.mse_loss(model(xs), ys) / 2)
        opt.step()
        opt.zero_grad()
    return net, fabric, model

ref, _, _ = run("auto", 1)
res = {}
for name, strategy, devices in (("instance", DpoolStrategy(device_ids=["cpu", "cpu"]), 1), ("by_name", "dpool", 2),
                                ("dp_installed", "dp", 1)):
    held.clear()
    with dpool.installed(device_ids=["cpu", "cpu"]) if name == "dp_installed" else contextlib.nullcontext():
        net, fabric, model = run(strategy, devices)
    with tempfile.TemporaryDirectory() as d:
        fabric.save(d + "/ckpt", {"model": model})
        state = torch.load(d + "/ckpt", weights_only=False)["model"]
    plain = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    plain.load_state_dict(state)
    res[name] = {"params": biggest_difference(net, ref), "loaded": biggest_difference(plain, net),
                 "wrapped": dpool.is_wrapped(model._forward_module), "is_dpool": isinstance(fabric.strategy, DpoolStrategy),
                 "workers": len(model._forward_module.pids), "held": len(held)}
    fabric.strategy.teardown()
res["clean"] = clean()
print("RESULT " + json.dumps(res))
"""


@pytest.fixture(scope="module")
def results():
    return [script_result(r) for r in run_scripts([_TRAINER, _FABRIC], timeout=280)]


def test_lightning_trainer_with_dpool_strategy_trains_like_one_device(results):
    res = results[0]
    for name in ("instance", "by_name", "dp_installed"):
        r = res[name]
        assert r["params"] < 1e-5 and r["val_loss"] < 1e-5 and r["strategy"] == "DpoolStrategy", r
        assert r["loaded"] == 0 and all(not k.startswith("module.") for k in r["keys"]) and "net.0.weight" in r["keys"]
        assert r["forwards_on_workers"] > 0 and r["closed"], r
        assert r["held"] == 4, r  # 2 epochs of 4 batches, accumulated in pairs
    assert res["bf16"]["vs_one_device"] < 2e-2 < res["bf16"]["vs_fp32"] * 1e3, res["bf16"]
    assert res["steps_in_main"] and res["clean"] and res["dp_uninstalled"] == "ValueError", res
    # a child called from training_step, not through self(...): named once, at run time
    assert res["direct_warnings_of_self_calls"] == [], res
    assert len(res["direct_warnings"]) == 1 and "Direct.training_step calls self.net directly" in \
        res["direct_warnings"][0], res


def test_fabric_with_dpool_strategy_trains_like_one_device(results):
    res = results[1]
    for name in ("instance", "by_name", "dp_installed"):
        r = res[name]
        assert r["params"] < 1e-5 and r["loaded"] == 0, r
        assert r["wrapped"] and r["is_dpool"] and r["workers"] == 2 and r["held"] == 4, r
    assert res["clean"]


def test_the_integration_examples_run():
    """examples/integrations/: the complete examples the docs' integration pages show, on CPU workers."""
    names = ["hf_trainer", "lightning_trainer", "fabric", "accelerate_one_process"]
    runs = run_scripts([f"import runpy; runpy.run_path('examples/integrations/{n}.py', run_name='__main__')"
                        for n in names], timeout=280)
    for name, r in zip(names, runs):
        assert r.returncode == 0, f"{name}: {r.stdout[-2000:]}\n{r.stderr[-4000:]}"
