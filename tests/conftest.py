"""Fixtures: every test is checked for leaked worker processes and shared-memory segments."""
from __future__ import annotations

import os
import time

import psutil
import pytest
import torch


def dpool_segments() -> set[str]:
    d = os.environ.get("DPOOL_SHM_DIR", "/dev/shm")
    return {n for n in os.listdir(d) if n.startswith(f"dpool-{os.getuid()}-")}


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.02) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` passes (no fixed sleeps)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def assert_no_leaks(before_children: set[int] = frozenset(), before_shm: set[str] = frozenset()) -> None:
    me = psutil.Process()

    def clean() -> bool:
        kids = [p for p in me.children(recursive=True) if p.pid not in before_children and p.status() != psutil.STATUS_ZOMBIE]
        return not kids and not (dpool_segments() - before_shm)

    if not wait_for(clean, timeout=10.0):
        kids = [(p.pid, p.cmdline()) for p in me.children(recursive=True) if p.pid not in before_children]
        raise AssertionError(f"leaked processes {kids} / segments {sorted(dpool_segments() - before_shm)}")


@pytest.fixture(autouse=True)
def no_leaks():
    """Fail the test if it leaves a child process or a dpool /dev/shm segment behind."""
    me = psutil.Process()
    before_children = {p.pid for p in me.children(recursive=True)}
    before_shm = dpool_segments()
    threads = torch.get_num_threads()
    yield
    assert_no_leaks(before_children, before_shm)
    torch.set_num_threads(threads)


@pytest.fixture
def wrap():
    """``wrap(module, **kw)``: a dpool model that is closed after the test."""
    import dpool

    made = []

    def _wrap(module, device_ids=("cpu", "cpu"), **kw):
        kw.setdefault("heartbeat_timeout_s", 30.0)
        m = dpool.wrap(module, None if device_ids is None else list(device_ids), **kw)
        made.append(m)
        return m

    yield _wrap
    for m in made:
        m.close()
