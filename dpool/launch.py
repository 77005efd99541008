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
from typing import TYPE_CHECKING, Any, Callable, Sequence

from . import protocol as P
from .cpus import allowed_cores, local_share, physical_cores
from .errors import DpoolError, DpoolValueError, WorkerDiedError, WorkerStartError

if TYPE_CHECKING:  # the pool is passed in, never imported: it imports us
    from .pool import Pool

__all__ = ["worker_cpus", "coordinator_cpus", "COORDINATOR_AFFINITY_POLICIES", "reply_together",
           "REPLY_TOGETHER_POLICIES", "forward_with_loss", "FORWARD_WITH_LOSS_POLICIES",
           "wait_spin", "WAIT_SPIN_US_DEFAULT",
           "worker_command", "worker_env", "worker_package_dir", "visible_device", "client_device",
           "WORKER_MALLOC_KEEP", "WORKER_SCHED_POLICIES", "WORKER_AFFINITY_POLICIES", "Worker", "Launcher", "Spawn",
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
# ``DPOOL_WORKER_SCHED``: the Linux scheduling policy of a worker's threads (see ``worker_env`` and
# workers/worker.py's ``set_scheduling``): ``batch``, ``other`` (Linux's default policy), or ``auto``
# (the default: ``batch`` while every worker can have a physical core of its own, else ``other``).
WORKER_SCHED_POLICIES = ("auto", "batch", "other")


# ``DPOOL_WORKER_AFFINITY``: which CPUs a CPU worker's threads may run on (see ``worker_cpus``): ``cores``
# (worker k on cores of its own), ``none`` (wherever Linux puts them), or ``auto`` (the default:
# ``cores`` for CPU workers whose threads fill exactly the cores this process may use, else ``none``).
WORKER_AFFINITY_POLICIES = ("auto", "cores", "none")


def worker_cpus(index: int, threads: int, workers: int, device: str) -> list[int] | None:
    """The logical CPUs worker ``index`` of ``workers`` is bound to (``None``: not bound), per ``DPOOL_WORKER_AFFINITY``.

    Worker ``k`` gets ``threads`` physical cores of its own, the ``k``-th such run of the cores this
    process may use (with their hyperthreads), wrapping around when they run out. Its main thread and
    its ZeroMQ I/O thread then hand each message over on one core: probe and mlp steps measured 4-7%
    faster bound than unbound (docs/performance.md, "Worker affinity"). Under torchrun with several
    coordinators per machine whose workers together fill the cores, each coordinator's workers take
    its ``LOCAL_RANK``'s share of them.

    ``auto`` binds only CPU workers whose threads fill exactly the cores we may use (the default
    layout): a pool that leaves cores free (``worker_threads`` set lower, or two jobs on one machine)
    would put every job's workers on the same first cores. GPU workers are left alone: where their
    cores should be depends on the GPU's NUMA node.
    """
    policy = os.environ.get("DPOOL_WORKER_AFFINITY", "") or "auto"
    if policy not in WORKER_AFFINITY_POLICIES:
        raise DpoolValueError(f"DPOOL_WORKER_AFFINITY={policy!r} is not a worker affinity policy; use one of "
                              f"{', '.join(WORKER_AFFINITY_POLICIES)} (unset it for the default, auto)")
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


# ``DPOOL_COORDINATOR_AFFINITY``: whether a coordinator under torchrun joins its workers on its local rank's
# share of the cores (see ``coordinator_cpus``): ``auto`` (the default) or ``none``.
COORDINATOR_AFFINITY_POLICIES = ("auto", "none")


def coordinator_cpus(threads: int, devices: Sequence[str]) -> list[int] | None:
    """The logical CPUs this coordinator binds itself to while its pool is open (``None``: not bound), per
    ``DPOOL_COORDINATOR_AFFINITY``.

    Under torchrun with several coordinators per machine whose CPU workers together fill the cores,
    :func:`worker_cpus` gives each coordinator's workers its ``LOCAL_RANK``'s share of them. ``auto`` (the
    default) then binds the coordinator to that share too: it and its workers take turns (it waits while
    they compute, they wait while it reduces and steps), so each rank keeps to its own cores instead of
    the scheduler moving the ranks' coordinators onto each other's workers' cores. Two cross-node ranks
    with a worker each on 2 cores, the binding toggled between blocks of steps in one run: probe 0.30-0.52 ms
    and mlp 1.9-3.4 ms per step faster (docs/performance.md). ``none`` leaves the coordinator where it was;
    so does any other layout (one coordinator per machine, workers that leave cores free, GPU workers).
    """
    policy = os.environ.get("DPOOL_COORDINATOR_AFFINITY", "") or "auto"
    if policy not in COORDINATOR_AFFINITY_POLICIES:
        raise DpoolValueError(f"DPOOL_COORDINATOR_AFFINITY={policy!r} is not a policy; use one of "
                              f"{', '.join(COORDINATOR_AFFINITY_POLICIES)} (unset it for the default, auto)")
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


REPLY_TOGETHER_POLICIES = ("auto", "on", "off")


def _cpu_pool(devices: Sequence[str]) -> bool:
    return all(d.startswith("cpu") for d in devices)


def reply_together(devices: Sequence[str], threads: int) -> bool:
    """Whether a pool's rounds ask its workers to reply together, per ``DPOOL_REPLY_TOGETHER``
    (see :data:`dpool.protocol.TOGETHER_WAIT_S`).

    ``auto`` (the default) asks when the coordinator has no core of its own: two or more CPU workers
    whose threads fill exactly the cores this process may use (the default layout). Then a worker done
    first has an otherwise idle core to wait on, and the coordinator, woken once per round instead of
    once per reply, does not preempt the slower worker's handler on the core they share: a probe step
    measured 1.52 → 1.22 ms (docs/performance.md). With a core to spare the coordinator wakes elsewhere,
    and with more threads than cores a waiting worker would hold a core another one needs. ``on`` asks
    for any pool of CPU workers, ``off`` never. GPU workers never wait: their machines have cores to spare.
    """
    policy = os.environ.get("DPOOL_REPLY_TOGETHER", "") or "auto"
    if policy not in REPLY_TOGETHER_POLICIES:
        raise DpoolValueError(f"DPOOL_REPLY_TOGETHER={policy!r} is not a policy; use one of "
                              f"{', '.join(REPLY_TOGETHER_POLICIES)} (unset it for the default, auto)")
    if policy == "off" or len(devices) < 2 or not _cpu_pool(devices):
        return False
    return policy == "on" or len(devices) * threads == len(allowed_cores())


FORWARD_WITH_LOSS_POLICIES = ("auto", "off")


def forward_with_loss() -> bool:
    """Whether a ``gather=False`` training forward waits for its loss and goes to the workers with it, per
    ``DPOOL_FORWARD_WITH_LOSS``: ``auto`` (the default) defers it where it can (see
    ``dpool.coordinator._Deferred``), ``off`` runs every forward at once, in a round of its own (its errors
    then come from ``model(x)`` itself instead of from the criterion)."""
    policy = os.environ.get("DPOOL_FORWARD_WITH_LOSS", "") or "auto"
    if policy not in FORWARD_WITH_LOSS_POLICIES:
        raise DpoolValueError(f"DPOOL_FORWARD_WITH_LOSS={policy!r} is not a policy; use one of "
                              f"{', '.join(FORWARD_WITH_LOSS_POLICIES)} (unset it for the default, auto)")
    return policy == "auto"


WAIT_SPIN_US_DEFAULT = 300


def wait_spin(devices: Sequence[str]) -> float:
    """How long (seconds) past a short round's previous time the coordinator spins before it sleeps in
    the poll, per ``DPOOL_WAIT_SPIN_US`` (see NOTE [ spinning through short rounds ] in :mod:`dpool.pool`).

    Unset: 300 µs for a pool of CPU workers, 0 (never spin) for GPU workers, where it has not been
    measured yet. A number of microseconds applies to either; ``0`` turns spinning off.
    """
    raw = os.environ.get("DPOOL_WAIT_SPIN_US", "")
    if not raw:
        return WAIT_SPIN_US_DEFAULT * 1e-6 if _cpu_pool(devices) else 0.0
    try:
        us = float(raw)
    except ValueError:
        us = -1.0
    if not 0 <= us <= 1e6:
        raise DpoolValueError(f"DPOOL_WAIT_SPIN_US={raw!r} is not a number of microseconds from 0 to 1000000 "
                              f"(0 turns spinning off; unset it for the default, {WAIT_SPIN_US_DEFAULT} on CPU)")
    return us * 1e-6


def worker_env(threads: int, workers: int) -> dict[str, str]:
    """The environment of a worker process: this dpool importable, native thread pools sized on purpose,
    the heap kept, the scheduling policy chosen for ``workers`` workers on this machine."""
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
    # Under Linux's default policy a thread that wakes may preempt whoever runs on its core: a worker
    # (or its ZeroMQ I/O thread) woken by a request preempts the coordinator, which still has the
    # other requests to send, or the other worker mid-compute. On the mlp benchmark (2 workers,
    # 2 cores) that is ~3 involuntary context switches per step in the coordinator and 3-5 in each
    # worker. SCHED_BATCH threads never preempt on wake-up (they take a free core or wait for the
    # next tick); their priority is unchanged, and the coordinator keeps the default policy.
    # Measured: 0.4-0.6 and 0.6-1.5 switches per step, and the mlp step faster (README, "Performance").
    # More workers than cores is the opposite case: a woken worker then has no free core to take, and
    # waking it by preemption is what gets its request served before the next tick. With 8 workers on
    # 2 cores the coordinator's CPU per probe step measured 1.90 ms under SCHED_BATCH against 1.48-1.75
    # under the default policy, so ``auto`` keeps the default there.
    sched = os.environ.get("DPOOL_WORKER_SCHED", "") or "auto"
    if sched not in WORKER_SCHED_POLICIES:
        raise DpoolValueError(f"DPOOL_WORKER_SCHED={sched!r} is not a worker scheduling policy; use one of "
                              f"{', '.join(WORKER_SCHED_POLICIES)} (unset it for the default, auto)")
    if sched == "auto":
        sched = "batch" if workers <= physical_cores() else "other"
    env["DPOOL_WORKER_SCHED"] = sched
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
        boot = P.Boot("embedded", pool.key, pool.endpoint, w.index, w.ident, w.device, os.getpid(), pool.threads,
                      pool.config.shm_dir, pool.prefix, pool.control.fd_ref(), None,
                      pool.config.heartbeat_interval_s, pool.config.max_message_bytes)
        w.proc, w.threads = start_worker(boot, pool.threads, len(pool.workers), pool.inherited_fds,
                                         f"dpool worker {w.index}", w.stderr_tail)
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
        text = f"{w.where()} {how} while {stage} at step {pool.step}{detail}.{hint}"
        if others:
            text += " Also dead: " + ", ".join(
                f"{o.where()} ({signal_name(o.proc.returncode) or 'exit ' + str(o.proc.returncode)})"
                for o in others if o.proc is not None) + "."
        if tail:
            text += "\n--- last stderr of worker %d ---\n%s" % (w.index, tail[-4000:])
        if stage == "starting":
            return WorkerStartError(text)
        return WorkerDiedError(
            text, worker=w.index, device=w.device, pid=w.pid, step=pool.step,
            exitcode=rc if rc is not None and rc >= 0 else None, signal_name=sig,
            workers=[w.index] + [o.index for o in others],
        )
