"""``minimal``: the least code that trains with dpool's design, as a floor under dpool's own cost.

The performance issue asked whether dpool's distance to its targets is the design's or dpool's own. This
program answers it by measurement. It has what dpool's loss-on-the-workers path has, and nothing else:

* persistent worker processes, started with dpool's own environment (``worker_env``: one thread each, the
  heap kept), scheduling policy and CPU binding (``worker_cpus``);
* the master's parameters in one shared-memory file that the replicas' parameters alias;
* preallocated shared input, target and gradient slots, one of each per worker;
* one round per step over ZeroMQ (a ROUTER and one DEALER per worker on ``ipc://``), each message encoded and
  authenticated by dpool's codec (:class:`dpool.protocol.Codec`); a worker runs forward, loss and backward,
  its gradient scaled by its share of the batch, and copies it into its slot;
* the coordinator sums the slots into one flat buffer that the master's ``.grad`` are views of, and the
  user's optimizer steps.

What it leaves out is everything that makes dpool a product: the autograd bridge (a step is
``Minimal.step(x, y)``, not ``loss(model(x), y).backward()``), uneven and changing batches, any loss but
cross-entropy, outputs, hooks, ``no_sync()``, buffers (BatchNorm statistics stay on each worker), changes
to the model after start, failures and restarts, and every check. So it is not a product, and its numbers
are only a floor. It trains the same numbers as ``dpool.wrap(net, gather=False)`` with
``dpool.criterion(nn.CrossEntropyLoss())`` on models without buffers (``tests/test_examples_bench.py``).
"""
from __future__ import annotations

import json
import math
import os
import secrets
import shutil
import struct
import subprocess
import sys
import tempfile
from typing import Any

import torch
import zmq

from dpool import protocol as P
from dpool.launch import worker_cpus, worker_env

__all__ = ["Minimal"]

_STOP = -1
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _align(n: int) -> int:
    return (n + 63) & ~63


class _Layout:
    """Where each part lies in the shared file: the parameters, then per worker a gradient slot, an input and a
    target slot. Both sides compute it from the same arguments."""

    def __init__(self, numel: int, workers: int, rows: int, x_shape: tuple[int, ...], x_dtype: torch.dtype) -> None:
        self.numel, self.rows, self.x_shape, self.x_dtype = numel, rows, x_shape, x_dtype
        x_bytes = rows * math.prod(x_shape) * x_dtype.itemsize
        off = self.params = 0
        off += _align(numel * 4)
        self.slots, self.inputs, self.targets = [], [], []
        for _ in range(workers):
            self.slots.append(off)
            off += _align(numel * 4)
            self.inputs.append(off)
            off += _align(x_bytes)
            self.targets.append(off)
            off += _align(rows * 8)
        self.size = off

    def flat(self, u8: torch.Tensor, off: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return u8[off:off + numel * dtype.itemsize].view(dtype)

    def input(self, u8: torch.Tensor, w: int) -> torch.Tensor:
        return self.flat(u8, self.inputs[w], self.rows * math.prod(self.x_shape), self.x_dtype).view(
            (self.rows, *self.x_shape))

    def target(self, u8: torch.Tensor, w: int) -> torch.Tensor:
        return self.flat(u8, self.targets[w], self.rows, torch.int64)


def _views(flat: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor]:
    out, off = [], 0
    for p in params:
        out.append(flat[off:off + p.numel()].view_as(p))
        off += p.numel()
    return out


class Minimal:
    """Trains ``net`` (float32 parameters, no buffers needed) on ``workers`` CPU workers.

    Args:
        wname: the benchmark workload whose model ``net`` is (the workers build their replicas from it).
        net: the master model; its parameters move into shared memory.
        workers: how many worker processes.
        rows: rows per worker per step (the global batch is ``workers * rows``).
        x_shape, x_dtype: one input row's shape and dtype.
    """

    def __init__(self, wname: str, net: torch.nn.Module, workers: int, rows: int, x_shape: tuple[int, ...],
                 x_dtype: torch.dtype) -> None:
        self.net, self.n, self.rows = net, workers, rows
        self.params = list(net.parameters())
        if any(p.dtype != torch.float32 for p in self.params):
            raise ValueError("minimal: float32 parameters only")
        numel = sum(p.numel() for p in self.params)
        self.layout = lay = _Layout(numel, workers, rows, tuple(x_shape), x_dtype)
        self._dir = tempfile.mkdtemp(prefix="dpool-minimal-")  # 0700: the socket file is ours alone
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else self._dir
        fd, self._file = tempfile.mkstemp(prefix="dpool-minimal-", dir=shm)
        os.close(fd)
        self.procs: list[subprocess.Popen] = []
        self.sock: Any = None
        self._ctx = zmq.Context()
        try:
            self.u8 = torch.from_file(self._file, shared=True, size=lay.size, dtype=torch.uint8)
            master = lay.flat(self.u8, lay.params, numel, torch.float32)
            for p, v in zip(self.params, _views(master, self.params)):
                v.copy_(p.detach())
                p.data = v
            self.slots = [lay.flat(self.u8, lay.slots[w], numel, torch.float32) for w in range(workers)]
            self.inputs = [lay.input(self.u8, w) for w in range(workers)]
            self.targets = [lay.target(self.u8, w) for w in range(workers)]
            self.total = torch.empty(numel)
            self.grads = _views(self.total, self.params)
            key = secrets.token_bytes(32)
            self.codec = P.Codec(key)
            self.sock = self._ctx.socket(zmq.ROUTER)
            endpoint = f"ipc://{self._dir}/c.sock"
            self.sock.bind(endpoint)
            spec = json.dumps([wname, workers, rows, list(x_shape), str(x_dtype).removeprefix("torch."), self._file,
                         endpoint])
            for w in range(workers):
                env = worker_env(1, workers)
                env["PYTHONPATH"] = os.pathsep.join([_ROOT, env.get("PYTHONPATH", "")])  # benchmarks.workloads
                cpus = worker_cpus(w, 1, workers, "cpu")
                env["DPOOL_WORKER_CPUS"] = ",".join(map(str, cpus)) if cpus is not None else ""
                proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", str(w), spec],
                                        stdin=subprocess.PIPE, env=env)
                assert proc.stdin is not None
                proc.stdin.write(key)  # the key never appears in argv or the environment
                proc.stdin.close()
                self.procs.append(proc)
            self.ids: list[bytes] = [b""] * workers
            for _ in range(workers):  # each worker's hello: it has mapped the file
                if not self.sock.poll(120_000):
                    raise RuntimeError("minimal: a worker did not start within 120 s")
                ident, frame = self.sock.recv_multipart()
                self.ids[struct.unpack("<q", self.codec.decode([frame])[2].result)[0]] = ident
        except BaseException:
            self.close()
            raise
        os.unlink(self._file)  # mapped by every process now
        self._file = ""
        self.seq = 0

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One step's forward, cross-entropy (mean) and backward of the batch ``x, y``: afterwards the master's
        ``.grad`` hold the gradient of the mean loss. Returns that loss."""
        rows, send, encode = self.rows, self.sock.send, self.codec.encode
        for w in range(self.n):
            self.inputs[w].copy_(x[w * rows:(w + 1) * rows])
            self.targets[w].copy_(y[w * rows:(w + 1) * rows])
            self.seq += 1
            send(self.ids[w], zmq.SNDMORE)
            send(encode(P.Call(struct.pack("<q", self.seq)), self.seq))
        loss = 0.0
        for _ in range(self.n):
            _, frame = self.sock.recv_multipart()
            loss += struct.unpack("<d", self.codec.decode([frame])[2].result)[0]
        torch.add(self.slots[0], self.slots[1], out=self.total) if self.n > 1 else self.total.copy_(self.slots[0])
        for s in self.slots[2:]:
            self.total.add_(s)
        for p, g in zip(self.params, self.grads):
            p.grad = g
        return loss / self.n

    def close(self) -> None:
        """Stop the workers (killed if they do not stop within 10 s) and remove every file."""
        if self.sock is not None:
            for w, ident in enumerate(getattr(self, "ids", [])):
                if ident:
                    self.sock.send(ident, zmq.SNDMORE)
                    self.sock.send(self.codec.encode(P.Call(struct.pack("<q", _STOP)), 0))
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs = []
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None
        self._ctx.term()
        if self._file:
            os.unlink(self._file)
            self._file = ""
        shutil.rmtree(self._dir, ignore_errors=True)


def _worker(index: int, spec: str) -> None:
    wname, workers, rows, x_shape, x_dtype, path, endpoint = json.loads(spec)
    policy, cpus = os.environ.get("DPOOL_WORKER_SCHED", "other"), os.environ.get("DPOOL_WORKER_CPUS", "")
    if policy == "batch" and hasattr(os, "SCHED_BATCH"):  # as dpool's worker does (workers/worker.py)
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    if cpus:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    from benchmarks.workloads import WORKLOADS

    torch.set_num_threads(1)
    codec = P.Codec(sys.stdin.buffer.read())
    model = WORKLOADS[wname].make()
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    lay = _Layout(numel, workers, rows, tuple(x_shape), getattr(torch, x_dtype))
    u8 = torch.from_file(path, shared=True, size=lay.size, dtype=torch.uint8)
    for p, v in zip(params, _views(lay.flat(u8, lay.params, numel, torch.float32), params)):
        p.data = v  # the replica's parameters are the master's memory
    slot = _views(lay.flat(u8, lay.slots[index], numel, torch.float32), params)
    x, y = lay.input(u8, index), lay.target(u8, index)
    loss_fn = torch.nn.CrossEntropyLoss()
    share = torch.tensor(1.0 / workers)  # equal shards: this shard's part of the mean loss's gradient
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(endpoint)
    seq = 1
    sock.send(codec.encode(P.CallDone(struct.pack("<q", index)), seq))
    while True:
        _, _, msg = codec.decode([sock.recv()])
        if struct.unpack("<q", msg.fn)[0] == _STOP:
            break
        loss = loss_fn(model(x), y)
        torch._foreach_copy_(slot, list(torch.autograd.grad(loss, params, share)))
        seq += 1
        sock.send(codec.encode(P.CallDone(struct.pack("<d", float(loss.detach()))), seq))
    sock.close(linger=0)


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--worker":
    _worker(int(sys.argv[2]), sys.argv[3])
