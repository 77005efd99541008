"""The interprocess CUDA events of ``NOTE [ CUDA ownership ]`` (:mod:`dpool.transport.cuda_ipc`): one per GPU
of the coordinator, recorded before every request, that workers' streams wait on before they touch its
memory; and, with ``DPOOL_CUDA_ASYNC_REPLIES`` (unverified), one per GPU worker process, recorded by the
worker before it replies, that the coordinator's streams wait on before they read what it wrote. The
coordinator makes and exports both (it outlives its workers); workers only open and record or wait."""
from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch

__all__ = ["CudaEvents"]


class CudaEvents:
    """The coordinator's events for the workers on ``devices`` (none are made for CPU workers).

    Args:
        devices: one device string per worker.
        async_replies: GPU workers reply before their GPU ran a forward's kernels, with an event each.
    """

    def __init__(self, devices: Sequence[str], async_replies: bool) -> None:
        self.devices = devices
        self.async_replies = async_replies
        self._requests: dict[int, Any] = {}  # GPU of ours -> the event recorded before each request
        self._replies: dict[int, Any] = {}  # worker -> the event it records before each reply

    def request_handle(self, idx: int) -> bytes | None:
        """The IPC handle of the event worker ``idx`` waits on before it reads what we wrote (``None`` on CPU).

        One interprocess event per GPU of ours, recorded on that GPU's current stream before every
        request. Cross-device copies into an arena on that GPU are ordered with its current stream
        (torch's copy_ synchronises both devices' current streams), so the one event covers them.
        """
        dev = self.devices[idx]
        if not dev.startswith("cuda"):
            return None
        d = int(dev.split(":")[1])
        event = self._requests.get(d)
        if event is None:
            with torch.cuda.device(d):
                event = self._requests[d] = torch.cuda.Event(interprocess=True)
                event.record(torch.cuda.current_stream(d))
        return event.ipc_handle()

    def reply_handle(self, idx: int) -> bytes | None:
        """The IPC handle of the event GPU worker ``idx`` records before each reply (``async_replies``), or
        ``None``: it replies once its GPU ran the request. One event per worker process, on its GPU."""
        dev = self.devices[idx]
        if not (self.async_replies and dev.startswith("cuda")):
            return None
        event = self._replies.get(idx)
        if event is None:
            with torch.cuda.device(int(dev.split(":")[1])):
                event = self._replies[idx] = torch.cuda.Event(interprocess=True)
                event.record(torch.cuda.current_stream())  # (recorded once: a wait before its first use passes)
        return event.ipc_handle()

    def before_request(self) -> None:
        """The workers' streams will wait for what we queued so far."""
        for d, event in self._requests.items():
            event.record(torch.cuda.current_stream(d))

    def after_replies(self, workers: Iterable[int]) -> None:
        """Our streams wait, on the GPU, for the work the replying ``workers`` queued before their replies."""
        if self._replies:
            for idx in workers:
                event = self._replies.get(idx)
                if event is not None:
                    for d in self._requests:
                        torch.cuda.current_stream(d).wait_event(event)

    def forget(self, idx: int) -> None:
        """Worker ``idx``'s process is gone: its replacement records an event of its own."""
        self._replies.pop(idx, None)
