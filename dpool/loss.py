"""Loss on the workers: ``dpool.wrap(net, gather=False)`` and ``dpool.criterion(loss)``.

With ``gather=False`` a forward returns a :class:`ShardedOutput`: the outputs stay on the
workers, and nothing piles up on the coordinator (DataParallel's "GPU-0 imbalance", which
PyTorch-Encoding's DataParallelCriterion fixed with threads). ``dpool.criterion(loss)(out,
target)`` scatters the targets the same way, computes the loss on each worker, and returns
the full-batch loss: each shard reports its loss with ``reduction="sum"`` and the number the
mean divides by (rows, elements, or the sum of class weights), and the coordinator divides the
totals, so unequal shards, class weights and ``ignore_index`` give exactly the single-process
value. A loss that does not split so is an error, not a wrong number (see :func:`split_loss`). ``loss.backward()`` backpropagates on the workers from their shard losses.

*The backward right after the loss.* ``loss.backward()`` gives each shard's loss the gradient
``1 / denominator`` (``1`` for ``reduction="sum"``). When the coordinator can compute that number
before the loss round (a sum, or a mean whose denominators the targets and the outputs' shapes
decide: class-index cross-entropy and NLL, see :func:`target_denominator` (without class weights the
number of targets, :func:`target_count`, until a round shows ignored ones), and elementwise losses
such as ``MSELoss``, see :func:`elementwise_denominator`), it sends it with the loss, and each worker
runs its backward with it at once, in the same round. ``loss.backward()`` then only sums the
gradient slots: one round per step less. The result is used only if the gradient autograd actually
passes is bitwise that number, the denominators came out as predicted, and no other backward,
restart or ``no_sync()`` touched the slots since; otherwise the backward round runs as before, on
the graph the workers kept, and gives the same numbers. A scaled loss (``(loss * c).backward()``,
``GradScaler``) or a loss never backpropagated turns the speculation off for that criterion until a
backward would have used it, so such loops pay for at most one wasted backward per switch. CPU
workers only, and not for models with SyncBatchNorm or sparse gradients. In cross-node mode the
reduce then averages across the nodes, as the backward round's does.
"""
from __future__ import annotations

from typing import Any, Callable

import math

import cloudpickle
import torch

from . import gather as _gather
from .bridge import CallState, Host, accumulates, enter_backward, leave_backward, track_release
from .errors import DpoolValueError, ModelChangedError, UnsupportedError
from .tensors import to_bytes


__all__ = ["ShardedOutput", "criterion"]


class Unrun:
    """The :class:`~dpool.bridge.CallState` stand-in of a deferred forward's :class:`ShardedOutput` until the
    forward runs (see :mod:`dpool.step.deferred`): what is known before it (its call, shards and rows)."""

    def __init__(self, *, call: int, k: int, rows: list[int], gin_sizes: list[int]) -> None:
        self.call, self.k, self.rows, self.gin_sizes = call, k, rows, gin_sizes
        self.refused: str | None = None  # why the forward never ran, if it was dropped for a changed parameter

    def check(self) -> None:
        if self.refused is not None:
            raise ModelChangedError(self.refused)


class ShardedOutput:
    """Outputs of a forward kept on the workers (``gather=False``).

    Pass it to a :func:`criterion`, or call :meth:`gather` for the usual gathered output.
    """

    def __init__(self, runtime: Host, call_state: CallState | Unrun, specs: list | None,
                 diff_inputs: list[torch.Tensor]) -> None:
        self._runtime = runtime
        # what the stages read (dpool.step.loss_round): its CallState (a deferred forward's Unrun until it ran,
        # filled in then), its outputs' structure per shard, and the inputs that require grad
        self.call_state = call_state
        self.specs = specs
        self.diff_inputs = diff_inputs

    @property
    def saved_tensors(self) -> tuple:  # lets the runtime's graph-release probe treat handles like ctx objects
        return ()

    @property
    def shard_sizes(self) -> list[int]:
        """Rows of the batch each worker holds."""
        return list(self.call_state.rows)

    def gather(self) -> Any:
        """The gathered output, exactly as ``gather=True`` would have returned it (differentiable)."""
        return self._runtime.gather_kept(self)

    def __repr__(self) -> str:
        return f"ShardedOutput(call={self.call_state.call}, shard_sizes={self.shard_sizes})"

    def __getattr__(self, name: str) -> Any:
        # only for names a tensor has (out.backward(), out.shape, out.argmax(1)): others fail as usual
        if not name.startswith("__") and hasattr(torch.Tensor, name):
            raise AttributeError(f"'ShardedOutput' object has no attribute {name!r}. {_NOT_A_TENSOR}")
        raise AttributeError(f"'ShardedOutput' object has no attribute {name!r}")

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = getattr(func, "__name__", repr(func))
        raise TypeError(f"{name}() got a ShardedOutput where it takes a tensor. {_NOT_A_TENSOR}")


_NOT_A_TENSOR = ("The dpool model was wrapped with gather=False, so its forward keeps its outputs on the workers "
                 "and returns this handle instead of tensors. Compute the loss there with "
                 "dpool.criterion(loss_fn)(out, target), or call out.gather() for the output as gather=True "
                 "gives it (loss_fn(out.gather(), target)).")


class criterion:
    """Wrap a loss module so that it runs on the workers, next to the outputs.

    Args:
        loss (nn.Module): e.g. ``nn.CrossEntropyLoss()``; its ``reduction`` attribute must be ``"mean"`` or
            ``"sum"``, and its forward must honour it. A loss outside ``torch.nn``'s (a subclass, your own) is
            checked on the workers, and one that does not split over shards exactly (``CTCLoss``) raises
            ``ValueError`` (see :func:`split_loss`).
        backward_with_loss (bool): let the workers run ``loss.backward()``'s backward in the same round as
            the loss when they can tell its gradient in advance (see the module's note), which saves a round
            per step and gives the same numbers. ``False`` always backpropagates in a round of its own: for
            replicas whose backward hooks must run only for backwards that count. Default: ``True``.

    Example::

        >>> model = dpool.wrap(net, gather=False)
        >>> crit = dpool.criterion(nn.CrossEntropyLoss())
        >>> loss = crit(model(x), y)       # a 0-dim tensor: the full-batch loss
        >>> loss.backward()
    """

    def __init__(self, loss: torch.nn.Module, backward_with_loss: bool = True) -> None:
        self.loss = loss
        self._attrs: list = []
        self._values: list[torch.Tensor] = []
        self.payload()  # checks the reduction
        self.backward_with_loss = backward_with_loss
        self.speculation = SpeculationPolicy()
        self._seed_key: tuple | None = None  # the latest predicted seed, as (bytes, value), and what it was for
        self._seed: tuple[bytes, float] = (b"", 0.0)

    def payload(self) -> bytes:
        """The loss pickled for the workers: pickled again when it changed since the last call (an attribute
        assigned, ``label_smoothing = 0.1``, ``reduction``; a class-weight tensor replaced or its values
        changed, through ``.data`` too), as a loss the replicas of DataParallel share would follow. Sets
        :attr:`reduction`."""
        attrs, tensors = _loss_state(self.loss)
        try:
            same = attrs == self._attrs and all(map(torch.equal, tensors, self._values))
        except Exception:  # an __eq__ that cannot answer (a tensor attribute replaced): changed
            same = False
        if not same:
            reduction = getattr(self.loss, "reduction", None)
            if reduction is None:
                raise DpoolValueError(
                    f"dpool.criterion({type(self.loss).__name__}) needs a loss with a `reduction` attribute "
                    f"('mean' or 'sum') that its forward honours, as torch.nn's losses have: each worker computes "
                    f"its shard's loss with reduction='sum' and the coordinator divides the totals, and a loss "
                    f"that always returns its shard's mean would give a mean of the shards' means, which is not "
                    f"the batch's mean when the shards are unequal. Give the loss module `self.reduction` and "
                    f"honour it, or compute the loss on the gathered output: loss_fn(out.gather(), target).")
            if reduction not in ("mean", "sum"):
                raise DpoolValueError(f"dpool.criterion supports reduction 'mean' or 'sum', not {reduction!r}")
            self._bytes = cloudpickle.dumps(self.loss)
            self.reduction: str = reduction
            self._attrs, self._values = attrs, [t.detach().clone() for t in tensors]
        return self._bytes

    def __call__(self, output: Any, *targets: Any) -> torch.Tensor:
        if not isinstance(output, ShardedOutput):
            return self.loss(output, *targets)  # a gathered output: compute it here
        if torch.is_grad_enabled() and isinstance(self.loss, torch.nn.Module):
            self._refuse_trainable()
        return output._runtime.criterion(output, self, targets)

    def _refuse_trainable(self) -> None:
        """The workers compute the loss with copies of it, whose parameters' gradients stay there: a loss
        with parameters that learn (an ArcFace head, learned task weights) would silently never train."""
        names = [n for n, p in self.loss.named_parameters() if p.requires_grad]
        if names:
            name = type(self.loss).__name__
            shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            raise UnsupportedError(
                f"dpool.criterion({name}): the loss has parameters that require grad ({shown}). The workers "
                f"compute the loss with copies of it, and the gradients of those copies' parameters would never "
                f"reach {name}'s, so they would not train. Compute this loss on the gathered output "
                f"(loss_fn(out.gather(), target)), or move the parameters into the wrapped model (a margin or "
                f"classifier head as its last layer); if they are not meant to train, {name}.requires_grad_(False).")


def _loss_state(loss: Any) -> tuple[list, list[torch.Tensor]]:
    """What :meth:`Criterion.payload` compares: every attribute of the loss's modules (by identity, or ``==``),
    its tensors among them, and the tensors' values (a loss's tensors are small: class weights)."""
    if not isinstance(loss, torch.nn.Module):
        return [loss], []
    mods = list(loss.modules()) if loss._modules else [loss]  # (most losses have no submodules)
    tensors = [t for m in mods for t in (*m._parameters.values(), *m._buffers.values()) if t is not None]
    return [v for m in mods for v in m.__dict__.values()] + tensors, tensors


class LossBridge(torch.autograd.Function):
    """``forward``: the combined loss; ``backward``: each worker backpropagates its shard loss."""

    @staticmethod
    def forward(ctx: Any, box: Any, *inputs: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.box = box
        track_release(ctx, inputs[0])
        # made for this output alone (combine): returned, not cloned. The box lets go of it: the output's graph
        # holds the box, and a box holding the output would be a cycle the garbage collector cannot see.
        value, box.value = box.value, None
        if value is None:
            raise RuntimeError("dpool: a criterion's loss was made twice from one result; compute the loss again")
        return value

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        enter_backward(ctx)
        box = ctx.box
        guess, box.guess = box.guess, None  # a second backward (retain_graph=True) runs its own round
        done = None
        if guess is not None:
            done = box.runtime.backward_speculated(box.call_state, guess, guess.hit(grad, box.denom), box.crit,
                                                   box.param_idx)
        if done is None:
            seed = shard_seed(grad, box.denom, box.dtype)
            pieces = [[None] * (idx + 1) for idx in box.indices]
            for s, idx in enumerate(box.indices):
                pieces[s][idx] = seed
            taken = accumulates(ctx, len(box.param_idx)) if box.runtime.no_sync else None
            done = box.runtime.backward(box.call_state, (), pieces, box.param_idx, taken)
        leave_backward(ctx)
        return (None, *done)


class SpeculationPolicy:
    """When a criterion's workers run its backward with its loss (see the module's note): on until a miss.

    ``count_ignored``: count the targets that are not ``ignore_index`` before the round (two ops and a read,
    every step) rather than predict that none is; set once a round's denominators showed some (see
    :func:`predict_seed`).
    """

    __slots__ = ("on", "last", "count_ignored")

    def __init__(self) -> None:
        self.on = True
        self.last: Speculation | None = None  # the latest loss's prediction
        self.count_ignored = False

    def allows(self) -> bool:
        """Whether this loss may speculate: not after a miss, nor when the previous loss of this criterion was
        never backpropagated (its early backward would have counted for nothing)."""
        if self.last is not None and not self.last.settled:
            self.on = False
        return self.on

    def settle(self, guess: Speculation, matched: bool, ran_at: int | None, replies: list, flags: bytes) -> None:
        """The loss round is in: the denominators ``matched`` the prediction or not; the early backward ran
        (at slot generation ``ran_at``) with the parameters' ``flags``, or did not (``None``)."""
        if not matched:  # predicted with every target counted (target_count): count them from now on
            self.count_ignored = True
        guess.gen = ran_at if ran_at is not None else -1
        guess.replies = replies if ran_at is not None else None
        guess.flags = flags
        self.last = guess

    def backpropagated(self, guess: Speculation, hit: bool) -> None:
        """``loss.backward()`` ran: a miss (a scaled loss, GradScaler) turns speculation off until a would-be hit."""
        guess.settled = True
        self.on = hit


class Speculation:
    """The gradient ``loss.backward()`` will give each shard's loss, predicted at the loss (see the module's note).

    ``seed``: its bytes (``value`` as a ``dtype`` scalar); ``denom``: the predicted sum of the shards'
    denominators (``None`` for a sum). After the loss round, ``replies`` holds the shards' reports of the
    backward they ran with it and ``gen`` the runtime's slot generation then (``None`` and ``-1``: it did
    not run, or the denominators came out otherwise: only a prediction). ``settled``: a backward of the
    loss happened.
    """

    __slots__ = ("seed", "value", "dtype", "denom", "gen", "replies", "settled", "flags")

    def __init__(self, seed: bytes, value: float, dtype: torch.dtype, denom: float | None) -> None:
        self.seed, self.value, self.dtype, self.denom = seed, value, dtype, denom  # seed = 1 / (denom or 1)
        self.gen = -1
        self.replies: list | None = None
        self.settled = False
        self.flags = b""  # the parameters' requires_grad flags the early backward ran with

    def matches(self, denoms: list[float]) -> bool:
        """Whether the shards' denominators add up as predicted (always, for a sum)."""
        return self.denom is None or sum(denoms) == self.denom  # summed as combine() sums them

    def hit(self, grad: torch.Tensor, denom: float) -> bool:
        """Whether the seed ``loss.backward()`` gives each shard, ``grad / denom`` as a ``dtype`` scalar, is
        bitwise the predicted one (a nonzero value: ``==`` cannot tell zeros' signs apart).

        ``grad`` is autograd's gradient of the combined loss, ``denom`` the denominator the shards reported.
        The usual ``grad``, ``loss.backward()``'s one, is a hit without computing the seed: divided by the
        predicted denominator it is the very operation that made the prediction. When the shards' denominators
        came out otherwise, the early backward is not used whatever this says (:attr:`replies` is ``None``),
        and a hit only means that the speculation stays on: a right prediction would have been used.
        """
        if self.value == 0.0:
            return False
        if grad.dtype == self.dtype and grad.item() == 1.0:
            return True
        return shard_seed(grad, denom, self.dtype).item() == self.value


def shard_seed(grad: torch.Tensor, denom: float, dtype: torch.dtype) -> torch.Tensor:
    """Each shard loss's gradient when the combined loss gets ``grad``: ``grad / denom`` as a ``dtype`` scalar.
    The prediction (:func:`predict_seed`), the check of it (:meth:`Speculation.hit`) and the backward round
    all make it here, so that they agree bit for bit."""
    return (grad / denom).to(dtype).reshape(())


# Losses whose mean divides by the number of elements of the input and the target broadcast together
# (their unreduced loss has that shape). Exact types: a subclass may reduce otherwise.
_ELEMENTWISE = (torch.nn.L1Loss, torch.nn.MSELoss, torch.nn.SmoothL1Loss, torch.nn.HuberLoss, torch.nn.BCELoss,
                torch.nn.BCEWithLogitsLoss, torch.nn.SoftMarginLoss)


def elementwise_denominator(loss_fn: Any, out_shape: list[int] | None, targets: tuple) -> float | None:
    """The elements a mean-reduced elementwise loss (``MSELoss``, ``L1Loss``, ``BCEWithLogitsLoss``, ...) divides
    by, for an output of ``out_shape`` and one target tensor; ``None`` for other losses or arguments."""
    if (type(loss_fn) not in _ELEMENTWISE or out_shape is None or len(targets) != 1
            or not isinstance(targets[0], torch.Tensor)):
        return None
    try:
        shape = torch.broadcast_shapes(tuple(out_shape), tuple(targets[0].shape))
    except RuntimeError:  # the loss itself will raise, on the workers
        return None
    return float(math.prod(shape))


def predict_seed(crit: criterion, targets: tuple, shard_targets: Callable[[], list[tuple]],
                 output_shapes: Callable[[], list[list[int] | None]], dtype: torch.dtype,
                 device: torch.device) -> Speculation | None:
    """What :meth:`LossBridge.backward` will pass each shard for ``loss.backward()``, if the targets (and the
    outputs' shapes) decide it.

    Args:
        targets: the whole batch's targets, as given to the criterion.
        shard_targets: makes each shard's targets (needed with class weights, whose float sums depend on the
            order, and for elementwise losses).
        output_shapes: makes each shard's output shape (``None`` where the output is not one tensor).
    """
    denom: float | None = None
    if crit.reduction == "mean":
        if type(crit.loss) in _ELEMENTWISE:  # counts of elements: exact
            found = [elementwise_denominator(crit.loss, o, t) for o, t in zip(output_shapes(), shard_targets())]
        elif getattr(crit.loss, "weight", None) is not None:
            found = [target_denominator(crit.loss, t) for t in shard_targets()]
        elif crit.speculation.count_ignored:  # a count of rows: exact whatever the order
            found = [target_denominator(crit.loss, targets)]
        else:  # every target counted, until a round showed some ignored (see SpeculationPolicy.count_ignored)
            found = [target_count(crit.loss, targets)]
        if any(d is None for d in found):
            return None
        denom = sum(d for d in found if d is not None)  # in shard order, as combine() adds the reports
    divisor = denom if denom else 1.0
    key = (dtype, device, divisor)
    if crit._seed_key != key:  # the batch size (and so the seed) rarely changes: made once
        # autograd's gradient for loss.backward() is ones_like(loss); LossBridge divides it by the denominator
        seed = shard_seed(torch.ones((), dtype=dtype, device=device), divisor, dtype)
        crit._seed_key, crit._seed = key, (to_bytes(seed.reshape(-1).cpu()), seed.item())
    return Speculation(crit._seed[0], crit._seed[1], dtype, denom)


class _LossBox:
    __slots__ = ("runtime", "call_state", "value", "dtype", "denom", "indices", "handle", "guess", "crit", "param_idx")

    def __init__(self, runtime: Host, handle: ShardedOutput, value: torch.Tensor, denom: float,
                 indices: list[int], guess: Speculation | None, crit: criterion, param_idx: list[int]) -> None:
        self.runtime, self.call_state, self.denom, self.indices = runtime, handle.call_state, denom, indices
        self.value: torch.Tensor | None = value  # the loss LossBridge returns (taken by its forward)
        self.dtype = value.dtype
        self.handle = handle  # the loss's graph keeps the outputs on the workers alive
        self.guess, self.crit = guess, crit
        self.param_idx = param_idx  # the parameters LossBridge takes as inputs, by index


# Losses whose summed loss is the sum of their unreduced loss, and whose mean is that sum divided by
# :func:`target_denominator`, or else by the unreduced loss's number of elements. Exact types: a subclass may
# compute otherwise, so :func:`split_loss` checks it on every shard. (``CTCLoss`` is not one: its mean divides
# each sample's loss by its target length first.)
_SPLITS_EXACTLY = frozenset((
    *_ELEMENTWISE, torch.nn.CrossEntropyLoss, torch.nn.NLLLoss, torch.nn.KLDivLoss, torch.nn.PoissonNLLLoss,
    torch.nn.GaussianNLLLoss, torch.nn.MultiLabelSoftMarginLoss, torch.nn.MultiLabelMarginLoss,
    torch.nn.MultiMarginLoss, torch.nn.HingeEmbeddingLoss, torch.nn.CosineEmbeddingLoss, torch.nn.MarginRankingLoss,
    torch.nn.TripletMarginLoss, torch.nn.TripletMarginWithDistanceLoss))


def _reduced_as(loss_fn: Any, reduction: str, cache: dict[tuple[int, str], tuple[Any, Any]]) -> Any:
    """A shallow copy of ``loss_fn`` with ``reduction``; made once per loss module (the worker keeps the
    unpickled criterion, so the same object comes every step) and kept in ``cache``."""
    if getattr(loss_fn, "reduction", None) == reduction:
        return loss_fn
    got = cache.get((id(loss_fn), reduction))
    if got is None or got[0] is not loss_fn:
        import copy

        other = copy.copy(loss_fn)
        other.reduction = reduction
        got = _remember(cache, (id(loss_fn), reduction), (loss_fn, other))
    return got[1]


def _remember(cache: dict, key: tuple, value: tuple) -> tuple:
    """``cache[key] = value``, emptying ``cache`` first when it is full: a loss changed every step arrives as
    a new object every step, and the entries hold the objects."""
    if len(cache) >= 256:
        cache.clear()
    cache[key] = value
    return value


def split_loss(loss_fn: Any, out: Any, args: tuple,
               cache: dict[tuple[int, str], tuple[Any, Any]]) -> tuple[torch.Tensor, float]:
    """A shard's part of the batch's loss (on a worker): its loss with ``reduction="sum"``, and what a mean
    divides it by (``1.0`` for a sum), so that the coordinator's ``sum(totals) / sum(denominators)`` equals
    the full-batch loss exactly, class weights and ``ignore_index`` included.

    For a loss outside ``torch.nn``'s that are known to split so (a subclass, a loss of your own), it checks
    that this shard's loss does, at its first 4 calls on this worker and one call in 32 after that, at the
    cost of one more computation of the loss then (without autograd): its
    ``"mean"`` loss times the denominator is its ``"sum"`` loss; where its ``reduction="none"`` loss is
    computed (the denominator is its size, or a sum), it has a value per sample or element and sums to the
    ``"sum"`` loss. Otherwise it raises ``ValueError`` instead of returning a loss that is not the batch's:
    a forward that ignores ``self.reduction`` gives a mean of the shards' means; ``CTCLoss``'s mean divides
    by target lengths. A loss whose forward changes its own parameters or buffers (in place or by assigning
    a new tensor) raises ``ValueError`` too: the change would stay in this worker's copy.
    """
    reduction = getattr(loss_fn, "reduction", None)
    if reduction not in ("mean", "sum"):
        raise ValueError(f"dpool.criterion supports reduction 'mean' or 'sum', not {reduction!r}")
    own = _own_tensors(loss_fn)
    versions = [t._version for _, _, t in own]
    total, denom = _split(loss_fn, reduction, out, args, cache)
    for (mod, key, t), v in zip(own, versions):
        if _tensor_at(mod, key) is not t or t._version != v:
            name = type(loss_fn).__name__
            raise ValueError(
                f"dpool.criterion({name}): the loss's forward changed its tensor {key!r} "
                f"({'in place' if _tensor_at(mod, key) is t else 'assigned anew'}). The workers compute the loss with "
                f"copies of it (and once more on the shards where they check it), so such a change would never "
                f"reach {name} itself, and the copies would drift apart. Keep that state outside the loss, or "
                f"compute this loss on the gathered output: loss_fn(out.gather(), target).")
    return total, denom


def _own_tensors(loss_fn: Any) -> list[tuple[Any, str, torch.Tensor]]:
    """The parameters and buffers of a loss module (usually none, or its class weights), with their homes."""
    if not isinstance(loss_fn, torch.nn.Module):
        return []
    return [(m, k, t) for m in loss_fn.modules() for d in (m._parameters, m._buffers) for k, t in d.items()
            if t is not None]


def _tensor_at(mod: torch.nn.Module, key: str) -> Any:
    return mod._parameters.get(key, mod._buffers.get(key))


def _split(loss_fn: Any, reduction: str, out: Any, args: tuple,
           cache: dict[tuple[int, str], tuple[Any, Any]]) -> tuple[torch.Tensor, float]:
    total = _reduced_as(loss_fn, "sum", cache)(out, *args)
    denom = target_denominator(loss_fn, args) if reduction == "mean" else 1.0
    check = type(loss_fn) not in _SPLITS_EXACTLY and _check_due(loss_fn, cache)
    if not check and denom is not None:
        return total, denom
    with torch.no_grad():  # one more loss computation where it is checked: the mean's, or the unreduced
        none = _reduced_as(loss_fn, "none", cache)(out, *args) if denom is None or reduction == "sum" else None
        if check:
            _check_split(loss_fn=loss_fn, reduction=reduction, total=total, none=none, denom=denom, out=out, args=args)
    if denom is None:
        assert none is not None
        denom = float(none.numel())
    return total, denom


_CHECK_FIRST, _CHECK_EVERY = 4, 32


def _check_due(loss_fn: Any, cache: dict) -> bool:
    """Whether :func:`split_loss` checks this call of ``loss_fn``: its first ``_CHECK_FIRST`` calls on this
    worker (a loss changed on the coordinator arrives as a new object), then one in ``_CHECK_EVERY``."""
    got = cache.get((id(loss_fn), "calls"))
    n = got[1] if got is not None and got[0] is loss_fn else 0
    _remember(cache, (id(loss_fn), "calls"), (loss_fn, n + 1))
    return n < _CHECK_FIRST or n % _CHECK_EVERY == 0


def _check_split(loss_fn: Any, reduction: str, total: Any, none: Any, denom: float | None, out: Any,
                 args: tuple) -> None:
    name = type(loss_fn).__name__
    advice = (f"dpool computes each shard's loss with reduction='sum' and divides the shards' totals by what "
              f"the mean divides by, so {name}'s forward must honour self.reduction ('sum', 'none', 'mean'), "
              f"and its mean must be its sum over its samples or elements (or over the class weights of "
              f"CrossEntropyLoss' targets). Otherwise compute the loss on the gathered output: "
              f"loss_fn(out.gather(), target), or dpool.wrap(..., gather=True).")
    if not isinstance(total, torch.Tensor) or total.dim() != 0:
        raise ValueError(f"dpool.criterion({name}) with reduction='sum' must return a 0-dim tensor, not "
                         f"{type(total).__name__} {tuple(getattr(total, 'shape', ()))}. {advice}")
    checks = []
    if none is not None:
        if not isinstance(none, torch.Tensor) or none.dim() == 0:
            raise ValueError(f"dpool.criterion({name}) with reduction='none' returned one value for the whole "
                             f"shard instead of one per sample: it does not honour self.reduction, so the shards' "
                             f"losses cannot be combined into the batch's exactly. {advice}")
        checks.append(("the sum of its reduction='none' loss", none.sum()))
        if denom is None:
            denom = float(none.numel())
    if reduction == "mean":
        checks.append((f"its reduction='mean' loss times {denom:g} (what its mean divides by)",
                       loss_fn(out, *args) * denom))
    eps = torch.finfo(total.dtype).eps if total.dtype.is_floating_point else 0.0
    rtol = max(1e-4, 16 * eps)
    value = float(total)
    for what, got in checks:
        other = float(got)
        if not abs(value - other) <= rtol * max(abs(value), abs(other)) + 1e-12:
            raise ValueError(f"dpool.criterion({name}) does not split over shards: on this shard its "
                             f"reduction='sum' loss is {value:.6g}, but {what} is {other:.6g}. {advice}")


def _class_indices(loss_fn: Any, targets: tuple) -> torch.Tensor | None:
    """The target of a ``CrossEntropyLoss``/``NLLLoss`` given class indices; ``None`` for any other loss or target."""
    target = targets[0] if targets else None
    if (isinstance(loss_fn, (torch.nn.CrossEntropyLoss, torch.nn.NLLLoss)) and isinstance(target, torch.Tensor)
            and not target.is_floating_point()):
        return target
    return None


def target_count(loss_fn: Any, targets: tuple) -> float | None:
    """:func:`target_denominator` if no target is ``ignore_index``: the number of targets (no class weights).

    A prediction, not a count: the shards report the true denominators with their losses, and a seed
    predicted from this one is used only if they add up to it (:meth:`Speculation.matches`). It saves
    reading the targets before the round; a criterion whose rounds showed ignored targets counts them.
    """
    target = _class_indices(loss_fn, targets)
    return None if target is None else float(target.numel())


def target_denominator(loss_fn: Any, targets: tuple) -> float | None:
    """What a mean-reduced ``loss_fn`` divides a shard's summed loss by, when the targets alone decide it:
    ``CrossEntropyLoss``/``NLLLoss`` with class indices (the rows not ``ignore_index``, or the sum of their
    class weights). ``None`` otherwise (the worker then counts the unreduced loss's elements).

    The workers compute their shard's denominator with this function, and the coordinator predicts it with
    the same function on the same target values (see :func:`predict_seed`).
    """
    target = _class_indices(loss_fn, targets)
    if target is None:
        return None
    valid = target != loss_fn.ignore_index
    if loss_fn.weight is not None:
        return float(loss_fn.weight[target.clamp(min=0)][valid].sum())
    return float(valid.sum())


def combine(runtime: Host, handle: ShardedOutput, replies: list, dtype: torch.dtype,
            reduction: str, guess: Speculation | None, crit: criterion, param_idx: list[int]) -> torch.Tensor:
    """The full-batch loss from the shards' (sum, denominator) replies, differentiable."""
    total = sum(r.value for r in replies)
    denom = sum(r.denom for r in replies) if reduction == "mean" else 1.0
    # a mean over nothing (every target ignored) is nan, as in one process; its gradients stay zero
    # (scalar_tensor: torch.tensor's conversion to dtype in one op where torch.tensor takes four)
    value = torch.scalar_tensor(total / denom if denom else (math.nan if reduction == "mean" else total),
                                dtype=dtype, device=runtime.output_device)
    box = _LossBox(runtime=runtime, handle=handle, value=value, denom=denom if denom else 1.0,
                   indices=[r.index for r in replies], guess=guess, crit=crit, param_idx=param_idx)
    grad_inputs = handle.diff_inputs + [runtime.params[i] for i in box.param_idx]
    call_state = handle.call_state
    assert isinstance(call_state, CallState)  # (its forward ran before its loss)
    if torch.is_grad_enabled() and grad_inputs and any(call_state.differentiable):
        return LossBridge.apply(box, *grad_inputs)
    return value


def build_output(handle: ShardedOutput, gathered: list) -> Any:
    assert handle.specs is not None  # (its forward ran before its gather)
    return _gather.build(handle.specs, iter(gathered))
