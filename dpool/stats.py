"""What ``DataParallel.stats()`` reports: per-worker step times, shard sizes, restarts, bytes moved."""
from __future__ import annotations

from typing import Any

__all__ = ["Stats"]


class Stats:
    """Counters of the latest step, updated by the coordinator after each round."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.steps = 0
        self.restarts = 0
        self.backward_rounds_saved = 0  # backwards a criterion's workers had already run (see dpool.loss)
        self.rows: list[int] = []
        self.forward_ms = [0.0] * n
        self.backward_ms = [0.0] * n
        self.bytes = {"inputs": 0, "outputs": 0, "output_grads": 0, "param_grads": 0}

    def forward(self, rows: list[int], busy: list[float], inputs: int, outputs: int) -> None:
        self.steps += 1
        self.rows = list(rows)
        for s, b in enumerate(busy):
            self.forward_ms[s] = b * 1e3
        self.bytes["inputs"], self.bytes["outputs"] = inputs, outputs

    def backward(self, busy: list[float], output_grads: int, param_grads: int) -> None:
        for s, b in enumerate(busy):
            self.backward_ms[s] = b * 1e3
        self.bytes["output_grads"], self.bytes["param_grads"] = output_grads, param_grads

    def snapshot(self, pids: list[int], devices: list[str],
                 held: list[tuple[int, int]] | None = None) -> dict[str, Any]:
        workers = []
        for i in range(self.n):
            w = {"index": i, "device": devices[i], "pid": pids[i], "forward_ms": round(self.forward_ms[i], 3),
                 "backward_ms": round(self.backward_ms[i], 3)}
            if held is not None:
                w["graphs_kept"], w["rss_bytes"] = held[i]
            workers.append(w)
        return {"steps": self.steps, "restarts": self.restarts, "shard_rows": list(self.rows), "workers": workers,
                "bytes_per_step": dict(self.bytes), "backward_rounds_saved": self.backward_rounds_saved}
