"""The step's decisions, each tested without a worker process: the plan's signature and its reuse, the slots'
generation, a forward's seed, the error hints and the warnings said once. (The stages that talk to workers are
tested end to end, against one process, by the rest of the suite.)"""
from __future__ import annotations

import warnings

import pytest
import torch

from dpool.errors import DpoolTypeError
from dpool.step import hints
from dpool.step.follow import Notices
from dpool.step.plan import FIELDS, Plan, Plans, signature
from dpool.step.state import SlotGen, StepState


def _signature(tensors=(torch.zeros(4, 3),), **change):
    """A forward's signature with every field at a plain value, ``change`` replacing some of them."""
    args = dict(spec=("tree", 1), grad=True, autocast=None, training=b"\x01", requires_grad=b"\x01", model=0,
                shares=None, buffers=False, no_sync=False, synced=False)
    args.update(change)
    return signature(args.pop("spec"), list(tensors), **args)


def _plan(key):
    return Plan(key=key, k=2, splits=[], rg=[], needs=[], gin_sizes=[], diff_idx=[], shapes=[], nbytes=0)


def test_the_signature_has_one_entry_per_field_and_equal_forwards_have_equal_signatures():
    assert len(_signature()) == len(FIELDS)
    assert _signature() == _signature(tensors=(torch.ones(4, 3),))  # values are not in it: only what the plan uses


@pytest.mark.parametrize("field, change", [
    ("structure", {"spec": ("tree", 2)}),
    ("tensors", {"tensors": (torch.zeros(5, 3),)}),
    ("tensors", {"tensors": (torch.zeros(4, 3, dtype=torch.float64),)}),
    ("tensors", {"tensors": (torch.zeros(4, 3, requires_grad=True),)}),
    ("grad", {"grad": False}),
    ("autocast", {"autocast": ["cpu", "bfloat16", True]}),
    ("training", {"training": b"\x00"}),
    ("requires_grad", {"requires_grad": b"\x00"}),
    ("model", {"model": 1}),
    ("shares", {"shares": [2.0, 1.0]}),
    ("buffers", {"buffers": True}),
    ("no_sync", {"no_sync": True}),
    ("synced", {"synced": True}),
])
def test_a_change_to_any_field_gives_another_signature_that_names_it(field, change):
    plans = Plans({"hits": 0, "rebuilds": 0, "last_rebuild": None})
    first = _signature()
    plans.keep(_plan(first))
    other = _signature(**change)
    assert other != first and plans.get(other) is None
    plans.keep(_plan(other))
    assert plans.counts["last_rebuild"] == field and plans.counts["rebuilds"] == 2


def test_a_plan_is_reused_only_for_its_own_signature_and_forgotten_at_a_close():
    plans = Plans({"hits": 0, "rebuilds": 0, "last_rebuild": None})
    key = _signature()
    assert plans.get(key) is None
    plan = _plan(key)
    plans.keep(plan)
    assert plans.counts["last_rebuild"] == "first forward"
    assert plans.get(_signature()) is plan and plans.get(_signature()) is plan and plans.counts["hits"] == 2
    plans.clear()
    assert plans.get(key) is None and plans.counts["hits"] == 2


def test_requires_grad_counts_in_the_signature_only_under_grad_mode():
    x = torch.zeros(4, 3, requires_grad=True)
    assert _signature(tensors=(x,), grad=False)[1] == _signature(grad=False)[1]


def test_an_input_dpool_cannot_transport_is_a_type_error_at_the_signature():
    with pytest.raises(DpoolTypeError, match="meta tensors have no data") as info:
        _signature(tensors=(torch.zeros(2, device="meta"),))
    assert isinstance(info.value, TypeError)


def test_the_slots_generation_invalidates_every_earlier_token():
    slots = SlotGen()
    token = slots.token()
    assert slots.valid(token)
    slots.bump("a backward round")
    assert not slots.valid(token) and slots.valid(slots.token()) and slots.reason == "a backward round"


def test_a_forwards_seed_repeats_under_the_same_seed_and_draws_nothing_from_the_scripts_generator():
    def seeds(state: StepState) -> list[int]:
        torch.manual_seed(7)
        before = torch.get_rng_state()
        drawn = [state.draw_seed() for _ in range(3)]
        assert torch.equal(torch.get_rng_state(), before)  # the script's random sequence is its own
        return drawn

    first = seeds(StepState(torch.float32, 0))
    assert len(set(first)) == 3 and all(0 <= s < 2**62 for s in first)
    assert seeds(StepState(torch.float32, 0)) == first
    torch.manual_seed(7)
    torch.rand(1)  # the script drew something: new numbers
    assert StepState(torch.float32, 0).draw_seed() not in first


class _Held:
    """A held forward as :class:`StepState` sees one (``f``: the forward it holds)."""

    def __init__(self) -> None:
        self.f = object()


def test_the_held_forward_is_deferred_taken_once_and_dropped_only_as_itself():
    state = StepState(torch.float32, 0)
    held = _Held()
    state.defer(held)
    state.drop_pending(object())  # another forward's drop leaves it
    assert state.pending is held
    assert state.take_pending() is held and state.pending is None
    assert state.take_pending() is None
    state.defer(held)
    state.drop_pending(held.f)
    assert state.pending is None
    state.defer(held)
    state.drop_pending()  # (close(): whichever it is)
    assert state.pending is None


def test_a_restart_spends_restarts_and_forgets_what_the_workers_were_sent():
    state = StepState(torch.float32, 3)
    state.sent_numerics_values(("float32",))
    state.sent_backend_flags((True,))
    state.begin_restart([1], 1)
    assert (state.restarting, state.restarts_left) == ([1], 2)
    state.begin_restart([0, 1], 1)  # another worker failed while it ran: one more restart spent
    assert (state.restarting, state.restarts_left) == ([0, 1], 1)
    state.forget_sent()
    state.end_restart()
    assert (state.restarting, state.sent_numerics, state.sent_flags) == (None, None, None)


def test_the_step_counter_advances_with_each_forward_and_new_requires_grad_flags_move_the_slots():
    state = StepState(torch.float32, 0)
    assert state.begin_forward([2, 2]) == 1 and state.begin_forward(None) == 2
    assert (state.progress.step, state.last_rows) == (2, None)
    assert state.begin_across() == 1 and state.progress.fseq == 1
    token = state.slots.token()
    state.sent_requires_grad_flags(b"\x01\x00")
    assert state.sent_requires_grad == b"\x01\x00" and not state.slots.valid(token)
    state.hold()
    assert state.workers_hold
    state.release()
    assert not state.workers_hold


def test_hints_name_what_a_failure_means_under_dpool():
    assert hints.names(["a", "b", "c", "d", "e"]) == "a, b, c and 2 more" and hints.names(["a"]) == "a"
    exc = ValueError("boom", 3)
    hints.amend(exc, "; more")
    assert type(exc) is ValueError and exc.args == ("boom; more", 3)
    bn = hints.worker_failure("Expected more than 1 value per channel when training, got input size [1, 4]",
                              "ValueError", [1, 1], [], [], ["cpu", "cpu"], False)
    assert "shards of [1, 1] rows" in bn and "drop_last=True" in bn
    resized = hints.worker_failure("the forward resized buffer 1 in place", "RuntimeError", None,
                                   ["bn.running_mean", "observer.scale"], [], ["cpu"], False)
    assert "; observer.scale" in resized and "before dpool.wrap()" in resized


def test_each_notice_is_said_once_per_name():
    notices = Notices()
    assert notices.new("attributes", ["a", "b"]) == ["a", "b"]
    assert notices.new("attributes", ["b", "c"]) == ["c"] and notices.new("relaid", ["b"]) == ["b"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        notices.global_hooks(["forward hook"])
        notices.global_hooks(["forward hook"])
    assert len(caught) == 1 and "global module hooks" in str(caught[0].message)
