"""What ``DataParallel.stats()`` reports: per-worker step times, shard sizes, restarts, bytes moved, and
where each round's time went."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

__all__ = ["Stats", "ROUNDS"]

ROUNDS = ("forward", "backward")  # the rounds whose time is split (Stats.split_round)


class Stats:
    """Counters of the latest step, updated by the coordinator after each round."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.steps = 0
        self.restarts = 0
        self.backward_rounds_saved = 0  # backwards a criterion's workers had already run (see dpool.loss)
        self.forward_rounds_saved = 0  # forwards that went to the workers with their loss (coordinator._Deferred)
        # forwards that ran the latest step plan, forwards that built one, and why the latest was built
        self.plan = {"hits": 0, "rebuilds": 0, "last_rebuild": ""}
        self.rows: list[int] = []
        self.forward_ms = [0.0] * n
        self.backward_ms = [0.0] * n
        self.bytes = {"inputs": 0, "outputs": 0, "output_grads": 0, "param_grads": 0}
        # per round kind: its wall time, and per worker the time its request and its reply travelled
        self.round_ms = {r: 0.0 for r in ROUNDS}
        self.request_ms = {r: [0.0] * n for r in ROUNDS}
        self.reply_ms = {r: [0.0] * n for r in ROUNDS}

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

    def split_round(self, kind: str, sent_at: float, arrived: Sequence[float], replies: Mapping[int, Any], k: int) -> None:
        """Split the latest ``kind`` round of shards ``0..k-1`` (every time on ``time.monotonic()``, one clock
        for all the processes of a machine).

        Args:
            sent_at: when the coordinator began sending the round's requests.
            arrived: per worker, when the coordinator read its reply.
            replies: per shard, its reply: ``started`` (when the worker's handler began) and ``busy``.

        Per worker, ``request_ms`` is ``started - sent_at`` (encoding, ZeroMQ, the worker waking up and
        decoding) and ``reply_ms`` is ``arrived - (started + busy)`` (the way back, until the coordinator
        read it); ``round_ms`` runs from ``sent_at`` to the last reply read.
        """
        req, rep = self.request_ms[kind], self.reply_ms[kind]
        last = sent_at
        for s in range(k):
            r, t = replies[s], arrived[s]
            req[s] = (r.started - sent_at) * 1e3
            rep[s] = (t - r.started - r.busy) * 1e3
            if t > last:
                last = t
        self.round_ms[kind] = (last - sent_at) * 1e3

    def no_round(self, kind: str) -> None:
        """The latest ``kind`` ran without a round of its own (a backward the loss round already ran)."""
        self.round_ms[kind] = 0.0
        for times in (self.request_ms[kind], self.reply_ms[kind]):
            for i in range(self.n):
                times[i] = 0.0

    def snapshot(self, pids: list[int], devices: list[str],
                 held: list[tuple[int, int]] | None = None, rounds_spun: int = 0) -> dict[str, Any]:
        workers = []
        for i in range(self.n):
            w = {"index": i, "device": devices[i], "pid": pids[i], "forward_ms": round(self.forward_ms[i], 3),
                 "backward_ms": round(self.backward_ms[i], 3)}
            for kind in ROUNDS:
                w[f"{kind}_request_ms"] = round(self.request_ms[kind][i], 3)
                w[f"{kind}_reply_ms"] = round(self.reply_ms[kind][i], 3)
            if held is not None:
                w["graphs_kept"], w["rss_bytes"] = held[i]
            workers.append(w)
        return {"steps": self.steps, "restarts": self.restarts, "shard_rows": list(self.rows), "workers": workers,
                "bytes_per_step": dict(self.bytes), "backward_rounds_saved": self.backward_rounds_saved,
                "forward_rounds_saved": self.forward_rounds_saved, "plan": dict(self.plan),
                "round_ms": {kind: round(ms, 3) for kind, ms in self.round_ms.items()}, "rounds_spun": rounds_spun}
