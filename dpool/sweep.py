"""Removing this user's dpool files whose owner process is gone: segments and socket files.

Torch-free on purpose (the daemon sweeps without importing torch).
"""
from __future__ import annotations

import os
import re
from typing import Callable

__all__ = ["SEGMENT_NAME", "SOCKET_NAME", "sweep", "sweep_sockets", "sweep_cuda_counters"]

SEGMENT_NAME = re.compile(r"^dpool-(\d+)-(\d+)-[0-9a-f]+-\d+$")
SOCKET_NAME = re.compile(r"^dpool-(\d+)-(\d+)-[0-9a-f]+(-r\d+)?\.sock$")


def sweep(directory: str = "/dev/shm", pattern: re.Pattern = SEGMENT_NAME) -> list[str]:
    """Unlink this user's dpool files in ``directory`` whose owner process is gone.

    Args:
        pattern: a name pattern whose groups 1 and 2 are the owner's uid and pid (default: segments;
            :func:`sweep_sockets` passes the socket-file pattern).

    Returns:
        The names removed.
    """
    import psutil

    uid = str(os.getuid())

    def dead_owner(name: str) -> bool:
        m = pattern.match(name)
        return m is not None and m.group(1) == uid and not psutil.pid_exists(int(m.group(2)))

    return _unlink_where(directory, dead_owner)


def _unlink_where(directory: str, chosen: Callable[[str], bool]) -> list[str]:
    """Unlink the files of ``directory`` whose name is ``chosen``; return the names removed."""
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if not chosen(name):
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed.append(name)
        except OSError:
            pass
    return removed


def sweep_sockets(directory: str) -> list[str]:
    """Remove this user's coordinator socket files (``dpool-<uid>-<pid>-<token>.sock``) whose owner is dead."""
    return sweep(directory, SOCKET_NAME)


def sweep_cuda_counters(pid: int, directory: str = "/dev/shm") -> list[str]:
    """Remove torch's CUDA IPC reference-counter files (``torch_<pid>_…``) of a dead coordinator ``pid``.

    A coordinator that exports GPU memory keeps its counters in such a file and removes it when it
    exits normally; one that is killed cannot. Its GPU workers call this once they saw it die (its
    pid may still be a zombie): the file is theirs to clean, and nobody can open it by name any more
    (only its dead owner handed it out).
    """
    return _unlink_where(directory, lambda name: name.startswith(f"torch_{pid}_"))
