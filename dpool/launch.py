"""How dpool starts its worker-side programs: their command line and environment.

Torch-free on purpose: the ``dpool-workers`` daemon and CLI use it without paying torch's import.
"""
from __future__ import annotations

import importlib.util
import os
import sys

__all__ = ["worker_command", "worker_env", "worker_package_dir", "visible_device", "client_device",
           "WORKER_MALLOC_KEEP"]

_DPOOL_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker_package_dir() -> str:
    """The folder of dpool's worker package (``workers/`` in the source tree, installed as ``dpool_workers``)."""
    try:
        spec = importlib.util.find_spec("dpool_workers")  # finds it without importing it
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        return list(spec.submodule_search_locations)[0]
    return os.path.join(_DPOOL_ROOT, "workers")  # a source checkout used without installing it


# How dpool starts its worker-side programs. The bootstrap loads dpool's worker package from its
# folder under the name ``dpool_workers`` after taking the current directory off ``sys.path``, so
# nothing of the user's (a ``workers.py`` beside the script, another ``workers`` package) can shadow
# it, installed or not.
_BOOT = (
    "import sys, importlib, importlib.util as u\n"
    "sys.path[:] = [p for p in sys.path if p not in ('', '.')]\n"
    "d, name = sys.argv[1], sys.argv[2]\n"
    "s = u.spec_from_file_location('dpool_workers', d + '/__init__.py', submodule_search_locations=[d])\n"
    "m = u.module_from_spec(s); sys.modules['dpool_workers'] = m; s.loader.exec_module(m)\n"
    "sys.argv = ['dpool_workers.' + name] + sys.argv[3:]\n"
    "sys.exit(importlib.import_module('dpool_workers.' + name).main())\n"
)


def worker_command(program: str = "worker", *args: str) -> list[str]:
    """The command line of a worker-side program: ``"worker"`` (boot data on stdin) or ``"cli"`` (``dpool-workers``)."""
    return [sys.executable, "-c", _BOOT, worker_package_dir(), program, *args]


WORKER_MALLOC_KEEP = 1 << 30  # bytes: blocks up to 1 GiB come from (and stay in) the heap


def worker_env(threads: int) -> dict[str, str]:
    """The environment of a worker process: this dpool importable, native thread pools sized on purpose."""
    env = dict(os.environ)
    pkg_root = _DPOOL_ROOT
    env["PYTHONPATH"] = os.pathsep.join([pkg_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    # glibc hands every freed block above its mmap threshold (128 KiB, adapting up to 32 MiB) back to
    # the kernel, so a step's activations page-fault in again on the next step: ~60k faults per CNN
    # step here, a third of its time. A long-lived worker keeps its peak heap instead, like a caching
    # allocator (the daemon trims it when a client detaches). A value already in the environment wins.
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(WORKER_MALLOC_KEEP))
    env.setdefault("MALLOC_TRIM_THRESHOLD_", str(WORKER_MALLOC_KEEP))
    return env


def _visible() -> list[str] | None:
    ours = os.environ.get("CUDA_VISIBLE_DEVICES")
    if ours is None or ours.strip() == "":
        return None
    return [e.strip() for e in ours.split(",") if e.strip()]


def visible_device(index: int) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` entry that makes a worker see our ``cuda:index`` as its only GPU."""
    entries = _visible()
    if entries is None:
        return str(index)
    if index >= len(entries):
        raise ValueError(f"cuda:{index} is not visible (CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r})")
    return entries[index]


def client_device(entry: str, where: str = "") -> str:
    """The inverse of :func:`visible_device`: this process's name (``cuda:i``) for the GPU a worker
    was given as ``CUDA_VISIBLE_DEVICES=entry`` (by a daemon whose own setting may differ from ours)."""
    entries = _visible()
    if entries is None:
        if entry.isdigit():
            return f"cuda:{entry}"
    elif entry in entries:
        return f"cuda:{entries.index(entry)}"
    raise ValueError(
        f"{where or 'a worker'} runs on GPU {entry!r} (its CUDA_VISIBLE_DEVICES entry), which this process does not see "
        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); run with the daemon's CUDA_VISIBLE_DEVICES, "
        "or unset it in both")
