"""dpool: ``nn.DataParallel``'s one-line API, with replicas in long-lived worker processes.

>>> import dpool
>>> model = dpool.wrap(net, device_ids=["cpu", "cpu"])
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import Config
from .errors import (
    AuthError,
    CollectiveDesyncError,
    DaemonLostError,
    DpoolError,
    DpoolTypeError,
    DpoolValueError,
    GatherError,
    ModelChangedError,
    PeerLostError,
    PeerTimeoutError,
    PoolNotFoundError,
    PoolPermissionError,
    UnpicklableModelError,
    ForkedChildError,
    PoolBrokenError,
    ProtocolError,
    RemoteError,
    SharedMemoryError,
    UnsupportedError,
    WorkerDiedError,
    WorkerStartError,
    WorkerTimeoutError,
)

# The training API imports torch (~2 s); it loads on first use, so that `dpool-workers status` and
# other tools that only need the errors, the config or the daemon client start at once.
_LAZY = {
    "DataParallel": "wrapper", "wrap": "wrapper", "unwrap": "wrapper",
    "is_wrapped": "wrapper", "ShardedOutput": "loss", "criterion": "loss",
    "SyncBatchNorm": "sync_batchnorm", "convert_sync_batchnorm": "sync_batchnorm",
    "data_parallel": "functional", "install": "installer", "uninstall": "installer", "installed": "installer",
}

if TYPE_CHECKING:
    from .loss import ShardedOutput, criterion
    from .functional import data_parallel
    from .wrapper import DataParallel, is_wrapped, unwrap, wrap
    from .installer import install, installed, uninstall
    from .sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dpool' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def _configure_logging() -> None:
    """``DPOOL_DEBUG=1`` or ``DPOOL_LOG_LEVEL=<level>``: show the "dpool" logger's records on stderr."""
    import logging

    from . import knobs

    level = knobs.get("DPOOL_LOG_LEVEL") or ("DEBUG" if knobs.get("DPOOL_DEBUG") else None)
    if level:
        logger = logging.getLogger("dpool")
        logger.setLevel(level.upper())
        if not logger.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(asctime)s dpool %(levelname)s: %(message)s"))
            logger.addHandler(handler)


_configure_logging()

__version__ = "0.4.0"  # keep equal to pyproject.toml (a test checks)

__all__ = [
    "wrap",
    "unwrap",
    "is_wrapped",
    "DataParallel",
    "data_parallel",
    "install",
    "uninstall",
    "installed",
    "SyncBatchNorm",
    "ShardedOutput",
    "criterion",
    "convert_sync_batchnorm",
    "Config",
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
    "ProtocolError",
    "AuthError",
    "SharedMemoryError",
    "UnsupportedError",
    "PoolNotFoundError",
    "PoolPermissionError",
    "UnpicklableModelError",
    "ModelChangedError",
    "GatherError",
    "DpoolValueError",
    "DpoolTypeError",
]
