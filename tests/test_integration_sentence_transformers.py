"""sentence-transformers' trainer with DpoolTrainerMixin: its loss keeps the model it is given
(``trainer.model_wrapped``), so that model must stay usable for the trainer's life and run on the workers."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("sentence_transformers")
import datasets  # noqa: E402
from sentence_transformers import (SentenceTransformer, SentenceTransformerTrainer,  # noqa: E402
                                   SentenceTransformerTrainingArguments, losses)
from sentence_transformers.sentence_transformer.modules import Pooling, Transformer  # noqa: E402
from transformers import BertConfig, BertModel, BertTokenizerFast  # noqa: E402

import dpool  # noqa: E402
from dpool.integrations.transformers import DpoolTrainerMixin  # noqa: E402

pytestmark = pytest.mark.timeout(240)


class DpoolSentenceTransformerTrainer(DpoolTrainerMixin, SentenceTransformerTrainer):
    pass


def _model(path) -> SentenceTransformer:
    """A tiny BERT and its tokenizer saved to ``path`` (nothing from a hub), as a SentenceTransformer."""
    if not (path / "config.json").exists():
        words = [f"w{i}" for i in range(40)]
        (path).mkdir(parents=True, exist_ok=True)
        (path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]))
        BertTokenizerFast(str(path / "vocab.txt")).save_pretrained(str(path))
        torch.manual_seed(0)
        BertModel(BertConfig(vocab_size=45, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                             intermediate_size=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                             max_position_embeddings=32)).save_pretrained(str(path))
    return SentenceTransformer(modules=[Transformer(str(path)), Pooling(16)], device="cpu")


def _pairs(n: int) -> datasets.Dataset:
    g = torch.Generator().manual_seed(2)

    def sentence() -> str:
        return " ".join(f"w{int(i)}" for i in torch.randint(0, 40, (int(torch.randint(3, 9, (1,), generator=g)),),
                                                             generator=g))

    return datasets.Dataset.from_list([{"anchor": sentence(), "positive": sentence()} for _ in range(n)])


def test_sentence_transformer_trainer_evaluates_and_trains_on_the_workers(tmp_path, monkeypatch):
    calls = []
    forward = dpool.DataParallel._forward
    monkeypatch.setattr(dpool.DataParallel, "_forward", lambda self, *a, **k: calls.append(1) or forward(self, *a, **k))
    train, evaluation = _pairs(32), _pairs(16)
    runs = {}
    for name, cls, extra in (("plain", SentenceTransformerTrainer, {}),
                             ("dpool", DpoolSentenceTransformerTrainer, {"device_ids": ["cpu", "cpu"]})):
        model = _model(tmp_path / "base")
        per_device = 8 // len(extra.get("device_ids", [0]))  # (a batch of 8 in both: 4 per worker for dpool's)
        args = SentenceTransformerTrainingArguments(
            str(tmp_path / name), use_cpu=True, per_device_train_batch_size=per_device,
            per_device_eval_batch_size=per_device,
            max_steps=4, learning_rate=0.05, optim="sgd", logging_steps=1, report_to=[], save_strategy="no", seed=0,
            disable_tqdm=True)
        trainer = cls(model=model, args=args, train_dataset=train, eval_dataset=evaluation,
                      loss=losses.MultipleNegativesRankingLoss(model), **extra)
        calls.clear()
        before = trainer.evaluate()
        evaluated_on_workers = len(calls)
        trainer.train()
        after = trainer.evaluate()  # (through the loss, which kept the dpool model since train())
        runs[name] = (model, trainer, before, after, evaluated_on_workers)
    (ref, ref_trainer, ref_before, ref_after, _), (model, trainer, before, after, on_workers) = runs["plain"], runs["dpool"]
    assert on_workers == 4  # 16 pairs, 8 a batch: 2 batches of an anchor and a positive forward each
    assert before["eval_loss"] == pytest.approx(ref_before["eval_loss"], rel=1e-5)
    losses_of = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (ref_trainer, trainer)]
    assert len(losses_of[1]) == 4 and losses_of[1] == pytest.approx(losses_of[0], rel=1e-5)
    assert after["eval_loss"] == pytest.approx(ref_after["eval_loss"], rel=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)
    assert dpool.is_wrapped(trainer.model_wrapped) and trainer.model_wrapped._runtime is None  # workers stopped
