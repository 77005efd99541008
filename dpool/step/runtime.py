"""One training step, coordinator side: the stages composed.

:class:`Runtime` wires the stages of a step and is their one entry point, the way ``DataParallel.forward``
reads in torch::

    forward:   follow the user's process (follow, replicas) → plan and place shards (forward)
               → request (rounds) → gather or keep on the workers, commit buffers (forward)
    loss:      the criterion round, with the deferred forward and a speculative backward (loss_round, deferred)
    backward:  slice output gradients per shard → request (rounds) → reduce → commit (backward)

Each public method holds the call lock (calls from several threads wait for the one in flight, as
``nn.DataParallel``'s do), runs a deferred forward first where the call needs it (:mod:`.deferred`), and
delegates. The step's shared state is one :class:`.state.StepState`.

A step is transactional: the master is only touched after every shard has succeeded (buffers are committed
after the forward round; gradients are returned to autograd after the backward round). A failed round
leaves the master's parameters, gradients, buffers and optimizer state as they were.

In cross-node mode (``nodes``, see :mod:`dpool.crossnode`) a training forward starts with the nodes agreeing
on where they are (and rank 0's buffers), and the reduce also averages over the nodes. A failure in such a
call ends this node's part in the job: the other nodes are told (the abort key), this node's workers are
stopped, and the process exits past gloo's teardown (the exit guard in :mod:`dpool.peers`).
"""
from __future__ import annotations

import functools
import weakref
import threading
from typing import Any, Callable, Sequence, TypeVar

import torch

from .. import hook_gate
from ..accumulate import HeldGradients
from ..bridge import CallState, Graphs
from ..cpus import bind_threads
from ..crossnode import CrossNode
from ..errors import DpoolValueError
from ..peers import arm_exit_guard
from ..policies import coordinator_cpus, cuda_async_replies, reply_together, wait_spin
from ..pool import Pool
from ..regions import IORegions
from ..replicate import Master
from ..scatter import Balancer
from ..stats import Stats
from ..sweep import sweep
from . import follow
from .backward import Backwards
from .deferred import Deferred
from .follow import Notices
from .forward import Forwards
from .loss_round import LossRound
from .replicas import ReplicaSet
from .rounds import Rounds
from .parts import StepParts
from .state import Options, Setup, StepState

__all__ = ["Runtime"]

F = TypeVar("F", bound=Callable[..., Any])


def _one_call_at_a_time(run_deferred_first: bool) -> Callable[[F], F]:
    """Hold the runtime's call lock for the whole call (threads wait for the call in flight); with
    ``run_deferred_first``, first run a forward held for its loss (see :mod:`dpool.step.deferred`). Only the
    criterion does not: it sends that forward with its loss, or runs it first itself."""

    def decorate(method: F) -> F:
        @functools.wraps(method)
        def locked(self: "Runtime", *args: Any, **kwargs: Any) -> Any:
            with self.call_lock:
                if run_deferred_first and self.state.pending is not None:
                    self.deferred.run(self)
                return method(self, *args, **kwargs)

        return locked  # type: ignore[return-value]

    return decorate


class Runtime:
    """Runs a module's forward and backward on a pool of worker processes.

    Args:
        module: the master module (on ``devices[0]``: the CPU, or the first GPU).
        options: the devices (one per worker, all ``"cpu"`` or all ``"cuda:i"``), limits and policies.
        nodes: cross-node mode's view of the other nodes, or ``None``.
    """

    def __init__(self, module: torch.nn.Module, options: Options, nodes: CrossNode | None = None) -> None:
        config, attach, worker_threads = options.config, options.attach, options.worker_threads
        if attach is not None and options.max_restarts:
            raise DpoolValueError("max_restarts is not available with pool=...: the dpool-workers daemon restarts workers")
        setup = self.setup = Setup(module, options, nodes)
        sweep(config.shm_dir)
        master = self.master = Master(module, setup.device)
        self.graphs = Graphs()
        # see StepState.last_out: before the first forward, the output's dtype is taken to be the parameters'
        state = self.state = StepState(next((p.dtype for p in module.parameters() if p.is_floating_point()),
                                            torch.get_default_dtype()), options.max_restarts)
        if nodes is not None:  # (weakly: the runtime is in no cycle)
            nodes.serve(state.progress, weakref.WeakMethod(self._leave_job))
        self.call_lock = threading.RLock()
        self.stats = Stats(setup.n)
        # Where the coordinator has no core of its own, rounds of several shards ask the workers to reply
        # together (see dpool.protocol.TOGETHER_WAIT_S); never in cross-node mode, whose buckets leave while
        # the workers still run. (Read before the pool exists: a bad DPOOL_REPLY_TOGETHER leaves nothing.)
        self.pool = pool = Pool(setup.devices, config, worker_threads, attach=attach,
                                reply_together=nodes is None and reply_together(setup.devices, worker_threads),
                                spin_s=wait_spin(setup.devices), async_replies=cuda_async_replies(setup.devices),
                                across=None if nodes is None else functools.partial(
                                    nodes.all_reduce, doing="combining SyncBatchNorm statistics"),
                                progress=state.progress)
        self.io = IORegions(setup.n, lambda w, size: pool.new_segment(size, device=setup.devices[w], owner=w))
        # (HeldGradients: what the loop did to the gradients the workers hold, see accumulate.py)
        self._wire(StepParts(setup=setup, state=state, pool=pool, io=self.io, graphs=self.graphs, stats=self.stats,
                             master=master, config=config,
                             balancer=Balancer(setup.n, options.shard_weights, options.balance), notices=Notices(),
                             held=HeldGradients(lambda: master.param_names)))
        self._unbind: Callable[[], None] | None = None  # undoes the coordinator's binding (close())
        try:
            self.replicas.start(self.rounds.call)
            # under torchrun, the coordinator joins its workers on its local rank's share of the cores
            cpus = coordinator_cpus(pool.threads, setup.devices) if attach is None else None
            if cpus is not None:
                self._unbind = bind_threads(cpus)
        except BaseException:
            self.close()
            raise

    def _wire(self, parts: StepParts) -> None:
        """Make the stages, each from the parts and the stages it calls (see :mod:`dpool.step.parts`)."""
        replicas = self.replicas = ReplicaSet(parts)
        rounds = self.rounds = Rounds(parts, replicas)
        forwards = self.forwards = Forwards(parts, replicas, rounds)
        self.deferred = Deferred(parts, rounds, forwards)
        self.backwards = Backwards(parts, replicas, rounds)
        self.losses = LossRound(parts=parts, replicas=replicas, rounds=rounds, forwards=forwards,
                                deferred=self.deferred, backwards=self.backwards)

    # ------------------------------------------------------------------ what the bridge and the loss read
    @property
    def params(self) -> list[torch.Tensor]:
        return self.master.params

    @property
    def dim(self) -> int:
        return self.setup.dim

    @property
    def n(self) -> int:
        return self.setup.n

    @property
    def output_device(self) -> torch.device:
        return self.setup.output_device

    @property
    def no_sync(self) -> bool:
        return self.state.no_sync

    @no_sync.setter
    def no_sync(self, value: bool) -> None:
        self.state.set_no_sync(value)

    @property
    def reducer(self) -> Any:
        return self.replicas.reducer

    # ------------------------------------------------------------------ cross-node failures
    def _leave_job(self, exc: BaseException) -> None:
        """A call that took part in the nodes' collectives failed (:meth:`dpool.crossnode.CrossNode.synced`):
        tell the other nodes (abort key), stop this node's workers, arm the exit guard."""
        nodes = self.setup.nodes
        assert nodes is not None
        nodes.fail(exc)
        arm_exit_guard(self.close)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        self.pool.break_pool(f"cross-node mode: {first}")
        self.close()

    # ------------------------------------------------------------------ the step
    @_one_call_at_a_time(run_deferred_first=True)
    def forward(self, args: tuple, kwargs: dict) -> Any:
        """``model(*args, **kwargs)`` on the workers (see :mod:`dpool.step.forward`)."""
        if follow.in_transform():
            follow.refuse_transform()
        nodes = self.setup.nodes
        if nodes is not None and torch.is_grad_enabled() and self.setup.module.training and not self.state.no_sync:
            return nodes.synced(lambda: self.forwards.run(self, args, kwargs, True))
        return self.forwards.run(self, args, kwargs, False)

    @_one_call_at_a_time(run_deferred_first=False)
    def criterion(self, handle: Any, crit: Any, targets: tuple) -> torch.Tensor:
        """Compute ``crit`` on every shard of ``handle`` (see :mod:`dpool.loss`).

        When the gradient ``loss.backward()`` will give each shard's loss can be told now, the workers also
        run that backward in the same round (a *speculative* backward): ``loss.backward()`` then finds the
        gradients in the slots and needs no round of its own. See :class:`dpool.loss.Speculation`.
        """
        return self.losses.criterion(self, handle, crit, targets)

    @_one_call_at_a_time(run_deferred_first=True)
    def backward_speculated(self, call_state: CallState, guess: Any, hit: bool, crit: Any,
                            param_idx: Sequence[int]) -> list[torch.Tensor | None] | None:
        """The gradients of a criterion's loss whose backward the workers ran right after it (see
        :meth:`criterion`), if ``hit`` (this backward's gradient for each shard's loss is bitwise the one
        they used: :meth:`dpool.loss.Speculation.hit`) and their slots still hold the result; ``None``: run
        the backward round instead. In cross-node mode the reduce averages over the nodes, with the same
        collectives the backward round's reduce would make, so ranks that took different paths stay in step."""
        run = functools.partial(self.losses.backward_speculated, call_state=call_state, guess=guess, hit=hit,
                                crit=crit, param_idx=param_idx)
        nodes = self.setup.nodes
        return nodes.synced(run) if nodes is not None and not self.state.no_sync else run()

    @_one_call_at_a_time(run_deferred_first=True)
    def gather_kept(self, handle: Any) -> Any:
        """Gather outputs kept on the workers, through the autograd bridge."""
        return self.losses.gather_kept(handle)

    @_one_call_at_a_time(run_deferred_first=True)
    def backward(self, call_state: CallState, grads: Sequence[torch.Tensor | None],
                 pieces: list[list[torch.Tensor | None]] | None = None,
                 param_idx: Sequence[int] = (), taken: Sequence[bool | None] | None = None
                 ) -> list[torch.Tensor | None]:
        """Backpropagate on the workers. ``pieces``: per shard, gradients by worker output index
        (given directly for losses computed on the workers); otherwise sliced from ``grads``.
        ``param_idx``: the parameters (by index) the calling autograd Function took as inputs, whose
        gradients are returned after the input gradients (``None`` for one that no longer requires grad).
        ``taken``: under ``no_sync()``, per ``param_idx`` entry, whether autograd accumulates into its
        ``.grad`` in this backward (see :func:`dpool.bridge.accumulates`); the workers hold only those.

        Under ``create_graph=True`` (autograd runs this with grad mode on) the gradients returned are
        differentiable: see :class:`dpool.bridge.DoubleBridge`.
        """
        hold = self.backwards.holds()
        nodes = self.setup.nodes
        if nodes is not None and not self.state.no_sync:
            return nodes.synced(lambda: self.backwards.run(host=self, call_state=call_state, grads=grads,
                                                           pieces=pieces, param_idx=param_idx, taken=None, hold=False))
        return self.backwards.run(host=self, call_state=call_state, grads=grads, pieces=pieces, param_idx=param_idx,
                                  taken=taken, hold=hold)

    @_one_call_at_a_time(run_deferred_first=True)
    def double_backward(self, double: Any, vs: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Differentiate the gradients of a ``create_graph=True`` backward (see ``DoubleBridge``)."""
        return self.backwards.double(double, vs)

    # ------------------------------------------------------------------ around the step
    @_one_call_at_a_time(run_deferred_first=True)
    def call_workers(self, fn: Any) -> list[Any]:
        """Run ``fn(replica)`` in every worker: their results, in worker order."""
        return self.rounds.call_all(fn)

    @_one_call_at_a_time(run_deferred_first=True)
    def inspect(self) -> list[tuple[int, int]]:
        """Per worker: the graphs it keeps for us, and its resident memory in bytes (one round trip)."""
        self.rounds.check_usable()
        return self.rounds.inspect()

    def close(self) -> None:
        """Close the pool; the master keeps its values in private memory. Every step is idempotent, and
        the runtime counts as closed only once all of them ran: a close cut short (Ctrl-C) is finished
        by the next one."""
        if self.state.closed:
            return
        self.state.drop_pending()  # a deferred forward nothing used: it never runs
        unbind, self._unbind = self.__dict__.get("_unbind"), None
        if unbind is not None:  # the coordinator's threads back where they were before wrap()
            unbind()
        if "replicas" in self.__dict__:
            self.replicas.held.release(self.master.params)
        hook_gate.restore(self.master.params)  # gates a failed backward left on the parameters' hooks
        self.master.close()
        self.pool.close()
        if self.setup.nodes is not None:
            self.setup.nodes.close()
        self._drop_shared_memory()
        self.state.close()

    def _drop_shared_memory(self) -> None:
        """Drop every reference to shared memory: a graph or output the user still holds keeps this object
        alive, but not the mappings (each one also holds an fd; see close() in DataParallel)."""
        self.io.clear()
        self.graphs.clear()
        if "losses" in self.__dict__:  # (the placements of inputs, targets and output gradients view segments)
            self.forwards.plans.clear()
            self.losses.targets.clear()
            self.backwards.gouts.clear()
        if "replicas" in self.__dict__:
            self.replicas.close()
