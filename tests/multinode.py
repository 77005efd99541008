"""Cross-node scenarios: each rank is a coordinator process started by tests/test_multinode.py.

``python -m tests.multinode SCENARIO '{"json": "params"}'`` with torchrun's environment variables
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) joins a gloo group on loopback, runs
the scenario, saves its tensors to ``<out>/rank<R>.pt`` and prints one ``RESULT {json}`` line.
The test process computes the single-process references itself.
"""
from __future__ import annotations

import copy
import datetime
import json
import os
import signal
import sys
import threading
import time

if __name__ == "__main__" and json.loads(sys.argv[2]).get("without_numpy"):
    sys.modules["numpy"] = None  # as where numpy is not installed (dpool does not depend on it): before torch

import torch
import torch.distributed as dist
from torch import nn
import torch.nn.functional as F

import dpool

D_IN, D_OUT = 6, 3


class Net(nn.Module):
    """An MLP with BatchNorm, a head used only when asked (``extra``) and a parameter used nowhere."""

    def __init__(self, bn: bool = True, sync_bn: bool | str = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D_IN, 8)
        self.bn = (nn.BatchNorm1d(8) if bn else nn.Identity())
        self.fc2 = nn.Linear(8, D_OUT)
        self.extra = nn.Linear(D_IN, D_OUT)
        self.unused = nn.Parameter(torch.ones(2))
        if sync_bn == "torch":  # as a script written for DDP converts it: the workers run it as dpool's
            self.bn = nn.SyncBatchNorm.convert_sync_batchnorm(self.bn)
        elif sync_bn:
            dpool.convert_sync_batchnorm(self)

    def forward(self, x: torch.Tensor, extra: bool = False) -> torch.Tensor:
        y = self.fc2(torch.relu(self.bn(self.fc1(x))))
        return y + self.extra(x) if extra else y


class _Slow(torch.autograd.Function):
    """The identity, whose backward takes 0.3 s: the coordinator surely reads a reported bucket meanwhile."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        time.sleep(0.3)
        return g


class Deep(nn.Module):
    """Parameters over several gradient buckets (2.3 MiB in float64). ``shared``: the middle block
    runs twice, in two reentrant checkpoints, after its bucket could already leave (DDP's "marked ready
    twice"): its second gradient arrives late."""

    def __init__(self, shared: bool = False) -> None:
        super().__init__()
        self.shared = shared
        self.pre = nn.Linear(D_IN, 16)
        self.wide = nn.Linear(16, 8192)  # registered before `block`, used after it: its gradient comes first
        self.block = nn.Linear(16, 16)
        self.post = nn.Linear(8192, D_OUT)

    def _slow_block(self, h: torch.Tensor) -> torch.Tensor:
        return _Slow.apply(self.block(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = torch.tanh(self.pre(x))
        if self.shared:  # the second checkpoint's backward runs first; the first's accumulates `block` again
            h = checkpoint(self._slow_block, h, use_reentrant=True)
            h = checkpoint(self.block, h, use_reentrant=True)
        else:
            h = self.block(h)
        return self.post(torch.tanh(self.wide(h)))


def make_deep(shared: bool = False) -> Deep:
    torch.manual_seed(0)
    return Deep(shared).double()


def make_net(bn: bool = True, sync_bn: bool | str = False) -> Net:
    torch.manual_seed(0)
    return Net(bn, sync_bn).double()


def batches(steps: int, global_batch: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batches of a run (every rank makes the same ones and takes its rows)."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(global_batch, D_IN, generator=g, dtype=torch.float64),
             torch.randn(global_batch, D_OUT, generator=g, dtype=torch.float64)) for _ in range(steps)]


def rows_of(rank: int, world: int, n: int) -> slice:
    """This rank's contiguous block of a global batch of ``n`` rows (DistributedSampler's union is contiguous)."""
    b = n // world
    return slice(rank * b, (rank + 1) * b)


def state(module: nn.Module) -> dict:
    return {"params": [p.detach().clone() for p in module.parameters()],
            "grads": [None if p.grad is None else p.grad.clone() for p in module.parameters()],
            "buffers": [b.clone() for b in module.buffers()]}


# ---------------------------------------------------------------------------- scenarios
def vs_ddp(rank: int, world: int, p: dict) -> dict:
    """K=1 per node against DDP with the same ranks, same data: bitwise; eval and no_grad issue no collectives.
    The first parameter is frozen from the start (fine-tuning): the workers' bucket hooks must take it."""
    steps, B = p.get("steps", 5), 8
    data = batches(steps, B)
    ref = make_net()
    next(ref.parameters()).requires_grad_(False)
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(ref), find_unused_parameters=True)  # broadcasts rank 0's state, as wrap() does
    net = make_net()
    next(net.parameters()).requires_grad_(False)
    if rank == 1:  # different parameters at wrap(): wrap() takes rank 0's
        with torch.no_grad():
            for q in net.parameters():
                q.add_(1.0)
    bad_policy = mismatch = ""  # (stay empty where wrap() does not refuse: the test's assertions say so)
    os.environ["DPOOL_GLOO_LOOP"] = "sometimes"  # bad input: a clear error at wrap(), before any collective
    try:
        dpool.wrap(net, device_ids=["cpu"], worker_threads=1)
    except ValueError as e:
        bad_policy = str(e)
    finally:
        del os.environ["DPOOL_GLOO_LOOP"]
    other = make_net() if rank == 0 else make_net().float()  # rank 1 wraps another model: both ranks refuse it
    try:
        dpool.wrap(other, device_ids=["cpu"], worker_threads=1)
    except ValueError as e:
        mismatch = str(e)
    model = dpool.wrap(net, device_ids=["cpu"], worker_threads=1)
    out = {"rank": model.rank, "world_size": model.world_size, "is_main": model.is_main, "bad_policy": bad_policy,
           "mismatch": mismatch, "first": [[n, list(q.shape)] for n, q in net.named_parameters()][0]}
    opt_d = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    opt_m = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in data:
        sl = rows_of(rank, world, B)
        for m, o in ((ddp, opt_d), (model, opt_m)):
            o.zero_grad()
            F.mse_loss(m(x[sl]), y[sl]).backward()
            o.step()
    torch.save({"ddp": state(ddp.module), "dpool": state(net)}, p["file"])
    nodes = model._nodes
    before = nodes.collectives
    model.eval()
    model(data[0][0][sl])
    model.train()
    with torch.no_grad():
        model(data[0][0][sl])
    out["eval_collectives"] = nodes.collectives - before
    # every swap was posted with gloo's loop threads under SCHED_BATCH, and they are back under SCHED_OTHER
    from dpool.cpus import threads_named
    out["quiet_posts"] = nodes.quiet_posts
    out["loop_policies"] = [os.sched_getscheduler(t) for t in threads_named("gloo_tcp_loop")]
    model.close()
    return out


def union(rank: int, world: int, p: dict) -> dict:
    """K_n workers per node, trained on the rank's rows; the test compares with one process on the union batch."""
    steps, B = p.get("steps", 4), 12
    net = make_net(sync_bn=p.get("sync_bn", False))
    model = dpool.wrap(net, device_ids=["cpu"] * p["workers"][rank], worker_threads=1, buffers=p["buffers"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches(steps, B):
        sl = rows_of(rank, world, B)
        opt.zero_grad()
        F.mse_loss(model(x[sl]), y[sl]).backward()
        opt.step()
    if p.get("head", True):  # a head used on rank 0 only: averaged with rank 1's zeros; `unused`: no gradient anywhere
        x, y = batches(1, B, seed=7)[0]
        opt.zero_grad()
        F.mse_loss(model(x[sl], extra=rank == 0), y[sl]).backward()
    torch.save(state(net), p["file"])
    model.close()
    return {}


def loss_on_workers(rank: int, world: int, p: dict) -> dict:
    """The loss on the workers (``gather=False`` + ``dpool.criterion``) across nodes of 1 and 2 workers: each
    training forward goes to the workers with its loss and their backward runs in the same round. Trained
    twice, the second time with a round for each (``DPOOL_FORWARD_WITH_LOSS=off``, ``backward_with_loss=False``);
    the test compares both with each other and with one process on the union batch. At the last step rank 1
    scales its loss, so its early backward misses and runs its round while rank 0's hits: the nodes must
    still combine the same step."""
    steps, B = p.get("steps", 4), 12
    out = {}
    for name, fast in (("one_round", True), ("rounds", False)):
        os.environ["DPOOL_FORWARD_WITH_LOSS"] = "auto" if fast else "off"
        net = make_net(bn=False)
        model = dpool.wrap(net, device_ids=["cpu"] * p["workers"][rank], worker_threads=1, gather=False)
        crit = dpool.criterion(nn.MSELoss(), backward_with_loss=fast)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sl = rows_of(rank, world, B)
        for x, y in batches(steps, B):
            opt.zero_grad()
            crit(model(x[sl]), y[sl]).backward()
            opt.step()
        x, y = batches(1, B, seed=7)[0]
        opt.zero_grad()
        (crit(model(x[sl]), y[sl]) * (2.0 if rank == 1 else 1.0)).backward()
        stats = model.stats()
        out[name] = {"forward_rounds_saved": stats["forward_rounds_saved"],
                     "backward_rounds_saved": stats["backward_rounds_saved"], "collectives": model._nodes.collectives}
        torch.save(state(net), p["file"] + name)
        model.close()
    return out


def minimal_nodes(rank: int, world: int, p: dict) -> dict:
    """benchmarks/minimal.py's ``MinimalNode`` (the ``minimal-nodes`` setup, the floor under the cross-node
    mode's speed): one worker per node, the benchmark's mlp, mean cross-entropy, momentum, trained on the rank's
    rows; the test compares with one process on the union batch. Its worker and files go at close."""
    from benchmarks.minimal import Minimal, MinimalNode, train
    from benchmarks.workloads import WORKLOADS

    w, B = WORKLOADS["mlp"], 32
    g = torch.Generator().manual_seed(0)
    data = [w.batch(B, g) for _ in range(3)]
    sl = rows_of(rank, world, B)
    torch.manual_seed(0)
    net = w.make()
    node = MinimalNode(Minimal("mlp", net, 1, B // world, (256,), torch.float32))
    try:
        train(node, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), [(x[sl], y[sl]) for x, y in data], 3)
    finally:
        node.close()
    torch.save(state(net), p["file"])
    floor = node.node  # (its shared file is unlinked once its worker mapped it; its socket dir goes at close)
    return {"left": [f for f in (floor._file, floor._dir) if f and os.path.exists(f)], "workers_left": len(floor.procs)}


def overlap(rank: int, world: int, p: dict) -> dict:
    """Buckets exchanged during the backward (nodes of 1 and 2 workers), then a model whose shared block
    makes a gradient late: both against one process on the union batch (computed by the test).
    ``subgroup``: three processes, and the nodes are global ranks 1 and 2 in a group of their own
    (rank 0 makes the group with them, then sits out); only the plain model."""
    B = 8
    out: dict = {}
    saved = {}
    group = None
    if p.get("subgroup"):
        group = dist.new_group([1, 2])
        if rank == 0:  # (it hosts the store the nodes' heartbeats use: it waits for them)
            _wait_for_the_nodes()
            return out
        rank, world = dist.get_rank(group), 2
    for shared in (False, True) if group is None else (False,):
        net = make_deep(shared)
        model = dpool.wrap(net, device_ids=["cpu"] * p["workers"][rank], worker_threads=1,
                           **({} if group is None else {"process_group": group}))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        before = model._nodes.collectives
        for x, y in batches(3, B):
            sl = rows_of(rank, world, B)
            opt.zero_grad()
            F.mse_loss(model(x[sl]), y[sl]).backward()
            opt.step()
        reducer = model._runtime.reducer
        out["shared" if shared else "plain"] = {"early": reducer.early, "overlap": reducer.overlap,
                                                "buckets": len(reducer.plan),
                                                "collectives": model._nodes.collectives - before}
        saved["shared" if shared else "plain"] = state(net)
        model.close()
    torch.save(saved, p["file"])
    if group is not None:
        _wait_for_the_nodes()
    return out


def _wait_for_the_nodes() -> None:
    """Rank 0's wait for the subgroup's nodes to finish: their whole run (worker starts included), which took
    over the init's 60 s when the test's other scenarios loaded the 2 cores too (Python 3.12, a CUDA torch)."""
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=150))


def accumulate(rank: int, world: int, p: dict) -> dict:
    """no_sync over micro-batches, then one synced backward of a batch with one row per node (fewer than its
    workers: the held sums of a worker without a shard join it too); then checkpoint on rank 0, close, resume."""
    B, micro = 8, 3
    net = make_net(bn=False)
    # a heartbeat every 2 ms: close() and the exit find the heartbeat thread in a store call most of the time
    beat = {"peer_heartbeat_s": p.get("heartbeat", 1.0)}
    model = dpool.wrap(net, device_ids=["cpu"] * p["workers"], worker_threads=1, **beat)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = batches(micro + 1, B)
    sl = rows_of(rank, world, B)
    nodes = model._nodes
    before = nodes.collectives
    # a hook on a parameter needs each micro-batch's gradient, which only a synced backward has: refused
    hook = next(net.parameters()).register_hook(lambda g: g.clamp(-1, 1))
    with model.no_sync():
        try:
            F.mse_loss(model(data[0][0][sl]), data[0][1][sl]).backward()
            hooked = "no error"
        except dpool.UnsupportedError as exc:
            hooked = str(exc)
    hook.remove()
    with model.no_sync():
        for x, y in data[:micro]:
            F.mse_loss(model(x[sl]), y[sl]).backward()
    inside = nodes.collectives - before
    grads_inside = [q.grad for q in net.parameters()]
    x, y = data[micro]
    last = rows_of(rank, world, world)  # one row per node, of the global batch's first `world` rows
    F.mse_loss(model(x[last]), y[last]).backward()
    accumulated = state(net)
    opt.step()
    # checkpoint: rank 0 saves, everyone stops; resume from it (loaded on every rank) and go on
    steps = batches(4, B, seed=3)
    for x, y in steps[:2]:
        opt.zero_grad()
        F.mse_loss(model(x[sl]), y[sl]).backward()
        opt.step()
    ckpt = os.path.join(p["out"], "checkpoint.pt")
    if model.is_main:
        torch.save({"model": dpool.unwrap(model).state_dict(), "opt": opt.state_dict()}, ckpt + ".tmp")
        os.replace(ckpt + ".tmp", ckpt)
    dist.barrier()
    model.close()
    # close() waits for its threads: one still in a torch call when the interpreter finalizes aborts
    # the process after a clean run (dpool/peers.py, Peers.stop)
    left = [t.name for t in threading.enumerate() if t.name.startswith("dpool")]
    resumed = make_net(bn=False)
    saved = torch.load(ckpt)
    if rank == 0:  # rank 0 alone loads the parameters: wrap() broadcasts them
        resumed.load_state_dict(saved["model"])
    model2 = dpool.wrap(resumed, device_ids=["cpu"] * p["workers"], worker_threads=1, **beat)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    opt2.load_state_dict(saved["opt"])  # every rank loads the optimizer state
    for x, y in steps[2:]:
        opt2.zero_grad()
        F.mse_loss(model2(x[sl]), y[sl]).backward()
        opt2.step()
    dist.barrier()
    torch.save({"accumulated": accumulated, "grads_inside": grads_inside, "resumed": state(resumed)}, p["file"])
    # model2 stays open until the process exits, as in a script that keeps it in a global and never
    # closes it: the exit must still be clean (code 0: dpool ends its threads at exit) and take the
    # workers with it (the runner waits for the pipes they inherited)
    _OPEN_AT_EXIT.append(model2)
    return {"inside": inside, "threads_left": left, "hooked": hooked}


_OPEN_AT_EXIT: list = []


def fault(rank: int, world: int, p: dict) -> dict:
    """One rank misbehaves at step 3; every rank reports what it raised, when, and whether its master moved."""
    from tests.helpers import assert_unchanged, snapshot

    kind, victim, before = p["kind"], p.get("victim", 1), p.get("where") == "before"
    B = 4 * world
    net = make_net(bn=p.get("bn", False))
    on_workers = p.get("loss", False)  # the loss on the workers: each forward runs with it, the backward too
    model = dpool.wrap(net, device_ids=["cpu"], worker_threads=1, max_restarts=0, gather=not on_workers,
                       peer_heartbeat_s=0.2, peer_heartbeat_timeout_s=p.get("silence", 3.0))
    loss_fn = dpool.criterion(nn.MSELoss()) if on_workers else F.mse_loss
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sl = rows_of(rank, world, B)
    pids = model.pids
    print("PIDS " + json.dumps(pids), flush=True)
    snap = None
    try:
        for step, (x, y) in enumerate(batches(6, B)):
            opt.zero_grad()
            snap = snapshot(net, opt)  # what a failure in this step must leave
            misbehave = step == 3 and rank == victim
            if misbehave and before:
                _misbehave(kind, pids)
            loss = loss_fn(model(x[sl]), y[sl])
            snap = snapshot(net, opt)  # the forward succeeded (its buffer updates stand, as in PyTorch): what
            # a failure in the backward must leave
            if misbehave and not before:
                _misbehave(kind, pids)
                if kind == "desync":  # an extra backward on this rank only
                    loss.backward(retain_graph=True)
            loss.backward()
            opt.step()
        raise AssertionError("no error")
    except dpool.DpoolError as exc:
        took = time.time()
        unchanged: bool | str = True
        try:
            assert_unchanged(snap, snapshot(net, opt))
        except AssertionError as e:
            unchanged = str(e)
        result = {"error": type(exc).__name__, "message": str(exc), "lost_rank": getattr(exc, "rank", None),
                  "pid": getattr(exc, "pid", None), "at": took, "unchanged": unchanged, "pids": pids,
                  "workers_alive": [q for q in pids if _alive(q)],
                  "told": model._nodes.peers.failed}  # this rank ended its part in the job (the abort key)
        print("RESULT " + json.dumps(result), flush=True)
        print(f"EXITING {time.time()}", flush=True)
        # the script ends (with the error, by default): the exit guard must end it promptly, without
        # SIGABRT, and with the status Python would give that ending
        ending = p.get("end", "raise")
        if ending == "SystemExit":  # as `raise SystemExit(main())` ends a script: sys.exit never called
            raise SystemExit(3) from None
        if ending == "exit":  # the builtin: it raises SystemExit itself
            exit(4)
        if ending == "KeyboardInterrupt":  # Python then ends by SIGINT
            raise KeyboardInterrupt from None
        raise


def lost_at(rank: int, world: int, p: dict) -> dict:
    """Rank 1 exits just before it starts its ``p["at"]``-th collective (0: never), counted by a hook on
    ``CrossNode.launch``, the one way dpool starts a collective; rank 0 reports what it raised. ``wrap()``
    and two training steps of a model with buffers (rank 0's, broadcast) and SyncBatchNorm (its statistics
    combined across the nodes) start every kind of collective dpool has."""
    from dpool.crossnode import CrossNode

    started: list[str] = []
    launch = CrossNode.launch

    pid_file = os.path.join(p["out"], "rank1.pid")
    if rank == 1:
        with open(pid_file + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(pid_file + ".tmp", pid_file)

    def counted(self, start, doing):
        started.append(doing)
        if len(started) == p["at"]:
            if rank == 1:
                print(f"T0 {time.time()}", flush=True)
                os._exit(3)
            # rank 0 starts the same collective once rank 1 is gone (a barrier on its death) and gloo's loop
            # thread has had its turn to see the connection close: gloo then refuses at the start
            while not os.path.exists(pid_file):
                time.sleep(0.01)
            with open(pid_file) as f:
                victim = int(f.read())
            while _alive(victim):
                time.sleep(0.01)
            time.sleep(0.2)
        return launch(self, start, doing)

    CrossNode.launch = counted  # type: ignore[method-assign]
    model = None
    try:
        model = dpool.wrap(make_net(bn=True, sync_bn=True), device_ids=["cpu"], worker_threads=1,
                           peer_heartbeat_s=0.2, peer_heartbeat_timeout_s=5.0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sl = rows_of(rank, world, 8)
        for x, y in batches(2, 8):
            opt.zero_grad()
            F.mse_loss(model(x[sl]), y[sl]).backward()
            opt.step()
        model.close()
        return {"error": None, "started": started}
    except RuntimeError as exc:  # (dpool's peer errors are RuntimeErrors too, as gloo's own is)
        result = {"error": type(exc).__name__, "dpool": isinstance(exc, dpool.DpoolError), "message": str(exc),
                  "lost_rank": getattr(exc, "rank", None), "started": started}
        print("RESULT " + json.dumps(result), flush=True)
        raise  # (the exit guard ends the rank past gloo's teardown, as a script ending with the error does)


def cuda_nodes(rank: int, world: int, p: dict) -> dict:
    """CUDA masters (``p["backend"]``: gloo or nccl), ``p["workers"][rank]`` GPU workers each on GPU 0; the
    test compares with one process on the union batch. Then no_sync and a step with a head on rank 0 only."""
    torch.cuda.set_device(0)
    steps, B = 4, 12
    net = make_net(bn=False).cuda()
    # an explicit group: "auto" stays on one node when the world has one rank
    model = dpool.wrap(net, device_ids=[0] * p["workers"][rank], process_group=dist.group.WORLD)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sl = rows_of(rank, world, B)
    data = [(x[sl].cuda(), y[sl].cuda()) for x, y in batches(steps, B)]
    nodes = model._nodes
    for x, y in data[:2]:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    opt.zero_grad()
    before = nodes.collectives
    with model.no_sync():  # two micro-batches accumulate locally, the third backward combines
        for x, y in data[2:]:
            F.mse_loss(model(x), y).backward()
    inside = nodes.collectives - before
    x, y = data[0]
    F.mse_loss(model(x, extra=rank == 0), y).backward()
    opt.step()
    torch.save({k: [None if t is None else t.cpu() for t in v] for k, v in state(net).items()}, p["file"])
    out = {"backend": nodes.backend, "comm_device": str(nodes.comm_device), "inside": inside,
           "early": model._runtime.reducer.early}
    model.close()
    return out


def _misbehave(kind: str, pids: list[int]) -> None:
    print(f"T0 {time.time()}", flush=True)
    if kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "exit":
        os._exit(7)
    elif kind == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif kind == "worker":
        os.kill(pids[0], signal.SIGKILL)
        time.sleep(0.5)


def _alive(pid: int) -> bool:
    import psutil
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


SCENARIOS = {"lost_at": lost_at, "vs_ddp": vs_ddp, "union": union, "overlap": overlap, "accumulate": accumulate, "fault": fault,
             "cuda_nodes": cuda_nodes, "minimal_nodes": minimal_nodes, "loss_on_workers": loss_on_workers}


def main() -> None:
    name, params = sys.argv[1], json.loads(sys.argv[2])
    torch.set_num_threads(1)  # BLAS results can depend on the thread count: DDP and the workers use one
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(params.get("backend", "gloo"), timeout=datetime.timedelta(seconds=60))
    params["file"] = os.path.join(params["out"], f"rank{rank}.pt")
    result = SCENARIOS[name](rank, world, params)
    try:
        torch.zeros(1).numpy()
        result["numpy"] = True
    except RuntimeError:  # "Numpy is not available"
        result["numpy"] = False
    print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
