"""``dpool-workers doctor``: what dpool depends on here, each OK, WARN or FAIL with what to do, and a smoke step.

Like ``accelerate env`` and ``torch.utils.collect_env``, plus a 2-worker training step of a tiny model compared
with the same step in this process. :func:`checks` returns the findings; :func:`main` prints them (or their
JSON) and says whether any failed.
"""
from __future__ import annotations

import json
import os
import platform
import stat
import sys
import time
from typing import Any, Callable

OK, WARN, FAIL = "OK", "WARN", "FAIL"
MiB = 1 << 20
SHM_FAIL = 32 * MiB  # below this even a tiny model's pool does not fit (its I/O segments and the control segment)
SHM_WARN = 1024 * MiB  # Docker's default is 64 MB: enough for small models only


def _finding(name: str, status: str, detail: str, fix: str = "") -> dict[str, str]:
    return {"check": name, "status": status, "detail": detail, "fix": fix}


def _python() -> dict[str, str]:
    v = sys.version_info
    detail = f"{platform.python_implementation()} {platform.python_version()} on {platform.system()} {platform.machine()}"
    if platform.system() != "Linux":
        return _finding("python", FAIL, detail, "dpool runs on Linux only (pidfds, /dev/shm, flock)")
    if v < (3, 10):
        return _finding("python", FAIL, detail, "use Python 3.10 or newer")
    return _finding("python", OK, detail)


def _torch() -> dict[str, str]:
    import torch

    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build"
    detail = f"torch {torch.__version__} ({build}), {torch.get_num_threads()} intra-op threads"
    major, minor = (int(p) for p in torch.__version__.split(".")[:2])
    if (major, minor) < (2, 1):
        return _finding("torch", FAIL, detail, "install torch 2.1 or newer")
    return _finding("torch", OK, detail)


def _cuda() -> dict[str, str]:
    import torch

    if not torch.cuda.is_available():
        return _finding("cuda", OK, "no GPU visible: dpool.wrap() starts CPU workers")
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    driver = torch._C._cuda_getDriverVersion() if hasattr(torch._C, "_cuda_getDriverVersion") else None
    detail = f"{len(names)} GPU(s): {', '.join(names)}; driver API {driver}"
    return _finding("cuda", OK, detail)


def _mps() -> dict[str, str]:
    import psutil
    import torch

    if not torch.cuda.is_available():
        return _finding("mps", OK, "not needed: no GPU")
    running = any(p.info["name"] == "nvidia-cuda-mps-control" for p in psutil.process_iter(["name"]))
    if running:
        return _finding("mps", OK, "the MPS control daemon runs: workers sharing a GPU run their kernels side by side")
    if torch.cuda.device_count() == 1:
        return _finding("mps", WARN, "MPS is not running: workers sharing the GPU (device_ids=[0, 0]) time-slice it",
                        "start it with `nvidia-cuda-mps-control -d` before sharing one GPU between workers")
    return _finding("mps", OK, "MPS is not running (needed only when workers share a GPU)")


def _cores() -> dict[str, str]:
    from dpool.cpus import allowed_cores, cpu_quota, local_share, physical_cores
    from dpool.devices import parse_devices

    cores, quota = physical_cores(), cpu_quota()
    devices = parse_devices(None)
    threads = max(1, cores // (len(devices) * local_share()[1]))
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    detail = (f"{affinity} logical CPU(s) in this process's affinity, {len(allowed_cores())} physical core(s)"
              f"{f', cgroup quota {quota:g} CPUs' if quota is not None else ''}; dpool.wrap() would start "
              f"{len(devices)} worker(s) ({devices[0]}) with {threads} thread(s) each")
    if devices[0] == "cpu" and cores < 2:
        return _finding("cores", WARN, detail, "one core gives CPU workers nothing to run in parallel on: "
                        "widen the affinity (taskset) or the cgroup quota")
    return _finding("cores", OK, detail)


def _shm() -> dict[str, str]:
    from dpool import knobs

    d = knobs.get("DPOOL_SHM_DIR") or "/dev/shm"
    try:
        st = os.statvfs(d)
    except OSError as exc:
        return _finding("shared memory", FAIL, f"{d}: {exc.strerror}",
                        "point DPOOL_SHM_DIR at a tmpfs directory that exists, or mount /dev/shm")
    free = st.f_bavail * st.f_frsize
    detail = f"{d}: {free / MiB:.0f} MiB free of {st.f_blocks * st.f_frsize / MiB:.0f} MiB"
    fix = ("give it more room (`docker run --shm-size=8g`, `mount -o remount,size=8G /dev/shm`) or point "
           "DPOOL_SHM_DIR at a larger tmpfs: a pool holds the parameters, gradients and a batch's inputs and "
           "outputs there")
    if free < SHM_FAIL:
        return _finding("shared memory", FAIL, detail, fix)
    if free < SHM_WARN:
        return _finding("shared memory", WARN, detail + " (enough for small models only)", fix)
    return _finding("shared memory", OK, detail)


def _runtime_dir() -> dict[str, str]:
    from dpool.daemon_client import runtime_dir

    d = runtime_dir()
    try:
        st = os.stat(d)
    except FileNotFoundError:
        return _finding("runtime directory", OK, f"{d} (made with mode 0700 when a pool starts)")
    mode = stat.S_IMODE(st.st_mode)
    detail = f"{d}, mode {mode:04o}, owner uid {st.st_uid}"
    if st.st_uid != os.getuid() or mode & 0o077:
        return _finding("runtime directory", FAIL, detail,
                        f"it must be yours and 0700: `chmod 700 {d}`, or set XDG_RUNTIME_DIR to a private directory")
    return _finding("runtime directory", OK, detail)


def _pools() -> dict[str, str]:
    from dpool import protocol as P
    from dpool.daemon_client import request, running_pools

    names = running_pools()
    if not names:
        return _finding("pools", OK, "no dpool-workers pool is running")
    unresponsive = []
    for name in names:
        try:
            request(name, P.Status(), timeout=2.0)
        except (OSError, ValueError, TimeoutError):
            unresponsive.append(name)
    detail = f"running: {', '.join(names)}"
    if unresponsive:
        return _finding("pools", WARN, detail + f"; not answering: {', '.join(unresponsive)}",
                        "`dpool-workers stop --name NAME` ends a pool that does not answer")
    return _finding("pools", OK, detail)


def _smoke() -> dict[str, str]:
    """A few training steps of a tiny model on the workers ``dpool.wrap`` would start by default (every GPU on a
    GPU machine, one per physical core otherwise), against the same steps in this process."""
    import torch

    import dpool
    from dpool.devices import parse_devices

    devices = parse_devices(None)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)).to(devices[0])
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)).to(devices[0])
    ref.load_state_dict(net.state_dict())
    x, y = torch.randn(16, 8, device=devices[0]), torch.randn(16, 2, device=devices[0])
    start = time.perf_counter()
    try:
        with dpool.wrap(net, devices, coordinator_threads=None) as model:
            started = time.perf_counter()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            times = []
            for _ in range(3):  # (the first step ships the model to the workers)
                t = time.perf_counter()
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                if devices[0] != "cpu":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
    except Exception as exc:  # what the user would meet at their first wrap(): say it, with its own advice
        return _finding("training step", FAIL, f"{type(exc).__name__}: {exc}".split("\n")[0],
                        "see the error above; `DPOOL_DEBUG=1 dpool-workers doctor` shows dpool's log")
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    same = all(torch.allclose(p, q, atol=1e-5) for p, q in zip(net.parameters(), ref.parameters()))
    on = "CPU" if devices[0] == "cpu" else "GPU"
    detail = (f"{len(devices)} {on} worker(s) on {','.join(devices)}: started in {started - start:.2f} s, first "
              f"training step {times[0] * 1e3:.0f} ms, then {times[-1] * 1e3:.1f} ms a step")
    if not same:
        return _finding("training step", FAIL, detail + ", but the parameters differ from one process's",
                        "report it: this is a bug in dpool")
    return _finding("training step", OK, detail + ", the same parameters as one process")


CHECKS: list[Callable[[], dict[str, str]]] = [_python, _torch, _cuda, _mps, _cores, _shm, _runtime_dir, _pools,
                                              _smoke]


def checks() -> list[dict[str, str]]:
    """Every finding, in order; a check that itself fails is a FAIL naming the exception."""
    found = []
    for check in CHECKS:
        try:
            found.append(check())
        except Exception as exc:
            found.append(_finding(check.__name__.strip("_"), FAIL, f"{type(exc).__name__}: {exc}"))
    return found


def main(as_json: bool) -> int:
    """Print the findings (or their JSON); 1 if any failed, else 0."""
    found = checks()
    failed = any(f["status"] == FAIL for f in found)
    if as_json:
        out: dict[str, Any] = {"ok": not failed, "checks": found}
        print(json.dumps(out, indent=2))
    else:
        for f in found:
            print(f"{f['status']:<5} {f['check']:<18} {f['detail']}")
            if f["fix"]:
                print(f"{'':<24}→ {f['fix']}")
        print("dpool-workers doctor: " + ("FAIL (see above)" if failed else "OK"))
    return 1 if failed else 0
