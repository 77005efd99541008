"""Models the tests train, defined in an importable module (shipped to workers by reference)."""
from __future__ import annotations

import os
from collections import namedtuple

import torch
from torch import nn
import torch.nn.functional as F

Pair = namedtuple("Pair", ["logits", "features"])


class MLP(nn.Module):
    def __init__(self, d_in: int = 12, hidden: int = 32, d_out: int = 4, depth: int = 3) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        d = d_in
        for _ in range(depth):
            layers += [nn.Linear(d, hidden), nn.Tanh()]
            d = hidden
        layers.append(nn.Linear(d, d_out))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CNN(nn.Module):
    """A small CNN with BatchNorm (running statistics are buffers)."""

    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.head = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(x, 2)
        x = F.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean(dim=(2, 3)))


class LSTMTagger(nn.Module):
    def __init__(self, vocab: int = 20, emb: int = 8, hidden: int = 16, tags: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, emb)
        self.lstm = nn.LSTM(emb, hidden, batch_first=True)
        self.out = nn.Linear(hidden, tags)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.emb(tokens))
        return self.out(h)


class DictModel(nn.Module):
    """Dict input, keyword arguments, non-tensor arguments and a structured output."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 5)
        self.b = nn.Linear(4, 5)
        self.cls = nn.Linear(5, 3)

    def forward(self, batch: dict, *, scale: float = 1.0, extra: torch.Tensor | None = None,
                mode: str = "sum") -> dict:
        h = self.a(batch["x"]) + self.b(batch["y"][0])
        if mode == "sum" and extra is not None:
            h = h + extra
        h = torch.tanh(h) * scale
        return {"out": Pair(self.cls(h), h), "aux": [h.sum(dim=1), None], "n": batch["x"].shape[0]}


def make(name: str, dtype: torch.dtype = torch.float64, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = {"mlp": MLP, "cnn": CNN, "lstm": LSTMTagger, "dict": DictModel}[name]()
    return model.to(dtype)


def batch(name: str, n: int, dtype: torch.dtype = torch.float64, seed: int = 1) -> tuple[tuple, dict]:
    g = torch.Generator().manual_seed(seed)
    if name == "mlp":
        return (torch.randn(n, 12, generator=g, dtype=dtype),), {}
    if name == "cnn":
        return (torch.randn(n, 3, 8, 8, generator=g, dtype=dtype),), {}
    if name == "lstm":
        return (torch.randint(0, 20, (n, 7), generator=g),), {}
    if name == "dict":
        b = {"x": torch.randn(n, 6, generator=g, dtype=dtype),
             "y": (torch.randn(n, 4, generator=g, dtype=dtype), "tag")}
        return (b,), {"scale": 0.5, "extra": torch.randn(n, 5, generator=g, dtype=dtype), "mode": "sum"}
    raise KeyError(name)


def loss_of(name: str, out) -> torch.Tensor:
    if name == "dict":
        return out["out"].logits.pow(2).mean() + out["aux"][0].sum() * 0.1
    return out.pow(2).mean()


class Faulty(nn.Module):
    """A Linear layer whose forward can sleep, hit a device-side assert or run out of GPU memory (fault tests)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, mode: str = "") -> torch.Tensor:
        import time

        if mode == "sleep":
            time.sleep(4.0)
        elif mode == "assert":  # an out-of-range index: a device-side assert on a GPU
            x = x[torch.full((x.shape[0],), 10**7, device=x.device)]
        elif mode == "oom":
            torch.empty(1 << 52, dtype=torch.uint8, device=x.device)
        elif mode == f"die_in_copy:{os.getpid()}":  # this worker dies while its output copy is queued on the GPU
            _die_with_gpu_busy()
        out = self.lin(x)
        if mode == "sleep_backward" and out.requires_grad:
            out.register_hook(lambda g: (time.sleep(4.0), g)[1])
        if mode == f"die_in_grad_copy:{os.getpid()}" and out.requires_grad:  # ... its gradient copy
            out.register_hook(lambda g: (_die_with_gpu_busy(), g)[1])
        return out


def gpu_numerics(_model: nn.Module) -> tuple:
    """A replica's TF32/cuDNN settings, for ``worker_states`` (a function of a module: cloudpickle
    cannot ship a lambda that reads ``torch.backends.cudnn``, a module-like object it cannot pickle)."""
    return torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision()


def _die_with_gpu_busy() -> None:
    """Keep this process's GPU stream busy for ~1 s and SIGKILL the process 0.3 s from now: the work the
    worker queues next (copies into the coordinator's arenas) is still pending when it dies."""
    import signal
    import threading

    torch.cuda._sleep(2_000_000_000)  # clock cycles: about a second
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
