"""HuggingFace ``Trainer`` with its forwards on dpool workers: :class:`DpoolTrainer`, :class:`DpoolTrainerMixin`.

>>> from dpool.integrations.transformers import DpoolTrainer
>>> trainer = DpoolTrainer(model=model, args=args, train_dataset=ds, device_ids=["cpu", "cpu"])
>>> trainer.train()

The Trainer keeps the bare model as ``trainer.model`` (what it saves, logs and hands to callbacks) and
runs every forward through a dpool model (``trainer.model_wrapped``), in place of its own
``nn.DataParallel``. Requires ``pip install dpool[transformers]``.
"""
from __future__ import annotations

import contextlib
import copyreg
import functools
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch
from torch import nn
import transformers
from torch.utils import _pytree
from transformers import Trainer

from . import require
from .. import scatter
from ..devices import DeviceLike, cpu_workers, parse_devices
from ..errors import UnsupportedError
from ..wrapper import DataParallel, is_wrapped, reopen, reopens, unwrap, wrap

__all__ = ["DpoolTrainer", "DpoolTrainerMixin"]

require("transformers", transformers.__version__, (5, 0))


class _Pool:
    """The trainer's dpool model, one for the trainer's life (what it hands out as ``model_wrapped``, which
    libraries keep: sentence-transformers puts it into its loss). Its workers start at the first use, stop
    when the outermost train/evaluate/predict returns (or when the trainer is collected: a
    ``weakref.finalize`` holds this, not the trainer), and start again at its next forward."""

    def __init__(self, device_ids: Sequence[DeviceLike] | None, options: dict[str, Any]) -> None:
        self.device_ids: list[DeviceLike] | None = None if device_ids is None else list(device_ids)
        self.options = options
        self.model: DataParallel | None = None
        self.depth = 0

    def open(self, module: nn.Module) -> DataParallel:
        model = self.model
        if model is None or model.module is not module:
            self.close()
            model = self.model = wrap(module, self.device_ids, **self.options)
            reopens(model)
            model.forward = _share_items(model, model.forward)
        else:
            reopen(model)
        return model

    def close(self) -> None:
        if self.model is not None:
            self.model.close()


if TYPE_CHECKING:  # (type checkers read the mixin as the Trainer it is mixed into)
    _Base = Trainer
else:
    _Base = object


class DpoolTrainerMixin(_Base):
    r"""What makes a ``transformers.Trainer`` subclass run its forwards on dpool workers.

    Put it first among the bases: ``class MyTrainer(DpoolTrainerMixin, SFTTrainer)``. It takes the
    subclass's arguments, plus:

    Args:
        device_ids (list of int, str or torch.device, optional): one worker per entry, as
            :func:`dpool.wrap`'s. Default: the Trainer's devices: every visible GPU, or with
            ``use_cpu=True`` (or no GPU) one CPU worker per physical core.
        dpool_options (dict, optional): other keyword arguments of :func:`dpool.wrap`
            (``worker_threads``, ``max_restarts``, ``buffers``...).

    What it changes:

    * every forward (training, evaluation, prediction) runs on the workers (the Trainer's own
      ``nn.DataParallel`` is never used), and the batch per step is ``per_device_train_batch_size`` (and
      ``per_device_eval_batch_size``) times the number of workers, as the Trainer's ``nn.DataParallel`` path
      computes it: ``trainer.args.train_batch_size`` says so, and the steps per epoch follow;
    * the loss logged and backpropagated is the mean of the shards' losses, as the Trainer computes it
      for ``nn.DataParallel``; a model that normalizes its loss by ``num_items_in_batch`` gets each
      shard's share of it, so the mean equals one process's loss, and a ``compute_loss`` that normalizes
      the gathered outputs itself gets the whole count;
    * ``gradient_accumulation_steps`` holds the gradients on the workers (:meth:`dpool.DataParallel.no_sync`)
      until the last micro-batch; ``bf16``/``fp16`` autocast reaches the workers;
    * checkpoints and ``save_model()`` hold the bare model's keys;
    * ``model_wrapped`` is one dpool model for the trainer's life: every forward runs through it,
      evaluation before ``train()`` included; its workers start at the first forward and stop when the
      outermost ``train()``, ``evaluate()`` or ``predict()`` returns, and a later forward through it (a
      loss that keeps the model) starts them again.

    Raises:
        UnsupportedError: at construction, for what dpool cannot do exactly: DeepSpeed or FSDP in the
            arguments, or a multi-process launch (``torchrun``, ``accelerate launch``).
    """

    def __init__(self, *args: Any, device_ids: Sequence[DeviceLike] | None = None,
                 dpool_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        model = kwargs.get("model", args[0] if args else None)
        if isinstance(model, nn.Module) and (is_wrapped(model) or isinstance(model, nn.DataParallel)):
            raise UnsupportedError(f"{type(self).__name__} wraps the model itself: pass the bare model "
                                   f"(dpool.unwrap(model)), not a {type(model).__name__}")
        self._dpool = _Pool(device_ids, dict(dpool_options or {}))
        weakref.finalize(self, self._dpool.close)
        super().__init__(*args, **kwargs)
        self._refuse_what_dpool_cannot_do()
        devices: list[DeviceLike] = list(parse_devices(None) if self.args.device.type == "cuda" else cpu_workers()) \
            if self._dpool.device_ids is None else self._dpool.device_ids  # (default: the Trainer's devices)
        self._dpool.device_ids = devices
        # One process drives every worker: the Trainer's DataParallel paths (which wrap the model and split
        # num_items_in_batch over GPUs) are dpool's here, as for model parallelism; its batch is theirs.
        self.args = _per_worker_batches(self.args, len(devices))
        self._train_batch_size = self.args.train_batch_size

    def _refuse_what_dpool_cannot_do(self) -> None:
        name = type(self).__name__
        if getattr(self, "is_deepspeed_enabled", False) or getattr(self, "is_fsdp_enabled", False) \
                or getattr(self, "is_fsdp_xla_enabled", False):
            raise UnsupportedError(
                f"{name} cannot run DeepSpeed or FSDP (set in the TrainingArguments): they shard the model over "
                "processes, dpool replicates it over workers of one process. Drop deepspeed/fsdp from the "
                "arguments, or use the plain Trainer for a sharded run.")
        if self.args.world_size > 1:
            raise UnsupportedError(
                f"{name} runs in one process, but this is process {self.args.process_index} of "
                f"{self.args.world_size} (torchrun or accelerate launch): the Trainer would put "
                "DistributedDataParallel around dpool and reduce the gradients twice. Launch one process "
                "(python train.py), or use dpool's cross-node mode (one dpool.wrap per machine under torchrun).")

    @contextlib.contextmanager
    def _dpool_session(self) -> Iterator[None]:
        pool = self._dpool
        pool.depth += 1
        try:
            yield
        finally:
            pool.depth -= 1
            if pool.depth == 0:
                pool.close()

    def train(self, *args: Any, **kwargs: Any) -> Any:
        with self._dpool_session():
            return super().train(*args, **kwargs)

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        with self._dpool_session():
            return super().evaluate(*args, **kwargs)

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        with self._dpool_session():
            return super().predict(*args, **kwargs)

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        accelerator = self.accelerator
        single_process_no_sync = accelerator.no_sync

        def no_sync(model: nn.Module) -> Any:
            # accelerate's no_sync does nothing in one process; a dpool model holds the micro-batches'
            # gradients on its workers until the last one, as DDP's no_sync does
            return model.no_sync() if is_wrapped(model) else single_process_no_sync(model)

        accelerator.no_sync = no_sync

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        bare = unwrap(model)
        new = self._dpool.model is None or self._dpool.model.module is not bare
        dp = self._dpool.open(bare)
        if new and self.accelerator.native_amp:
            # What accelerator.prepare() does to a model for bf16/fp16: autocast around the forward (which
            # the workers follow) and its outputs in float32. The Trainer does not prepare a wrapped model.
            from accelerate.utils import convert_outputs_to_fp32, get_mixed_precision_context_manager

            autocast = get_mixed_precision_context_manager(self.accelerator.native_amp,
                                                           self.accelerator.autocast_handler)
            dp.forward = convert_outputs_to_fp32(autocast(dp.forward))
        # the model every forward runs through, evaluation before train() included (a loss that keeps the
        # model, as sentence-transformers' do, is given this one)
        self.model_wrapped = dp
        return dp

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        if not is_wrapped(model):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        with warnings.catch_warnings():  # (a loss per shard is what is wanted here: DataParallel's warning is not)
            warnings.filterwarnings("ignore", message="Was asked to gather along dimension 0")
            result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        loss: Any
        loss, outputs = result if return_outputs else (result, None)
        if torch.is_tensor(loss) and loss.dim() > 0:
            loss = loss.mean()  # the shards' losses, one per worker
        return (loss, outputs) if return_outputs else loss


def _per_worker_batches(args: Any, workers: int) -> Any:
    """A copy of the Trainer's arguments whose ``train_batch_size`` and ``eval_batch_size`` are the per-device sizes
    times ``workers`` (as for the Trainer's ``nn.DataParallel``, with ``n_gpu`` GPUs), with ``n_gpu`` at most 1 (so
    the Trainer builds no DataParallel of its own). It pickles as the arguments' own class."""
    scaled = _SCALED.get(type(args))
    if scaled is None:
        scaled = _SCALED[type(args)] = type(type(args).__name__, (_WorkerBatches, type(args)),
                                            {"__module__": type(args).__module__})
    copy: Any = object.__new__(scaled)
    copy.__dict__.update(vars(args))
    copy._n_gpu, copy._dpool_workers = min(args.n_gpu, 1), workers
    return copy


class _WorkerBatches:
    _dpool_workers: int
    per_device_train_batch_size: int
    per_device_eval_batch_size: int

    @property
    def train_batch_size(self) -> int:
        return self.per_device_train_batch_size * self._dpool_workers

    @property
    def eval_batch_size(self) -> int:
        return self.per_device_eval_batch_size * self._dpool_workers

    def __reduce_ex__(self, protocol: Any) -> Any:  # (torch.save(trainer.args): the arguments' own class)
        state = {k: v for k, v in vars(self).items() if k != "_dpool_workers"}
        rebuild = copyreg._reconstructor  # type: ignore[attr-defined]
        return rebuild, (type(self).__mro__[2], object, None), state


_SCALED: "weakref.WeakKeyDictionary[type, type]" = weakref.WeakKeyDictionary()


def installed_trainer_class(cls: type, options: dict[str, Any]) -> type:
    """What ``dpool.install()`` makes of a Trainer class: the subclass with :class:`DpoolTrainerMixin` first, whose
    constructor takes the installation's ``device_ids`` and options (see ``dpool/installer.py``)."""
    if issubclass(cls, DpoolTrainerMixin):
        return cls
    made = _INSTALLED.get(cls)
    if made is None:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            options = dict(type(self)._dpool_options)
            DpoolTrainerMixin.__init__(self, *args, device_ids=options.pop("device_ids", None), dpool_options=options,
                                       **kwargs)

        made = _INSTALLED[cls] = type(cls.__name__, (DpoolTrainerMixin, cls), {
            "__module__": cls.__module__, "__qualname__": cls.__qualname__, "__init__": __init__})
    made._dpool_options = dict(options)  # type: ignore[attr-defined]
    return made


_INSTALLED: "weakref.WeakKeyDictionary[type, type]" = weakref.WeakKeyDictionary()


def _share_items(model: DataParallel, forward: Any) -> Any:
    """``forward`` that gives each shard its share of a ``num_items_in_batch`` keyword: the count reaches the
    model, which normalizes each shard's summed loss by it, and the mean of the shards' losses is then one
    process's loss (the Trainer's ``nn.DataParallel`` path divides by the GPU count the same way). A count
    that a ``compute_loss`` uses on the gathered outputs (TRL's ``SFTTrainer``, a token-mean trainer of
    one's own) is the Trainer's, unshared."""

    @functools.wraps(forward)
    def forward_sharing_items(*args: Any, **kwargs: Any) -> Any:
        count = kwargs.get("num_items_in_batch")
        if count is not None:
            tensors = [t for t in _pytree.tree_leaves((args, kwargs)) if torch.is_tensor(t) and t is not count]
            kwargs["num_items_in_batch"] = count / scatter.plan(tensors, len(model.device_ids), model.dim)[0]
        return forward(*args, **kwargs)

    return forward_sharing_items


class DpoolTrainer(DpoolTrainerMixin, Trainer):
    r"""A ``transformers.Trainer`` whose forwards run on dpool workers.

    Takes ``Trainer``'s arguments, plus ``device_ids`` and ``dpool_options``; see
    :class:`DpoolTrainerMixin` for what changes.

    Example::

        >>> args = TrainingArguments("out", use_cpu=True, per_device_train_batch_size=16)
        >>> trainer = DpoolTrainer(model=model, args=args, train_dataset=ds, device_ids=["cpu", "cpu"])
        >>> trainer.train()
        >>> trainer.save_model()     # AutoModel.from_pretrained("out") loads it
    """
