"""Every ``DPOOL_*`` environment variable, declared once: its name, kind, default, choices and meaning.

Library code reads the environment only through :func:`get` (and :func:`raw` for the few values that
are passed on as they are): no other module of ``dpool`` or ``dpool_workers`` calls ``os.environ`` for a
``DPOOL_*`` name, and every such name in the code is one declared here (``tests/test_shape.py`` checks
both). ``docs/knobs.md`` is generated from this table (the command is at its top; a test checks that it is
current).

Torch-free: the command line and the daemon client import it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from .errors import DpoolValueError

__all__ = ["Knob", "KNOBS", "get", "raw", "markdown"]

_FALSE = ("0", "false", "no", "off")
_TRUE = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Knob:
    """One environment variable.

    Args:
        name: the variable, ``DPOOL_...``.
        kind: how its value is read: ``choice`` (one of ``choices``), ``seconds`` (a number, an ``s`` may
            follow), ``microseconds`` (a number from 0 to 1,000,000), ``bool`` (``0/1``, ``true/false``,
            ``yes/no``, ``on/off``), ``path``, ``text``, or ``internal`` (dpool sets it for its own processes).
        default: the value when unset or empty (``None``: decided elsewhere, as ``doc`` says).
        group: the heading it is listed under in the docs.
        doc: one line: what it does, and for a tuning knob what it trades.
        choices: a ``choice`` knob's values.
        noun: what a ``choice`` value is, as its error names it ("policy").
    """

    name: str
    kind: str
    default: Any
    group: str
    doc: str
    choices: tuple[str, ...] = ()
    noun: str = "policy"


KNOBS: dict[str, Knob] = {k.name: k for k in (
    # ---- timeouts (the defaults of dpool.Config's fields)
    Knob("DPOOL_STEP_TIMEOUT", "seconds", 600.0, "timeouts",
         "Deadline for one forward or backward round (Config.step_timeout_s); NCCL's default."),
    Knob("DPOOL_STARTUP_TIMEOUT", "seconds", 60.0, "timeouts",
         "Deadline for spawning the workers and loading the model (Config.startup_timeout_s)."),
    Knob("DPOOL_HEARTBEAT_INTERVAL", "seconds", 0.2, "timeouts",
         "How often a worker's heartbeat thread beats (Config.heartbeat_interval_s)."),
    Knob("DPOOL_HEARTBEAT_TIMEOUT", "seconds", 10.0, "timeouts",
         "Silence after which a worker is declared hung (Config.heartbeat_timeout_s); "
         "shorter finds a hang sooner, and may call a worker stuck in a long GIL-holding call hung."),
    Knob("DPOOL_PEER_TIMEOUT", "seconds", 600.0, "timeouts",
         "Cross-node mode: deadline for one collective between the nodes' coordinators (Config.peer_timeout_s)."),
    Knob("DPOOL_PEER_HEARTBEAT", "seconds", 1.0, "timeouts",
         "Cross-node mode: how often each coordinator beats in the process group's store (Config.peer_heartbeat_s)."),
    Knob("DPOOL_PEER_HEARTBEAT_TIMEOUT", "seconds", 30.0, "timeouts",
         "Cross-node mode: silence after which a node is declared frozen (Config.peer_heartbeat_timeout_s)."),
    # ---- where things are
    Knob("DPOOL_SHM_DIR", "path", "/dev/shm", "pools and memory",
         "Directory of the shared-memory segments (Config.shm_dir): a tmpfs."),
    Knob("DPOOL_POOL", "text", None, "pools and memory",
         "The pool wrap() attaches to when it is given no pool=: a dpool-workers pool's name, a socket path, "
         "or tcp://HOST:PORT."),
    Knob("DPOOL_KEY_FILE", "path", None, "pools and memory",
         "A 0600 copy of a TCP pool's key, for a client attaching to tcp://HOST:PORT."),
    # ---- cross-node mode
    Knob("DPOOL_CROSS_NODE_OVERLAP", "bool", True, "cross-node mode",
         "Exchange each gradient bucket as soon as every local worker completed it, during the backward "
         "(Config.cross_node_overlap); off exchanges them all after it."),
    Knob("DPOOL_GLOO_LOOP", "choice", "batch", "cross-node mode",
         "Post a cross-node swap with gloo's loop threads under SCHED_BATCH (batch), so that they cannot "
         "preempt the posting thread, or leave them alone (none).", choices=("batch", "none")),
    # ---- tuning: each trades one thing for another; the defaults are measured (docs/performance.md)
    Knob("DPOOL_WORKER_SCHED", "choice", "auto", "tuning",
         "Scheduling policy of the workers' threads: batch (woken threads never preempt), other (Linux's "
         "default), auto (batch while every worker has a physical core of its own).",
         choices=("auto", "batch", "other"), noun="worker scheduling policy"),
    Knob("DPOOL_WORKER_AFFINITY", "choice", "auto", "tuning",
         "CPU workers' cores: cores (worker k on cores of its own), none (wherever Linux puts them), auto "
         "(cores when the workers' threads fill exactly the cores this process may use).",
         choices=("auto", "cores", "none"), noun="worker affinity policy"),
    Knob("DPOOL_COORDINATOR_AFFINITY", "choice", "auto", "tuning",
         "Under torchrun, whether a coordinator joins its workers on its local rank's share of the cores "
         "(auto) or stays where it is (none).", choices=("auto", "none")),
    Knob("DPOOL_REPLY_TOGETHER", "choice", "auto", "tuning",
         "Whether a round's workers reply together, waking the coordinator once: on, off, auto (when the "
         "coordinator has no core of its own). Trades a worker's idle wait for fewer wake-ups.",
         choices=("auto", "on", "off")),
    Knob("DPOOL_FORWARD_WITH_LOSS", "choice", "auto", "tuning",
         "Whether a gather=False training forward waits for its loss and goes to the workers with it, in "
         "one round (auto), or runs at once in a round of its own (off; its errors then come from model(x)).",
         choices=("auto", "off")),
    Knob("DPOOL_CUDA_ASYNC_REPLIES", "bool", False, "tuning",
         "UNVERIFIED (never run on a GPU yet): a GPU worker replies to a forward, a fetch or a loss as soon as "
         "their kernels are queued, with an interprocess event the coordinator's streams wait on, instead of "
         "after its GPU ran them; a backward's reply still waits. Trades: the GPU no longer drains at each "
         "forward; a CUDA error of a forward's kernels surfaces at its backward, and forward_ms times only the "
         "queueing."),
    Knob("DPOOL_WAIT_SPIN_US", "microseconds", None, "tuning",
         "How long past a short round's previous time the coordinator spins before it sleeps in the poll "
         "(unset: 300 for CPU workers, 0 for GPU workers; 0 never spins). Trades coordinator CPU for latency."),
    # ---- logging
    Knob("DPOOL_LOG_LEVEL", "text", None, "logging",
         "Show the \"dpool\" logger's records of this level (DEBUG, INFO, WARNING, ...) on stderr."),
    Knob("DPOOL_DEBUG", "bool", False, "logging", "The same as DPOOL_LOG_LEVEL=DEBUG."),
    # ---- internal: dpool sets these in its workers' environment
    Knob("DPOOL_WORKER_CPUS", "internal", "", "internal",
         "The CPUs a spawned worker binds itself to (chosen by the coordinator; empty: not bound)."),
    Knob("DPOOL_WORKER_OF", "internal", "", "internal",
         "In a spawned worker's environment: its pool's segment prefix (finds a dead pool's workers)."),
)}


def _knob(name: str) -> Knob:
    try:
        return KNOBS[name]
    except KeyError:
        raise KeyError(f"{name} is not a declared dpool knob (see dpool/knobs.py)") from None


def raw(name: str) -> str:
    """The variable's value as set (``""`` when unset), for a declared ``name``."""
    _knob(name)
    return os.environ.get(name, "")


def get(name: str, environ: Any = None) -> Any:
    """The value of knob ``name``: parsed and checked, or its default when unset or empty.

    Args:
        name: a declared ``DPOOL_*`` name.
        environ: where to read it (``os.environ``).

    Raises:
        DpoolValueError: the value is not one the knob takes; the message names the variable and its
            choices (or range).
    """
    knob = _knob(name)
    value = (os.environ if environ is None else environ).get(name, "")
    if value == "":
        return knob.default
    if knob.kind == "choice":
        if value not in knob.choices:
            raise DpoolValueError(f"{name}={value!r} is not a {knob.noun}; use one of {', '.join(knob.choices)} "
                                  f"(unset it for the default, {knob.default})")
        return value
    if knob.kind == "seconds":
        try:
            return float(value.rstrip("s"))
        except ValueError:
            raise DpoolValueError(f"{name}={value!r} is not a number of seconds") from None
    if knob.kind == "microseconds":
        try:
            us = float(value)
        except ValueError:
            us = -1.0
        if not 0 <= us <= 1e6:
            raise DpoolValueError(f"{name}={value!r} is not a number of microseconds from 0 to 1000000 (0 turns "
                                  "spinning off; unset it for the default, 300 on CPU)")
        return us
    if knob.kind == "bool":
        if value.lower() in _FALSE:
            return False
        if value.lower() in _TRUE:
            return True
        raise DpoolValueError(f"{name}={value!r} is not a yes or no; use 1 or 0 (unset it for the default, "
                              f"{int(knob.default)})")
    return value


def markdown() -> str:
    """``docs/knobs.md``: every knob, grouped, as a table."""
    lines = ["# Configuration: every environment variable", "",
             "Timeouts and limits are also `dpool.Config` fields and `dpool.wrap()` keyword arguments (the API "
             "reference lists them). Every `DPOOL_*` variable dpool reads, generated from `dpool/knobs.py` "
             "(`python -c 'import dpool.knobs as k; print(k.markdown(), end=\"\")' > docs/knobs.md`). An unset or empty variable takes its default; a value "
             "the variable does not take raises `dpool.DpoolValueError` naming it and its choices.", ""]
    groups: dict[str, list[Knob]] = {}
    for knob in KNOBS.values():
        groups.setdefault(knob.group, []).append(knob)
    for group, knobs in groups.items():
        lines += [f"## {group[0].upper()}{group[1:]}", "", "| variable | takes | default | what it does |",
                  "|---|---|---|---|"]
        for k in knobs:
            takes = " \\| ".join(k.choices) if k.kind == "choice" else k.kind
            default = "—" if k.default in (None, "") else f"`{k.default}`"
            lines.append(f"| `{k.name}` | {takes} | {default} | {k.doc} |")
        lines.append("")
    return "\n".join(lines)
