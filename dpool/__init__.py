"""dpool: ``nn.DataParallel``'s one-line API, with replicas in long-lived worker processes.

>>> import dpool
>>> model = dpool.wrap(net, device_ids=["cpu", "cpu"])
"""
from __future__ import annotations

from .config import Config
from .data_parallel import DataParallel, is_wrapped, unwrap, wrap
from ._criterion import ShardedOutput, criterion
from .sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm
from .errors import (
    AuthError,
    DaemonLostError,
    DpoolError,
    DpoolTypeError,
    DpoolValueError,
    GatherError,
    ModelChangedError,
    PoolNotFoundError,
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

def _configure_logging() -> None:
    """``DPOOL_DEBUG=1`` or ``DPOOL_LOG_LEVEL=<level>``: show the "dpool" logger's records on stderr."""
    import logging
    import os

    level = os.environ.get("DPOOL_LOG_LEVEL") or ("DEBUG" if os.environ.get("DPOOL_DEBUG") not in (None, "", "0")
                                                  else None)
    if level:
        logger = logging.getLogger("dpool")
        logger.setLevel(level.upper())
        if not logger.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(asctime)s dpool %(levelname)s: %(message)s"))
            logger.addHandler(handler)


_configure_logging()

__version__ = "0.2.0"  # keep equal to pyproject.toml (a test checks)

__all__ = [
    "wrap",
    "unwrap",
    "is_wrapped",
    "DataParallel",
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
    "ProtocolError",
    "AuthError",
    "SharedMemoryError",
    "UnsupportedError",
    "PoolNotFoundError",
    "UnpicklableModelError",
    "ModelChangedError",
    "GatherError",
    "DpoolValueError",
    "DpoolTypeError",
]
