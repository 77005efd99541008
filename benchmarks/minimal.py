"""``minimal`` and ``minimal-loss``: the least code that trains with dpool's design, as a floor under dpool's
own cost.

The performance issue asked whether dpool's distance to its targets is the design's or dpool's own. This
program answers it by measurement. It has what dpool's two paths have, and nothing else:

* persistent worker processes, started with dpool's own environment (``worker_env``: one thread each, the
  heap kept), scheduling policy and CPU binding (``worker_cpus``; under torchrun the coordinator's too,
  ``coordinator_cpus``);
* the master's parameters in one shared-memory file that the replicas' parameters alias;
* preallocated shared input, target, output, output-gradient and gradient slots, one of each per worker;
* messages over ZeroMQ (a ROUTER and one DEALER per worker on ``ipc://``), each encoded and authenticated by
  dpool's codec (:class:`dpool.protocol.Codec`);
* ``loss_on_workers=False`` (the ``minimal`` setup, beside ``dpool``): two rounds a step. The workers run the
  forward and keep its graph; the coordinator computes the loss on the gathered output and its gradient;
  the workers run the backward from their slices of it;
* ``loss_on_workers=True`` (``minimal-loss``, beside ``dpool-loss``): one round a step. A worker runs forward,
  loss and backward, its gradient scaled by its share of the batch;
* either way a worker copies its parameters' gradient into its slot, and the coordinator sums the slots into
  one flat buffer that the master's ``.grad`` are views of; the user's optimizer steps.

What it leaves out is everything that makes dpool a product: the autograd bridge (a step is
``Minimal.step(x, y)``, not ``loss(model(x), y).backward()``), uneven and changing batches, any loss but
cross-entropy, outputs, hooks, ``no_sync()``, buffers (BatchNorm statistics stay on each worker), changes
to the model after start, failures and restarts, and every check. So it is not a product, and its numbers
are only a floor. On models without buffers both modes train what one process trains on the global batch
(``tests/test_examples_bench.py``), as ``dpool.wrap(net)`` with ``F.cross_entropy`` and ``dpool.wrap(net,
gather=False)`` with ``dpool.criterion(nn.CrossEntropyLoss())`` do.

:class:`MinimalNode` (the ``minimal-nodes`` setup, beside ``nodes``) is one node of dpool's cross-node mode in
the same spirit: a :class:`Minimal` of the node's workers, then the node's gradient averaged across the nodes'
coordinators over ``torch.distributed`` as dpool does it (× 1/N, then summed; two nodes swap theirs point to
point, more all-reduce), with no header, buckets, overlap, heartbeat or bounded wait. It is the floor under the
cross-node mode's cost, to be read against DDP at the same process count.
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
import time
from typing import Any

import torch
import torch.nn.functional as F
import zmq

from dpool import protocol as P
from dpool.cpus import bind_threads
from dpool.crossnode import gloo_loops
from dpool.launch import worker_env
from dpool.policies import coordinator_cpus, gloo_loop_policy, worker_cpus
from dpool.transport.base import align, standalone

__all__ = ["Minimal", "MinimalNode", "train"]

_REPLY_WITHIN_MS = 120_000
_STOP, _FORWARD, _BACKWARD, _FORWARD_LOSS_BACKWARD = -1, 0, 1, 2  # what a request asks of a worker
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Layout:
    """Where each part lies in the shared file: the parameters, then per worker its gradient, input, target,
    output and output-gradient slots. Both sides compute it from the same arguments."""

    def __init__(self, numel: int, workers: int, rows: int, x_shape: tuple[int, ...], x_dtype: torch.dtype,
                 classes: int) -> None:
        self.numel, self.rows, self.x_shape, self.x_dtype, self.classes = numel, rows, x_shape, x_dtype, classes
        x_bytes = rows * math.prod(x_shape) * x_dtype.itemsize
        off = self.params = 0
        off += align(numel * 4)
        self.slots, self.inputs, self.targets, self.outs, self.gouts = [], [], [], [], []
        for _ in range(workers):
            for where, size in ((self.slots, numel * 4), (self.inputs, x_bytes), (self.targets, rows * 8),
                                (self.outs, rows * classes * 4), (self.gouts, rows * classes * 4)):
                where.append(off)
                off += align(size)
        self.size = off

    def flat(self, u8: torch.Tensor, off: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The part at byte ``off``: a tensor of its own on the mapping's storage, not a view of ``u8``. Views of
        one tensor share a version counter, so writing a worker's output would otherwise look to autograd as
        if its input and parameters had changed before the backward."""
        return standalone(u8.untyped_storage(), u8.device, off, dtype, (numel,))

    def input(self, u8: torch.Tensor, w: int) -> torch.Tensor:
        return self.flat(u8, self.inputs[w], self.rows * math.prod(self.x_shape), self.x_dtype).view(
            (self.rows, *self.x_shape))

    def target(self, u8: torch.Tensor, w: int) -> torch.Tensor:
        return self.flat(u8, self.targets[w], self.rows, torch.int64)

    def out(self, u8: torch.Tensor, w: int, grad: bool = False) -> torch.Tensor:
        at = (self.gouts if grad else self.outs)[w]
        return self.flat(u8, at, self.rows * self.classes, torch.float32).view(self.rows, self.classes)


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
        loss_on_workers: one round a step with the loss on the workers; otherwise two, with the loss here.
            The attribute of that name may be changed between steps: the workers serve both kinds.
    """

    def __init__(self, wname: str, net: torch.nn.Module, workers: int, rows: int, x_shape: tuple[int, ...],
                 x_dtype: torch.dtype, loss_on_workers: bool = False) -> None:
        self.net, self.n, self.rows, self.loss_on_workers = net, workers, rows, loss_on_workers
        self.params = list(net.parameters())
        if any(p.dtype != torch.float32 for p in self.params):
            raise ValueError("minimal: float32 parameters only")
        numel = sum(p.numel() for p in self.params)
        was = net.training
        with torch.no_grad():
            classes = net.eval()(torch.zeros((1, *x_shape), dtype=x_dtype)).size(1)
        net.train(was)
        self.layout = lay = _Layout(numel, workers, rows, tuple(x_shape), x_dtype, classes)
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
            self.outs = [lay.out(self.u8, w) for w in range(workers)]
            self.gouts = [lay.out(self.u8, w, grad=True) for w in range(workers)]
            self.total = torch.empty(numel)
            self.grads = _views(self.total, self.params)
            self.gathered = torch.empty(workers * rows, classes)
            key = secrets.token_bytes(32)
            self.codec = P.Codec(key)
            self.sock = self._ctx.socket(zmq.ROUTER)
            endpoint = f"ipc://{self._dir}/c.sock"
            self.sock.bind(endpoint)
            spec = json.dumps([wname, workers, rows, list(x_shape), str(x_dtype).removeprefix("torch."), classes,
                               self._file, endpoint])
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
                self.ids[int(self._decode(frame))] = ident
        except BaseException:
            self.close()
            raise
        os.unlink(self._file)  # mapped by every process now
        self._file = ""
        self.seq = 0

    def _decode(self, frame: bytes) -> float:
        return struct.unpack("<d", self.codec.decode([frame])[2].result)[0]

    def _round(self, op: int) -> float:
        """Send ``op`` to every worker; the sum of their replies' numbers."""
        send, encode = self.sock.send, self.codec.encode
        for w in range(self.n):
            self.seq += 1
            send(self.ids[w], zmq.SNDMORE)
            send(encode(P.Call(struct.pack("<q", op)), self.seq))
        total = 0.0
        for _ in range(self.n):
            if not self.sock.poll(_REPLY_WITHIN_MS):  # (a worker that failed printed why: never a hang)
                raise RuntimeError(f"minimal: no reply within {_REPLY_WITHIN_MS / 1000:g} s; exit codes "
                                   f"{[proc.poll() for proc in self.procs]}")
            total += self._decode(self.sock.recv_multipart()[1])
        return total

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One step's forward, cross-entropy (mean) and backward of the batch ``x, y``: afterwards the master's
        ``.grad`` hold the gradient of the mean loss. Returns that loss."""
        rows = self.rows
        if x.size(0) != self.n * rows:  # (a batch it would split otherwise would train on other rows than dpool)
            raise ValueError(f"minimal: a batch of {x.size(0)} rows, but {self.n} workers of {rows} rows each")
        for w in range(self.n):
            self.inputs[w].copy_(x[w * rows:(w + 1) * rows])
            if self.loss_on_workers:
                self.targets[w].copy_(y[w * rows:(w + 1) * rows])
        if self.loss_on_workers:
            loss = self._round(_FORWARD_LOSS_BACKWARD) / self.n
        else:
            self._round(_FORWARD)
            out = torch.cat(self.outs, out=self.gathered).detach().requires_grad_()
            value = F.cross_entropy(out, y)
            (gout,) = torch.autograd.grad(value, out)
            for w in range(self.n):
                self.gouts[w].copy_(gout[w * rows:(w + 1) * rows])
            self._round(_BACKWARD)
            loss = float(value.detach())
        torch.add(self.slots[0], self.slots[1], out=self.total) if self.n > 1 else self.total.copy_(self.slots[0])
        for s in self.slots[2:]:
            self.total.add_(s)
        for p, g in zip(self.params, self.grads):
            p.grad = g
        return loss

    def close(self) -> None:
        """Stop the workers (killed if they do not stop within 10 s) and remove every file."""
        if self.sock is not None:
            for ident in getattr(self, "ids", []):
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


class MinimalNode:
    """One node of the cross-node design in the least code: ``minimal``'s step on the node's workers, then the
    node's gradient (the sum over its workers: the gradient of the node's mean loss) averaged across the ranks
    of the initialised default process group, in dpool's and DDP's order (× 1/N, then a sum). Two ranks swap
    their gradients point to point (``isend``/``irecv``, dpool's exchange for two nodes of CPU masters) and
    add; more all-reduce. With equal node batches this trains what one process trains on the union batch.

    Args:
        node: this node's :class:`Minimal` (its ``.grad`` are views of ``node.total``).
    """

    def __init__(self, node: Minimal) -> None:
        import torch.distributed as dist

        self.node, self.dist = node, dist
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.theirs = torch.empty_like(node.total) if self.world == 2 else None
        # under torchrun, joins its workers on its local rank's share of the cores, as dpool's coordinator does
        cpus = coordinator_cpus(1, ["cpu"] * len(node.procs))
        self._unbind = bind_threads(cpus) if cpus is not None else None
        # and posts its swap with gloo's loop threads kept from preempting it, as dpool does (NOTE [ gloo's loop
        # thread ] in dpool/crossnode.py)
        self._loops = gloo_loops(gloo_loop_policy())

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """This node's step on its batch ``x, y``, then the gradient averaged across the nodes (in ``.grad``).
        Returns this node's loss."""
        loss = self.node.step(x, y)
        total = self.node.total
        total.mul_(1.0 / self.world)
        if self.theirs is None:
            self.dist.all_reduce(total)
        else:  # (both ranks add the same two halves: a + b == b + a, so they stay identical)
            other = 1 - self.rank
            with self._loops:
                reqs = (self.dist.isend(total, other), self.dist.irecv(self.theirs, other))
            for req in reqs:
                req.wait()
            total.add_(self.theirs)
        return loss

    def close(self) -> None:
        if self._unbind is not None:
            self._unbind()
            self._unbind = None
        self.node.close()


def train(model: Minimal | MinimalNode, opt: torch.optim.Optimizer, data: list, steps: int) -> float:
    """``steps`` training steps of ``model`` on the batches ``data`` (in turn), as the benchmark times them.
    Returns the seconds they took."""
    t0 = time.perf_counter()
    for i in range(steps):
        x, y = data[i % len(data)]
        opt.zero_grad(set_to_none=True)
        model.step(x, y)
        opt.step()
    return time.perf_counter() - t0


def _worker(index: int, spec: str) -> None:
    wname, workers, rows, x_shape, x_dtype, classes, path, endpoint = json.loads(spec)
    from benchmarks.workloads import WORKLOADS
    from workers.worker import set_affinity, set_scheduling  # dpool's worker's own, as it calls them

    set_scheduling(os.environ.get("DPOOL_WORKER_SCHED", "other"))
    set_affinity(os.environ.get("DPOOL_WORKER_CPUS", ""))

    torch.set_num_threads(1)
    codec = P.Codec(sys.stdin.buffer.read())
    model = WORKLOADS[wname].make()
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    lay = _Layout(numel, workers, rows, tuple(x_shape), getattr(torch, x_dtype), classes)
    u8 = torch.from_file(path, shared=True, size=lay.size, dtype=torch.uint8)
    for p, v in zip(params, _views(lay.flat(u8, lay.params, numel, torch.float32), params)):
        p.data = v  # the replica's parameters are the master's memory
    slot = _views(lay.flat(u8, lay.slots[index], numel, torch.float32), params)
    x, y, out_slot, gout = lay.input(u8, index), lay.target(u8, index), lay.out(u8, index), lay.out(u8, index, True)
    share = torch.tensor(1.0 / workers)  # equal shards: this shard's part of the mean loss's gradient
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(endpoint)
    seq = 1
    sock.send(codec.encode(P.CallDone(struct.pack("<d", index)), seq))
    out = None
    while True:
        _, _, msg = codec.decode([sock.recv()])
        op = struct.unpack("<q", msg.fn)[0]
        if op == _STOP:
            break
        value = 0.0
        if op == _FORWARD_LOSS_BACKWARD:
            loss = F.cross_entropy(model(x), y)
            torch._foreach_copy_(slot, list(torch.autograd.grad(loss, params, share)))
            value = float(loss.detach())
        elif op == _FORWARD:
            out = model(x)
            out_slot.copy_(out.detach())
        else:
            assert out is not None
            torch._foreach_copy_(slot, list(torch.autograd.grad(out, params, gout)))
            out = None
        seq += 1
        sock.send(codec.encode(P.CallDone(struct.pack("<d", value)), seq))
    sock.close(linger=0)


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--worker":
    _worker(int(sys.argv[2]), sys.argv[3])
