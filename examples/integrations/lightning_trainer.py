"""Lightning's Trainer with DpoolStrategy: training_step here, the module's forward on the workers.

    python examples/integrations/lightning_trainer.py      # needs: pip install -e ".[lightning]"

The workers are the Trainer's devices: devices=2 gives two GPUs on a GPU machine and two CPU workers on a
CPU one (accelerator="gpu" or "cpu" chooses). DpoolStrategy(device_ids=[...]) chooses them yourself.
"""
import tempfile

import lightning as L
import torch
from torch import nn

from dpool.integrations.lightning import DpoolStrategy


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x):
        return self.net(x)  # runs on the workers

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)  # self(x): the workers; the rest runs here
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


data = torch.utils.data.TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
with tempfile.TemporaryDirectory() as root:
    trainer = L.Trainer(strategy=DpoolStrategy(), devices=2, max_epochs=2, accumulate_grad_batches=2,
                        default_root_dir=root, logger=False, enable_progress_bar=False)
    trainer.fit(Regressor(), torch.utils.data.DataLoader(data, batch_size=32))
    Regressor.load_from_checkpoint(trainer.checkpoint_callback.best_model_path)  # the plain class
    print("train_loss", float(trainer.callback_metrics["train_loss"]))
