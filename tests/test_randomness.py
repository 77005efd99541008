"""Randomness: the same seed gives the same run, dpool leaves the user's random sequence alone, and generators
the model's code draws from (torch, Python, NumPy, its own) give each shard its own numbers."""
from __future__ import annotations

import random

from random import uniform as _py_uniform

import numpy
import torch
from torch import nn



class _Dropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.lin(x))


def _dropout_run(wrap, **kw) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = wrap(_Dropout(), **kw)
    outs = [model(torch.ones(8, 16)).detach() for _ in range(3)]
    model.close()
    return outs


def test_the_same_seed_gives_the_same_run(wrap):
    """Workers' generators are seeded from the coordinator's: torch.manual_seed makes dropout repeat."""
    a, b = _dropout_run(wrap), _dropout_run(wrap)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], a[1])  # each forward draws new masks
    assert not torch.equal(a[0][:4], a[0][4:])  # and the two shards draw different ones


def test_dpool_does_not_change_the_users_random_sequence(wrap):
    """Seeding the workers draws nothing from the script's generator: a shuffled DataLoader without a generator
    of its own yields the same batches epoch after epoch with dpool as without, so a model without randomness
    trains to the same parameters (SGD, 3 epochs)."""

    def run(use_dpool: bool):
        torch.manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(24, 6), torch.randn(24, 2))
        loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)
        net = nn.Linear(6, 2)
        model = wrap(net) if use_dpool else net
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        batches = []
        for _ in range(3):
            for x, y in loader:
                batches.append(x)
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
        return batches, [p.detach().clone() for p in net.parameters()], torch.rand(3)

    plain, pooled = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(plain[0], pooled[0]))
    for a, b in zip(plain[1], pooled[1]):
        torch.testing.assert_close(a, b)
    assert torch.equal(plain[2], pooled[2])  # and the generator is where the script left it


class _LayerDrop(nn.Module):
    """LayerDrop drawn from Python's and NumPy's global generators, as HF's data2vec-audio and MusicGen do."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(8))

    def forward(self, x):
        for layer in self.layers:
            if not (self.training and (random.random() < 0.3 or numpy.random.uniform(0, 1) < 0.3)):
                x = layer(x)
        return x


def test_python_and_numpy_randomness_in_the_models_code_repeats_under_the_same_seeds(wrap):
    """Each worker's Python and NumPy generators were seeded by the OS at its start, so a run whose forward
    draws from them (LayerDrop) did not repeat under `random.seed`, `numpy.random.seed` and
    `torch.manual_seed` (as `transformers.set_seed` does). They are now seeded per shard at each forward."""
    runs = []
    for _ in range(2):
        random.seed(0)
        numpy.random.seed(0)
        torch.manual_seed(0)
        model = wrap(_LayerDrop())
        runs.append(torch.stack([model(torch.ones(4, 4)).detach() for _ in range(4)]))
        model.close()
    assert torch.equal(*runs)
    assert len({tuple(out.flatten().tolist()) for out in runs[0]}) > 1  # (layers were dropped differently)


def _drop_half(x):
    return x if _py_uniform(0, 1) < 0.5 else x * 0


class _DropsThroughAHelper(nn.Linear):
    def forward(self, x):
        return _drop_half(super().forward(x))


def test_the_global_generators_a_models_code_draws_from_are_found():
    """Only models whose code names Python's or NumPy's global generator pay for seeding them per forward:
    found through `random.x()`, `numpy.random.x()`, a function imported from `random`, and the functions
    the methods call."""
    from dpool_workers.randomness import global_streams_used

    assert global_streams_used(_LayerDrop()) == (True, True)
    assert global_streams_used(nn.Sequential(_DropsThroughAHelper(4, 4))) == (True, False)
    assert global_streams_used(nn.Sequential(nn.Linear(4, 4), nn.Dropout(), nn.TransformerEncoderLayer(8, 2))) == (
        False, False)


class _Noise(nn.Module):
    """Noise from generators the model holds: torch's, Python's and NumPy's."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.gen = torch.Generator().manual_seed(0)
        self.rng = random.Random(0)
        self.np_rng = numpy.random.default_rng(0)

    def forward(self, x):
        rows = [[self.rng.random(), self.np_rng.random()] for _ in range(len(x))]
        return self.lin(x) + torch.randn(x.shape, generator=self.gen), torch.tensor(rows)


def test_generators_the_model_holds_give_each_shard_its_own_numbers(wrap):
    """Every worker holds a copy of each generator in the same state, so each shard drew the same numbers as
    the others: the batch's rows came in identical groups, which one process never gives. Each shard
    now seeds its copies from the forward's draw, as its default generator."""
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        model = wrap(_Noise())
        x = torch.zeros(8, 16)
        runs.append([torch.cat([out - model.module.lin(x), other], 1).detach()
                     for out, other in (model(x) for _ in range(2))])
        model.close()
    (a, b), (a2, b2) = runs
    for cols, what in ((slice(0, 16), "torch.Generator"), (16, "random.Random"), (17, "numpy's Generator")):
        assert not torch.allclose(a[:4, cols], a[4:, cols]), f"the two shards drew the same numbers from {what}"
        assert not torch.allclose(a[:, cols], b[:, cols]), what  # each forward draws new numbers
    assert torch.equal(a, a2) and torch.equal(b, b2)  # and the same seed repeats them
    assert abs(float(a[:, :16].std()) - 1) < 0.3
