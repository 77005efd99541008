"""dpool's settings in one place: limits and timeouts, with ``DPOOL_*`` overrides (:mod:`dpool.knobs`), units.

Durations are in seconds (``*_s`` fields). A :class:`Config` is built in the
coordinator and the part the workers need is shipped to them at start-up,
so nothing relies on inherited globals.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

from . import knobs

__all__ = ["Config"]


def _env(name: str) -> Any:
    """A field's default: knob ``name``, read when the :class:`Config` is made (see :mod:`dpool.knobs`)."""
    return field(default_factory=functools.partial(knobs.get, name))


@dataclass
class Config:
    """Tunable limits of a pool.

    Args:
        heartbeat_interval_s: how often a worker's heartbeat thread beats.
        heartbeat_timeout_s: silence after which a worker is declared hung
            (``DPOOL_HEARTBEAT_TIMEOUT``). Not applied while a worker loads the model, which
            may hold its GIL for long: ``startup_timeout_s`` bounds that.
        step_timeout_s: deadline for one forward or backward round
            (``DPOOL_STEP_TIMEOUT``; default 600 s, as NCCL's).
        startup_timeout_s: deadline for spawning the workers and loading the model
            (``DPOOL_STARTUP_TIMEOUT``).
        shutdown_timeout_s: grace period before workers are killed on ``close()``.
        shm_dir: directory of the shared-memory segments (``DPOOL_SHM_DIR``).
        max_message_bytes: cap on one control message, enforced by ZeroMQ
            (``ZMQ_MAXMSGSIZE``) and by the msgpack decoder.
        peer_timeout_s: cross-node mode: deadline for one collective between the nodes'
            coordinators (``DPOOL_PEER_TIMEOUT``; default 600 s).
        peer_heartbeat_s: cross-node mode: how often each coordinator beats in the process
            group's store (``DPOOL_PEER_HEARTBEAT``).
        peer_heartbeat_timeout_s: cross-node mode: silence after which a node is declared
            frozen (``DPOOL_PEER_HEARTBEAT_TIMEOUT``).
        cross_node_overlap: cross-node mode: exchange each gradient bucket as soon as every
            local worker completed it, during the backward (``DPOOL_CROSS_NODE_OVERLAP=0``
            exchanges them after it).
    """

    heartbeat_interval_s: float = _env("DPOOL_HEARTBEAT_INTERVAL")
    heartbeat_timeout_s: float = _env("DPOOL_HEARTBEAT_TIMEOUT")
    step_timeout_s: float = _env("DPOOL_STEP_TIMEOUT")
    startup_timeout_s: float = _env("DPOOL_STARTUP_TIMEOUT")
    shutdown_timeout_s: float = 2.0
    shm_dir: str = _env("DPOOL_SHM_DIR")
    max_message_bytes: int = 64 * 1024 * 1024
    peer_timeout_s: float = _env("DPOOL_PEER_TIMEOUT")
    peer_heartbeat_s: float = _env("DPOOL_PEER_HEARTBEAT")
    peer_heartbeat_timeout_s: float = _env("DPOOL_PEER_HEARTBEAT_TIMEOUT")
    cross_node_overlap: bool = _env("DPOOL_CROSS_NODE_OVERLAP")

    def replace(self, **changes: Any) -> "Config":
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise TypeError(f"unknown dpool config option(s): {sorted(unknown)}")
        return dataclasses.replace(self, **changes)
