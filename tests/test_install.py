"""Zero lines changed: ``dpool.install()`` and ``python -m dpool script.py`` run scripts written for torch's
``nn.DataParallel`` and HF's ``Trainer`` on dpool workers, against the same training written for dpool.
(Lightning's ``strategy="dp"`` under ``dpool.installed()``: tests/test_integration_lightning.py.)"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import types
import warnings

import pytest
import torch

import dpool
from tests.conftest import wait_for
from tests.helpers import PYPATH, ROOT, run_script, running

pytestmark = pytest.mark.timeout(240)

TORCH_DP = torch.nn.DataParallel


def _env(**extra: str) -> dict:
    return dict(os.environ, PYTHONPATH=PYPATH, PYTHONFAULTHANDLER="1", **extra)


def _dpool_cli(*args: str, cwd: str = ROOT, timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dpool", *args], capture_output=True, text=True, timeout=timeout,
                          env=_env(), cwd=cwd)


def _result(res: subprocess.CompletedProcess) -> dict:
    lines = [line for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    assert res.returncode == 0 and lines, f"rc={res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-5000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def _started_workers(stderr: str) -> list[int]:
    """The worker pids of dpool's "started N worker(s) ... (pids [...])" lines: how a user sees it ran."""
    return [int(p) for found in re.findall(r"started \d+ worker\(s\) .*?\(pids \[([\d, ]+)\]\)", stderr)
            for p in found.split(",")]


# ------------------------------------------------------------------------------ torch's DataParallel
_DP_SCRIPT = """
import json, os, sys, torch
from torch import nn
{imports}

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))

    def forward(self, x):  # the process that ran each row comes back with the output
        return self.body(x), torch.full((x.shape[0],), os.getpid())

class Outer(nn.Module):  # calls data_parallel inside its forward, as pytorch/examples' DCGAN does
    def __init__(self):
        super().__init__()
        self.inner = Net()

    def forward(self, x):
        return {functional}

def train(make, dtype):
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, pids = [], set()
    for step in range(3):
        y, who = model(torch.randn(8, 6, dtype=dtype))
        loss = y.pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        pids |= set(who.tolist())
    return {{"losses": losses, "params": [p.tolist() for p in model.parameters()], "pids": sorted(pids),
             "type": type(model).__module__}}

print("RESULT " + json.dumps({{
    "me": os.getpid(),
    "plain": train(lambda: {wrap}(Net()), torch.float32),
    "wrapped_then_moved": train(lambda: {moved}, torch.float64),
    "functional": train(Outer, torch.float32),
}}))
"""
UNCHANGED_DP = _DP_SCRIPT.format(imports="", wrap="nn.DataParallel", functional="nn.parallel.data_parallel(self.inner, x)",
                                moved='nn.DataParallel(Net()).to("cpu", torch.float64)')
WITH_DPOOL = _DP_SCRIPT.format(imports="import dpool", wrap="(lambda m: dpool.wrap(m, ['cpu', 'cpu']))",
                               functional="dpool.data_parallel(self.inner, x, ['cpu', 'cpu'])",
                               moved="dpool.wrap(Net().to('cpu', torch.float64), ['cpu', 'cpu'])")


def test_an_unchanged_dataparallel_script_trains_on_the_workers_like_dpool_wrap(tmp_path):
    """nn.DataParallel(net), nn.DataParallel(net).to(...) (wrapped before the module moves: the workers start at the
    first forward) and nn.parallel.data_parallel inside a forward, run as `python -m dpool --device-ids cpu,cpu`."""
    script = tmp_path / "train.py"
    script.write_text(UNCHANGED_DP)
    res = _dpool_cli("--device-ids", "cpu,cpu", str(script))
    got = _result(res)
    ref = _result(run_script(WITH_DPOOL, timeout=150))
    assert f"dpool {dpool.__version__}: installed (workers: cpu,cpu)" in res.stderr
    for case in ("plain", "wrapped_then_moved", "functional"):
        ran, want = got[case], ref[case]
        assert len(ran["pids"]) == 2 and got["me"] not in ran["pids"], (case, ran["pids"])  # in two workers
        assert ran["losses"] == pytest.approx(want["losses"], rel=1e-6), case
        for p, q in zip(ran["params"], want["params"]):
            torch.testing.assert_close(torch.tensor(p), torch.tensor(q), msg=case)
    assert got["plain"]["type"] == "dpool.installer"
    workers = _started_workers(res.stderr)
    assert len(workers) == 6 and wait_for(lambda: not any(running(p) for p in workers), timeout=10)


# ------------------------------------------------------------------------------------------ HF Trainer
_HF_SCRIPT = """
import json, sys, torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments
{imports}

out = sys.argv[1]
torch.manual_seed(0)
model = BertForSequenceClassification(BertConfig(
    vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3, max_position_embeddings=16))
g = torch.Generator().manual_seed(0)
data = [{{"input_ids": torch.randint(0, 50, (8,), generator=g), "attention_mask": torch.ones(8, dtype=torch.long),
          "label": int(torch.randint(0, 3, (1,), generator=g))}} for _ in range(32)]
args = TrainingArguments(out, use_cpu=True, per_device_train_batch_size=4, per_device_eval_batch_size=4, max_steps=3,
                         learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="no", seed=0,
                         dataloader_drop_last=True, disable_tqdm=True)
trainer = {trainer}(model=model, args=args, train_dataset=data, eval_dataset=data[:16]{extra})
trainer.train()
evaluation = trainer.evaluate()
trainer.save_model(out + "/saved")
print("RESULT " + json.dumps({{
    "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h], "eval": evaluation["eval_loss"],
    "batch": trainer.args.train_batch_size, "steps": trainer.state.global_step,
    "dpool": [c.__name__ for c in type(trainer).__mro__[:2]]}}))
"""


def test_an_unchanged_hf_trainer_script_equals_dpool_trainer(tmp_path, capsys, monkeypatch):
    """A plain `Trainer(...)` script under `python -m dpool --device-ids cpu,cpu` trains as DpoolTrainer with those
    devices: the same logged losses, evaluation, batch (per device x workers) and saved parameters (bare keys)."""
    pytest.importorskip("transformers")
    from transformers import BertForSequenceClassification

    script = tmp_path / "hf.py"
    script.write_text(_HF_SCRIPT.format(imports="", trainer="Trainer", extra=""))
    res = _dpool_cli("--device-ids", "cpu,cpu", str(script), str(tmp_path / "cli"), timeout=200)
    got = _result(res)
    reference = _HF_SCRIPT.format(imports="from dpool.integrations.transformers import DpoolTrainer",
                                  trainer="DpoolTrainer", extra=", device_ids=['cpu', 'cpu']")
    monkeypatch.setattr(sys, "argv", ["reference", str(tmp_path / "ref")])
    capsys.readouterr()
    exec(compile(reference, "reference", "exec"), {"__name__": "reference"})  # (here: transformers is loaded)
    ref = json.loads(capsys.readouterr().out.split("RESULT ")[-1])
    assert got["dpool"] == ["Trainer", "DpoolTrainerMixin"]  # (a Trainer of the script's class, dpool's mixin first)
    assert got["batch"] == ref["batch"] == 8 and got["steps"] == 3
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5) and len(got["losses"]) == 3
    assert got["eval"] == pytest.approx(ref["eval"], rel=1e-5)
    saved, want = (BertForSequenceClassification.from_pretrained(str(tmp_path / run / "saved")) for run in ("cli", "ref"))
    for (name, p), q in zip(saved.named_parameters(), want.parameters()):
        torch.testing.assert_close(p, q, msg=name)
    workers = _started_workers(res.stderr)
    assert len(workers) == 4  # train(), then evaluate(): two workers each
    assert wait_for(lambda: not any(running(p) for p in workers), timeout=10)


def test_trainers_made_while_installed_are_dpool_trainers_also_when_transformers_came_first(tmp_path):
    """transformers imported before install() (patched at once, not by the import hook), a subclass defined before
    it: every Trainer made while installed is a DpoolTrainer of its class; after uninstall() none is."""
    transformers = pytest.importorskip("transformers")
    from dpool.integrations.transformers import DpoolTrainerMixin

    class Mine(transformers.Trainer):
        pass

    model = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, num_labels=3,
        max_position_embeddings=16))
    args = transformers.TrainingArguments(str(tmp_path), use_cpu=True, per_device_train_batch_size=3, report_to=[])
    with dpool.installed(device_ids=["cpu", "cpu"]):
        made = Mine(model=model, args=args)
        assert isinstance(made, Mine) and isinstance(made, DpoolTrainerMixin) and type(made).__name__ == "Mine"
        assert made.args.train_batch_size == 6 and args.train_batch_size == 3  # (the script's args untouched)
        assert made._dpool.device_ids == ["cpu", "cpu"]
    assert not isinstance(Mine(model=model, args=args), DpoolTrainerMixin)


# --------------------------------------------------------------------- install(), uninstall(), installed()
def test_install_replaces_torchs_names_and_uninstall_puts_the_same_objects_back():
    function = torch.nn.parallel.data_parallel
    module = sys.modules["torch.nn.parallel.data_parallel"]
    try:
        dpool.install(device_ids=["cpu", "cpu"])
        dpool.install(device_ids=["cpu", "cpu"])  # idempotent
        ours = torch.nn.DataParallel
        assert ours is torch.nn.parallel.DataParallel is module.DataParallel and ours is not TORCH_DP
        assert issubclass(ours, TORCH_DP) and dpool.is_wrapped(ours(torch.nn.Linear(2, 2)))
        assert torch.nn.parallel.data_parallel is module.data_parallel is not function
        with dpool.installed(device_ids=["cpu"]):  # another installation for the block, then this one again
            assert torch.nn.DataParallel(torch.nn.Linear(2, 2)).device_ids == ["cpu"]
        assert torch.nn.DataParallel(torch.nn.Linear(2, 2)).device_ids == ["cpu", "cpu"]
    finally:
        dpool.uninstall()
        dpool.uninstall()  # idempotent
    assert torch.nn.DataParallel is torch.nn.parallel.DataParallel is module.DataParallel is TORCH_DP
    assert torch.nn.parallel.data_parallel is module.data_parallel is function
    with dpool.installed():
        pass
    assert torch.nn.DataParallel is TORCH_DP


def test_the_installed_dataparallel_starts_at_its_first_forward_and_shares_a_modules_pool():
    net = torch.nn.Linear(4, 2)
    with dpool.installed(device_ids=["cpu", "cpu"]):
        first = torch.nn.DataParallel(net, device_ids=[0, 1], output_device=0)  # (the installation's devices win)
        assert first.pids == [] and first.device_ids == ["cpu", "cpu"]  # nothing started yet
        first(torch.randn(6, 4)).sum().backward()
        assert len(first.pids) == 2
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # (the same arguments: no "closing that pool" warning)
            again = torch.nn.DataParallel(net)  # what HF's evaluate() does each time: it joins the pool
            again(torch.randn(3, 4))
        assert again.pids == first.pids
        assert again.in_features == 4 and again.extra_repr is not net.extra_repr  # the module's, where it lacks one
        del first  # dropping one wrapper never breaks the other
        again(torch.randn(3, 4)).sum().backward()
        pids = again.pids
        again.close()
    assert wait_for(lambda: not any(running(p) for p in pids), timeout=10)


def test_an_error_of_the_first_forward_is_the_one_wrap_raises():
    class Locked(torch.nn.Linear):
        def __init__(self):
            super().__init__(2, 2)
            self.lock = __import__("threading").Lock()  # cannot be pickled to a worker

    with pytest.raises(dpool.UnpicklableModelError) as at_wrap:
        dpool.wrap(Locked(), ["cpu", "cpu"])
    with dpool.installed(device_ids=["cpu", "cpu"]):
        model = torch.nn.DataParallel(Locked())  # constructed: arguments only
        with pytest.raises(dpool.UnpicklableModelError) as at_forward:
            model(torch.randn(2, 2))
    assert str(at_forward.value) == str(at_wrap.value)


def test_subclasses_of_the_installed_dataparallel():
    class Before(torch.nn.DataParallel):  # created before install(): keeps torch's base
        pass

    with dpool.installed(device_ids=["cpu", "cpu"]):
        class Scatters(torch.nn.DataParallel):
            def scatter(self, inputs, kwargs, device_ids):
                return super().scatter(inputs, kwargs, device_ids)

        class Forwards(torch.nn.DataParallel):  # kept: it runs here, around dpool's forward
            def forward(self, *inputs, **kwargs):
                return super().forward(*inputs, **kwargs) * 2

        with pytest.raises(dpool.UnsupportedError, match=r"Scatters overrides nn.DataParallel.scatter.*"
                                                         r"dpool.uninstall\(\)") as refused:
            Scatters(torch.nn.Linear(2, 2))
        assert isinstance(refused.value, NotImplementedError)
        net = torch.nn.Linear(3, 1)
        with Forwards(net) as model:
            x = torch.randn(4, 3)
            torch.testing.assert_close(model(x), net(x) * 2)
        assert not issubclass(Before, dpool.DataParallel) and not dpool.is_wrapped(Before(net))


def test_a_module_holding_torchs_class_under_its_own_name_is_named_once():
    early = types.ModuleType("early_binder")
    early.DP = TORCH_DP
    sys.modules["early_binder"] = early
    try:
        with pytest.warns(UserWarning, match=r"early_binder\.DP still names torch's DataParallel"):
            dpool.install(device_ids=["cpu"])
        dpool.uninstall()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            dpool.install(device_ids=["cpu"])  # once
    finally:
        dpool.uninstall()
        del sys.modules["early_binder"]


# ------------------------------------------------------------------------------------- the command line
def test_python_m_dpool_runs_a_script_as_python_would(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    show = ("import sys, os\nprint('ARGV', sys.argv[1:], os.path.basename(__file__), sys.path[0] == {where!r})\n"
            "if '--fail' in sys.argv: raise ValueError('the script failed')\nsys.exit(int(sys.argv[-1]))\n")
    (tmp_path / "pkg" / "job.py").write_text(show.format(where=str(tmp_path)))
    (tmp_path / "script.py").write_text(show.format(where=str(tmp_path)))
    res = _dpool_cli("script.py", "--flag", "x", "3", cwd=str(tmp_path))  # the script's own options pass through
    assert res.returncode == 3 and "ARGV ['--flag', 'x', '3'] script.py True" in res.stdout, res.stderr
    res = _dpool_cli("--max-restarts", "1", "-m", "pkg.job", "-v", "4", cwd=str(tmp_path))
    assert res.returncode == 4 and "ARGV ['-v', '4'] job.py True" in res.stdout, res.stderr
    # a failure: Python's exit status and traceback, from the script's frame on
    res = _dpool_cli("script.py", "--fail", "0", cwd=str(tmp_path))
    plain = subprocess.run([sys.executable, "script.py", "--fail", "0"], capture_output=True, text=True,
                           cwd=str(tmp_path), timeout=60)
    assert res.returncode == plain.returncode == 1
    assert res.stderr.split("Traceback")[1] == plain.stderr.split("Traceback")[1]
    # wrong usage: an error before anything runs
    for args, says in ((["--device-ids", "cpu,cpu"], "required"), (["missing.py"], "can't open file 'missing.py'"),
                       (["--device-ids", "tpu,cpu", "script.py"], "--device-ids tpu,cpu"),
                       (["--device-ids", "cpu,0", "script.py"], "mix CPU and GPU"),
                       (["--max-restarts", "-1", "script.py"], "--max-restarts"),
                       (["-m", "no_such_pkg.job"], "no module named 'no_such_pkg.job'")):
        res = _dpool_cli(*args, cwd=str(tmp_path), timeout=60)
        assert res.returncode == 2 and says in res.stderr and "ARGV" not in res.stdout, (args, res.stderr)


def test_ctrl_c_ends_a_script_under_python_m_dpool_as_without_it(tmp_path):
    (tmp_path / "slow.py").write_text(textwrap.dedent("""
        import time, torch
        model = torch.nn.DataParallel(torch.nn.Linear(2, 2))
        model(torch.randn(4, 2))
        print("READY", *getattr(model, "pids", []), flush=True)
        time.sleep(60)
    """))
    codes = {}
    for how in (["-m", "dpool", "--device-ids", "cpu,cpu"], []):
        # (SIGINT at its default first: a background job of a non-interactive shell, as CI may start the tests,
        # inherits it ignored, and Python then installs no KeyboardInterrupt handler, with or without dpool)
        proc = subprocess.Popen([sys.executable, *how, "slow.py"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=_env(), cwd=str(tmp_path),
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        ready = proc.stdout.readline()
        assert ready.startswith("READY"), proc.communicate(timeout=30)
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        codes[bool(how)] = (proc.returncode, err.strip().splitlines()[-1])
        workers = [int(p) for p in ready.split()[1:]]
        assert wait_for(lambda: not any(running(p) for p in workers), timeout=10)
    assert codes[True] == codes[False] == (-signal.SIGINT, "KeyboardInterrupt")


# ------------------------------------------------------------------------------------------ a notebook
def test_install_in_a_jupyter_kernel_then_uninstall():
    code = """
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in (
        "import os, torch, dpool\\ntorchs = torch.nn.DataParallel\\ndpool.install(device_ids=['cpu', 'cpu'])",
        "torch.manual_seed(0)\\nnet = torch.nn.Linear(4, 1)\\nmodel = torch.nn.DataParallel(net)\\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)",
        "for _ in range(3):\\n    opt.zero_grad()\\n    model(torch.randn(8, 4)).pow(2).mean().backward()\\n"
        "    opt.step()\\nprint('PIDS', os.getpid(), *model.pids)",
        "model.close()\\ndpool.uninstall()\\nprint('RESTORED', torch.nn.DataParallel is torchs, "
        "torch.nn.parallel.DataParallel is torchs)",
    )]
    NotebookClient(nb, kernel_name="python3", timeout=90).execute()
    for cell in nb.cells[2:]:
        print(cell.outputs[0]["text"].strip())
    """
    res = run_script(code, timeout=150)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "RESTORED True True" in res.stdout
    kernel, *workers = (int(p) for p in res.stdout.split("PIDS")[1].split("\n")[0].split())
    assert len(workers) == 2
    assert wait_for(lambda: not any(running(p) for p in [kernel, *workers]), timeout=10)
    assert not [f for f in os.listdir("/dev/shm") if str(kernel) in f]
