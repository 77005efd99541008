"""TRL's SFTTrainer with a PEFT LoRA adapter on dpool workers (DpoolTrainerMixin), against the same run in one
process. TRL normalizes the gathered per-token losses by the Trainer's ``num_items_in_batch`` itself."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("peft")
import datasets  # noqa: E402
from peft import LoraConfig, PeftModel  # noqa: E402
from tokenizers import Tokenizer, models as tokenizer_models  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

from dpool.integrations.transformers import DpoolTrainerMixin  # noqa: E402

pytestmark = pytest.mark.timeout(240)

_LLAMA = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=2, max_position_embeddings=32)


class DpoolSFTTrainer(DpoolTrainerMixin, SFTTrainer):
    """The recipe docs/integrations/transformers.md gives for TRL."""


def _tokenizer() -> PreTrainedTokenizerFast:
    vocab = {f"t{i}": i for i in range(64)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(tokenizer_models.WordLevel(vocab, unk_token="t0")),
                                   pad_token="t0", eos_token="t1", unk_token="t0")


def _dataset() -> datasets.Dataset:
    """Tokenized rows of different lengths: the shards hold different numbers of target tokens."""
    g = torch.Generator().manual_seed(1)
    return datasets.Dataset.from_list([{"input_ids": torch.randint(2, 64, (4 + i % 7,), generator=g).tolist()}
                                       for i in range(16)])


def test_sft_trainer_with_lora_equals_one_process(tmp_path):
    runs = {}
    for name, cls, extra in (("plain", SFTTrainer, {}), ("dpool", DpoolSFTTrainer, {"device_ids": ["cpu", "cpu"]})):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**_LLAMA))
        frozen = {n: p.detach().clone() for n, p in model.named_parameters()}
        # fp32 and SGD: the comparison is then exact up to the order of float sums (bf16 autocast, TRL's default,
        # and Adam's normalization of near-zero gradients amplify that order into visible differences)
        args = SFTConfig(str(tmp_path / name), use_cpu=True, bf16=False, optim="sgd", learning_rate=0.1,
                         per_device_train_batch_size=8 // len(extra.get("device_ids", [0])), max_steps=3,
                         logging_steps=1, report_to=[], save_strategy="no",
                         seed=0, disable_tqdm=True, max_length=16)
        trainer = cls(model=model, args=args, train_dataset=_dataset(), processing_class=_tokenizer(),
                      peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
                      **extra)
        trainer.train()
        trainer.save_model(str(tmp_path / name / "adapter"))
        runs[name] = (trainer, frozen)
    (ref, _), (trainer, frozen) = runs["plain"], runs["dpool"]
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (ref, trainer)]
    assert len(losses[1]) == 3 and losses[1] == pytest.approx(losses[0], rel=1e-5)  # (was 2.000× on 2 workers)
    lora = [(n, p) for n, p in trainer.model.named_parameters() if "lora_" in n]
    assert lora and all(p.requires_grad for _, p in lora)
    for (n, p), q in zip(trainer.model.named_parameters(), ref.model.parameters()):
        torch.testing.assert_close(p, q, msg=n, rtol=1e-4, atol=1e-6)
    base = trainer.model.get_base_model()
    for n, p in base.named_parameters():  # the frozen weights never moved
        if "lora_" not in n:
            torch.testing.assert_close(p, frozen[n.replace(".base_layer", "")], rtol=0, atol=0, msg=n)
    # the adapter saved by the dpool run loads with PEFT onto a fresh base model and computes the same
    torch.manual_seed(0)
    loaded = PeftModel.from_pretrained(LlamaForCausalLM(LlamaConfig(**_LLAMA)), str(tmp_path / "dpool" / "adapter"))
    ids = torch.randint(2, 64, (2, 6))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, trainer.model(input_ids=ids).logits)
