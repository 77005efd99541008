"""The step plan (dpool/step/plan.py): a forward like the previous one reuses its plan, and anything its
signature covers that changes builds a new one. A stale plan would give silently wrong numbers, so a
property test changes one covered thing at random between steps and checks every step against one
process: outputs, gradients (input gradients too), parameters after the step."""
from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch import nn

import dpool
from dpool.step.plan import FIELDS
from tests.helpers import sigkill

pytestmark = pytest.mark.timeout(300)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.act: nn.Module = nn.ReLU()
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.a(x.to(self.a.weight.dtype)))
        if self.training:  # (train/eval changes the numbers)
            h = h * 1.5
        return self.b(h)


def halve(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    return out * 0.5


CHANGES = ("batch", "dtype", "mode", "no_grad", "autocast", "freeze", "hook", "replace", "restart", "no_sync",
           "loss", "input_grad")


class World:
    """The dpool model and its one-process reference, changed alike."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.ref = Net()
        self.net = Net()
        self.net.load_state_dict(self.ref.state_dict())
        self.model = dpool.wrap(self.net, ["cpu", "cpu"], max_restarts=100, heartbeat_timeout_s=30.0)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.ref_opt = torch.optim.SGD(self.ref.parameters(), lr=0.05)
        self.batch, self.dtype, self.loss, self.input_grad = 8, torch.float32, "ce", False
        self.hooks: list = []
        self.restarts = 0
        self.forwards = 0

    def change(self, what: str, once: set[str]) -> None:
        """Change ``what`` for the next steps (``once``: what applies to the next step only)."""
        if what == "batch":
            self.batch = {8: 5, 5: 3, 3: 8}[self.batch]
        elif what == "dtype":
            self.dtype = torch.float64 if self.dtype == torch.float32 else torch.float32
        elif what == "mode":
            training = not self.net.training
            self.net.train(training)
            self.ref.train(training)
        elif what == "freeze":
            for m in (self.net, self.ref):
                m.b.bias.requires_grad_(not m.b.bias.requires_grad)
        elif what == "hook":
            if self.hooks:
                for h in self.hooks:
                    h.remove()
                self.hooks = []
            else:
                self.hooks = [m.act.register_forward_hook(halve) for m in (self.net, self.ref)]
        elif what == "replace":
            for h in self.hooks:
                h.remove()
            self.hooks = []
            kind = nn.ReLU if isinstance(self.net.act, nn.Tanh) else nn.Tanh
            self.net.act, self.ref.act = kind(), kind()
        elif what == "restart":
            sigkill(self.model.stats()["workers"][1]["pid"])
            once.add("restart")
        elif what == "loss":
            self.loss = "mse" if self.loss == "ce" else "ce"
        elif what == "input_grad":
            self.input_grad = not self.input_grad
        else:  # no_grad, autocast, no_sync: the next step only
            once.add(what)

    def criterion(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.loss == "ce":
            return nn.functional.cross_entropy(out.float(), y)
        return (out.float() ** 2).mean()

    def inputs(self, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(self.batch, 6, generator=gen).to(self.dtype)
        return x, torch.randint(0, 4, (self.batch,), generator=gen)

    def step(self, gen: torch.Generator, once: set[str]) -> None:
        """One step of each, from the same parameters, compared; the reference then takes dpool's values."""
        micro = [self.inputs(gen) for _ in range(2 if "no_sync" in once else 1)]
        grad = "no_grad" not in once
        autocast = (torch.autocast("cpu", torch.bfloat16) if "autocast" in once else contextlib.nullcontext())
        tol = dict(rtol=2e-2, atol=2e-2) if "autocast" in once else dict(rtol=1e-5, atol=1e-6)
        if "restart" in once:  # the killed worker is met by this step's forward, restarted, then it runs again
            with pytest.raises(dpool.WorkerDiedError, match="restarted and re-synced"):
                self.model(micro[0][0])
            self.restarts += 1
        self.opt.zero_grad()
        self.ref_opt.zero_grad()
        for i, (x, y) in enumerate(micro):
            xs = [x.clone().requires_grad_(self.input_grad and x.is_floating_point()) for _ in range(2)]
            sync = self.model.no_sync() if i < len(micro) - 1 else contextlib.nullcontext()
            with torch.set_grad_enabled(grad), autocast, sync:
                out = self.model(xs[0])
                self.forwards += 1
                ref_out = self.ref(xs[1])
                assert out.dtype == ref_out.dtype and out.shape == ref_out.shape
                torch.testing.assert_close(out, ref_out, **tol)
                if grad:
                    self.criterion(out, y).backward()
                    self.criterion(ref_out, y).backward()
            if grad and self.input_grad:
                torch.testing.assert_close(xs[0].grad, xs[1].grad, **tol)
        if not grad:
            return
        for (name, p), q in zip(self.net.named_parameters(), self.ref.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            if p.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, **tol, msg=lambda m: f"{name}: {m}")
        self.opt.step()
        self.ref_opt.step()
        for p, q in zip(self.net.parameters(), self.ref.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), **tol)
        with torch.no_grad():  # (an autocast step differs in its last bits: the next starts from one state)
            for p, q in zip(self.net.parameters(), self.ref.parameters()):
                q.copy_(p)


# (a restart costs a worker's start: drawn a twelfth as often as each other change)
DRAWN = tuple(c for c in CHANGES if c != "restart") * 6 + ("restart",)


@settings(max_examples=2, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(DRAWN), min_size=40, max_size=60), st.integers(0, 2 ** 31))
def test_a_random_change_between_steps_never_reuses_a_stale_plan(changes, seed):
    """40-60 steps; before each, one thing the signature covers changes at random (a batch size, a dtype,
    train/eval, no_grad, autocast, a frozen parameter, a hook, a submodule replaced, a restart, no_sync, the
    loss, inputs that require grad); every step equals one process's."""
    world = World()
    try:
        gen = torch.Generator().manual_seed(seed)
        for what in changes:
            once: set[str] = set()
            world.change(what, once)
            world.step(gen, once)
            world.step(gen, set())  # the same signature again: the plan's own step
        plan = world.model.stats()["plan"]
        # every forward ran a plan or built one (a forward that met a killed worker may have met it before);
        # at least the repeated steps after a lasting change ran one
        assert world.forwards <= plan["hits"] + plan["rebuilds"] <= world.forwards + world.restarts
        assert plan["hits"] >= len(changes) // 2 and plan["rebuilds"] >= 2
        assert plan["last_rebuild"] in FIELDS + ("first forward",)
    finally:
        for h in world.hooks:
            h.remove()
        world.model.close()


def test_stats_say_plan_hits_rebuilds_and_why(wrap):
    """The same step again runs the plan; each covered change builds one and is named."""
    net = Net()
    model = wrap(net)
    x = torch.randn(8, 6)
    for _ in range(3):
        model(x).sum().backward()
    assert model.stats()["plan"] == {"hits": 2, "rebuilds": 1, "last_rebuild": "first forward"}
    reasons = []
    for change in (lambda: torch.randn(5, 6), lambda: torch.randn(5, 6, dtype=torch.float64),
                   lambda: (net.eval(), torch.randn(5, 6, dtype=torch.float64))[1]):
        x = change()
        model(x)
        reasons.append(model.stats()["plan"]["last_rebuild"])
        model(x)
    with torch.no_grad():
        model(x)
        reasons.append(model.stats()["plan"]["last_rebuild"])
        net.b.bias.requires_grad_(False)
        model(x)
        reasons.append(model.stats()["plan"]["last_rebuild"])
        net.act = nn.Tanh().eval()
        model(x)
        reasons.append(model.stats()["plan"]["last_rebuild"])
    assert reasons == ["tensors", "tensors", "training", "grad", "requires_grad", "model"]
    assert model.stats()["plan"]["rebuilds"] == 7 and model.stats()["plan"]["hits"] == 5
