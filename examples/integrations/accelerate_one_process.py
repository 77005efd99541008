"""accelerate in one process with a dpool model: prepare, unwrap_model, save_state/load_state.

    python examples/integrations/accelerate_one_process.py      # needs: pip install -e ".[accelerate]"

The workers go where the accelerator puts the model: one per GPU on a GPU machine, one per physical core on a
CPU one or with Accelerator(cpu=True). A multi-process run (accelerate launch --num_processes 2) would put DDP
around dpool; prepare() refuses it.
"""
import tempfile

import torch
from accelerate import Accelerator
from torch import nn

import dpool

accelerator = Accelerator()
net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)).to(accelerator.device)
optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)  # from the bare module's parameters
data = torch.utils.data.TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
model, optimizer, loader = accelerator.prepare(dpool.wrap(net), optimizer,
                                               torch.utils.data.DataLoader(data, batch_size=32))
for x, y in loader:
    optimizer.zero_grad()
    accelerator.backward(nn.functional.mse_loss(model(x), y))
    optimizer.step()
assert accelerator.unwrap_model(model) is net
with tempfile.TemporaryDirectory() as d:
    accelerator.save_state(d)
    accelerator.load_state(d)
with torch.no_grad():
    x, y = (t.to(accelerator.device) for t in data.tensors)
    print("loss", nn.functional.mse_loss(model(x), y).item())
model.close()
