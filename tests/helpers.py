"""Shared test helpers: running scripts as separate coordinator processes, snapshots."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# PYTHONPATH for child processes: this checkout first, then whatever the environment adds (a GPU
# machine's offline site of dependencies, see scripts/gpu-test.sh).
PYPATH = os.pathsep.join([ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])


def running(pid: int) -> bool:
    """Whether process ``pid`` is still running. An exited process that is not our child stays a zombie
    until init reaps it, which some container inits do only every second or two: it has exited all the same."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def sigkill(pid: int) -> None:
    """SIGKILL process ``pid``, wait until it has exited, and then long enough for ZeroMQ to see the peer
    gone (the next send to it fails)."""
    os.kill(pid, signal.SIGKILL)
    while running(pid):
        time.sleep(0.01)
    time.sleep(0.3)


def run_script(code: str, timeout: float = 90.0, cwd: str | None = None, env: dict | None = None,
               ) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh coordinator process; its stacks are dumped if it hangs."""
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join([ROOT, full_env.get("PYTHONPATH", "")])
    full_env["PYTHONFAULTHANDLER"] = "1"
    if env:
        full_env.update(env)
    src = "import faulthandler, sys\nfaulthandler.dump_traceback_later(%r, exit=True)\n" % (timeout - 5) + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd or ROOT, env=full_env)


def script_result(res: subprocess.CompletedProcess) -> dict:
    """The JSON a script printed on its last ``RESULT `` line; fails with its output if there is none."""
    import json

    lines = [line for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    assert res.returncode == 0 and lines, f"{res.stdout}\n{res.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def run_scripts(codes: list[str], timeout: float = 120.0, env: dict | None = None,
                at_once: int | None = None) -> list[subprocess.CompletedProcess]:
    """Run several coordinator scripts side by side (slow fault scenarios in parallel), each like ``run_script``.

    ``at_once``: at most this many run at a time (the next starts when one ends); ``timeout`` is each one's.
    """
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join([ROOT, full_env.get("PYTHONPATH", "")])
    full_env["PYTHONFAULTHANDLER"] = "1"
    if env:
        full_env.update(env)
    head = "import faulthandler, sys\nfaulthandler.dump_traceback_later(%r, exit=True)\n" % (timeout - 5)
    limit = at_once or len(codes)
    results: list[subprocess.CompletedProcess | None] = [None] * len(codes)
    live: dict[int, tuple[subprocess.Popen, float]] = {}
    waiting = list(range(len(codes)))
    while waiting or live:
        while waiting and len(live) < limit:
            i = waiting.pop(0)
            p = subprocess.Popen([sys.executable, "-c", head + textwrap.dedent(codes[i])], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, cwd=ROOT, env=full_env)
            live[i] = (p, time.monotonic())
        # communicate() with the oldest: it drains its pipes (a full pipe would block the child) until it ends
        i = min(live, key=lambda k: live[k][1])
        p, started = live.pop(i)
        try:
            out, err = p.communicate(timeout=max(0.1, started + timeout - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        results[i] = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    return [r for r in results if r is not None]


def snapshot(module: torch.nn.Module, opt: torch.optim.Optimizer | None = None) -> dict:
    """Everything a failed step must leave untouched."""
    snap = {
        "params": [p.detach().clone() for p in module.parameters()],
        "grads": [None if p.grad is None else p.grad.clone() for p in module.parameters()],
        "buffers": [b.clone() for b in module.buffers()],
    }
    if opt is not None:
        snap["opt"] = {k: {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in s.items()}
                       for k, s in enumerate(opt.state.values())}
    return snap


def assert_unchanged(before: dict, after: dict) -> None:
    for key in ("params", "buffers"):
        for a, b in zip(before[key], after[key]):
            assert torch.equal(a, b), f"{key} changed by a failed step"
    for a, b in zip(before["grads"], after["grads"]):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), "grads changed by a failed step"
    if "opt" in before:
        assert before["opt"].keys() == after["opt"].keys()
        for k in before["opt"]:
            for n, v in before["opt"][k].items():
                w = after["opt"][k][n]
                assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w


def dataparallel(module: torch.nn.Module) -> torch.nn.DataParallel:
    """``nn.DataParallel(module)`` for its state_dict layout, with ``module`` left on the CPU.

    With exactly one visible GPU, DataParallel's constructor moves the module to it; the CPU tests
    compare against that module afterwards, so it goes back.
    """
    return torch.nn.DataParallel(module).cpu()


def _trace_opcodes(frame, tracer, local) -> None:
    """Ask for ``frame``'s opcode events from inside ``tracer``'s call event, ``local`` being the frame's
    tracer. Python 3.12 and 3.13 (3.12.1 and 3.13.0 here) ignore the flag set there, unlike 3.11, and turn
    the events on when a tracer is set for a frame that already has its own: give it ``local``, then set
    the same ``tracer`` again."""
    frame.f_trace_opcodes = True
    if sys.version_info >= (3, 12):
        frame.f_trace = local
        sys.settrace(tracer)


class CtrlC:
    """A real Ctrl-C (SIGINT to this process) just before a chosen instruction of a chosen function.

    CPython runs a signal's handler where it checks for pending signals: at a function's start, after
    a call returns, and at a loop's backward jump. :meth:`positions` lists every such point (an
    instruction right after one of those) that a call runs in ``fns``: every place where a user's
    Ctrl-C can land in them. ``with CtrlC(code, offset, skip):`` delivers SIGINT when ``code`` is
    about to run the instruction at ``offset`` for the ``skip + 1``-th time, with Python's own handler
    installed (a process started in the background may inherit SIGINT ignored), so
    :class:`KeyboardInterrupt` is raised there.
    """

    # CPython checks for signals after these: 3.11-3.13 (3.13 adds CALL_KW for calls with keywords), and
    # 3.10's names for calls and the jump back of a loop
    _CHECKED = {"CALL", "CALL_KW", "CALL_FUNCTION_EX", "JUMP_BACKWARD",
                "CALL_FUNCTION", "CALL_FUNCTION_KW", "CALL_METHOD", "JUMP_ABSOLUTE"}

    def __init__(self, code, offset: int, skip: int = 0) -> None:
        self.code, self.offset, self.skip, self.hit = code, offset, skip, False

    @classmethod
    def positions(cls, fns, run) -> list[tuple]:
        """``(code, offset)`` of every point where a signal can land in ``fns`` while ``run()`` runs, in
        first-run order."""
        import dis

        ops = {f.__code__: {i.offset: i.opname for i in dis.get_instructions(f.__code__)} for f in fns}
        seen: dict[tuple, None] = {}

        def tracer(frame, event, arg):
            names = ops.get(frame.f_code)
            if names is None:
                return None
            last = [None]  # the previous instruction this frame ran (None: the function just started)

            def local(frame, event, arg):
                if event == "opcode":
                    if last[0] is None or names.get(last[0]) in cls._CHECKED:
                        seen.setdefault((frame.f_code, frame.f_lasti))
                    last[0] = frame.f_lasti
                return local

            _trace_opcodes(frame, tracer, local)
            return local

        sys.settrace(tracer)
        try:
            run()
        finally:
            sys.settrace(None)
        return list(seen)

    def _local(self, frame, event, arg):
        if event == "opcode" and not self.hit and frame.f_lasti == self.offset:
            if self.skip:
                self.skip -= 1
                return self._local
            self.hit = True
            os.kill(os.getpid(), signal.SIGINT)  # the handler runs at once, inside this trace call
        return self._local

    def _tracer(self, frame, event, arg):
        if frame.f_code is not self.code or self.hit:
            return None
        _trace_opcodes(frame, self._tracer, self._local)
        return self._local

    def __enter__(self) -> "CtrlC":
        self._handler = signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.settrace(self._tracer)
        return self

    def __exit__(self, *exc) -> None:
        sys.settrace(None)
        signal.signal(signal.SIGINT, self._handler)


@contextlib.contextmanager
def tmpfs(path, size: str):
    """A tmpfs of ``size`` ("64m") mounted at ``path`` for the block (root only: elsewhere the test is skipped)."""
    import pytest

    os.makedirs(path, exist_ok=True)
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=1777", "tmpfs", str(path)], check=True,
                       capture_output=True, timeout=30)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot mount a small tmpfs here ({exc}); run as root to test a full /dev/shm")
    try:
        yield str(path)
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True, timeout=30)
