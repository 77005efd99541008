"""Which devices a pool's workers run on: parsing ``device_ids``, checking them, a daemon's devices.

Shared by :func:`dpool.wrap` and the ``dpool-workers`` daemon (which parses and checks its
``--device-ids`` with the same rules).
"""
from __future__ import annotations

import itertools
import os
from typing import Sequence, TypeAlias

import torch

from . import protocol as P
from .cpus import local_share, physical_cores
from .launch import client_device
from .daemon_client import read_pool, request
from .errors import DpoolTypeError, DpoolValueError

__all__ = ["DeviceLike", "parse_devices", "check_devices", "pool_devices"]

DeviceLike: TypeAlias = "int | str | torch.device"


def cpu_workers() -> list[str]:
    """The default CPU workers: one per physical core this process may run on (its share of them under ``torchrun``
    with several coordinators per machine)."""
    return ["cpu"] * max(1, physical_cores() // local_share()[1])


def parse_devices(device_ids: Sequence[DeviceLike] | None, module: torch.nn.Module | None = None) -> list[str]:
    """``device_ids`` as one string per worker: ``"cpu"`` or ``"cuda:i"``.

    ``None`` means where ``module`` is: one CPU worker per physical core this process may run on for a module on
    the CPU (also on a machine with GPUs: a Trainer or ``Accelerator`` that keeps the model on the CPU gets CPU
    workers), every visible GPU otherwise, or CPU workers when there is none.
    Under ``torchrun`` with several coordinators per machine (``LOCAL_WORLD_SIZE`` > 1), each
    takes its ``LOCAL_RANK``'s share of the GPUs or cores.
    """
    if device_ids is None:
        rank, size = local_share()
        first = next(itertools.chain(module.parameters(), module.buffers()), None) if module is not None else None
        if torch.cuda.is_available() and (first is None or first.device.type != "cpu"):
            gpus = list(range(torch.cuda.device_count()))
            per = len(gpus) // size
            mine = gpus[rank * per:(rank + 1) * per] if per else [gpus[rank % len(gpus)]]
            return [f"cuda:{i}" for i in mine]
        return cpu_workers()
    if isinstance(device_ids, (str, int, torch.device)):
        raise DpoolTypeError("device_ids must be a list, e.g. ['cpu', 'cpu'] or [0, 1]")
    devices: list[str] = []
    for d in device_ids:
        if isinstance(d, bool) or not isinstance(d, (int, str, torch.device)):
            raise DpoolTypeError(f"device_ids entries must be GPU indices, torch.device or strings, got {d!r}")
        try:
            dev = torch.device("cuda", d) if isinstance(d, int) else torch.device(d)
        except RuntimeError as exc:
            raise DpoolValueError(f"device_ids entry {d!r} is not a device ({exc}); use 'cpu' or GPU indices") from None
        if dev.type not in ("cpu", "cuda"):
            raise DpoolValueError(f"dpool supports 'cpu' and CUDA devices, got {dev}")
        devices.append("cpu" if dev.type == "cpu" else f"cuda:{dev.index or 0}")
    if not devices:
        raise DpoolValueError("device_ids is empty; give at least one device, e.g. ['cpu', 'cpu']")
    return devices


def check_devices(devices: list[str], output_device: DeviceLike | None = None) -> torch.device:
    """Refuse device lists dpool cannot run; return where outputs are gathered."""
    gpus = [d for d in devices if d != "cpu"]
    if not gpus:
        if output_device is not None and output_device != -1 and torch.device(output_device).type != "cpu":
            raise DpoolValueError(f"output_device={output_device!r}: CPU workers gather onto the CPU")
        return torch.device("cpu")
    if len(gpus) != len(devices):
        raise DpoolValueError(f"device_ids {devices} mix CPU and GPU workers; use all 'cpu' entries or all GPU indices")
    if not torch.cuda.is_available():
        raise DpoolValueError(f"device_ids {devices} name GPUs, but torch sees none (torch {torch.__version__}, "
                              f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); use 'cpu' entries")
    count = torch.cuda.device_count()
    bad = [d for d in devices if int(d.split(":")[1]) >= count]
    if bad:
        raise DpoolValueError(f"device_ids {devices}: {bad[0]} does not exist; this process sees {count} GPU(s) "
                              f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}). On one GPU, "
                              "device_ids=[0, 0] runs two workers on it.")
    if output_device is None:
        return torch.device(devices[0])
    if output_device == -1:
        return torch.device("cpu")
    dev = torch.device("cuda", output_device) if isinstance(output_device, int) else torch.device(output_device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def pool_devices(pool: str) -> list[str]:
    """The devices of the ``dpool-workers`` pool ``pool`` (a name or ``tcp://HOST:PORT``), in this
    process's numbering: the daemon's ``CUDA_VISIBLE_DEVICES`` may differ from ours."""
    if pool.startswith("tcp://"):  # a pool started with --listen; its key comes from DPOOL_KEY_FILE
        rows = request(pool, P.Status()).info["workers"]
        devices, visible = [w["device"] for w in rows], [w.get("visible") for w in rows]
    else:
        state, _ = read_pool(pool)
        devices, visible = list(state["devices"]), state.get("visible") or [None] * len(state["devices"])
    try:
        return [client_device(v, f"worker {i} of pool {pool!r}") if v is not None else d
                for i, (d, v) in enumerate(zip(devices, visible))]
    except ValueError as exc:
        raise DpoolValueError(str(exc)) from None
