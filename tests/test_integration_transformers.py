"""HF Trainer on dpool workers (DpoolTrainer), against the same run of the plain Trainer in one process."""
from __future__ import annotations

import psutil
import pytest
import torch

pytest.importorskip("transformers")
from transformers import (BertConfig, BertForSequenceClassification, LlamaConfig, LlamaForCausalLM,  # noqa: E402
                          Trainer, TrainingArguments)

import dpool  # noqa: E402
from dpool.integrations.transformers import DpoolTrainer  # noqa: E402

pytestmark = pytest.mark.timeout(240)

_BERT = dict(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3, max_position_embeddings=16)


def _classification_data(n: int = 32) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    # "label" is renamed by the collator; "note" is a column the model does not take: the Trainer drops it
    # by the forward's signature (with the wrapper's old (*inputs, **kwargs), it dropped every column)
    return [{"input_ids": torch.randint(0, 50, (8,), generator=g), "attention_mask": torch.ones(8, dtype=torch.long),
             "label": int(torch.randint(0, 3, (1,), generator=g)), "note": "unused"} for _ in range(n)]


def _args(out, workers: int = 1, **kw) -> TrainingArguments:
    """Batches of 8 rows: per device, for one process; 8 // workers per worker for a DpoolTrainer, whose batch is
    the per-device size times its workers (as the Trainer's nn.DataParallel path computes it)."""
    base = dict(use_cpu=True, per_device_train_batch_size=8 // workers, per_device_eval_batch_size=8 // workers,
                max_steps=4,
                learning_rate=1e-2, gradient_accumulation_steps=2, logging_steps=1, report_to=[], save_strategy="no",
                seed=0, dataloader_drop_last=True, disable_tqdm=True)
    base.update(kw)
    return TrainingArguments(str(out), **base)


def _losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _assert_same_parameters(a: torch.nn.Module, b: torch.nn.Module, **tol) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, msg=name, **tol)


def _workers_gone(pids) -> bool:
    return not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)


def test_dpool_trainer_trains_evaluates_and_saves_like_the_trainer(tmp_path, monkeypatch):
    data = _classification_data()
    runs = {}
    held = []  # the micro-batches run inside no_sync() (the parity below holds without it: this says it is used)
    no_sync = dpool.DataParallel.no_sync
    monkeypatch.setattr(dpool.DataParallel, "no_sync", lambda self: held.append(1) or no_sync(self))
    for name, cls, extra in (("plain", Trainer, {}), ("dpool", DpoolTrainer, {"device_ids": ["cpu", "cpu"]})):
        torch.manual_seed(0)
        model = BertForSequenceClassification(BertConfig(**_BERT))
        trainer = cls(model=model, args=_args(tmp_path / name, workers=len(extra.get("device_ids", [0]))),
                      train_dataset=data, eval_dataset=data[:16], **extra)
        trainer.train()
        runs[name] = (model, trainer, trainer.evaluate(), trainer.predict(data[:16]))
    (ref, ref_trainer, ref_eval, ref_pred), (model, trainer, evaluation, pred) = runs["plain"], runs["dpool"]
    assert trainer.model is model and dpool.is_wrapped(trainer.model_wrapped)
    # the batch per step is per device x workers (8 rows, as the plain run's), as the Trainer's DataParallel has it
    assert trainer.args.train_batch_size == trainer.args.eval_batch_size == 8 == ref_trainer.args.train_batch_size
    assert trainer.args.per_device_train_batch_size == 4 and trainer.state.global_step == 4
    assert trainer.model_wrapped.config is model.config  # (the module's attributes through the wrapper)
    assert _losses(trainer) == pytest.approx(_losses(ref_trainer), rel=1e-5) and len(_losses(trainer)) == 4
    assert len(held) == 4  # gradient_accumulation_steps=2: the first of each step's two micro-batches
    _assert_same_parameters(model, ref)
    assert evaluation["eval_loss"] == pytest.approx(ref_eval["eval_loss"], rel=1e-5)
    torch.testing.assert_close(torch.as_tensor(pred.predictions), torch.as_tensor(ref_pred.predictions))
    # the workers stop when train()/evaluate()/predict() return
    pids = trainer.model_wrapped.pids or [0]
    assert trainer.model_wrapped._runtime is None and _workers_gone(pids)
    # save_model() holds the bare model's keys: from_pretrained loads the trained weights
    trainer.save_model(str(tmp_path / "saved"))
    loaded = BertForSequenceClassification.from_pretrained(str(tmp_path / "saved"))
    _assert_same_parameters(loaded, model, rtol=0, atol=0)


def _lm_data(n: int = 16) -> list[dict]:
    """Causal-LM rows padded to different lengths (labels -100 there), so the shards hold different numbers
    of target tokens: a loss normalized by num_items_in_batch is then wrong unless each shard gets its share."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(n):
        ids = torch.randint(1, 64, (10,), generator=g)
        labels = ids.clone()
        labels[10 - (i % 7):] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def test_a_loss_normalized_by_the_items_in_the_batch_equals_one_process(tmp_path):
    cfg = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=2, max_position_embeddings=16)
    models, trainers = {}, {}
    for name, cls, extra in (("plain", Trainer, {}), ("dpool", DpoolTrainer, {"device_ids": ["cpu", "cpu"]})):
        torch.manual_seed(0)
        models[name] = LlamaForCausalLM(LlamaConfig(**cfg))
        trainers[name] = cls(model=models[name], args=_args(tmp_path / name, len(extra.get("device_ids", [0])),
                                                            max_steps=3), train_dataset=_lm_data(),
                             **extra)
        trainers[name].train()
    assert trainers["plain"].model_accepts_loss_kwargs  # (the path under test)
    assert _losses(trainers["dpool"]) == pytest.approx(_losses(trainers["plain"]), rel=1e-5)
    _assert_same_parameters(models["dpool"], models["plain"])


def test_resume_from_checkpoint_continues_the_same_run(tmp_path):
    data = _classification_data()
    args = dict(workers=2, max_steps=4, save_strategy="steps", save_steps=2)
    torch.manual_seed(0)
    whole = BertForSequenceClassification(BertConfig(**_BERT))
    DpoolTrainer(model=whole, args=_args(tmp_path / "whole", **args), train_dataset=data,
                 device_ids=["cpu", "cpu"]).train()
    torch.manual_seed(0)
    first = BertForSequenceClassification(BertConfig(**_BERT))
    DpoolTrainer(model=first, args=_args(tmp_path / "cut", **args), train_dataset=data,
                 device_ids=["cpu", "cpu"]).train()
    torch.manual_seed(1)  # another start: everything must come from the checkpoint
    resumed = BertForSequenceClassification(BertConfig(**_BERT))
    DpoolTrainer(model=resumed, args=_args(tmp_path / "cut", **args), train_dataset=data,
                 device_ids=["cpu", "cpu"]).train(resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-2"))
    _assert_same_parameters(resumed, whole)


def test_bf16_autocast_reaches_the_workers(tmp_path):
    data = _classification_data()
    losses = {}
    for name, cls, kw in (("plain-bf16", Trainer, {"bf16": True}), ("dpool-bf16", DpoolTrainer, {"bf16": True}),
                          ("dpool-fp32", DpoolTrainer, {})):
        torch.manual_seed(0)
        model = BertForSequenceClassification(BertConfig(**_BERT))
        extra = {"device_ids": ["cpu", "cpu"]} if cls is DpoolTrainer else {}
        trainer = cls(model=model, args=_args(tmp_path / name, len(extra.get("device_ids", [0])), **kw),
                      train_dataset=data, **extra)
        trainer.train()
        losses[name] = _losses(trainer)
    assert losses["dpool-bf16"] == pytest.approx(losses["plain-bf16"], rel=2e-3)
    assert losses["dpool-bf16"] != pytest.approx(losses["dpool-fp32"], rel=1e-5)  # (the workers did use bf16)


def test_a_wrapped_model_is_refused_at_construction(tmp_path):
    """DpoolTrainer wraps the model itself; one wrapped already (DataParallel, dpool) would be wrapped twice.
    (DeepSpeed, FSDP and multi-process launches: tests/test_integration_accelerate.py, under torchrun.)"""
    model = BertForSequenceClassification(BertConfig(**_BERT))
    with pytest.raises(dpool.UnsupportedError, match="pass the bare model"):
        DpoolTrainer(model=torch.nn.DataParallel(model), args=_args(tmp_path))
    with dpool.wrap(model, ["cpu", "cpu"]) as wrapped:
        with pytest.raises(dpool.UnsupportedError, match="pass the bare model"):
            DpoolTrainer(model=wrapped, args=_args(tmp_path))


def test_the_workers_stop_when_the_trainer_is_collected(tmp_path):
    """A trainer dropped with its pool open (an exception out of a callback, a notebook cell run again)."""
    import gc

    model = BertForSequenceClassification(BertConfig(**_BERT))
    trainer = DpoolTrainer(model=model, args=_args(tmp_path), device_ids=["cpu", "cpu"])
    pids = trainer._wrap_model(trainer.model).pids  # what train() and evaluate() open first
    assert len(pids) == 2 and not _workers_gone(pids)
    del trainer
    gc.collect()
    assert _workers_gone(pids)


def _sum_over_items_trainer(base):
    """A Trainer subclass that normalizes the gathered logits' summed loss by ``num_items_in_batch`` itself,
    as TRL's SFTTrainer and hand-written token-mean trainers do."""

    class SumOverItems(base):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            outputs = model(**inputs)
            logits = outputs.logits[:, :-1].reshape(-1, outputs.logits.shape[-1])
            loss = torch.nn.functional.cross_entropy(logits.float(), labels[:, 1:].reshape(-1), reduction="sum",
                                                     ignore_index=-100) / num_items_in_batch
            return (loss, outputs) if return_outputs else loss

    return SumOverItems


def test_a_compute_loss_normalized_by_the_items_in_the_batch_gets_the_whole_count(tmp_path):
    """The count is shared out only where it reaches the model's forward: a compute_loss that divides the gathered
    outputs' sum by it gets the Trainer's count, and its logged losses and parameters equal one process's."""
    from dpool.integrations.transformers import DpoolTrainerMixin

    cfg = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=2, max_position_embeddings=16)
    models, trainers = {}, {}
    plain = _sum_over_items_trainer(Trainer)
    for name, cls, extra in (("plain", plain, {}),
                             ("dpool", type("Mixed", (DpoolTrainerMixin, plain), {}), {"device_ids": ["cpu", "cpu"]})):
        torch.manual_seed(0)
        models[name] = LlamaForCausalLM(LlamaConfig(**cfg))
        trainers[name] = cls(model=models[name], args=_args(tmp_path / name, len(extra.get("device_ids", [0])),
                                                            max_steps=3), train_dataset=_lm_data(),
                             **extra)
        trainers[name].train()
    assert trainers["plain"].model_accepts_loss_kwargs  # (the Trainer counts the items)
    assert _losses(trainers["dpool"]) == pytest.approx(_losses(trainers["plain"]), rel=1e-5)
    _assert_same_parameters(models["dpool"], models["plain"])


def test_model_wrapped_stays_usable_and_every_evaluation_runs_on_the_workers(tmp_path, monkeypatch):
    """trainer.model_wrapped is one dpool model for the trainer's life: a forward through it after train()
    starts its workers again; evaluate() before train() runs its forwards on the workers too."""
    data = _classification_data()
    calls = []
    forward = dpool.DataParallel._forward
    monkeypatch.setattr(dpool.DataParallel, "_forward", lambda self, *a, **k: calls.append(1) or forward(self, *a, **k))
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(**_BERT))
    trainer = DpoolTrainer(model=model, args=_args(tmp_path, workers=2), train_dataset=data, eval_dataset=data[:16],
                           device_ids=["cpu", "cpu"])
    before = trainer.evaluate()
    assert len(calls) == 2 and dpool.is_wrapped(trainer.model_wrapped)  # 16 rows, 8 a batch: on the workers
    wrapped = trainer.model_wrapped
    trainer.train()
    assert trainer.model_wrapped is wrapped and wrapped._runtime is None  # the workers stopped with train()
    batch = {"input_ids": torch.stack([r["input_ids"] for r in data[:4]]),
             "attention_mask": torch.stack([r["attention_mask"] for r in data[:4]])}
    with torch.no_grad():
        out = trainer.model_wrapped(**batch).logits
        torch.testing.assert_close(out, model(**batch).logits)
    after = trainer.evaluate()
    assert after["eval_loss"] != before["eval_loss"]
    trainer._dpool.close()
