"""The process settings that change what a forward or backward computes, which workers copy from the
coordinator (as nn.DataParallel's replicas, in its one process, share them).

:func:`numerics` is read before every forward (cheaply: see below) and sent through ``call_workers`` at the first
forward and whenever it changed; :func:`apply_numerics` sets it in a worker. The float32 precisions
(TF32 and bf16) of CPU and GPU are here; the other cuDNN and cuBLAS settings are
:func:`dpool.gpu.backend_flags`.
"""
from __future__ import annotations

import itertools
import operator
from typing import Any, Callable

import torch
import torch.backends.mha as _mha

__all__ = ["numerics", "apply_numerics", "fp32_precision", "set_fp32_precision", "legacy_precision", "precision_state",
           "set_precision_state", "sdp_settings", "CPU_PRECISION_OPS", "CUDA_PRECISION_OPS", "PRECISION_OPS"]


# torch's float32 precision settings (torch >= 2.9): "ieee", "tf32", "bf16", or "none" (the parent's), per
# (backend, operation). torch.set_float32_matmul_precision("medium") sets them too; on a CPU with AVX512-BF16
# or AMX, "bf16" for mkldnn makes float32 matmuls and convolutions compute in bf16. Read through torch._C: the
# torch.backends attributes are slower to read, and the legacy getter raises once the new API has been used.
_GET_PRECISION = getattr(torch._C, "_get_fp32_precision_getter", None)
_SET_PRECISION = getattr(torch._C, "_set_fp32_precision_setter", None)
CPU_PRECISION_OPS = (("generic", "all"), ("mkldnn", "all"), ("mkldnn", "matmul"), ("mkldnn", "conv"),
                     ("mkldnn", "rnn"))
CUDA_PRECISION_OPS = (("cuda", "all"), ("cuda", "matmul"), ("cuda", "conv"), ("cuda", "rnn"))
PRECISION_OPS = CPU_PRECISION_OPS + CUDA_PRECISION_OPS


def fp32_precision(ops: tuple) -> tuple:
    """The float32 precision of each ``(backend, operation)`` in ``ops`` (torch < 2.9, which has no such
    API: the matmul precision and cuDNN's TF32 switch, whatever ``ops`` is)."""
    if _GET_PRECISION is None:
        return torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    return tuple(itertools.starmap(_GET_PRECISION, ops))


def set_fp32_precision(ops: tuple, values: tuple) -> None:
    """Set what :func:`fp32_precision` read (parents first, so every child gets its own value)."""
    if _SET_PRECISION is None:
        torch.set_float32_matmul_precision(values[0])
        torch.backends.cudnn.allow_tf32 = values[1]
        return
    for (backend, op), value in zip(ops, values):
        _SET_PRECISION(backend, op, value)


# torch >= 2.9 keeps the legacy settings (torch.set_float32_matmul_precision, torch.backends.cudnn.allow_tf32)
# beside the per-operation ones, and its legacy getters (get_float32_matmul_precision(), ...matmul.allow_tf32,
# cudnn.allow_tf32, which libraries read) raise where the two disagree. A legacy setter sets both; the
# per-operation setters only their own. So a worker given only the per-operation values disagreed with
# itself where the coordinator did not, and those getters raised in the workers alone.
def legacy_precision() -> tuple[str | None, bool | None]:
    """The legacy matmul precision and cuDNN TF32 switch, each ``None`` where its getter raises (this process
    mixed the two APIs) or torch has only these (then :func:`fp32_precision` holds them)."""
    if _GET_PRECISION is None:
        return None, None
    values: list[Any] = []
    for get in (torch.get_float32_matmul_precision, torch._C._get_cudnn_allow_tf32):
        try:
            values.append(get())
        except RuntimeError:
            values.append(None)
    return values[0], values[1]


def precision_state() -> tuple:
    """Every float32 precision setting of this process, legacy and per operation, for :func:`set_precision_state`."""
    return legacy_precision(), fp32_precision(PRECISION_OPS)


def set_precision_state(state: tuple) -> None:
    """Set what :func:`precision_state` read: the legacy settings first (each sets some per-operation values
    too), then every per-operation value. Every getter of this process then answers (or raises) as it did
    where the state was read."""
    (matmul, cudnn_tf32), values = state
    if matmul is not None:
        torch.set_float32_matmul_precision(matmul)
    if cudnn_tf32 is not None:
        torch.backends.cudnn.allow_tf32 = cudnn_tf32
    set_fp32_precision(PRECISION_OPS, values)


# scaled_dot_product_attention's backends, as torch.nn.attention.sdpa_kernel sets them for the whole process:
# on a CPU they choose between the flash kernel (slightly different values, and a backward with no derivative
# of its own, so no gradient penalty through it) and the math one; on a GPU among flash, memory-efficient,
# cuDNN and math. Also whether the math backend may reduce in fp16/bf16, and the order backends are tried in.
def _sdp_pair(get: str, set_: str) -> tuple[Callable[[], Any], Callable[[Any], None]] | None:
    g, s = getattr(torch._C, get, None), getattr(torch._C, set_, None)
    return (g, s) if g is not None and s is not None else None


_SDP_FLAGS = tuple(pair for pair in (
    *(_sdp_pair(f"_get_{n}_sdp_enabled", f"_set_sdp_use_{n}")
      for n in ("flash", "mem_efficient", "math", "cudnn", "overrideable", "fa3")),
    _sdp_pair("_get_math_sdp_allow_fp16_bf16_reduction", "_set_math_sdp_allow_fp16_bf16_reduction"))
    if pair is not None)
_SDP_GETTERS = tuple(get for get, _ in _SDP_FLAGS)
_SDP_ORDER = _sdp_pair("_get_sdp_priority_order", "_set_sdp_priority_order")
_CALL = getattr(operator, "call", None) or operator.methodcaller("__call__")  # (operator.call: Python >= 3.11)


def sdp_settings() -> tuple:
    """The attention backends' flags, then their priority order (a tuple; ``()`` where torch has none)."""
    return (*map(_CALL, _SDP_GETTERS), tuple(_SDP_ORDER[0]()) if _SDP_ORDER else ())


def _set_sdp_settings(values: tuple) -> None:
    for (_, set_), value in zip(_SDP_FLAGS, values):
        set_(value)
    if _SDP_ORDER and values[-1]:
        _SDP_ORDER[1](list(values[-1]))


# the CPU's convolution backends (torch.backends.mkldnn.enabled = False falls back to torch's own kernels:
# values differ in the last bits), oneDNN's deterministic mode, fp16 matmuls reducing in fp16 on a CPU, and
# whether deterministic mode fills torch.empty's memory
_CPU_BACKENDS = tuple(pair for pair in (_sdp_pair(f"_get_{n}", f"_set_{n}") for n in (
    "mkldnn_enabled", "mkldnn_deterministic", "nnpack_enabled", "cpu_allow_fp16_reduced_precision_reduction",
    "deterministic_fill_uninitialized_memory")) if pair is not None)
_CPU_BACKEND_GETTERS = tuple(get for get, _ in _CPU_BACKENDS)


def numerics() -> tuple:
    """This process's settings that change what a forward or backward computes on any device: the default
    dtype (what ``torch.tensor(0.1)`` or ``torch.arange(n) * 0.5`` inside a forward make), deterministic
    algorithms, autograd's anomaly detection, and the float32 precision of matmuls, convolutions and RNNs
    on CPU and GPU (``torch.set_float32_matmul_precision``, ``torch.backends.mkldnn.matmul.fp32_precision``,
    TF32: ``torch.backends.cudnn.allow_tf32``, ``torch.backends.cuda.matmul.fp32_precision``), and
    the backends ``scaled_dot_product_attention`` may use (``torch.nn.attention.sdpa_kernel``), and
    whether ``nn.MultiheadAttention`` and ``nn.TransformerEncoder`` may take their fast path in inference
    (``torch.backends.mha.set_fastpath_enabled``: it returns zeros at padded positions, the other path
    values), the CPU's convolution backends (``torch.backends.mkldnn.enabled``, its ``deterministic``,
    ``torch.backends.nnpack.enabled``), fp16 reductions in CPU matmuls, and
    ``torch.utils.deterministic.fill_uninitialized_memory``. Workers follow the coordinator's, as
    nn.DataParallel's replicas in its one process do (cuDNN's other settings: :func:`dpool.gpu.backend_flags`)."""
    return (torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(), torch.is_anomaly_enabled(),
            torch.is_anomaly_check_nan_enabled(), fp32_precision(PRECISION_OPS), sdp_settings(),
            _mha._is_fastpath_enabled, tuple(map(_CALL, _CPU_BACKEND_GETTERS)))


def apply_numerics(values: tuple, _model: Any = None, legacy: tuple = (None, None)) -> None:
    """Set :func:`numerics` in this (worker) process, with the coordinator's :func:`legacy_precision` (read
    when sending: its getters raise in a process that mixed the APIs, which makes them too slow to compare
    before every forward). Only what differs, as ``torch.use_deterministic_algorithms`` imports torch's
    compiler (seconds) the first time it is called; the precisions always, each legacy setter changing some."""
    now = numerics()
    set_precision_state((legacy, values[5]))
    if values[0] != now[0]:
        torch.set_default_dtype(values[0])
    if values[1:3] != now[1:3]:
        torch.use_deterministic_algorithms(values[1], warn_only=values[2])
    if values[3:5] != now[3:5]:
        torch.autograd.set_detect_anomaly(values[3], check_nan=values[4])
    if values[6] != now[6]:
        _set_sdp_settings(values[6])
    if values[7] != now[7]:
        _mha.set_fastpath_enabled(values[7])
    if values[8] != now[8]:
        for (_, set_), value in zip(_CPU_BACKENDS, values[8]):
            set_(value)
