"""The design's floor: dpool's architecture with nothing but its transport.

``floor`` is a diagnostic setup of ``bench.py``. It answers one question: how
fast can *this design* train on this machine, whatever dpool's own code does?
It is the smallest program that does what dpool does per step:

* a coordinator holds the master model and runs the optimizer, held to one
  torch thread (as dpool holds it);
* N worker processes keep a persistent replica whose parameters are views of
  the master's parameters in shared memory (so an optimizer step reaches them
  with no copy);
* per step, two ZeroMQ ROUTER/DEALER round trips over ``ipc://`` carry msgpack
  control messages authenticated with HMAC-SHA256: "forward your shard" and
  "backward this output gradient";
* inputs, outputs, output gradients and gradient slots are tensors in shared
  memory that are allocated once;
* a ``torch.autograd.Function`` bridges the coordinator's graph to the
  workers', and the coordinator sums the workers' gradient slots.

It leaves out everything else dpool does: message validation and replay
protection, liveness (heartbeats, exit sentinels, deadlines), buffers
(BatchNorm statistics are not synchronised), arbitrary input/output
structures (one tensor in, one tensor out, split evenly), growing segments,
error reporting, and clean-up after crashes beyond a parent-death watchdog.
So it is a lower bound on the per-step cost of the design, not a product.
The test suite checks that it computes the same training step as one process.

It deliberately does not call dpool's codec (:mod:`dpool.protocol`) or segment
code (:mod:`dpool.transport.shm`): the point is to measure the design without dpool's
code. It shares only :func:`dpool.pool.worker_env`, the workers' process
environment (thread counts, heap setting), so that the comparison is about
the per-step path.
"""
from __future__ import annotations

import hmac
import os
import secrets
import subprocess
import sys
import threading
import time
from typing import Any

import msgpack
import torch
import zmq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.workloads import WORKLOADS  # noqa: E402
from dpool.pool import worker_env  # noqa: E402

_IO_BYTES = 8 << 20  # per worker and role: enough for every workload's shard


def _seal(key: bytes, obj: Any) -> bytes:
    payload = msgpack.packb(obj)
    return hmac.digest(key, payload, "sha256") + payload


def _open(key: bytes, frame: bytes) -> Any:
    mac, payload = frame[:32], frame[32:]
    if not hmac.compare_digest(hmac.digest(key, payload, "sha256"), mac):
        raise RuntimeError("floor: control message failed authentication")
    return msgpack.unpackb(payload)


def _map(path: str, nbytes: int, create: bool = False) -> torch.Tensor:
    if create:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, nbytes)
        os.close(fd)
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def _typed(buf: torch.Tensor, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    n = dtype.itemsize
    for s in shape:
        n *= s
    return buf[:n].view(dtype).view(shape)


class _Segments:
    """The shared tensors: flat parameters, one gradient slot per worker, per-worker I/O areas."""

    def __init__(self, prefix: str, nparams: int, workers: int, create: bool) -> None:
        self.paths = [prefix + role for role in ("params", "grads", *(f"{r}{k}" for k in range(workers) for r in "iog"))]
        it = iter(self.paths)
        self.params = _map(next(it), nparams * 4, create).view(torch.float32)
        self.grads = _map(next(it), workers * nparams * 4, create).view(torch.float32).view(workers, nparams)
        self.io = [{r: _map(next(it), _IO_BYTES, create) for r in "iog"} for _ in range(workers)]


def _bind(model: torch.nn.Module, flat: torch.Tensor) -> None:
    off = 0
    for p in model.parameters():
        p.data = flat[off : off + p.numel()].view(p.shape)
        off += p.numel()


def _worker(wname: str, prefix: str, endpoint: str, k: int, workers: int) -> None:
    key = bytes.fromhex(sys.stdin.readline().strip())
    ppid = os.getppid()

    def watchdog() -> None:  # the benchmark died: do not linger
        while os.getppid() == ppid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watchdog, daemon=True).start()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # sized by dpool's worker_env(), as dpool's workers
    torch.set_num_interop_threads(1)
    model = WORKLOADS[wname].make()
    params = list(model.parameters())
    seg = _Segments(prefix, sum(p.numel() for p in params), workers, create=False)
    _bind(model, seg.params)
    slots, off = [], 0
    for p in params:
        slots.append(seg.grads[k, off : off + p.numel()].view(p.shape))
        off += p.numel()
    io = seg.io[k]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send(_seal(key, ["hello", k]))
    out = None
    while True:
        msg = _open(key, sock.recv())
        if msg[0] == "forward":
            dtype, shape = getattr(torch, msg[1]), msg[2]
            out = model(_typed(io["i"], dtype, shape))
            _typed(io["o"], torch.float32, list(out.shape)).copy_(out.detach())
            sock.send(_seal(key, ["forward_done", list(out.shape)]))
        elif msg[0] == "backward":
            for p in params:
                p.grad = None
            out.backward(_typed(io["g"], torch.float32, list(out.shape)))
            for slot, p in zip(slots, params):
                slot.copy_(p.grad)
            sock.send(_seal(key, ["backward_done"]))
        else:
            break
    sock.close()
    ctx.term()


class FloorPool:
    """Coordinator side: start the workers, run remote forwards and backwards, sum the gradients."""

    def __init__(self, wname: str, model: torch.nn.Module, workers: int) -> None:
        self.workers = workers
        self.params = list(model.parameters())
        if any(p.dtype != torch.float32 for p in self.params):
            raise TypeError("the floor handles float32 parameters only")
        self.key = secrets.token_bytes(32)
        tag = f"dpool-{os.getuid()}-{os.getpid()}-{secrets.token_hex(4)}-"  # dpool's own naming: swept if we crash
        self.seg = _Segments(os.path.join("/dev/shm", tag), sum(p.numel() for p in self.params), workers, create=True)
        with torch.no_grad():
            self.seg.params.copy_(torch.cat([p.detach().reshape(-1) for p in self.params]))
        _bind(model, self.seg.params)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sockdir = os.path.join("/tmp", tag.rstrip("-"))
        os.mkdir(self.sockdir, 0o700)
        endpoint = f"ipc://{self.sockdir}/floor.sock"
        self.sock.bind(endpoint)
        script = os.path.abspath(__file__)
        # The same process environment as dpool's workers (thread counts, heap setting), so that a
        # comparison with dpool is about the per-step path only.
        env = worker_env(max(1, (os.cpu_count() or 1) // workers))
        self.procs = []
        for k in range(workers):
            p = subprocess.Popen([sys.executable, script, "worker", wname, os.path.join("/dev/shm", tag), endpoint,
                                  str(k), str(workers)], stdin=subprocess.PIPE, text=True, env=env)
            assert p.stdin is not None
            p.stdin.write(self.key.hex() + "\n")
            p.stdin.close()
            self.procs.append(p)
        self.ids: list[bytes] = [b""] * workers
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        try:
            for _ in range(workers):
                if not self.poller.poll(120_000):
                    raise RuntimeError("floor: a worker did not start")
                ident, frame = self.sock.recv_multipart()
                self.ids[_open(self.key, frame)[1]] = ident
        except BaseException:
            self.close()
            raise
        finally:
            for path in self.seg.paths:  # every worker has mapped them (or failed): no name outlives us
                os.unlink(path)

    def send(self, k: int, msg: list) -> None:
        self.sock.send_multipart([self.ids[k], _seal(self.key, msg)])

    def wait(self) -> dict[int, Any]:
        replies: dict[int, Any] = {}
        while len(replies) < self.workers:
            if not self.poller.poll(60_000):
                raise RuntimeError("floor: a worker stopped answering")
            while self.sock.get(zmq.EVENTS) & zmq.POLLIN:
                ident, frame = self.sock.recv_multipart()
                replies[self.ids.index(ident)] = _open(self.key, frame)
        return replies

    def close(self) -> None:
        for k, ident in enumerate(self.ids):
            if ident:
                self.send(k, ["shutdown"])
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.sock.close()
        self.ctx.term()
        for name in os.listdir(self.sockdir):
            os.unlink(os.path.join(self.sockdir, name))
        os.rmdir(self.sockdir)


class _Bridge(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, pool: FloorPool, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        rows = x.shape[0] // pool.workers
        for k in range(pool.workers):
            shard = x[k * rows : (k + 1) * rows]
            _typed(pool.seg.io[k]["i"], x.dtype, list(shard.shape)).copy_(shard)
            pool.send(k, ["forward", str(x.dtype).split(".")[1], list(shard.shape)])
        replies = pool.wait()
        ctx.pool, ctx.rows = pool, rows
        return torch.cat([_typed(pool.seg.io[k]["o"], torch.float32, replies[k][1]) for k in range(pool.workers)])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        pool, rows = ctx.pool, ctx.rows
        for k in range(pool.workers):
            g = grad[k * rows : (k + 1) * rows]
            _typed(pool.seg.io[k]["g"], torch.float32, list(g.shape)).copy_(g)
            pool.send(k, ["backward"])
        pool.wait()
        total = pool.seg.grads.sum(0)
        grads, off = [], 0
        for p in pool.params:
            grads.append(total[off : off + p.numel()].view(p.shape))
            off += p.numel()
        return (None, None, *grads)


class FloorModel(torch.nn.Module):
    """``model(x)`` through the floor pool; ``x`` is split evenly along dim 0."""

    def __init__(self, wname: str, model: torch.nn.Module, workers: int) -> None:
        super().__init__()
        self.module = model
        self.pool = FloorPool(wname, model, workers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] % self.pool.workers:
            raise ValueError("the floor splits batches evenly only")
        return _Bridge.apply(self.pool, x, *self.pool.params)

    def close(self) -> None:
        self.pool.close()


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "worker":
    _worker(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
