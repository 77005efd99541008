"""Lightning Fabric with DpoolStrategy: your loop, the model's forward on the workers.

    python examples/integrations/fabric.py      # needs: pip install -e ".[lightning]"

The workers are Fabric's devices: devices=2 gives two GPUs on a GPU machine and two CPU workers on a CPU one.
"""
import lightning as L
import torch
from torch import nn

from dpool.integrations.lightning import DpoolStrategy

fabric = L.Fabric(strategy=DpoolStrategy(), devices=2)
net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.05))
data = torch.utils.data.TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
for step, (x, y) in enumerate(fabric.setup_dataloaders(torch.utils.data.DataLoader(data, batch_size=16))):
    last = step % 2 == 1  # two micro-batches per optimizer step
    with fabric.no_backward_sync(model, enabled=not last):  # gradients held on the workers
        fabric.backward(nn.functional.mse_loss(model(x), y) / 2)
    if last:
        optimizer.step()
        optimizer.zero_grad()
with torch.no_grad():
    x, y = fabric.to_device(data.tensors)
    print("loss", nn.functional.mse_loss(model(x), y).item())
fabric.strategy.teardown()  # stops the workers (they also stop at exit)
