"""What a worker's failure means for the user: the text dpool adds to an error, built in one place.

Functions here only make text (and :func:`amend` puts it on an error); the rounds decide when.
"""
from __future__ import annotations

import re
from typing import Sequence

from .. import protocol as P
from ..gpu import memory_report

__all__ = ["amend", "names", "worker_failure", "restarted", "restart_failed", "broken", "lost_held", "cut_restart",
           "finish_failed", "lost_context", "restart_goes_on"]

_NO_LOSS = "the master module is unchanged (dpool.unwrap(model) returns it)"


def names(items: Sequence[str], shown: int = 3) -> str:
    """``"a, b, c and 2 more"``: the first ``shown`` of ``items``, and how many more there are."""
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more


def amend(exc: BaseException, text: str) -> None:
    """Add ``text`` to ``exc``'s message, keeping its type, attributes and traceback."""
    exc.args = (f"{exc.args[0]}{text}",) + tuple(exc.args[1:])


def _resized_buffer(buffer_names: Sequence[str], empty: Sequence[str], index: int | None) -> str:
    """What to do about a forward that resized buffer ``index`` in place (None: torch's own error, which
    does not say which; the empty buffers are the likely ones)."""
    if index is not None and index < len(buffer_names):
        which = f"; {buffer_names[index]}"
    else:
        which = f"; empty buffers, the likely ones: {names(empty, 5)}" if empty else ""
    return ("the forward resized a parameter or buffer in place, which dpool keeps at a fixed size in shared "
            f"memory{which}. Run one forward on the plain module before dpool.wrap(), so that every buffer has "
            "its final shape (quantization-aware training's per-channel observers start empty), or keep such "
            "state as a plain attribute.")


def worker_failure(message: str, qualname: str, rows: list[int] | None, buffer_names: Sequence[str],
                   empty_buffers: Sequence[str], devices: Sequence[str], cuda: bool) -> str:
    """A replica's error message, with what it means under dpool where dpool can tell."""
    if "Expected more than 1 value per channel when training" in message and rows:
        message += (f"\n(dpool: the batch was split into shards of {rows} rows, and BatchNorm cannot "
                    "train on a one-row shard. Use DataLoader(..., drop_last=True), a batch of at least 2 rows "
                    "per worker, or fewer workers.)")
    resized = re.match(r"the forward resized buffer (\d+) ", message)
    if resized or "resize storage that is not resizable" in message:
        index = int(resized.group(1)) if resized else None
        message += f"\n(dpool: {_resized_buffer(buffer_names, empty_buffers, index)})"
    if qualname == "OutOfMemoryError" and cuda:
        message += (f"\n(dpool: {memory_report(devices)}. Each worker holds its shard's activations: use a "
                    "smaller batch, fewer workers per GPU, or free memory first: torch.cuda.empty_cache() here, "
                    "other processes per nvidia-smi.)")
    return message


def lost_held() -> str:
    return (" The gradients model.no_sync() had accumulated on them were lost: call "
            "optimizer.zero_grad() and accumulate again (the next backward raises until then).")


def restarted(dead: list[int], left: int, lost: str) -> str:
    return (f" Worker(s) {dead} were restarted and re-synced from the master ({left} restart(s) left): the master "
            f"module is unchanged and the next call runs on the restarted pool.{lost}")


def restart_failed(again: BaseException) -> str:
    return f" Restarting it failed too ({again!r}); the pool is broken; {_NO_LOSS}."


def broken() -> str:
    return (" The pool is broken; the master module is unchanged (dpool.unwrap(model) returns it; pass "
            "max_restarts=K to dpool.wrap to respawn workers instead).")


def restart_goes_on(dead: list[int], left: int) -> str:
    return (f" Restarting worker(s) {dead} failed again and again (faults keep coming; {left} restart(s) left): "
            "the next call goes on with the restart; the master module is unchanged.")


def cut_restart(dead: list[int], first_line: str) -> str:
    return (f"dpool: this interrupted the restart of worker(s) {dead} after: {first_line} "
            "The next call to the model finishes the restart first; model.close() ends the pool.")


def finish_failed(dead: list[int], exc: BaseException) -> str:
    return (f"restarting worker(s) {dead} (interrupted by a Ctrl-C in an earlier call) failed: {exc!r}. "
            f"The pool is broken; {_NO_LOSS}.")


def lost_context(where: str, also: str, reply: P.Failed, step: int) -> str:
    return (f"{where}{also} hit a CUDA error its process cannot recover from while "
            f"{reply.stage[: -len(P.CONTEXT_LOST)]} at step {step}: {reply.qualname}: {reply.message.strip()}\n"
            "Its CUDA context is lost, so the worker exited. To find the failing operation, run with "
            "CUDA_LAUNCH_BLOCKING=1 (and TORCH_USE_CUDA_DSA=1 for device-side asserts); the coordinator's own "
            "CUDA context is unaffected.")
