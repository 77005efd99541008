"""Decisions made from the knobs (:mod:`dpool.knobs`) and the machine: where threads run, how rounds wait.

Each function reads its knob, checks it, and decides for the pool at hand. Why each default is what it is,
with the measurements, is in docs/performance.md ("Tuning knobs").

Torch-free: the daemon and the command line use the launcher, which uses these.
"""
from __future__ import annotations

import os
from typing import Sequence

from . import knobs
from .cpus import allowed_cores, local_share, physical_cores

__all__ = ["worker_cpus", "coordinator_cpus", "reply_together", "forward_with_loss", "wait_spin", "worker_sched",
           "gloo_loop_policy", "WAIT_SPIN_US_DEFAULT"]

WAIT_SPIN_US_DEFAULT = 300


def _cpu_pool(devices: Sequence[str]) -> bool:
    return all(d.startswith("cpu") for d in devices)


def worker_cpus(index: int, threads: int, workers: int, device: str) -> list[int] | None:
    """The logical CPUs worker ``index`` of ``workers`` is bound to (``None``: not bound), per ``DPOOL_WORKER_AFFINITY``.

    Worker ``k`` gets ``threads`` physical cores of its own, the ``k``-th such run of the cores this
    process may use (with their hyperthreads), wrapping around when they run out. Its main thread and
    its ZeroMQ I/O thread then hand each message over on one core. Under torchrun with several
    coordinators per machine whose workers together fill the cores, each coordinator's workers take
    its ``LOCAL_RANK``'s share of them.

    ``auto`` binds only CPU workers whose threads fill exactly the cores we may use (the default
    layout): a pool that leaves cores free (``worker_threads`` set lower, or two jobs on one machine)
    would put every job's workers on the same first cores. GPU workers are left alone: where their
    cores should be depends on the GPU's NUMA node.
    """
    policy = knobs.get("DPOOL_WORKER_AFFINITY")
    if policy == "none" or not hasattr(os, "sched_setaffinity"):
        return None
    cores = allowed_cores()
    rank, size = local_share()
    if size > 1 and workers * threads * size == len(cores):  # torchrun: this coordinator's share of the cores
        cores = cores[rank * workers * threads:(rank + 1) * workers * threads]
    if policy == "auto" and (not device.startswith("cpu") or workers * threads != len(cores)):
        return None
    start = index * threads
    return sorted(cpu for i in range(start, start + threads) for cpu in cores[i % len(cores)])


def coordinator_cpus(threads: int, devices: Sequence[str]) -> list[int] | None:
    """The logical CPUs this coordinator binds itself to while its pool is open (``None``: not bound), per
    ``DPOOL_COORDINATOR_AFFINITY``.

    Under torchrun with several coordinators per machine whose CPU workers together fill the cores,
    :func:`worker_cpus` gives each coordinator's workers its ``LOCAL_RANK``'s share of them. ``auto`` (the
    default) then binds the coordinator to that share too: it and its workers take turns (it waits while
    they compute, they wait while it reduces and steps), so each rank keeps to its own cores instead of
    the scheduler moving the ranks' coordinators onto each other's workers' cores. ``none`` leaves the
    coordinator where it was; so does any other layout (one coordinator per machine, workers that leave
    cores free, GPU workers).
    """
    policy = knobs.get("DPOOL_COORDINATOR_AFFINITY")
    rank, size = local_share()
    if policy == "none" or size < 2 or not _cpu_pool(devices) or not hasattr(os, "sched_setaffinity"):
        return None
    if len(devices) * threads * size != len(allowed_cores()):  # (the layout worker_cpus shares out)
        return None
    cpus: set[int] = set()
    for i, device in enumerate(devices):
        mine = worker_cpus(i, threads, len(devices), device)
        if mine is None:  # (DPOOL_WORKER_AFFINITY=none: the workers are not bound, so neither is it)
            return None
        cpus.update(mine)
    return sorted(cpus)


def reply_together(devices: Sequence[str], threads: int) -> bool:
    """Whether a pool's rounds ask its workers to reply together, per ``DPOOL_REPLY_TOGETHER``
    (see :data:`dpool.protocol.TOGETHER_WAIT_S`).

    ``auto`` (the default) asks when the coordinator has no core of its own: two or more CPU workers
    whose threads fill exactly the cores this process may use (the default layout). Then a worker done
    first has an otherwise idle core to wait on, and the coordinator, woken once per round instead of
    once per reply, does not preempt the slower worker's handler on the core they share. With a core to
    spare the coordinator wakes elsewhere, and with more threads than cores a waiting worker would hold a
    core another one needs. ``on`` asks for any pool of CPU workers, ``off`` never. GPU workers never
    wait: their machines have cores to spare.
    """
    policy = knobs.get("DPOOL_REPLY_TOGETHER")
    if policy == "off" or len(devices) < 2 or not _cpu_pool(devices):
        return False
    return policy == "on" or len(devices) * threads == len(allowed_cores())


def forward_with_loss() -> bool:
    """Whether a ``gather=False`` training forward waits for its loss and goes to the workers with it, per
    ``DPOOL_FORWARD_WITH_LOSS``: ``auto`` (the default) defers it where it can (see
    :mod:`dpool.step.deferred`), ``off`` runs every forward at once, in a round of its own (its errors
    then come from ``model(x)`` itself instead of from the criterion)."""
    return knobs.get("DPOOL_FORWARD_WITH_LOSS") == "auto"


def cuda_async_replies(devices: Sequence[str]) -> bool:
    """Whether GPU workers reply before their GPU ran a forward's kernels (``DPOOL_CUDA_ASYNC_REPLIES``: off by
    default, not yet verified on a GPU; see NOTE [ CUDA ownership ] in :mod:`dpool.transport.cuda_ipc`)."""
    return bool(knobs.get("DPOOL_CUDA_ASYNC_REPLIES")) and any(d.startswith("cuda") for d in devices)


def wait_spin(devices: Sequence[str]) -> float:
    """How long (seconds) past a short round's previous time the coordinator spins before it sleeps in
    the poll, per ``DPOOL_WAIT_SPIN_US`` (see NOTE [ spinning through short rounds ] in :mod:`dpool.pool`).

    Unset: ``WAIT_SPIN_US_DEFAULT`` microseconds for a pool of CPU workers, 0 (never spin) for GPU workers, where it has not been
    measured yet. A number of microseconds applies to either; ``0`` turns spinning off.
    """
    us = knobs.get("DPOOL_WAIT_SPIN_US")
    if us is None:
        return WAIT_SPIN_US_DEFAULT * 1e-6 if _cpu_pool(devices) else 0.0
    return float(us) * 1e-6


def worker_sched(workers: int) -> str:
    """The Linux scheduling policy of the workers' threads, per ``DPOOL_WORKER_SCHED``: ``batch`` or ``other``.

    Under Linux's default policy a thread that wakes may preempt whoever runs on its core: a worker (or
    its ZeroMQ I/O thread) woken by a request preempts the coordinator, which still has the other
    requests to send, or the other worker mid-compute. ``SCHED_BATCH`` threads never preempt on wake-up
    (they take a free core or wait for the next tick); their priority is unchanged, and the coordinator
    keeps the default policy. More workers than cores is the opposite case: a woken worker then has no
    free core to take, and waking it by preemption is what gets its request served before the next tick.
    So ``auto`` chooses ``batch`` while every worker can have a physical core of its own, else ``other``.
    """
    sched = knobs.get("DPOOL_WORKER_SCHED")
    if sched == "auto":
        sched = "batch" if workers <= physical_cores() else "other"
    return sched


def gloo_loop_policy() -> str:
    """``DPOOL_GLOO_LOOP`` (see NOTE [ gloo's loop thread ] in :mod:`dpool.crossnode`): ``batch`` (the default)
    or ``none``.

    Raises:
        DpoolValueError: another value.
    """
    return knobs.get("DPOOL_GLOO_LOOP")
