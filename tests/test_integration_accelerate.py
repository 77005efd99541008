"""accelerate with a dpool model: the one-process recipe, and DDP around dpool refused in a multi-process run
(accelerate's prepare(), HF Trainer, Lightning), under a real torchrun."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

pytest.importorskip("accelerate")
from accelerate import Accelerator  # noqa: E402

import dpool  # noqa: E402
from tests.helpers import ROOT  # noqa: E402

pytestmark = pytest.mark.timeout(240)


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def test_the_one_process_recipe_trains_saves_and_loads_like_one_process(tmp_path):
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 6, generator=g), torch.randn(32, 2, generator=g))
    ref = _net()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for x, y in torch.utils.data.DataLoader(data, batch_size=8):
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()

    accelerator = Accelerator(cpu=True)
    net = _net()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)  # (from the bare module's parameters)
    model, opt, loader = accelerator.prepare(dpool.wrap(net, ["cpu", "cpu"]), opt,
                                             torch.utils.data.DataLoader(data, batch_size=8))
    try:
        assert dpool.is_wrapped(model) and accelerator.unwrap_model(model) is net
        for x, y in loader:
            opt.zero_grad()
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
        for p, q in zip(net.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q)
        accelerator.save_state(str(tmp_path / "state"))
        saved = [p.detach().clone() for p in net.parameters()]
        with torch.no_grad():
            for p in net.parameters():
                p.zero_()
        accelerator.load_state(str(tmp_path / "state"))
        for p, q in zip(net.parameters(), saved):
            torch.testing.assert_close(p, q, rtol=0, atol=0)
        x = torch.randn(4, 6)
        torch.testing.assert_close(model(x), ref(x))  # (the loaded values reached the workers)
    finally:
        model.close()


_RANK = r"""
import json, os, sys, torch, dpool
res = {}
from accelerate import Accelerator
accelerator = Accelerator(cpu=True)
res["processes"] = accelerator.num_processes
model = dpool.wrap(torch.nn.Linear(3, 2), ["cpu"], process_group=None)
try:
    accelerator.prepare(model)
    res["accelerate"] = "accepted"
except dpool.UnsupportedError as e:
    res["accelerate"] = str(e)
model.close()

from transformers import BertConfig, BertForSequenceClassification, TrainingArguments
from dpool.integrations.transformers import DpoolTrainer
bert = BertForSequenceClassification(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                                num_attention_heads=2, intermediate_size=32))
try:
    DpoolTrainer(model=bert, args=TrainingArguments(sys.argv[1], use_cpu=True, report_to=[]), device_ids=["cpu"])
    res["transformers"] = "accepted"
except dpool.UnsupportedError as e:
    res["transformers"] = str(e)

import lightning as L
from dpool.integrations.lightning import DpoolStrategy
class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 1)
    def forward(self, x):
        return self.lin(x)
    def training_step(self, batch, i):
        return self(batch[0]).sum()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 3)), batch_size=4)
try:
    L.Trainer(strategy=DpoolStrategy(device_ids=["cpu"]), accelerator="cpu", max_steps=1, logger=False,
              enable_checkpointing=False, enable_progress_bar=False).fit(Module(), loader)
    res["lightning"] = "accepted"
except dpool.UnsupportedError as e:
    res["lightning"] = str(e)
print("RESULT " + json.dumps(res), flush=True)
"""


def test_a_multi_process_launch_is_refused_by_accelerate_hf_and_lightning(tmp_path):
    """Under torchrun, accelerate's prepare() would put DistributedDataParallel around the dpool model (the
    gradients reduced twice): refused at prepare(), as DpoolTrainer and DpoolStrategy refuse the launch."""
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    torchrun = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    res = subprocess.run([torchrun, "--standalone", "--nproc-per-node=2", str(script), str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=200, cwd=ROOT, env=env)
    results = [json.loads(line[len("RESULT "):]) for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    assert res.returncode == 0 and len(results) == 2, res.stdout + res.stderr[-4000:]
    for r in results:
        assert r["processes"] == 2
        assert "DistributedDataParallel around a dpool model" in r["accelerate"] and "one process" in r["accelerate"]
        assert "process 0 of 2" in r["transformers"] or "process 1 of 2" in r["transformers"]
        assert "runs in one process" in r["lightning"] and "2 processes" in r["lightning"]
