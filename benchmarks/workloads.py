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


class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock: two 3x3 convolutions, BatchNorm, a projected shortcut when the shape changes."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet18(nn.Module):
    """ResNet-18 in torchvision's layout (BasicBlock [2, 2, 2, 2], 1000 classes; torchvision is not a
    dependency): a real, compute-bound model."""

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        layers, inplanes = [], 64
        for planes, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers.append(nn.Sequential(BasicBlock(inplanes, planes, stride), BasicBlock(planes, planes)))
            inplanes = planes
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


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


def _images64(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 3, 64, 64, generator=g), torch.randint(0, 1000, (n,), generator=g)


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
    "resnet18": Workload("resnet18", ResNet18, _images64, 64),
}
