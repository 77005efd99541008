"""HF Trainer with DpoolTrainer: a tiny BERT classifier, built from a config (no download).

    python examples/integrations/hf_trainer.py      # needs: pip install -e ".[transformers]"

The workers are the Trainer's devices: one per GPU on a GPU machine, one per physical core on a CPU one
(or with use_cpu=True). device_ids=[...] chooses them yourself.
"""
import tempfile

import torch
from transformers import AutoModelForSequenceClassification, BertConfig, TrainingArguments

from dpool.integrations.transformers import DpoolTrainer

config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=64, num_labels=2)
model = AutoModelForSequenceClassification.from_config(config)
g = torch.Generator().manual_seed(0)
data = [{"input_ids": torch.randint(0, 100, (16,), generator=g), "label": i % 2} for i in range(64)]

with tempfile.TemporaryDirectory() as out:
    # 8 rows per worker a step (16 on two workers), as the Trainer's own DataParallel counts the batch
    args = TrainingArguments(out, per_device_train_batch_size=8, num_train_epochs=2,
                             gradient_accumulation_steps=2, logging_steps=2, report_to=[], disable_tqdm=True)
    trainer = DpoolTrainer(model=model, args=args, train_dataset=data, eval_dataset=data[:16])
    trainer.train()                      # the forwards run on the workers
    print(trainer.evaluate())            # the workers start again, and stop when it returns
    trainer.save_model(out + "/final")   # the bare model's keys
    AutoModelForSequenceClassification.from_pretrained(out + "/final")
