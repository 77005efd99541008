"""Fault scenarios, each run as a separate coordinator process by tests/test_faults.py.

``python -m tests.fault_scenarios NAME '{"json": "params"}'`` prints one JSON line:
the error raised (type, text, attributes), how long it took to detect, whether the
master (parameters, gradients, buffers, optimizer state) is unchanged, what the next call
did, and the workers' pids (for the outer leak check).
"""
from __future__ import annotations

import copy
import enum
import json
import os
import signal
import sys
import threading
import time

import psutil
import torch
from torch import nn

import dpool
from tests.helpers import assert_unchanged, sigkill, snapshot


_TRIGGER = 100


class Fault(enum.IntEnum):
    """What :class:`Victim` does on the shard that carries the code: the one table of fault triggers."""

    SLOW_FORWARD = 1  # sleeps 6 s, so that a test can kill or stop it mid-forward (faults land at 0.5 s)
    GIL_HANG = 2  # a hang holding the GIL (Python's heartbeat stops)
    RELEASED_HANG = 3  # a hang with the GIL released (heartbeats go on; only the step deadline catches it)
    MEMORY_ERROR = 4
    UNPICKLABLE_RESULT = 5
    SLOW_BACKWARD = 6
    SEGFAULT = 7
    CLEAN_EXIT = 8  # os._exit(0) mid-step
    VALUE_ERROR = 9
    ODD_EXCEPTION = 10  # an exception whose __init__ is not (message,)
    BACKWARD_FAILS = 11


class Victim(nn.Module):
    """Misbehaves on the shard whose first element is a :class:`Fault` code."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        code = int(x[0, 0].item()) - _TRIGGER  # random data (|x| < 10) never reaches a trigger
        if code == Fault.SLOW_FORWARD:  # after a Ctrl-C the next call waits for this to end, so keep it short
            time.sleep(6)
        elif code == Fault.GIL_HANG:
            sum(range(10**11))
        elif code == Fault.RELEASED_HANG:
            time.sleep(3600)
        elif code == Fault.MEMORY_ERROR:
            bytearray(1 << 60)  # 1 EiB, beyond any x86-64 address space: MemoryError even with overcommit
        elif code == Fault.UNPICKLABLE_RESULT:
            return _Unpicklable()
        elif code == Fault.SEGFAULT:
            import ctypes

            ctypes.string_at(0)
        elif code == Fault.CLEAN_EXIT:
            os._exit(0)
        elif code == Fault.VALUE_ERROR:
            raise ValueError("bad shard")
        elif code == Fault.ODD_EXCEPTION:
            raise _TwoArgs(1, 2)
        y = self.bn(self.lin(x))
        if code == Fault.SLOW_BACKWARD:
            y = _SlowBackward.apply(y)
        elif code == Fault.BACKWARD_FAILS:
            y = _BackwardFails.apply(y)
        return y


class _TwoArgs(Exception):
    def __init__(self, a, b):
        super().__init__(f"{a}/{b}")


class _BackwardFails(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y):
        return y.clone()

    @staticmethod
    def backward(ctx, g):
        raise ArithmeticError("backward exploded")


class _Unpicklable:
    def __reduce__(self):
        raise RuntimeError("this result cannot be pickled")


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y):
        return y.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(30)
        return g


def batch(code: Fault | None = None, shard: int = 1, n: int = 8, shards: int = 2) -> torch.Tensor:
    """A batch whose shard ``shard`` (of ``shards`` equal shards; -1: every shard) carries ``code``."""
    x = torch.randn(n, 4)
    if code is not None:
        for s in range(shards) if shard == -1 else [shard]:
            x[(n // shards) * s, 0] = _TRIGGER + code
    return x


def good_step(model, opt) -> None:
    opt.zero_grad()
    model(batch()).pow(2).mean().backward()
    opt.step()


def _later(delay: float, fn) -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(delay), fn()), daemon=True)
    t.start()
    return t


def run(name: str, p: dict) -> dict:
    workers = p.get("workers", 2)
    options = {k: v for k, v in p.items() if k in ("max_restarts", "heartbeat_timeout_s", "step_timeout_s")}
    torch.manual_seed(0)
    net = Victim()
    model = dpool.wrap(net, ["cpu"] * workers, **options)
    pids = model.pids
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    good_step(model, opt)
    before = snapshot(net, opt)
    out: dict = {"pids": pids}
    target = pids[p.get("victim", 1)]

    def trigger() -> None:
        if name == "sigkill_forward":
            _later(0.5, lambda: os.kill(target, signal.SIGKILL))
            model(batch(Fault.SLOW_FORWARD))
        elif name == "sigkill_backward":
            y = model(batch(Fault.SLOW_BACKWARD))
            # forward and backward are each transactional: the successful forward committed
            # its BatchNorm statistics (as single-process torch does); the backward must change nothing
            before.update(snapshot(net, opt))
            _later(0.5, lambda: os.kill(target, signal.SIGKILL))
            y.sum().backward()
        elif name == "kill_all":
            _later(0.5, lambda: [os.kill(q, signal.SIGKILL) for q in pids])
            model(batch(Fault.SLOW_FORWARD, shard=-1, n=4 * workers, shards=workers))
        elif name == "segfault":
            model(batch(Fault.SEGFAULT))
        elif name == "exit0":
            model(batch(Fault.CLEAN_EXIT))
        elif name == "gil_hang":
            model(batch(Fault.GIL_HANG))
        elif name == "sigstop":
            _later(0.5, lambda: os.kill(target, signal.SIGSTOP))
            model(batch(Fault.SLOW_FORWARD))
        elif name == "progress_hang":
            model(batch(Fault.RELEASED_HANG))
        elif name == "memory_error":
            model(batch(Fault.MEMORY_ERROR))
        elif name == "result_pickling":
            model(batch(Fault.UNPICKLABLE_RESULT))
        elif name == "sigint":
            # Python's own Ctrl-C handler: a coordinator started in the background by a non-interactive
            # shell (as CI may start it) inherits SIGINT ignored, and then no KeyboardInterrupt exists.
            out["sigint_at_start"] = repr(signal.getsignal(signal.SIGINT))
            signal.signal(signal.SIGINT, signal.default_int_handler)
            _later(0.5, lambda: os.kill(os.getpid(), signal.SIGINT))
            model(batch(Fault.SLOW_FORWARD))
        elif name == "close_from_thread":
            closer = _later(0.5, model.close)
            try:
                model(batch(Fault.SLOW_FORWARD))
            finally:
                closer.join()
        else:
            raise KeyError(name)

    t0 = time.monotonic()
    try:
        trigger()
        out["error"] = None
    except BaseException as exc:  # noqa: BLE001 - we report whatever came out
        out["detect_s"] = time.monotonic() - t0
        out["error"] = type(exc).__name__
        out["error_mro"] = [c.__name__ for c in type(exc).__mro__]
        out["message"] = str(exc)
        for attr in ("worker", "pid", "device", "step", "signal_name", "exitcode", "workers"):
            if hasattr(exc, attr):
                out[attr] = getattr(exc, attr)
    try:
        os.kill(target, signal.SIGCONT)
    except ProcessLookupError:
        pass
    try:
        assert_unchanged(before, snapshot(net, opt))
        out["unchanged"] = True
    except AssertionError as exc:
        out["unchanged"] = str(exc)
    t0 = time.monotonic()
    try:
        good_step(model, opt)
        out["next"] = "ok"
        # after a restart the pool must still match a single-process run of the same steps
        out["next_params_finite"] = all(torch.isfinite(q).all().item() for q in net.parameters())
    except BaseException as exc:  # noqa: BLE001
        out["next"] = type(exc).__name__
    out["next_s"] = time.monotonic() - t0
    out["pids_after"] = model.pids
    model.close()
    # close() returns only when the pool is fully down, even if another thread's close is still running
    out["children_after_close"] = [c.pid for c in psutil.Process().children()]
    out["params_private"] = all(_is_private(q) for q in list(net.parameters()) + list(net.buffers()))
    return out


def _fixed_batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randn(8, 4, generator=g) for _ in range(n)]


def _train(model, opt, batches) -> None:
    for x in batches:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


def restart_phase(phase: str) -> dict:
    """Kill worker 1 in ``phase`` with ``max_restarts=1``; then train 3 steps and compare, bit for bit,
    with a fresh pool that trains the same 3 steps from the same master and optimizer state."""
    torch.manual_seed(0)
    net = Victim()
    model = dpool.wrap(net, ["cpu", "cpu"], max_restarts=1, step_timeout_s=20)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    good_step(model, opt)
    pids = model.pids
    victim = pids[1]
    out: dict = {"pids": pids, "phase": phase}

    t0 = time.monotonic()
    try:
        if phase == "between_steps":
            sigkill(victim)
            good_step(model, opt)
        elif phase == "between_forward_and_backward":
            y = model(batch())
            sigkill(victim)
            y.pow(2).mean().backward()
        elif phase == "during_optimizer_step":
            opt.zero_grad()
            model(batch()).pow(2).mean().backward()
            handle = opt.register_step_pre_hook(lambda *_: sigkill(victim))
            opt.step()  # the kill lands while the master steps; the next call finds the worker dead
            handle.remove()
            good_step(model, opt)
        elif phase == "mid_step_other_busy":
            # worker 0 sleeps 6 s in its forward; worker 1 dies meanwhile: worker 0's reply arrives
            # after the restart, and must not be taken for the answer to a later request
            _later(0.5, lambda: sigkill(victim))
            model(batch(Fault.SLOW_FORWARD, shard=0))
        else:
            raise KeyError(phase)
        out["error"] = None
    except dpool.WorkerDiedError as exc:
        out["error"] = type(exc).__name__
        out["message"] = str(exc)
    out["detect_s"] = time.monotonic() - t0
    # the state the next steps start from: a fresh pool must compute the same from it
    start_state = {k: v.clone() for k, v in net.state_dict().items()}
    start_opt = copy.deepcopy(opt.state_dict())
    t0 = time.monotonic()
    _train(model, opt, _fixed_batches(3))
    out["next_s"] = time.monotonic() - t0
    after = [t.clone() for t in net.state_dict().values()]
    out["pids_after"] = model.pids
    model.close()

    fresh_net = Victim()
    fresh_net.load_state_dict(start_state)
    fresh = dpool.wrap(fresh_net, ["cpu", "cpu"])
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    fresh_opt.load_state_dict(start_opt)
    _train(fresh, fresh_opt, _fixed_batches(3))
    out["pids_after"] += fresh.pids
    fresh.close()
    out["bitwise_equal"] = all(torch.equal(a, b) for a, b in zip(after, fresh_net.state_dict().values()))
    return out


def _is_private(t: torch.Tensor) -> bool:
    """True if ``t`` no longer lives in a dpool shared segment (close() gave it private memory)."""
    with open("/proc/self/maps") as f:
        shared = [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in f if "dpool" in line]
    return not any(lo <= t.data_ptr() < hi for lo, hi in shared)


if __name__ == "__main__":
    if sys.argv[1] == "restart":
        result = restart_phase(sys.argv[2])
    else:
        result = run(sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else {})
    print("RESULT " + json.dumps(result), flush=True)
