"""Benchmark workloads: models, synthetic batches and losses (nothing is downloaded)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
import torch.nn.functional as F


class MLP(nn.Module):
    """8 Linear(256, 256) layers: many small ops, dispatch-bound."""

    def __init__(self, width: int = 256, depth: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())])
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(x))


class SmallCNN(nn.Module):
    """Three conv blocks with BatchNorm on 3x32x32 images: compute-bound."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        )
        self.head = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


class LSTMClassifier(nn.Module):
    """Embedding + 1-layer LSTM over 32 steps: sequential."""

    def __init__(self, vocab: int = 1000, emb: int = 64, hidden: int = 128, classes: int = 10) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, emb)
        self.lstm = nn.LSTM(emb, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.emb(tokens))
        return self.head(h[:, -1])


class Tiny(nn.Module):
    """Overhead probe: one Linear(8, 8) on a batch of 16; compute is negligible."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


@dataclass
class Workload:
    name: str
    make: Callable[[], nn.Module]
    batch: Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    global_batch: int
    lr: float = 0.01

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, y)


def _images(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)


def _vectors(width: int) -> Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]:
    def make(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, width, generator=g), torch.randint(0, min(width, 10), (n,), generator=g)

    return make


def _tokens(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 1000, (n, 32), generator=g), torch.randint(0, 10, (n,), generator=g)


WORKLOADS = {
    "mlp": Workload("mlp", MLP, _vectors(256), 512),
    "cnn": Workload("cnn", SmallCNN, _images, 512),
    "lstm": Workload("lstm", LSTMClassifier, _tokens, 256),
    "probe": Workload("probe", Tiny, _vectors(8), 16),
}
