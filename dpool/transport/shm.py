"""The CPU transport: shared-memory segments (creation, size checks, naming, mapping).

Segments are plain files in ``/dev/shm`` (or ``DPOOL_SHM_DIR``) named
``dpool-<uid>-<owner pid>-<token>-<n>``, created ``0600`` by the coordinator.

Ownership rule (see ``NOTE [ dpool shutdown ]`` in :mod:`dpool.pool`): the
coordinator creates a segment and *unlinks its name as soon as every worker
that needs it has mapped it*. From then on the memory lives exactly as long as
some process maps it, so a crash of any process, even ``SIGKILL`` of the whole
process group, leaves no name behind. The only window for a leftover name is
between creation and the next reply; :func:`dpool.sweep.sweep` removes names
whose owner pid is dead, and runs at every ``wrap()``.

Space is reserved with ``posix_fallocate`` before anything is mapped, so a
too-small ``/dev/shm`` gives a :class:`~dpool.errors.SharedMemoryError` up
front, never a ``SIGBUS`` later.
"""
from __future__ import annotations

import errno
import mmap
import os
import secrets
import weakref

import torch

from ..sweep import SEGMENT_NAME
from ..errors import SharedMemoryError
from .base import Views

__all__ = ["Segment", "Mapped", "check_free", "segment_prefix", "standalone_view"]


def segment_prefix() -> str:
    """A fresh per-pool name prefix: ``dpool-<uid>-<pid>-<token>``."""
    return f"dpool-{os.getuid()}-{os.getpid()}-{secrets.token_hex(4)}"


def _free_bytes(directory: str) -> int:
    try:
        st = os.statvfs(directory)
    except OSError as exc:
        raise SharedMemoryError(
            f"dpool's shared-memory directory {directory} cannot be used ({exc.strerror}): point DPOOL_SHM_DIR "
            f"(or Config.shm_dir) at a tmpfs directory that exists, or mount /dev/shm") from None
    return st.f_bavail * st.f_frsize


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def check_free(directory: str, size: int) -> None:
    """Raise :class:`SharedMemoryError` if ``size`` bytes cannot fit in ``directory`` (before any write)."""
    free = _free_bytes(directory)
    if size > free:
        raise SharedMemoryError(
            f"dpool needs {_mib(size)} of shared memory in {directory}, but only {_mib(free)} is free. "
            f"Use smaller batches, free some space, enlarge it (docker: --shm-size or --ipc=host), or point "
            f"DPOOL_SHM_DIR at a larger tmpfs."
        )


def standalone_view(buf: mmap.mmap, offset: int, dtype: torch.dtype, shape: list[int] | tuple[int, ...],
                    strides: list[int] | None = None) -> torch.Tensor:
    """Like :func:`tensor_view`, but a tensor with its *own* storage object (and version counter).

    Long-lived tensors (parameters, buffers, gradient slots) must not share one
    autograd version counter: BatchNorm's in-place update of one buffer would
    otherwise invalidate another tensor saved for backward. ``strides`` lay a
    dense tensor out in its own memory format (``channels_last``); default row-major.
    """
    numel = 1
    for s in shape:
        numel *= s
    if numel == 0:  # over the segment too, not private memory: a forward that resizes it must fail, as for any
        # other buffer, rather than grow a private copy whose values never reach the master
        return torch.frombuffer(buf, dtype=torch.uint8, count=1)[:0].view(dtype).view(shape)
    flat = torch.frombuffer(buf, dtype=dtype, count=numel, offset=offset)
    return flat.as_strided(shape, strides) if strides else flat.view(shape)


class Segment:
    """A coordinator-owned shared-memory segment, mapped read-write.

    Args:
        directory: where the segment file lives (``/dev/shm``).
        name: its file name.
        size: its size in bytes (> 0).
    """

    def __init__(self, directory: str, name: str, size: int, keep_fd: bool = False) -> None:
        self.directory = directory
        self.name = name
        self.size = size
        self.path = os.path.join(directory, name)
        self._linked = False
        self.fd: int | None = None
        check_free(directory, size)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise SharedMemoryError(f"cannot create shared-memory segment {self.path}: {exc}") from None
        self._linked = True
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                    raise SharedMemoryError(
                        f"dpool needs {_mib(size)} of shared memory in {directory}, but the allocation failed "
                        f"({exc.strerror}; {_mib(_free_bytes(directory))} free). Enlarge {directory} "
                        f"(docker: --shm-size) or set DPOOL_SHM_DIR."
                    ) from None
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                os.ftruncate(fd, size)
            self.mmap = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            self.unlink()
            raise
        if keep_fd:
            # Inherited by workers (pass_fds), so a respawned worker can map it after the name is gone.
            # Closed by close_fd(), or when the segment is garbage (a pool dropped without close()).
            os.set_inheritable(fd, False)
            self.fd = fd
            self._fd_closer = weakref.finalize(self, os.close, fd)
        else:
            os.close(fd)
        self.u8 = torch.frombuffer(self.mmap, dtype=torch.uint8)
        self.views = Views(self.u8)

    def standalone(self, offset: int, dtype: torch.dtype, shape: list[int] | tuple[int, ...],
                   strides: list[int] | None = None) -> torch.Tensor:
        return standalone_view(self.mmap, offset, dtype, shape, strides)

    def fd_ref(self) -> list:
        """``[fd, size]``: a reference by file descriptor (valid in workers spawned with ``pass_fds``)."""
        assert self.fd is not None
        return [self.fd, self.size]

    def close_fd(self) -> None:
        if self.fd is not None:
            self._fd_closer()
            self.fd = None

    def ref(self) -> list:
        """The ``[name, size]`` reference sent in messages."""
        return [self.name, self.size]

    def unlink(self) -> None:
        """Remove the name (idempotent). Mappings stay valid."""
        if self._linked:
            self._linked = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    @property
    def linked(self) -> bool:
        return self._linked


class Mapped:
    """A worker-side mapping of a segment created by the coordinator."""

    __slots__ = ("name", "size", "mmap", "u8", "views")

    def __init__(self, directory: str, name: str | int, size: int) -> None:
        if isinstance(name, int):  # an inherited file descriptor
            self.mmap = mmap.mmap(name, size)
            self.name, self.size = f"fd:{name}", size
            self.u8 = torch.frombuffer(self.mmap, dtype=torch.uint8)
            self.views = Views(self.u8)
            return
        if not SEGMENT_NAME.match(name) or not str(os.getuid()) == name.split("-")[1]:
            raise SharedMemoryError(f"refusing to map {name!r}: not a dpool segment of this user")
        fd = os.open(os.path.join(directory, name), os.O_RDWR)
        try:
            if os.fstat(fd).st_size < size:
                raise SharedMemoryError(f"segment {name} is smaller than announced ({size} bytes)")
            self.mmap = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.name = name
        self.size = size
        self.u8 = torch.frombuffer(self.mmap, dtype=torch.uint8)
        self.views = Views(self.u8)

    def standalone(self, offset: int, dtype: torch.dtype, shape: list[int] | tuple[int, ...],
                   strides: list[int] | None = None) -> torch.Tensor:
        return standalone_view(self.mmap, offset, dtype, shape, strides)
