"""The trainer integrations with CUDA devices, against the same training on one GPU in one process.

``DpoolTrainer`` (bf16, and fp16 with its loss scaling) and ``DpoolStrategy`` (``accelerator="gpu"``) on
``device_ids=[0, 0]``: two worker processes on GPU 0. Each scenario runs in a fresh process (Lightning replaces
``torch.compile`` in the process that imports it). On a machine without a GPU every test here is skipped;
``scripts/gpu-check.sh`` runs them on one.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers import run_scripts, script_result

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (one is enough: [0, 0])"),
              pytest.mark.timeout(300)]

_HF = r"""
import json, tempfile, torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments
from dpool.integrations.transformers import DpoolTrainer

cfg = dict(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3, max_position_embeddings=16)
g = torch.Generator().manual_seed(0)
data = [{"input_ids": torch.randint(0, 50, (8,), generator=g), "attention_mask": torch.ones(8, dtype=torch.long),
         "label": int(torch.randint(0, 3, (1,), generator=g))} for _ in range(64)]
res = {}
with tempfile.TemporaryDirectory() as out:
    for precision in ("bf16", "fp16"):
        runs = {}
        for name, cls, extra in (("plain", Trainer, {}), ("dpool", DpoolTrainer, {"device_ids": [0, 0]})):
            torch.manual_seed(0)
            model = BertForSequenceClassification(BertConfig(**cfg))
            per_device = 16 // len(extra.get("device_ids", [0]))  # (16 rows a step in both runs)
            args = TrainingArguments(f"{out}/{precision}-{name}", per_device_train_batch_size=per_device, max_steps=4,
                                     learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no", seed=0,
                                     disable_tqdm=True, **{precision: True})
            trainer = cls(model=model, args=args, train_dataset=data, **extra)
            trainer.train()
            runs[name] = (model, [h["loss"] for h in trainer.state.log_history if "loss" in h])
        (ref, ref_losses), (model, losses) = runs["plain"], runs["dpool"]
        res[precision] = {"device": str(next(model.parameters()).device), "losses": losses, "ref": ref_losses,
                          "params": max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))}
print("RESULT " + json.dumps(res))
"""

_LIGHTNING = r"""
import json, torch
import lightning as L
from torch import nn
from dpool.integrations.lightning import DpoolStrategy

g = torch.Generator().manual_seed(0)
X, Y = torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)

class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    def training_step(self, batch, i):
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

def fit(**kw):
    torch.manual_seed(0)
    module = Module()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=16)
    L.Trainer(max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, accelerator="gpu", **kw).fit(module, loader)
    return module

ref = fit(devices=1)
module = fit(strategy=DpoolStrategy(device_ids=[0, 0]), devices=1)
print("RESULT " + json.dumps({"device": str(next(module.parameters()).device),
                              "params": max((p - q).abs().max().item()
                                            for p, q in zip(module.parameters(), ref.parameters()))}))
"""


@pytest.fixture(scope="module")
def results():
    return [script_result(r) for r in run_scripts([_HF, _LIGHTNING], timeout=280)]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_dpool_trainer_on_cuda_workers_equals_the_trainer_on_one_gpu(results, precision):
    r = results[0][precision]
    assert r["device"] == "cuda:0" and len(r["losses"]) == 4, r
    assert r["losses"] == pytest.approx(r["ref"], rel=2e-2), r  # half precision: shard and batch sums differ a bit
    assert r["params"] < 2e-2, r


def test_dpool_strategy_on_cuda_workers_equals_one_gpu(results):
    r = results[1]
    assert r["device"] == "cuda:0" and r["params"] < 1e-4, r


_DP_CUDA = r"""
import json, os, torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))

    def forward(self, x):
        return self.body(x), torch.full((x.shape[0],), os.getpid(), device=x.device)

def train(parallel):
    torch.manual_seed(0)
    net = Net()
    model = nn.DataParallel(net).cuda() if parallel else net.cuda()  # wrapped first, moved after
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pids = set()
    for _ in range(3):
        y, who = model(torch.randn(8, 6).cuda())
        opt.zero_grad()
        y.pow(2).mean().backward()
        opt.step()
        pids |= set(who.tolist())
    return net, sorted(pids)

net, pids = train(True)
ref, _ = train(False)
print("RESULT " + json.dumps({"me": os.getpid(), "pids": pids, "device": str(next(net.parameters()).device),
                              "params": max((p - q).abs().max().item() for p, q in zip(net.parameters(), ref.parameters()))}))
"""


def test_an_unchanged_dataparallel_cuda_script_under_python_m_dpool(tmp_path):
    """`nn.DataParallel(net).cuda()` (wrapped before the move) under `python -m dpool --device-ids 0,0`: two worker
    processes on GPU 0 run the forwards, and the parameters equal one process on the GPU."""
    import json
    import os
    import subprocess
    import sys

    from tests.helpers import PYPATH

    script = tmp_path / "train.py"
    script.write_text(_DP_CUDA)
    res = subprocess.run([sys.executable, "-m", "dpool", "--device-ids", "0,0", str(script)], capture_output=True,
                         text=True, timeout=240, env=dict(os.environ, PYTHONPATH=PYPATH))
    lines = [line for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    assert res.returncode == 0 and lines, res.stderr[-4000:]
    r = json.loads(lines[-1][len("RESULT "):])
    assert r["device"] == "cuda:0" and len(r["pids"]) == 2 and r["me"] not in r["pids"], r
    assert r["params"] < 1e-5, r


_WHERE_THE_MODULE_IS = r"""
import json, os, torch, dpool
from torch import nn
x = torch.randn(8, 4)
with dpool.wrap(nn.Linear(4, 2)) as model:                  # a module on the CPU: CPU workers, GPU or not
    model(x)
    on_cpu = model.device_ids
lazy = dpool.DataParallel(nn.Linear(4, 2)).cuda()           # moved after construction: the GPUs, at the first forward
lazy(x.cuda()).sum().backward()
on_gpu = lazy.device_ids
lazy.close()
print("RESULT " + json.dumps({"cpu": on_cpu, "gpu": on_gpu, "gpus": torch.cuda.device_count()}))
"""


def test_the_default_workers_are_where_the_module_is_when_they_start():
    """``device_ids=None`` on a GPU machine: a module on the CPU gets CPU workers (an ``Accelerator(cpu=True)``, a
    Trainer with ``use_cpu=True``), a module moved to the GPU before the first forward gets every GPU."""
    r = script_result(run_scripts([_WHERE_THE_MODULE_IS], timeout=240)[0])
    assert set(r["cpu"]) == {"cpu"} and r["gpu"] == [f"cuda:{i}" for i in range(r["gpus"])], r


def test_the_integration_examples_run_as_written_on_the_gpu():
    """The examples the integration pages show, unchanged, where the workers default to the GPUs: the HF Trainer's
    and accelerate's (the Lightning ones ask for ``devices=2``, two GPUs: they run where there are two)."""
    names = ["hf_trainer", "accelerate_one_process"] + (["lightning_trainer", "fabric"]
                                                        if torch.cuda.device_count() >= 2 else [])
    runs = run_scripts([f"import runpy; runpy.run_path('examples/integrations/{n}.py', run_name='__main__')"
                        for n in names], timeout=280)
    for name, r in zip(names, runs):
        assert r.returncode == 0, f"{name}: {r.stdout[-2000:]}\n{r.stderr[-4000:]}"
