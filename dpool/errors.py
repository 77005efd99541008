"""The exceptions dpool raises.

Every error says what failed, where (worker index, device, pid, step) and, where
there is one, what the user can do about it.

Hierarchy::

    DpoolError
    ├── RemoteError            a replica raised; also an instance of the remote type
    ├── WorkerDiedError        a worker process exited or was killed; also a RuntimeError
    ├── WorkerTimeoutError     no heartbeat, or a step passed its deadline; also a TimeoutError and a
    │                          RuntimeError
    ├── WorkerStartError       a worker failed to start or to load the model; also a RuntimeError
    ├── PoolBrokenError        the pool is unusable after an earlier failure, or closed; also a RuntimeError
    │   └── ForkedChildError   a forked child called a model whose pool belongs to its parent
    ├── DaemonLostError        the dpool-workers daemon of an attached pool is gone; also a RuntimeError
    ├── PeerLostError          cross-node mode: another node's coordinator died or aborted the job; also a
    │                          RuntimeError
    ├── PeerTimeoutError       cross-node mode: a node stopped answering; also a TimeoutError and a
    │                          RuntimeError
    ├── CollectiveDesyncError  cross-node mode: the nodes reached different steps; also a RuntimeError
    ├── UnsupportedError       a use dpool cannot run exactly (raised instead of a wrong result);
    │                          also a NotImplementedError
    ├── PoolNotFoundError      no dpool-workers pool of that name runs (or its key file is missing);
    │                          also a FileNotFoundError
    ├── PoolPermissionError    a pool, its directory or key belongs to another user or is open to
    │                          others; also a PermissionError
    ├── UnpicklableModelError  the model cannot be shipped to the workers; also a TypeError
    ├── ModelChangedError      the master changed in a way the replicas cannot follow; also a RuntimeError
    ├── GatherError            replicas returned outputs that cannot be gathered; also a ValueError and a
    │                          RuntimeError
    ├── DpoolValueError        a bad argument or input value; also a ValueError
    ├── DpoolTypeError         an argument or input of a type dpool cannot take; also a TypeError
    ├── ProtocolError          a malformed, oversized or foreign message
    │   └── AuthError          a message failed authentication; at attach, a key the daemon rejects
    │                          (then also a TimeoutError)
    └── SharedMemoryError      shared memory could not be allocated; also an OSError and a RuntimeError

Every error of dpool's own is a :class:`DpoolError` and also an instance of the builtin type that torch
(or ``nn.DataParallel``, or a ``DataLoader``'s worker processes, or gloo) raises for the same failure:
``except RuntimeError`` around a training step catches a dead worker as it catches a dead ``DataLoader``
worker or a lost gloo peer. The table in ``docs/semantics.md`` ("Errors") pairs each with torch's case.
"""
from __future__ import annotations

from typing import Any

__all__ = [
    "DpoolError",
    "RemoteError",
    "WorkerDiedError",
    "WorkerTimeoutError",
    "WorkerStartError",
    "PoolBrokenError",
    "ForkedChildError",
    "DaemonLostError",
    "PeerLostError",
    "PeerTimeoutError",
    "CollectiveDesyncError",
    "UnsupportedError",
    "PoolNotFoundError",
    "PoolPermissionError",
    "UnpicklableModelError",
    "ModelChangedError",
    "GatherError",
    "DpoolValueError",
    "DpoolTypeError",
    "ProtocolError",
    "AuthError",
    "SharedMemoryError",
    "remote_error",
]


class DpoolError(Exception):
    """Base class of every error raised by dpool."""


class _RemoteTraceback(Exception):
    """Carries the formatted traceback of a worker; set as ``__cause__``."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return "\n\n" + "".join(self.tb) + "\n(the traceback above was raised in a dpool worker)"


class RemoteError(DpoolError):
    """An exception raised inside a replica (forward, backward or unpickling).

    When the remote exception type can be found in the coordinator, the raised
    object is *also* an instance of that type, so ``except ValueError`` keeps
    working. The remote traceback is attached as ``__cause__``.

    Attributes:
        worker (int): index of the worker that raised.
        device (str): the worker's device.
        pid (int): the worker's process id.
        step (int): the coordinator's step counter when it happened.
        ename (str): qualified name of the remote exception type.
        remote_traceback (str): the formatted remote traceback.
    """

    worker: int
    device: str
    pid: int
    step: int
    ename: str
    remote_traceback: str

    def __str__(self) -> str:
        return self.args[0] if self.args else ""


class WorkerDiedError(DpoolError, RuntimeError):
    """A worker process exited while the pool needed it.

    Attributes:
        worker (int), device (str), pid (int), step (int),
        exitcode (int | None): the exit code, or ``None`` when killed by a signal,
        signal_name (str | None): e.g. ``"SIGKILL"``.
    """

    def __init__(
        self,
        message: str,
        *,
        worker: int = -1,
        device: str = "",
        pid: int = -1,
        step: int = -1,
        exitcode: int | None = None,
        signal_name: str | None = None,
        workers: list[int] | None = None,
    ) -> None:
        super().__init__(message)
        self.worker = worker
        self.device = device
        self.pid = pid
        self.step = step
        self.exitcode = exitcode
        self.signal_name = signal_name
        self.workers = workers if workers is not None else [worker]


class WorkerTimeoutError(DpoolError, TimeoutError, RuntimeError):
    """A worker stopped sending heartbeats, or a step passed ``step_timeout``."""

    def __init__(self, message: str, *, worker: int = -1, device: str = "", pid: int = -1, step: int = -1) -> None:
        super().__init__(message)
        self.worker = worker
        self.device = device
        self.pid = pid
        self.step = step


class WorkerStartError(DpoolError, RuntimeError):
    """A worker could not start, connect or load the model during ``wrap()`` (or a restart).

    Attributes:
        workers (list[int]): the workers that failed to start, where known (a restart starts them again).
    """

    def __init__(self, message: str, *, workers: list[int] | None = None) -> None:
        super().__init__(message)
        self.workers = list(workers or [])


class DaemonLostError(DpoolError, RuntimeError):
    """The ``dpool-workers`` daemon this model was attached to died or was stopped."""


class _PeerError(DpoolError):
    """Base of the cross-node errors: which rank, on which host and pid, at which step of this rank.

    Attributes:
        rank (int): the rank the error is about (the lost, silent or out-of-step one; -1 if unknown).
        host (str): that rank's host name ("" if unknown).
        pid (int): that rank's coordinator pid (-1 if unknown).
        step (int): this rank's step counter when it happened.
    """

    def __init__(self, message: str, *, rank: int = -1, host: str = "", pid: int = -1, step: int = -1) -> None:
        super().__init__(message)
        self.rank = rank
        self.host = host
        self.pid = pid
        self.step = step


class PeerLostError(_PeerError, RuntimeError):
    """Another node's coordinator died, exited, or aborted the job after its own failure.

    Raised on every surviving node within seconds (gloo's closed connection, or the abort key the
    first node to fail writes into the process group's store).
    """


class PeerTimeoutError(_PeerError, TimeoutError, RuntimeError):
    """Another node stopped sending heartbeats (``peer_heartbeat_timeout_s``), or a cross-node
    collective passed ``peer_timeout_s``."""


class CollectiveDesyncError(_PeerError, RuntimeError):
    """The nodes reached different collectives (one ran an extra forward or backward): the step is
    refused before any gradient is combined."""


class PoolBrokenError(DpoolError, RuntimeError):
    """The pool was broken by an earlier failure, or closed; every call raises this."""


class ForkedChildError(PoolBrokenError, RuntimeError):
    """A process forked after ``wrap()`` (a ``DataLoader`` worker, ``os.fork()``) called the model.

    Raised at once in the child; the parent's pool is not touched and stays usable.
    """


class UnsupportedError(DpoolError, NotImplementedError):
    """Something dpool cannot compute exactly, such as higher-order gradients through the workers.

    Raised where the use is detected (at ``wrap()``, or at the ``backward``/``grad`` call), so that
    training never goes on with a silently wrong number.
    """


class PoolNotFoundError(DpoolError, FileNotFoundError):
    """No ``dpool-workers`` pool of that name is running (``pool=`` or ``DPOOL_POOL``)."""


class PoolPermissionError(DpoolError, PermissionError):
    """A pool cannot be used by this user: its runtime directory, pool directory or key file belongs to another
    user or is open to group or others. The message names the path and what to do."""


class UnpicklableModelError(DpoolError, TypeError):
    """The model cannot be pickled to ship it to the workers; raised before any worker starts."""


class ModelChangedError(DpoolError, RuntimeError):
    """The master changed after ``wrap()`` in a way the replicas cannot follow: a parameter's shape, dtype or
    device (close and wrap again), or a parameter changed in place between a forward and its backward (run
    the backward first, or the forward again)."""


class GatherError(DpoolError, ValueError, RuntimeError):
    """The replicas returned outputs that cannot be gathered into one: different structures (torch's gather
    raises ``ValueError`` for dicts that differ) or shapes (``torch.cat`` raises ``RuntimeError``)."""


class DpoolValueError(DpoolError, ValueError):
    """A bad argument or input value (device placement, an empty batch, an unknown option value)."""


class DpoolTypeError(DpoolError, TypeError):
    """An argument or input of a type dpool cannot take (a tensor kind it cannot transport)."""


class ProtocolError(DpoolError):
    """A control message was malformed, oversized, unexpected or of another protocol version."""


class AuthError(ProtocolError):
    """A control message failed authentication; nothing in it was decoded. Raised to a client whose key the
    daemon rejected, naming the key file (that error is also a :class:`TimeoutError`: it used to be one)."""


class KeyRejectedError(AuthError, TimeoutError):
    """The daemon of a pool rejected this client's key (see :class:`AuthError`)."""


class SharedMemoryError(DpoolError, OSError, RuntimeError):
    """Shared memory could not be allocated (too small ``/dev/shm``, no permission, ...)."""


_REMOTE_CLASSES: dict[type, type] = {}


def _find_type(module: str, qualname: str) -> type | None:
    import sys

    mod = sys.modules.get(module)
    obj: Any = mod
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    if isinstance(obj, type) and issubclass(obj, BaseException) and not issubclass(obj, DpoolError):
        return obj
    return None


def remote_error(
    module: str, qualname: str, message: str, tb: str, *, worker: int, device: str, pid: int, step: int, where: str
) -> RemoteError:
    """Build the coordinator-side exception for a failure reported by a worker.

    The result is an instance of :class:`RemoteError` and, where the remote type
    exists in the coordinator, of that type too (a dynamically made subclass,
    as Ray's ``RayTaskError`` does).
    """
    base = _find_type(module, qualname)
    ename = qualname if module in ("builtins", "") else f"{module}.{qualname}"
    text = (
        f"Caught {ename} in worker {worker} ({device}, pid {pid}) {where} at step {step}: {message}\n"
        f"The pool is still usable; fix the model code or its input and call again."
    )
    cls: type = RemoteError
    if base is not None and base is not Exception and base is not BaseException:
        cls = _REMOTE_CLASSES.get(base)  # type: ignore[assignment]
        if cls is None:
            try:
                cls = type(f"Remote{base.__name__}", (RemoteError, base), {"__module__": "dpool.errors"})
                # __str__ of RemoteError must win over the user type's __str__.
                cls.__str__ = RemoteError.__str__  # type: ignore[method-assign]
            except TypeError:  # incompatible layouts (e.g. some C exception types)
                cls = RemoteError
            _REMOTE_CLASSES[base] = cls
    try:
        err = cls(text)
    except Exception:
        try:
            err = cls.__new__(cls)  # type: ignore[call-overload]  # a user type whose __init__ takes other arguments
            Exception.__init__(err, text)
        except Exception:  # exotic exception types: keep the dpool type at least
            err = RemoteError(text)
    err.worker, err.device, err.pid, err.step = worker, device, pid, step
    err.ename, err.remote_traceback = ename, tb
    err.__cause__ = _RemoteTraceback(tb)
    return err
