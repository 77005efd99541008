"""CUDA facts the coordinator and its workers share, apart from moving tensors.

The cuDNN and cuBLAS settings workers copy from the coordinator (:func:`backend_flags`; TF32 is one of
:mod:`dpool.numerics`), which CUDA errors end a process's context (:func:`sticky_error`), and the
free-memory preflight that runs before any worker starts (:func:`check_free_memory`). Moving tensors
between processes is :mod:`dpool.transport.cuda_ipc`'s job.
"""
from __future__ import annotations

import collections
from typing import Any, Sequence

import torch

from .errors import WorkerStartError

__all__ = ["backend_flags", "apply_backend_flags", "sticky_error", "CONTEXT_BYTES", "shortfall", "check_free_memory",
           "memory_report"]


def backend_flags() -> tuple:
    """This process's cuDNN and cuBLAS settings that change results on a GPU, apart from TF32.

    Workers follow the coordinator's, as replicas in nn.DataParallel's one process do. TF32 (the float32
    precision of cuBLAS and cuDNN) is one of :func:`dpool.numerics.numerics`, which every pool follows.
    """
    cudnn = torch.backends.cudnn
    return (cudnn.deterministic, cudnn.benchmark, torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction)


def apply_backend_flags(flags: tuple, _model: Any = None) -> None:
    """Set :func:`backend_flags` in this (worker) process."""
    cudnn = torch.backends.cudnn
    cudnn.deterministic, cudnn.benchmark = flags[0], flags[1]
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = flags[2]
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = flags[3]


_STICKY = ("device-side assert", "illegal memory access", "unspecified launch failure", "misaligned address",
           "illegal instruction", "an illegal", "CUDA error: uncorrectable", "context is destroyed")


def sticky_error(exc: BaseException) -> bool:
    """Whether ``exc`` leaves this process's CUDA context unusable (every later CUDA call fails)."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and "CUDA error" in text and any(s in text for s in _STICKY)


# About what a worker's CUDA context takes before it holds a tensor (lazy module loading; measured
# 0.3-0.5 GiB on an H100): the preflight check counts it, the error says "about".
CONTEXT_BYTES = 300 << 20
_GiB = float(1 << 30)


def shortfall(devices: Sequence[str], model_bytes: int, free: dict[str, tuple[int, int]], spawn: bool) -> str | None:
    """What :func:`check_free_memory` would refuse, from given ``free[device] = (free, total)`` bytes.

    Per GPU, dpool itself needs for each of its workers a state arena (gradient slots and private
    buffers: ``model_bytes``), a replica arena when the worker is not on the master's GPU, and its
    CUDA context when it is a new process (``spawn``); plus the master's arena on ``devices[0]``
    (the master's own storage is freed when it moves there). Activations come on top.
    """
    counts = collections.Counter(devices)
    problems = []
    for dev, n in counts.items():
        per_worker = model_bytes * (1 if dev == devices[0] else 2) + (CONTEXT_BYTES if spawn else 0)
        need = n * per_worker
        have, total = free[dev]
        if need > have:
            problems.append(
                f"{dev} has {have / _GiB:.2f} GiB free of {total / _GiB:.1f} GiB, and its {n} worker(s) need about "
                f"{need / _GiB:.2f} GiB before any activation ({per_worker / _GiB:.2f} GiB each: "
                + ("its CUDA context, " if spawn else "") + f"{model_bytes / _GiB:.3f} GiB of gradient slots"
                + (" and a parameter replica" if dev != devices[0] else "") + ")")
    if not problems:
        return None
    return ("not enough free GPU memory to start the workers: " + "; ".join(problems) + ". Free memory on those "
            "GPUs (nvidia-smi lists the processes holding it; torch.cuda.empty_cache() in this process), or run "
            "fewer workers per GPU.")


def check_free_memory(devices: Sequence[str], model_bytes: int, spawn: bool) -> None:
    """Refuse to start workers on GPUs that cannot hold them (:func:`shortfall`), before any starts."""
    free = {dev: torch.cuda.mem_get_info(torch.device(dev)) for dev in set(devices)}
    problem = shortfall(devices, model_bytes, free, spawn)
    if problem is not None:
        raise WorkerStartError(problem)


def memory_report(devices: Sequence[str]) -> str:
    """Free and total memory of each GPU of ``devices`` now, and how many workers share it."""
    parts = []
    for dev, n in collections.Counter(devices).items():
        have, total = torch.cuda.mem_get_info(torch.device(dev))
        parts.append(f"{dev}: {have / _GiB:.2f} GiB free of {total / _GiB:.1f} GiB, {n} worker(s)")
    return "; ".join(parts)
