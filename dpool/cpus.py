"""The CPUs this process may use: what dpool sizes its default worker and thread counts by.

Two limits apply, and the smaller wins:

* the affinity mask (``taskset``, a Slurm or container cpuset), counted in physical cores, as
  torch's own default thread count is (:func:`allowed_cores`);
* a cgroup CPU bandwidth limit (``docker run --cpus``, a Kubernetes CPU limit, systemd's
  ``CPUQuota``), which torch does not see (:func:`cpu_quota`): such a container usually sees every
  CPU of its host, and without this dpool would start a worker per host core inside a budget of a
  few, each throttled most of every period.

Torch-free, like :mod:`dpool.launch`: the ``dpool-workers`` CLI sizes its daemon's workers with it.
"""
from __future__ import annotations

import functools
import math
import os
from typing import Callable, Iterable

import psutil

__all__ = ["physical_cores", "allowed_cores", "cpu_quota", "local_share", "bind_threads", "threads_named",
           "NoWakeupPreemption"]


def physical_cores() -> int:
    """The physical cores this process may run on: what worker counts and thread counts are sized by.

    The cores in its affinity mask (psutil's machine-wide count where the mask cannot be read),
    at most its cgroup CPU quota rounded up (:func:`cpu_quota`), and at least 1.
    """
    if hasattr(os, "sched_getaffinity"):
        cores = len(allowed_cores())
    else:
        cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    quota = cpu_quota()
    if quota is not None:
        cores = min(cores, math.ceil(quota))
    return max(1, cores)


def local_share() -> tuple[int, int]:
    """This coordinator's ``(LOCAL_RANK, LOCAL_WORLD_SIZE)`` under torchrun; ``(0, 1)`` otherwise."""
    try:
        size = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        rank = min(max(0, int(os.environ.get("LOCAL_RANK", "0"))), size - 1)
    except ValueError:
        return 0, 1
    return rank, size


@functools.lru_cache(maxsize=None)
def _core_of(cpu: int) -> tuple[str, str]:
    """The physical core logical CPU ``cpu`` belongs to, as (package, core) from sysfs (fixed while we run)."""
    topo = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
    try:
        with open(topo + "physical_package_id") as f1, open(topo + "core_id") as f2:
            return f1.read().strip(), f2.read().strip()
    except OSError:  # no topology: each logical CPU counts as a core
        return "", str(cpu)


def allowed_cores() -> list[list[int]]:
    """The physical cores this process may run on (its affinity mask, read anew: it may change), each as its
    logical CPUs, in order."""
    cores: dict[tuple[str, str], list[int]] = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        cores.setdefault(_core_of(cpu), []).append(cpu)
    return sorted(cores.values())


def cpu_quota(proc: str = "/proc/self") -> float | None:
    """The CPUs' worth of time per period this process's cgroups allow it (``quota / period``), or ``None``.

    Read where the kernel applies it: the process's own cgroup (``proc``/cgroup) in every mounted
    hierarchy with the ``cpu`` controller (cgroup v2's ``cpu.max``, v1's ``cpu.cfs_quota_us`` over
    ``cpu.cfs_period_us``), and each ancestor up to the mount's root, since a parent's limit binds its
    children too; the smallest wins. Inside a container the mount's root is the container's own
    cgroup. ``None`` where no limit is set or nothing can be read (not Linux, no cgroup mounted):
    a file dpool cannot parse counts as no limit, never as an error.
    """
    try:
        with open(os.path.join(proc, "cgroup")) as f:
            groups = f.read().splitlines()
        with open(os.path.join(proc, "mountinfo")) as f:
            mounts = f.read().splitlines()
    except OSError:
        return None
    v1_path = v2_path = None
    for line in groups:  # hierarchy-id:controllers:path
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2_path = parts[2]
        elif "cpu" in parts[1].split(","):
            v1_path = parts[2]
    limits: list[float] = []
    for line in mounts:  # id parent major:minor root mountpoint options [optional...] - fstype source superoptions
        fields = line.split()
        if "-" not in fields or len(fields) < 5:
            continue
        sep = fields.index("-")
        fstype = fields[sep + 1] if sep + 1 < len(fields) else ""
        superopts = fields[sep + 3].split(",") if sep + 3 < len(fields) else []
        root, mountpoint = _unescape(fields[3]), _unescape(fields[4])
        if fstype == "cgroup2" and v2_path is not None:
            limits += _walk(mountpoint, root, v2_path, _read_v2)
        elif fstype == "cgroup" and "cpu" in superopts and v1_path is not None:
            limits += _walk(mountpoint, root, v1_path, _read_v1)
    return min(limits) if limits else None


def _unescape(field: str) -> str:
    """A mountinfo path field as a path (the kernel writes space, tab, newline and backslash as octal escapes)."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def _walk(mountpoint: str, root: str, path: str, read: Callable[[str], float | None]) -> list[float]:
    """The limits set on cgroup ``path`` and its ancestors, in a hierarchy mounted at ``mountpoint`` from ``root``."""
    root = root.rstrip("/")
    if root and (path == root or path.startswith(root + "/")):
        path = path[len(root):]
    elif root:  # a cgroup outside the mount's root (a cgroup namespace): only the mount's own root applies
        path = ""
    here = os.path.normpath(mountpoint + "/" + path.strip("/"))
    top = os.path.normpath(mountpoint)
    if here != top and not here.startswith(top + "/"):
        return []
    found = []
    while True:
        limit = read(here)
        if limit is not None:
            found.append(limit)
        if here == top:
            return found
        here = os.path.dirname(here)


def _read_v2(folder: str) -> float | None:
    """``cpu.max`` ("max 100000" or "150000 100000") as CPUs, or ``None``."""
    try:
        with open(os.path.join(folder, "cpu.max")) as f:
            quota, period = f.read().split()[:2]
        if quota == "max":
            return None
        return _ratio(int(quota), int(period))
    except (OSError, ValueError):
        return None


def _read_v1(folder: str) -> float | None:
    """``cpu.cfs_quota_us`` (-1: none) over ``cpu.cfs_period_us`` as CPUs, or ``None``."""
    try:
        with open(os.path.join(folder, "cpu.cfs_quota_us")) as f1, open(os.path.join(folder, "cpu.cfs_period_us")) as f2:
            return _ratio(int(f1.read()), int(f2.read()))
    except (OSError, ValueError):
        return None


def _ratio(quota: int, period: int) -> float | None:
    return quota / period if quota > 0 and period > 0 else None


def bind_threads(cpus: Iterable[int]) -> Callable[[], None]:
    """Bind every thread of this process to ``cpus`` (threads started later inherit their creator's mask), and
    return what undoes it: every thread back to the mask this thread had before."""
    before = os.sched_getaffinity(0)
    _bind_all(set(cpus))
    return functools.partial(_bind_all, before)


def _bind_all(cpus: set[int]) -> None:
    for tid in _thread_ids():
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:  # a thread that ended meanwhile
            pass


def _thread_ids() -> list[int]:
    """The native ids of this process's threads (none where ``/proc`` cannot be read)."""
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return []


def threads_named(name: str) -> list[int]:
    """The native ids of this process's threads named ``name`` (``/proc/self/task/*/comm``)."""
    found: list[int] = []
    for tid in _thread_ids():
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == name:
                    found.append(tid)
        except OSError:  # a thread that ended meanwhile
            pass
    return found


class NoWakeupPreemption:
    """Threads of this process that may not preempt a running thread when they wake, inside ``with``.

    Inside the block each one is under ``SCHED_BATCH``: Linux's fair scheduler then never lets it preempt the
    thread running on its core when it wakes up; it runs when that thread blocks, on a free core, or at the
    next scheduler tick. Its share of the CPU is what it was. On leaving, each is back under ``SCHED_OTHER``.
    (``SCHED_IDLE`` would do the first too, but a process without ``CAP_SYS_NICE`` cannot leave it again, and
    under load it starves: a swap over gloo beside two busy processes took thirty times as long; see
    docs/performance.md.)

    Only threads under ``SCHED_OTHER`` when given are taken: a policy set by someone else is left alone. A
    thread that ended, or whose policy cannot be set, is dropped.

    Why (see ``NOTE [ gloo's loop thread ]`` in :mod:`dpool.crossnode`): gloo's TCP loop thread polls its
    sockets with level-triggered ``epoll`` and only *tries* a pair's lock; while the caller posts an
    ``isend``/``irecv`` it holds that lock, and the loop, woken by the peer's bytes, spins on it, preempting the
    caller on a shared core until the next tick.

    Args:
        tids: native thread ids (:func:`threads_named`).
    """

    def __init__(self, tids: Iterable[int]) -> None:
        self.tids: list[int] = []
        if not hasattr(os, "SCHED_BATCH"):
            return
        for tid in tids:
            try:
                if os.sched_getscheduler(tid) == os.SCHED_OTHER:
                    self.tids.append(tid)
            except OSError:
                pass

    def __enter__(self) -> "NoWakeupPreemption":
        self._set(getattr(os, "SCHED_BATCH", 0))
        return self

    def __exit__(self, *exc: object) -> None:
        self._set(getattr(os, "SCHED_OTHER", 0))

    def _set(self, policy: int) -> None:
        if not self.tids:
            return
        param = os.sched_param(0)
        for tid in list(self.tids):
            try:
                os.sched_setscheduler(tid, policy, param)
            except OSError:  # it ended, or it is not ours to set: never touch it again
                self.tids.remove(tid)
