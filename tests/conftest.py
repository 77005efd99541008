"""Fixtures: every test is checked for leaked worker processes and shared-memory segments."""
from __future__ import annotations

import gc
import os
import time

import psutil
import pytest
import torch


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With ``DPOOL_TEST_EARLY_TRACEBACKS=1`` (scripts/gpu-test.sh sets it), a failure's traceback is printed
    when the test fails, not at the end of the run: a run its time limit cuts off (a short GPU lease) still
    says why each test failed."""
    if report.failed and os.environ.get("DPOOL_TEST_EARLY_TRACEBACKS") == "1":
        import sys

        sys.__stderr__.write(f"\n--- {report.nodeid} failed ({report.when}) ---\n{report.longreprtext}\n")
        sys.__stderr__.flush()


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


def open_fds() -> dict[int, str]:
    """This process's open file descriptors and what they point at."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # the fd of the listing itself, or one closed meanwhile
            pass
    return out


def dpool_sockets() -> set[str]:
    """Coordinator socket files of this process in dpool's runtime directory."""
    from dpool.daemon_client import runtime_dir

    mine = f"dpool-{os.getuid()}-{os.getpid()}-"
    return {n for n in os.listdir(runtime_dir()) if n.startswith(mine) and n.endswith(".sock")}


def assert_no_leaks(before_children: set[int] = frozenset(), before_shm: set[str] = frozenset(),
                    before_fds: dict[int, str] | None = None, before_socks: set[str] = frozenset()) -> None:
    me = psutil.Process()

    def new_fds() -> dict[int, str]:
        if before_fds is None:
            return {}
        return {fd: t for fd, t in open_fds().items() if before_fds.get(fd) != t}

    def clean() -> bool:
        kids = [p for p in me.children(recursive=True) if p.pid not in before_children and p.status() != psutil.STATUS_ZOMBIE]
        return not kids and not (dpool_segments() - before_shm) and not new_fds() and not (dpool_sockets() - before_socks)

    # Unreachable reference cycles (a test frame holding the exception that holds that frame) are
    # not leaks: collected before looking again (only then: a collection costs ~0.1 s with torch and
    # transformers loaded, 40 s over the suite). The wrap/close cycle test checks fds without this help.
    if clean():
        return
    gc.collect()
    if not wait_for(clean, timeout=10.0):
        kids = [(p.pid, p.cmdline()) for p in me.children(recursive=True) if p.pid not in before_children]
        raise AssertionError(f"leaked processes {kids} / segments {sorted(dpool_segments() - before_shm)} / "
                             f"file descriptors {new_fds()} / socket files {sorted(dpool_sockets() - before_socks)}")


@pytest.fixture(scope="session", autouse=True)
def cuda_driver_opened():
    """On a machine with a GPU: start CUDA once, first. The driver's files (/dev/nvidia*, its eventfd,
    pipes and socket) stay open for the process's life from the first CUDA call, wherever a test
    makes it; they are not a test's leak."""
    if torch.cuda.is_available():
        torch.zeros(1, device="cuda")
    yield


@pytest.fixture(autouse=True)
def copy_path(monkeypatch):
    """With ``DPOOL_TEST_COPY_PATH=1`` (scripts/gpu-check.sh sets it for a second run of the CUDA tests): workers
    on the master's GPU take the copy path that workers on another GPU take, so that one GPU tests it."""
    if os.environ.get("DPOOL_TEST_COPY_PATH") == "1":
        from dpool.step import replicas

        monkeypatch.setattr(replicas, "ALIAS_SAME_GPU", False)
    yield


@pytest.fixture(autouse=True)
def no_leaks(cuda_driver_opened):
    """Fail the test if it leaves a child process, a dpool /dev/shm segment, a file descriptor or a
    coordinator socket file behind."""
    yield from leak_check()


def leak_check():
    """The body of :func:`no_leaks`: snapshot, ``yield`` (the test runs), check, restore threads."""
    me = psutil.Process()
    before_children = {p.pid for p in me.children(recursive=True)}
    before_shm = dpool_segments()
    before_fds = open_fds()
    before_socks = dpool_sockets()
    threads = torch.get_num_threads()
    yield
    assert_no_leaks(before_children, before_shm, before_fds, before_socks)
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
