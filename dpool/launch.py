"""How dpool starts its workers: their command line, environment and boot message, and the launcher seam.

A pool gets its workers from a :class:`Launcher`. Two implement it:

* :class:`Spawn` (here): start our own worker processes, our children;
* :class:`dpool.attach.Lease`: borrow the warm workers of a ``dpool-workers`` daemon.

The pool calls the launcher for everything that depends on where its workers
come from (starting, restarting, ending them, and explaining a death), and
nothing else in dpool asks which one it has.

Torch-free on purpose: the ``dpool-workers`` daemon and CLI use it without paying torch's import.
"""
from __future__ import annotations

import collections
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Iterable, Protocol, Sequence

from . import protocol as P
from .errors import DpoolError, WorkerDiedError, WorkerStartError
from .policies import worker_cpus, worker_sched



class Pool(Protocol):
    """What a launcher uses of the :class:`dpool.pool.Pool` it is passed (never imported: the pool imports us)."""

    workers: list["Worker"]
    config: Any
    threads: int
    endpoint: str
    prefix: str
    control: Any
    key: bytes
    inherited_fds: list[int]
    chan: Any
    progress: Any

    def watch(self, w: "Worker") -> None: ...
    def tell(self, w: "Worker", msg: Any) -> bool: ...
    def kill(self, w: "Worker") -> None: ...
    def exited(self, w: "Worker") -> bool: ...
    def drain(self) -> Iterable[tuple[int, Any]]: ...
    def rekey(self, key: bytes) -> None: ...

__all__ = ["worker_command", "worker_env", "worker_package_dir", "visible_device", "client_device",
           "WORKER_MALLOC_KEEP", "Worker", "Launcher", "Spawn",
           "start_worker", "kill_strays", "WORKER_OF", "join_or_kill", "signal_name", "show_output"]

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


def worker_env(threads: int, workers: int) -> dict[str, str]:
    """The environment of a worker process: this dpool importable, native thread pools sized on purpose,
    the heap kept, the scheduling policy chosen for ``workers`` workers on this machine."""
    env = dict(os.environ)
    pkg_root = _DPOOL_ROOT
    env["PYTHONPATH"] = os.pathsep.join([pkg_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    # glibc hands every freed block above its mmap threshold (128 KiB, adapting up to 32 MiB) back to
    # the kernel, so a step's activations page-fault in again on the next step (a CNN step spent a third
    # of its time on such faults: docs/performance.md). A long-lived worker keeps its peak heap instead, like a caching
    # allocator (the daemon trims it when a client detaches). A value already in the environment wins.
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(WORKER_MALLOC_KEEP))
    env.setdefault("MALLOC_TRIM_THRESHOLD_", str(WORKER_MALLOC_KEEP))
    env["DPOOL_WORKER_SCHED"] = worker_sched(workers)  # (see dpool.policies.worker_sched)
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


# ---------------------------------------------------------------------------- processes
_STDERR_TAIL = 40  # lines of a worker's stderr kept for the error that reports its death


def signal_name(returncode: int) -> str | None:
    """``"SIGKILL"`` for a process killed by SIGKILL (``returncode`` -9), ``None`` for a normal exit."""
    if returncode < 0:
        try:
            return signal.Signals(-returncode).name
        except ValueError:
            return f"signal {-returncode}"
    return None


def show_output(label: str, text: str, to_stderr: bool) -> None:
    """Write a worker's output to ours, each line labelled with the worker index."""
    out = sys.stderr if to_stderr else sys.stdout
    try:
        out.write("".join(f"[{label}] {line}\n" for line in text.rstrip("\n").split("\n")))
        out.flush()
    except Exception:  # interpreter shutting down, closed capture, ...
        pass


Sink = Callable[[str, str, bool], None]  # (label, text, from stderr)


def _pump(stream: Any, label: str, tail: collections.deque | None, to_stderr: bool, sink: Sink) -> None:
    """Copy a worker's output pipe to ``sink``, line by line."""
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace")
        if tail is not None:
            tail.append(line)
        sink(label, line, to_stderr)
    stream.close()


def start_worker(boot: P.Boot, threads: int, workers: int, pass_fds: Sequence[int], label: str,
                 tail: collections.deque | None = None,
                 sink: Sink = show_output) -> tuple[subprocess.Popen, list[threading.Thread]]:
    """Start one worker process of ``workers`` and hand it ``boot`` on its stdin (a pipe only we hold).

    A GPU worker sees only its own GPU, as ``cuda:0`` (``boot.device`` is rewritten so).
    Its stdout and stderr go to ``sink`` (ours, labelled, by default); the last lines of stderr to ``tail``.
    """
    env = worker_env(threads, workers)
    env.setdefault("PYTHONUNBUFFERED", "1")  # worker output reaches us as it is written
    cpus = worker_cpus(boot.index, threads, workers, boot.device)
    env["DPOOL_WORKER_CPUS"] = ",".join(map(str, cpus)) if cpus is not None else ""
    env[WORKER_OF] = boot.prefix  # whose it is, should its handle be lost (see kill_strays)
    if boot.device.startswith("cuda:"):
        env["CUDA_VISIBLE_DEVICES"] = visible_device(int(boot.device.split(":")[1]))
        boot.device = "cuda:0"
    proc = subprocess.Popen(worker_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, close_fds=True, pass_fds=list(pass_fds))
    try:
        threads_ = []
        for stream, t, err in ((proc.stdout, None, False), (proc.stderr, tail, True)):
            th = threading.Thread(target=_pump, args=(stream, label, t, err, sink), name=f"{label} output",
                                  daemon=True)
            th.start()
            threads_.append(th)
        assert proc.stdin is not None
        try:
            proc.stdin.write(boot.pack())
            proc.stdin.close()
        except BrokenPipeError:
            pass  # it died at start: its exit and stderr are reported by whoever waits for its hello
    except BaseException:  # (Ctrl-C) nobody else holds this process yet
        proc.kill()
        proc.wait()
        if proc.stdin is not None:
            try:
                proc.stdin.close()
            except OSError:
                pass  # (what was buffered for the dead process)
        raise
    return proc, threads_


WORKER_OF = "DPOOL_WORKER_OF"  # in a spawned worker's environment: its pool's segment prefix


def kill_strays(prefix: str, known: Sequence[int]) -> None:
    """Kill and reap the children started for the pool ``prefix`` that are not in ``known``.

    A Ctrl-C that lands as :func:`start_worker` returns (CPython checks for signals after every call)
    loses the only handle of a process already running: it would wait for its boot data until this
    process exits. Its environment still names its pool.
    """
    import psutil

    try:
        children = psutil.Process().children()
    except psutil.Error:
        return
    for child in children:
        if child.pid in known:
            continue
        try:
            if child.environ().get(WORKER_OF) == prefix:
                child.kill()
                child.wait(timeout=5.0)
        except (psutil.Error, OSError):
            pass  # gone already (or reaped by its Popen meanwhile)


def join_or_kill(procs: Sequence[subprocess.Popen], grace: float) -> None:
    """Wait up to ``grace`` seconds in all for ``procs`` to exit, then SIGKILL and reap the rest."""
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Worker:
    """One worker as the pool sees it: index, device, process, and what the pool tracks about it."""

    __slots__ = ("index", "device", "proc", "pidfd", "pid", "stderr_tail", "threads", "alive", "ident", "exports")

    def __init__(self, index: int, device: str, generation: int = 0) -> None:
        self.index = index
        # A respawned worker gets a new identity: replies are matched to the current process only.
        self.ident = b"w%d.%d" % (index, generation)
        self.device = device
        self.proc: subprocess.Popen | None = None  # ours to wait for (spawned), or None (a daemon's)
        self.pid = -1
        self.pidfd: int | None = None
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=_STDERR_TAIL)
        self.threads: list[threading.Thread] = []
        self.alive = True
        self.exports: list = []  # CUDA IPC reference-counter slots this process imported (see dpool.transport.cuda_ipc)

    def where(self) -> str:
        return f"worker {self.index} ({self.device}, pid {self.pid})"

    def reap(self) -> None:
        """Collect the exit status of a worker that is our child (a daemon's worker is the daemon's to reap)."""
        if self.proc is not None:
            self.proc.wait()

    def kill(self) -> None:
        """SIGKILL our child (waking it first if it is stopped) and reap it; no-op if gone or not ours."""
        proc = self.proc
        if proc is not None:
            if proc.poll() is None:
                try:
                    os.kill(proc.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                proc.kill()
            proc.wait()
        self.alive = False


# ---------------------------------------------------------------------------- the seam
class Launcher:
    """Where a pool's workers come from: the interface :class:`Spawn` and :class:`~dpool.attach.Lease` implement."""

    verb = "started"
    """How the log says the workers came to be."""
    spawns = True
    """Whether the workers are new processes of ours: they inherit fds (a daemon's workers map shared
    memory by name instead), need a CUDA context each, and :meth:`respawn` can replace a dead one (a
    daemon restarts its own)."""

    def start(self, pool: "Pool") -> None:
        """Make every worker of ``pool`` run and connect to ``pool.endpoint`` (the pool awaits the hellos)."""
        raise NotImplementedError

    def respawn(self, pool: "Pool", w: Worker) -> None:
        """Start a fresh process for the (reaped) worker ``w``."""
        raise NotImplementedError

    def end(self, pool: "Pool", grace: float) -> None:
        """End the workers' service to ``pool``: within ``grace`` seconds if they cooperate, by force after."""
        raise NotImplementedError

    def kill_hung(self, w: Worker) -> None:
        """Kill a worker whose stacks were just dumped (hung or past its deadline)."""
        raise NotImplementedError

    def abandon(self, chan: Any, workers: Sequence[Worker]) -> None:
        """End the workers' service to a pool nobody closed, now garbage or at exit (no pool to use: only its
        channel and workers). Our own workers are then killed; nothing to do before that."""

    def death(self, pool: "Pool", w: Worker, stage: str, others: Sequence[Worker], detail: str) -> DpoolError:
        """The error that reports ``w``'s death (and ``others``', found dead at the same time)."""
        raise NotImplementedError


class Spawn(Launcher):
    """Our own workers: child processes started with :func:`start_worker`, killed and reaped by us."""

    def start(self, pool: "Pool") -> None:
        for w in pool.workers:
            self._start(pool, w)

    def respawn(self, pool: "Pool", w: Worker) -> None:
        # A restart that a Ctrl-C cut as start_worker returned lost that process's handle: end it first.
        kill_strays(pool.prefix, [x.pid for x in pool.workers])
        self._start(pool, w)

    def _start(self, pool: "Pool", w: Worker) -> None:
        boot = P.Boot(mode="embedded", key=pool.key, endpoint=pool.endpoint, index=w.index, ident=w.ident,
                      device=w.device, ppid=os.getpid(), threads=pool.threads, shm_dir=pool.config.shm_dir,
                      prefix=pool.prefix, control=pool.control.fd_ref(), steps=None,
                      heartbeat_interval_s=pool.config.heartbeat_interval_s,
                      max_message_bytes=pool.config.max_message_bytes)
        w.proc, w.threads = start_worker(boot=boot, threads=pool.threads, workers=len(pool.workers),
                                         pass_fds=pool.inherited_fds, label=f"dpool worker {w.index}",
                                         tail=w.stderr_tail)
        w.pid = w.proc.pid
        pool.watch(w)

    def end(self, pool: "Pool", grace: float) -> None:
        if grace > 0:
            for w in pool.workers:
                if w.alive and w.proc is not None and w.proc.poll() is None:
                    pool.tell(w, P.Shutdown())
            join_or_kill([w.proc for w in pool.workers if w.proc is not None], grace)
        for w in pool.workers:
            pool.kill(w)  # reaped already, or killed now; releases what we held for it
        kill_strays(pool.prefix, [w.pid for w in pool.workers])

    def kill_hung(self, w: Worker) -> None:
        assert w.proc is not None
        try:
            w.proc.wait(timeout=0.3)  # the dump is written before it dies
        except subprocess.TimeoutExpired:
            pass
        w.proc.kill()

    def death(self, pool: "Pool", w: Worker, stage: str, others: Sequence[Worker], detail: str) -> DpoolError:
        assert w.proc is not None
        if w.proc.poll() is None:
            try:
                w.proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
        rc = w.proc.returncode
        sig = signal_name(rc) if rc is not None else None
        how = f"was killed by {sig}" if sig else f"exited with code {rc}"
        hint = ""
        if sig == "SIGKILL":
            hint = " A SIGKILL nobody sent on purpose is usually the out-of-memory killer: check dmesg and memory limits."
        elif sig in ("SIGSEGV", "SIGBUS", "SIGILL", "SIGABRT"):
            hint = " The worker crashed in native code; its faulthandler traceback (stderr) follows."
        elif rc == 0:
            hint = " The model code (or a library) exited the process, e.g. sys.exit() in forward."
        if stage == "starting":
            for t in w.threads:
                t.join(timeout=1.0)  # its last words, before they are quoted
        tail = "".join(w.stderr_tail).rstrip()
        text = f"{w.where()} {how} while {stage} at step {pool.progress.step}{detail}.{hint}"
        if others:
            text += " Also dead: " + ", ".join(
                f"{o.where()} ({signal_name(o.proc.returncode) or 'exit ' + str(o.proc.returncode)})"
                for o in others if o.proc is not None) + "."
        if tail:
            text += "\n--- last stderr of worker %d ---\n%s" % (w.index, tail[-4000:])
        if stage == "starting":
            return WorkerStartError(text, workers=[w.index] + [o.index for o in others])
        return WorkerDiedError(
            text, worker=w.index, device=w.device, pid=w.pid, step=pool.progress.step,
            exitcode=rc if rc is not None and rc >= 0 else None, signal_name=sig,
            workers=[w.index] + [o.index for o in others],
        )
