"""The client side of the ``dpool-workers`` daemon: where pools live, and one authenticated request.

The daemon itself (``workers/daemon.py``, driven by ``workers/cli.py``) and the library both use these; the library never
imports the daemon. Files of a pool live in ``<runtime dir>/pools/<name>/`` (see the daemon's
module docstring); the runtime directory is private to the user (0700).
"""
from __future__ import annotations

import fcntl
import json
import os
import secrets
import stat
import time
from typing import Any

import zmq

from . import knobs, protocol as P
from .channel import Channel
from .errors import DaemonLostError, DpoolValueError, KeyRejectedError, PoolNotFoundError, PoolPermissionError

__all__ = ["runtime_dir", "pool_dir", "lock_held", "running_pools", "read_pool", "read_key_file", "locate", "request",
           "POOL_FILES"]

POOL_FILES = ("state.json", "daemon.sock", "key", "daemon.log", "lock")  # what a pool directory holds

def runtime_dir() -> str:
    """This user's private directory for sockets: ``$XDG_RUNTIME_DIR/dpool`` or ``/tmp/dpool-<uid>``.

    Created with mode 0700. Refuses (:class:`~dpool.errors.PoolPermissionError`, a ``PermissionError``)
    to use a directory owned by another user or open to group or others.
    """
    base = os.environ.get("XDG_RUNTIME_DIR")
    path = os.path.join(base, "dpool") if base and os.path.isdir(base) else f"/tmp/dpool-{os.getuid()}"
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PoolPermissionError(
            f"dpool runtime directory {path} must be a directory owned by uid {os.getuid()} with mode 0700 "
            f"(found owner {st.st_uid}, mode {oct(st.st_mode & 0o777)}); remove it or fix its permissions"
        )
    return path


def pool_dir(name: str, create: bool = False) -> str:
    """``<runtime dir>/pools/<name>``, mode 0700."""
    if not name or "/" in name or name.startswith("."):
        raise DpoolValueError(f"invalid pool name {name!r}: a pool is named by a plain word (no '/', no leading "
                              "'.'), or by tcp://HOST:PORT")
    base = os.path.join(runtime_dir(), "pools")
    path = os.path.join(base, name)
    if create:
        os.makedirs(base, mode=0o700, exist_ok=True)
        os.makedirs(path, mode=0o700, exist_ok=True)
        os.chmod(path, 0o700)
    return path


def lock_held(path: str) -> bool:
    try:
        fd = os.open(os.path.join(path, "lock"), os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def running_pools() -> list[str]:
    """Names of this user's pools whose daemon is alive (holds the pool's lock)."""
    base = os.path.join(runtime_dir(), "pools")
    try:
        names = sorted(os.listdir(base))
    except FileNotFoundError:
        return []
    return [n for n in names if lock_held(os.path.join(base, n))]


def read_pool(name: str) -> tuple[dict, bytes]:
    """State and key of a running pool. Raises ``FileNotFoundError`` if none is running."""
    path = pool_dir(name)
    if not lock_held(path):
        raise PoolNotFoundError(f"no dpool-workers pool named {name!r} is running (start one: dpool-workers start --name {name})")
    with open(os.path.join(path, "state.json")) as f:
        state = json.load(f)
    return state, _read_key(os.path.join(path, "key"), f"the key of pool {name!r}")


def _read_key(path: str, what: str) -> bytes:
    """The key in ``path`` (``what`` it is, for errors), which must be this user's, mode 0600."""
    try:
        st = os.stat(path)
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise PoolPermissionError(
                f"{what}, {path}, must be owned by uid {os.getuid()} with mode 0600 (found owner {st.st_uid}, "
                f"mode {oct(st.st_mode & 0o777)}): only its user may talk to a pool; chmod 600 your copy")
        with open(path, "rb") as f:
            key = f.read()
    except FileNotFoundError:
        raise PoolNotFoundError(f"{what}, {path}, does not exist") from None
    except PermissionError as exc:
        if isinstance(exc, PoolPermissionError):
            raise
        raise PoolPermissionError(f"{what}, {path}, cannot be read by this user ({exc.strerror}): only the "
                                  "user who started the pool may attach to it") from None
    if len(key) < 16:
        raise DpoolValueError(f"{path} does not hold a dpool pool key (it has {len(key)} bytes)")
    return key


def read_key_file(path: str) -> bytes:
    """A pool key from ``path``, which must be owned by this user with mode 0600."""
    return _read_key(path, "the key file DPOOL_KEY_FILE names")


def locate(pool: str) -> tuple[str, bytes, str]:
    """Endpoint, key and a label of ``pool``: a pool name, or ``tcp://HOST:PORT`` of a pool started
    with ``--listen``, whose key is read from the file named by ``DPOOL_KEY_FILE``."""
    if pool.startswith("tcp://"):
        path = knobs.get("DPOOL_KEY_FILE")
        if not path:
            raise DpoolValueError(
                f"attaching to {pool} needs the pool's key: set DPOOL_KEY_FILE to its key file "
                "(<runtime dir>/pools/<name>/key on the daemon's side; keep the copy at mode 0600)"
            )
        return pool, read_key_file(path), f"pool at {pool}"
    state, key = read_pool(pool)
    return state["endpoint"], key, f"pool {pool!r} (daemon pid {state['pid']})"


class DaemonTimeoutError(DaemonLostError, TimeoutError):
    """The daemon of a pool did not answer a request in time."""


def request(pool: str, msg: Any, timeout: float = 5.0) -> Any:
    """Send one authenticated request to the daemon of ``pool`` (see :func:`locate`) and return its reply.

    The connection first asks for a challenge, which the request then carries (see
    :class:`dpool.protocol.Challenge`): the daemon accepts a request once, from the connection it was made
    on. Both answers come within ``timeout`` seconds in all, or this raises.

    Raises:
        KeyRejectedError: the daemon rejected this key (a :class:`dpool.AuthError` and a ``TimeoutError``).
        DaemonTimeoutError: no answer in time (a :class:`dpool.DaemonLostError` and a ``TimeoutError``).
        ProtocolError: the daemon refused the request.
    """
    endpoint, key, label = locate(pool)
    ctx = zmq.Context()
    chan = Channel(ctx, False, key, 1 << 20, ident=b"c" + secrets.token_hex(6).encode())
    deadline = time.monotonic() + timeout
    try:
        chan.connect(endpoint)
        chan.send(P.Challenge())
        given = _answer(chan, deadline, label, timeout, endpoint)
        if not isinstance(given, P.ChallengeDone):
            raise P.ProtocolError(f"the dpool-workers daemon of {label} answered {given.op!r} to a challenge request")
        if hasattr(msg, "challenge"):  # (a request the daemon serves; any other is answered with an error)
            msg.challenge = given.challenge
        chan.send(msg)
        reply = _answer(chan, deadline, label, timeout, endpoint)
        if isinstance(reply, P.Failed):
            raise P.ProtocolError(f"the dpool-workers daemon of {label} refused {msg.op!r}: {reply.message}")
        return reply
    finally:
        chan.close()
        ctx.term()


def _answer(chan: Channel, deadline: float, label: str, timeout: float, endpoint: str) -> Any:
    """The daemon's next answer on ``chan`` before ``deadline``."""
    while True:
        left = deadline - time.monotonic()
        if chan.key_rejected:
            where = ("the key file DPOOL_KEY_FILE names" + (f" ({knobs.get('DPOOL_KEY_FILE')})"
                                                            if knobs.get("DPOOL_KEY_FILE") else "")
                     if endpoint.startswith("tcp://") else "the pool's key file")
            raise KeyRejectedError(f"the dpool-workers daemon of {label} rejected this client's key: {where} "
                                   "holds another pool's key, or an old one (a restarted pool makes a new key); "
                                   "copy the current <runtime dir>/pools/<name>/key of the daemon's user")
        if left <= 0 or not chan.poll(max(1, int(left * 1000))):
            if chan.key_rejected:
                continue
            raise DaemonTimeoutError(f"the dpool-workers daemon of {label} did not answer within {timeout:g}s; "
                                     f"check that it runs (dpool-workers list)")
        got = chan.recv_nowait()  # not from the daemon (it would hold the key): ignored, never decoded further
        if got is not None:
            return got[1]
