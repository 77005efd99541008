"""Errors: what a failure in a replica, at start or in the user's input raises (a typed error that is also the
builtin type torch raises, saying what failed, where and what to do), and that the master stays untouched."""
from __future__ import annotations

import builtins
import os
import re
import sys
import time

import psutil
import pytest
import torch
from torch import nn

import dpool
from tests.fault_scenarios import Fault, Victim, batch
from tests.helpers import ROOT, assert_unchanged, run_script, sigkill, snapshot


def train_step(model, opt, x):
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


def test_remote_exception_is_typed_and_pool_survives(wrap):
    net = Victim()
    model = wrap(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train_step(model, opt, batch())
    before = snapshot(net, opt)
    with pytest.raises(ValueError) as info:
        model(batch(Fault.VALUE_ERROR))
    err = info.value
    assert isinstance(err, dpool.RemoteError)
    assert err.worker == 1 and err.pid == model.pids[1] and err.device == "cpu"
    text = str(err)
    assert "Caught ValueError in worker 1 (cpu, pid" in text and "bad shard" in text and "shard 1" in text
    assert "raise ValueError" in str(err.__cause__) and "in forward" in err.remote_traceback
    assert_unchanged(before, snapshot(net, opt))  # buffers not committed, nothing touched
    train_step(model, opt, batch())  # the same pool keeps working
    with pytest.raises(dpool.RemoteError, match=r"_TwoArgs.*1/2"):
        model(batch(Fault.ODD_EXCEPTION))


def test_backward_exception_leaves_master_untouched(wrap):
    net = Victim()
    model = wrap(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train_step(model, opt, batch())
    model(batch()).sum().backward()  # grads present before the failing step
    out = model(batch(Fault.BACKWARD_FAILS, shard=0))
    before = snapshot(net, opt)  # after the (successful) forward: only the backward fails
    with pytest.raises(ArithmeticError, match="backward exploded") as info:
        out.sum().backward()
    assert isinstance(info.value, dpool.RemoteError) and info.value.worker == 0
    assert_unchanged(before, snapshot(net, opt))
    train_step(model, opt, batch())


def test_model_class_defined_in_main():
    code = """
    import copy, torch, dpool
    from torch import nn

    class Net(nn.Module):          # lives in __main__: shipped by value
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(5, 3)
        def forward(self, x):
            return helper(self.a(x))

    def helper(y):
        return y * 2

    torch.manual_seed(0)
    net = Net().double(); ref = copy.deepcopy(net)
    model = dpool.wrap(net, ["cpu", "cpu"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1); ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        x = torch.randn(7, 5, dtype=torch.float64)
        model(x).pow(2).sum().backward(); ref(x).pow(2).sum().backward()
        opt.step(); ropt.step(); opt.zero_grad(); ropt.zero_grad()
    assert all(torch.allclose(p, q) for p, q in zip(net.parameters(), ref.parameters()))
    model.close()
    print("OK")
    """
    res = run_script(code)
    assert res.returncode == 0 and res.stdout.strip().endswith("OK"), res.stderr


def test_model_class_from_module_on_coordinator_sys_path(wrap, tmp_path, monkeypatch):
    (tmp_path / "my_private_model.py").write_text(
        "import torch\n"
        "class Scale(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.w = torch.nn.Parameter(torch.full((3,), 2.0))\n"
        "    def forward(self, x):\n"
        "        return x * self.w\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_private_model

    model = wrap(my_private_model.Scale())
    x = torch.randn(4, 3)
    torch.testing.assert_close(model(x), x * 2)
    sys.modules.pop("my_private_model", None)


def test_unpicklable_model_fails_clearly():
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.lock = __import__("threading").Lock()

    with pytest.raises(TypeError, match="could not pickle the model") as info:
        dpool.wrap(Bad(), ["cpu"])
    assert isinstance(info.value, dpool.UnpicklableModelError)
    # checked before any worker is spawned, and the attribute that failed is named
    assert "model.lock: _thread.lock" in str(info.value) and "__getstate__" in str(info.value)
    # a TorchScript module (which pickle refuses deep inside, at its C++ half) is named with the way out
    scripted = nn.Sequential(nn.Linear(2, 2), torch.jit.script(nn.Sequential(nn.Linear(2, 2), nn.ReLU())))
    with pytest.raises(NotImplementedError, match=r"model\.1 is a TorchScript module .*eager module"):
        dpool.wrap(scripted, ["cpu"])
    with pytest.raises(dpool.UnsupportedError, match=r"the model is a TorchScript module"):
        dpool.wrap(torch.jit.trace(nn.Linear(2, 2), torch.randn(1, 2)), ["cpu"])
    assert psutil.Process().children() == []


def _error_cases(tmp_path):
    class TwoShapes(nn.Module):  # replicas return differently structured outputs
        def forward(self, x):
            return x if x.shape[0] > 3 else (x, x)

    def gather_mismatch():
        with dpool.wrap(TwoShapes(), ["cpu", "cpu"]) as m:
            m(torch.randn(7, 2))

    def dtype_change():
        net = nn.Linear(2, 2)
        with dpool.wrap(net, ["cpu"]) as m:
            net.weight.data = net.weight.data.double()
            m(torch.randn(2, 2))

    class TwoDicts(nn.Module):  # replicas return dicts with different keys: DataParallel's ValueError
        def forward(self, x):
            return {"a": x} if x.shape[0] > 3 else {"a": x, "b": x}

    def dict_keys():
        with dpool.wrap(TwoDicts(), ["cpu", "cpu"]) as m:
            m(torch.randn(7, 2))

    class TwoWidths(nn.Module):  # shapes that differ outside the batch dim: torch.cat's RuntimeError
        def forward(self, x):
            return x if x.shape[0] > 3 else torch.cat([x, x], 1)

    def shapes():
        with dpool.wrap(TwoWidths(), ["cpu", "cpu"]) as m:
            m(torch.randn(7, 2))

    def worker_killed():
        with dpool.wrap(nn.Linear(2, 2), ["cpu", "cpu"]) as m:
            sigkill(m.pids[1])
            m(torch.randn(4, 2))

    def closed():
        m = dpool.wrap(nn.Linear(2, 2), ["cpu"])
        m.close()
        m(torch.randn(2, 2))

    def no_shm_dir():
        os.environ["DPOOL_SHM_DIR"] = str(tmp_path / "missing")
        try:
            dpool.wrap(nn.Linear(2, 2), ["cpu"])
        finally:
            del os.environ["DPOOL_SHM_DIR"]

    return {
        "dict keys": (dict_keys, dpool.GatherError, ValueError),
        "shapes": (shapes, dpool.GatherError, RuntimeError),
        "worker killed": (worker_killed, dpool.WorkerDiedError, RuntimeError),
        "closed": (closed, dpool.PoolBrokenError, RuntimeError),
        "no shm dir": (no_shm_dir, dpool.SharedMemoryError, OSError),
        "unknown pool": (lambda: dpool.wrap(nn.Linear(2, 2), pool="no-such-pool-here"),
                         dpool.PoolNotFoundError, FileNotFoundError),
        "bad device": (lambda: dpool.wrap(nn.Linear(2, 2), ["tpu"]), dpool.DpoolValueError, ValueError),
        # a CPU master with GPU workers (or GPUs torch cannot see): DataParallel's device check
        "gpu ids": (lambda: dpool.wrap(nn.Linear(2, 2), [0, 0]), dpool.DpoolValueError, ValueError),
        "gather mismatch": (gather_mismatch, dpool.GatherError, RuntimeError),
        "dtype change": (dtype_change, dpool.ModelChangedError, RuntimeError),
        "device_ids type": (lambda: dpool.wrap(nn.Linear(2, 2), "cpu"), dpool.DpoolTypeError, TypeError),
    }


@pytest.mark.parametrize("case", ["unknown pool", "bad device", "gpu ids", "gather mismatch", "dtype change",
                                  "device_ids type", "dict keys", "shapes", "worker killed", "closed",
                                  "no shm dir"])
def test_every_error_is_a_dpool_error_and_its_builtin_type(case, tmp_path):
    fn, dpool_type, builtin = _error_cases(tmp_path)[case]
    with pytest.raises(dpool.DpoolError) as info:
        fn()
    assert isinstance(info.value, dpool_type) and isinstance(info.value, builtin), type(info.value).__mro__


def _error_table() -> dict[str, list[str]]:
    """docs/semantics.md's errors table: each dpool error and the builtin types it says it also is."""
    text = open(os.path.join(ROOT, "docs", "semantics.md")).read()
    rows = {}
    for line in text[text.index("| error | when | the same failure without dpool"):].splitlines()[2:]:
        if not line.startswith("| `dpool."):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        for name in re.findall(r"`dpool\.(\w+)`", cells[0]):
            rows[name] = [b for b in re.findall(r"`(\w+)`", cells[3].split("(")[0]) if hasattr(builtins, b)]
    return rows


@pytest.mark.parametrize("name", sorted(set(dpool.errors.__all__) - {"DpoolError", "remote_error"}))
def test_each_error_is_the_builtin_type_the_docs_table_names_for_it(name):
    """A row per error in docs/semantics.md, naming the builtin types torch raises for the same failure; the
    class is an instance of each, and of DpoolError (a RemoteError is of the model's own type instead)."""
    rows = _error_table()
    assert name in rows, f"docs/semantics.md's errors table has no row for dpool.{name}"
    cls = getattr(dpool, name)
    assert issubclass(cls, dpool.DpoolError)
    for builtin in rows[name]:
        assert issubclass(cls, getattr(builtins, builtin)), (name, builtin)
    stated = {getattr(builtins, b) for b in rows[name]}
    if name != "RemoteError":  # nothing beyond what the row says, but for the bases of what it says
        extra = [b.__name__ for b in cls.__mro__ if b.__module__ == "builtins" and b not in stated
                 and b not in (Exception, BaseException, object) and not any(issubclass(s, b) for s in stated)]
        assert not extra, (name, extra)


def test_a_failing_assert_of_a_pytest_test_module_is_an_assertion_error_with_pytests_explanation(wrap):
    """pytest rewrites the asserts of test modules (this one): a failing one calls helpers that pytest adds to
    the module's globals. A forward defined here raises AssertionError through dpool as in one process, with
    pytest's explanation of the failed comparison."""

    class Layer(nn.Module):
        def forward(self, x):
            rows = x.shape[0]
            assert rows == 99
            return x

    model = wrap(Layer())
    with pytest.raises(AssertionError) as info:
        model(torch.randn(20, 10))
    assert isinstance(info.value, dpool.RemoteError)
    assert "assert 10 == 99" in str(info.value)
    with pytest.raises(AssertionError, match="assert 3 == 99"):  # the pool is still usable
        model(torch.randn(6, 10))


def test_worker_side_unpickle_failure_names_stage():
    class Exploding(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def __setstate__(self, state):
            raise RuntimeError("cannot rebuild here")

    t0 = time.monotonic()
    with pytest.raises(dpool.WorkerStartError, match="unpickling the model.*cannot rebuild here"):
        dpool.wrap(Exploding(), ["cpu", "cpu"])
    assert time.monotonic() - t0 < 60


class _Packed(nn.Module):
    def __init__(self, total_length=None):
        super().__init__()
        self.rnn = nn.GRU(3, 4, batch_first=True)
        self.total_length = total_length

    def forward(self, x, lengths):
        from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.rnn(packed)
        return pad_packed_sequence(out, batch_first=True, total_length=self.total_length)[0]


def test_packed_sequences_get_the_faq_advice(wrap):
    from torch.nn.utils.rnn import pack_padded_sequence

    x, lengths = torch.randn(4, 6, 3), torch.tensor([6, 5, 2, 2])
    model = wrap(_Packed())
    with pytest.raises(TypeError, match="PackedSequence cannot be split.*pack inside forward") as info:
        model(pack_padded_sequence(x, lengths, batch_first=True))
    assert isinstance(info.value, dpool.DpoolError)
    with pytest.raises(dpool.GatherError, match=r"shapes \[\(2, 6, 4\), \(2, 2, 4\)\].*total_length"):
        model(x, lengths)  # shards pad to their own longest sequence
    fixed = wrap(_Packed(total_length=6))
    assert fixed(x, lengths).shape == (4, 6, 4)


@pytest.mark.parametrize("refused", ["packed_sequence", "dual_tensor"])
def test_a_refused_input_leaves_no_graph_behind_on_the_workers(wrap, refused):
    """The graph of an output let go of is freed by the workers with the next request. An input refused
    before any request (a PackedSequence; a dual tensor of forward-mode AD, whose tangent could not travel)
    must leave that release pending, not lose it: the workers would keep the graph for good."""
    import torch.autograd.forward_ad as fwAD
    from torch.nn.utils.rnn import pack_sequence

    model = wrap(nn.Linear(4, 2))
    out = model(torch.randn(6, 4))
    del out  # its graph is released with the next request
    if refused == "packed_sequence":
        with pytest.raises(TypeError, match="PackedSequence cannot be split"):
            model(pack_sequence([torch.randn(3, 4), torch.randn(2, 4)]))
    else:
        with fwAD.dual_level(), pytest.raises(dpool.UnsupportedError, match="dual tensor.*tangent"):
            model(fwAD.make_dual(torch.randn(6, 4), torch.randn(6, 4)))
    model(torch.randn(6, 4)).sum().backward()
    assert [w["graphs_kept"] for w in model.stats(inspect=True)["workers"]] == [0, 0]


def test_a_forward_that_fails_after_the_workers_ran_it_leaves_no_graph_on_them(wrap):
    """Replicas whose outputs disagree in structure: the coordinator's gather raises GatherError after the
    workers ran the forward with grad and kept its graph. Nothing tracked that call, so every such call
    used to leave one graph (its activations) on every worker for good."""

    class TwoShapes(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x):
            y = self.lin(x)
            return y if x.shape[0] > 3 else (y, y)

    model = wrap(TwoShapes())
    for _ in range(3):
        with pytest.raises(dpool.GatherError):
            model(torch.randn(7, 4))  # shards of 4 and 3 rows
    model(torch.randn(8, 4)).sum().backward()
    assert [w["graphs_kept"] for w in model.stats(inspect=True)["workers"]] == [0, 0]


def test_batchnorm_on_a_one_row_shard_names_the_shards_and_the_fix(wrap):
    model = wrap(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)), ["cpu", "cpu", "cpu"])
    with pytest.raises(ValueError, match=r"shards of \[2, 1, 1\] rows.*drop_last=True.*fewer workers"):
        model(torch.randn(4, 3))


class _GrowsABuffer(nn.Module):
    """A buffer that starts empty and takes its shape in the first forward, as QAT's per-channel observers do."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("seen_max", torch.tensor([]))

    def forward(self, x):
        if not self.seen_max.numel():
            self.seen_max.resize_(x.shape[1])
        self.seen_max.copy_(x.amax(0))
        return self.lin(x)


class _ShrinksABuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("window", torch.zeros(4))

    def forward(self, x):
        self.window.resize_(2)
        return self.lin(x)


def test_a_buffer_resized_by_the_forward_names_the_buffer_and_the_fix(wrap):
    """An empty buffer that takes its shape in the first forward (QAT's per-channel observers) grew a private
    copy in the workers, whose values never reached the master; one shrunk in place parted silently from the
    master's. Both are errors now, naming the buffer and the fix (torch's "Trying to resize storage that is
    not resizable" alone had left QAT users guessing)."""
    for net, match in ((_GrowsABuffer(), r"likely ones: seen_max\."), (_ShrinksABuffer(), r"; window\.")):
        model = wrap(net)
        with pytest.raises(RuntimeError, match=r"resized a parameter or buffer in place.*" + match
                                               + r".*one forward on the plain module before dpool\.wrap\(\)"):
            model(torch.randn(4, 3))
        model.close()
    net = _GrowsABuffer()
    net(torch.randn(2, 3))  # what the message advises: then the buffer has its shape
    model = wrap(net)
    x = torch.randn(4, 3)
    torch.testing.assert_close(model(x), net.lin(x))
    torch.testing.assert_close(net.seen_max, x[:2].amax(0))  # (the first shard's, as DataParallel keeps)


def test_meta_parameters_get_advice_without_cuda():
    net = nn.Linear(2, 2, device="meta")
    with pytest.raises(dpool.DpoolValueError, match="meta tensor.*to_empty") as info:
        dpool.wrap(net, ["cpu"])
    assert "CUDA" not in str(info.value) and "cuda" not in str(info.value)


class _Scalar(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(2, 1)

    def forward(self, x):
        return self.l(x).sum()


def test_scalar_gather_warning_points_at_the_users_line(wrap):
    import inspect

    model = wrap(_Scalar())
    with pytest.warns(UserWarning, match="all input tensors were scalars") as record:
        model(torch.randn(4, 2, requires_grad=True)); line = inspect.currentframe().f_lineno  # noqa: E702
    assert [(w.filename, w.lineno) for w in record] == [(__file__, line)]


def test_gpu_preflight_arithmetic_and_message():
    """The free-memory preflight of GPU workers (its numbers come from torch.cuda.mem_get_info on a
    GPU; tests/test_cuda.py runs it for real). Here: what it counts, and what it says."""
    from dpool.gpu import CONTEXT_BYTES, shortfall

    GiB = 1 << 30
    free = {"cuda:0": (80 * GiB, 80 * GiB), "cuda:1": (80 * GiB, 80 * GiB)}
    assert shortfall(["cuda:0", "cuda:0", "cuda:1"], GiB, free, spawn=True) is None
    # two workers on the master's GPU: a gradient arena and a context each; on another GPU a replica too
    tight = {"cuda:0": (2 * (GiB + CONTEXT_BYTES) - 1, 80 * GiB), "cuda:1": (2 * GiB + CONTEXT_BYTES, 80 * GiB)}
    msg = shortfall(["cuda:0", "cuda:0", "cuda:1"], GiB, tight, spawn=True)
    assert msg is not None and msg.count(" has ") == 1 and "cuda:0 has" in msg and "2 worker(s)" in msg
    assert "nvidia-smi" in msg and "fewer workers per GPU" in msg
    # attached (daemon) workers already have their contexts
    assert shortfall(["cuda:0", "cuda:0", "cuda:1"], GiB, tight, spawn=False) is None
