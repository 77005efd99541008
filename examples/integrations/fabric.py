"""Lightning Fabric with DpoolStrategy: your loop, the model's forward on two CPU workers.

    python examples/integrations/fabric.py      # needs: pip install -e ".[lightning]"
"""
import lightning as L
import torch
from torch import nn

from dpool.integrations.lightning import DpoolStrategy

fabric = L.Fabric(accelerator="cpu", strategy=DpoolStrategy(device_ids=["cpu", "cpu"]))
net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.05))
data = torch.utils.data.TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
for step, (x, y) in enumerate(torch.utils.data.DataLoader(data, batch_size=16)):
    last = step % 2 == 1  # two micro-batches per optimizer step
    with fabric.no_backward_sync(model, enabled=not last):  # gradients held on the workers
        fabric.backward(nn.functional.mse_loss(model(x), y) / 2)
    if last:
        optimizer.step()
        optimizer.zero_grad()
with torch.no_grad():
    print("loss", nn.functional.mse_loss(model(data.tensors[0]), data.tensors[1]).item())
fabric.strategy.teardown()  # stops the workers (they also stop at exit)
