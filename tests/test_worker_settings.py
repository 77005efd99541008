"""Process-wide settings the replicas must share with the master (default dtype, deterministic mode, float32
precision, attention and convolution backends, anomaly detection): each reaches the workers."""
from __future__ import annotations

import contextlib
import copy


import pytest
import torch
from torch import nn



class _Constants(nn.Module):
    """A forward that makes tensors of the default dtype: what torch.set_default_dtype changes."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 4)

    def forward(self, x):
        h = self.lin(x)
        return h + (torch.arange(h.shape[1]) * 1e6 + 0.1)  # float32 would keep 1000000.125, not .1


@pytest.mark.parametrize("when", ["before_wrap", "after_wrap"])
def test_the_default_dtype_and_deterministic_mode_reach_the_workers(wrap, when):
    """torch.set_default_dtype(torch.float64) changes what a forward computes, and DataParallel's replicas,
    in its one process, follow it; so must dpool's workers, whether it was set before wrap() or after.
    The same for torch.use_deterministic_algorithms."""
    torch.manual_seed(0)
    net = _Constants().double()
    ref = copy.deepcopy(net)
    x = torch.randn(5, 6, dtype=torch.float64)
    try:
        if when == "before_wrap":
            torch.set_default_dtype(torch.float64)
            torch.use_deterministic_algorithms(True, warn_only=True)
        model = wrap(net)
        if when == "after_wrap":
            torch.testing.assert_close(model(x), ref(x))  # (float32 in both)
            torch.set_default_dtype(torch.float64)
            torch.use_deterministic_algorithms(True, warn_only=True)
        torch.testing.assert_close(model(x), ref(x), rtol=0, atol=1e-9)
        assert model.worker_states(lambda r: (torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled(),
                                              torch.is_deterministic_algorithms_warn_only_enabled())) == \
            [(torch.float64, True, True)] * 2
    finally:
        torch.set_default_dtype(torch.float32)
        torch.use_deterministic_algorithms(False)
    torch.testing.assert_close(model(x), ref(x))  # and back


def test_the_float32_precision_reaches_the_workers(wrap):
    """torch.set_float32_matmul_precision("medium"), or torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    (torch's newer API, whose use makes the legacy getter raise), lets a CPU with AVX512-BF16 or AMX compute
    float32 matmuls with bf16. DataParallel's replicas, in its one process, follow it; the workers ignored
    it (a difference of 6e-7 here) and must follow it. Their settings are read back, and the outputs equal
    the coordinator's on the same shards bitwise."""
    from dpool.numerics import CPU_PRECISION_OPS, fp32_precision, precision_state, set_precision_state

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256))
    ref = copy.deepcopy(net)
    model = wrap(net)
    x = torch.randn(8, 256)
    saved = precision_state()
    try:
        for setting in ("legacy", "new", "back"):
            set_precision_state(saved)
            if setting == "legacy":
                torch.set_float32_matmul_precision("medium")
            elif setting == "new":
                torch.backends.mkldnn.matmul.fp32_precision = "bf16"
            out = model(x)
            assert model.worker_states(lambda r: fp32_precision(CPU_PRECISION_OPS)) == \
                [fp32_precision(CPU_PRECISION_OPS)] * 2, setting
            assert (fp32_precision(CPU_PRECISION_OPS)[2] == "bf16") == (setting != "back")
            torch.testing.assert_close(out, torch.cat([ref(x[:4]), ref(x[4:])]), rtol=0, atol=0,
                                       msg=lambda m: f"{setting}: {m}")
    finally:
        set_precision_state(saved)


def _precision_as_libraries_read_it(_model=None) -> tuple:
    """torch's legacy getters, which libraries read (and which raise where the two APIs disagree)."""
    answers = []
    for get in (torch.get_float32_matmul_precision, lambda: torch.backends.cuda.matmul.allow_tf32,
                lambda: torch.backends.cudnn.allow_tf32):
        try:
            answers.append(get())
        except RuntimeError:
            answers.append("raises")
    return tuple(answers)


class _ReadsThePrecision(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        fast = torch.get_float32_matmul_precision() != "highest"  # as a library picks a kernel
        return self.lin(x) * (2.0 if fast else 1.0)


def test_torchs_legacy_precision_getters_answer_in_the_workers_as_in_one_process(wrap):
    """torch keeps the legacy precision settings (torch.set_float32_matmul_precision, cudnn.allow_tf32) beside
    the per-operation ones, and its legacy getters raise where the two disagree. Workers were given only the
    per-operation values: after torch.set_float32_matmul_precision("high") in the script, a forward that
    called torch.get_float32_matmul_precision() raised in the workers alone (found on a GPU machine, where
    torch.backends.cuda.matmul.allow_tf32 raised too). The workers' getters must answer as the coordinator's:
    with its values, or raising where it mixed the two APIs itself."""
    from dpool.numerics import precision_state, set_precision_state

    torch.manual_seed(0)
    net = _ReadsThePrecision()
    model = wrap(net)
    x = torch.randn(4, 4)
    saved, before = precision_state(), _precision_as_libraries_read_it()
    try:
        for setting in ("high", "cudnn_off", "highest", "mixed"):
            if setting in ("high", "highest"):
                torch.set_float32_matmul_precision(setting)
            elif setting == "cudnn_off":
                torch.backends.cudnn.allow_tf32 = False
            else:  # the per-operation API alone: the coordinator's own legacy getters raise
                torch.backends.cuda.matmul.fp32_precision = "tf32"
            here = _precision_as_libraries_read_it()
            assert ("raises" in here) == (setting == "mixed"), (setting, here)
            if setting == "mixed":  # the forward raises as it does in one process, and the pool stays usable
                for run in (net, model):
                    with pytest.raises(RuntimeError, match="mix of the legacy and new APIs"):
                        run(x)
            else:
                torch.testing.assert_close(model(x), net(x), msg=setting)
            assert model.worker_states(_precision_as_libraries_read_it) == [here] * 2, setting
    finally:
        set_precision_state(saved)
    assert _precision_as_libraries_read_it() == before


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)  # 3 × (batch, heads, length, 8)
        return self.out(nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))


def test_the_attention_backend_choice_reaches_the_workers(wrap):
    """`with sdpa_kernel(SDPBackend.MATH):` sets scaled_dot_product_attention's backends for the process, so
    DataParallel's replicas follow it. On a CPU it picks the math kernel over flash, whose backward has no
    derivative: a gradient penalty through attention works only under it. The workers ignored it, so the
    penalty failed there ("derivative ... not implemented") and outputs differed from one process's. Now the
    outputs equal the reference's on the same shards bitwise, and the penalty's gradients match."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from dpool.numerics import sdp_settings

    torch.manual_seed(0)
    net = _Attention()
    ref = copy.deepcopy(net)
    model = wrap(net)
    x = torch.randn(4, 24, 16)
    for kernel in ("math", "default"):
        with (sdpa_kernel(SDPBackend.MATH) if kernel == "math" else contextlib.nullcontext()):
            with torch.no_grad():
                torch.testing.assert_close(model(x), torch.cat([ref(x[:2]), ref(x[2:])]), rtol=0, atol=0,
                                           msg=lambda m: f"{kernel}: {m}")
            assert model.worker_states(lambda r: sdp_settings()) == [sdp_settings()] * 2, kernel
            if kernel == "math":  # a gradient penalty, as WGAN-GP's
                for m in (model, ref):
                    xi = x.clone().requires_grad_()
                    g, = torch.autograd.grad(m(xi).sum(), xi, create_graph=True)
                    g.pow(2).sum().backward()
                for (n, p), rp in zip(net.named_parameters(), ref.parameters()):
                    torch.testing.assert_close(p.grad, rp.grad, msg=n)


def test_the_transformer_fast_path_setting_reaches_the_workers(wrap):
    """`torch.backends.mha.set_fastpath_enabled(False)` keeps nn.TransformerEncoder off its inference fast
    path, which returns zeros at padded positions where the other path returns values. The workers kept
    the fast path: outputs apart by 2.5 there."""
    torch.manual_seed(0)
    net = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 1).eval()
    model = wrap(net)
    x, mask = torch.randn(4, 6, 16), torch.zeros(4, 6, dtype=torch.bool)
    mask[:, 4:] = True
    try:
        for fast in (False, True):
            torch.backends.mha.set_fastpath_enabled(fast)
            with torch.no_grad():
                out, ref = model(x, src_key_padding_mask=mask), net(x, src_key_padding_mask=mask)
            torch.testing.assert_close(out, ref, msg=lambda m: f"fast path {fast}: {m}")
    finally:
        torch.backends.mha.set_fastpath_enabled(True)


def test_the_cpu_convolution_backend_setting_reaches_the_workers(wrap):
    """`torch.backends.mkldnn.enabled = False` (a common work-around for a oneDNN bug) moves convolutions to
    torch's own kernels, whose values differ in the last bits (7e-7): the workers kept oneDNN. Now the
    outputs equal the reference's on the same shards bitwise."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(8, 8, 3), nn.Tanh(), nn.Conv2d(8, 4, 3))
    model = wrap(net)
    x = torch.randn(4, 8, 16, 16)
    from dpool.numerics import numerics

    try:
        for enabled in (False, True):
            torch.backends.mkldnn.enabled = enabled
            torch.utils.deterministic.fill_uninitialized_memory = enabled
            with torch.no_grad():
                torch.testing.assert_close(model(x), torch.cat([net(x[:2]), net(x[2:])]), rtol=0, atol=0,
                                           msg=lambda m: f"mkldnn {enabled}: {m}")
            assert model.worker_states(lambda r: numerics()) == [numerics()] * 2
    finally:
        torch.backends.mkldnn.enabled = True
        torch.utils.deterministic.fill_uninitialized_memory = True


def test_the_gpu_settings_are_read_after_torchs_newer_precision_api_was_used():
    """A GPU pool reads the coordinator's TF32 settings before each forward. It read them through
    torch.get_float32_matmul_precision(), which raises once torch.backends.cuda.matmul.fp32_precision (the
    API torch's docs now advise) has been set: every forward of a GPU pool failed. These are plain process
    settings, read and written the same way on a CPU-only machine."""
    from dpool.numerics import CUDA_PRECISION_OPS, apply_numerics, fp32_precision, legacy_precision, numerics
    from dpool.numerics import precision_state, set_precision_state

    saved, before = precision_state(), numerics()
    try:
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        torch.backends.cudnn.conv.fp32_precision = "ieee"
        values = numerics()
        assert values != before and values[5][-4:] == fp32_precision(CUDA_PRECISION_OPS)
        apply_numerics(before, legacy=saved[0])
        assert numerics() == before
        apply_numerics(values, legacy=legacy_precision())
        assert numerics() == values and torch.backends.cuda.matmul.fp32_precision == "tf32"
    finally:
        set_precision_state(saved)


class _NaNBackward(nn.Module):
    """A finite forward whose backward makes a NaN (sqrt's gradient at 0 is inf, times 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 4)

    def forward(self, x):
        h = self.lin(x)
        return h + torch.sqrt(h - h) * 0


def test_anomaly_detection_reaches_the_workers_backward(wrap):
    """torch.autograd.set_detect_anomaly(True) makes a backward that produces NaN raise, naming the
    function, in one process and in DataParallel's replicas; dpool's workers follow it (without it, the
    NaN would reach the master's gradients silently)."""
    model = wrap(_NaNBackward())
    x = torch.randn(5, 6)
    model(x).sum().backward()
    assert torch.isnan(model.module.lin.weight.grad).all()  # the case anomaly detection is for
    try:
        torch.autograd.set_detect_anomaly(True)
        with pytest.raises(RuntimeError, match="SqrtBackward0.*returned nan values"):
            model(x).sum().backward()
    finally:
        torch.autograd.set_detect_anomaly(False)
    model(x).sum().backward()  # the pool goes on, and the workers follow the switch back
    assert model.worker_states(lambda r: torch.is_anomaly_enabled()) == [False, False]
