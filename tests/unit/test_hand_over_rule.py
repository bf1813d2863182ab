"""When `execute` runs a call's step itself and when it hands the call to the engine loop
(`engine_loop.hands_over`), and the measured cost of a hand-over (`HandOverCost`), on a fake clock."""
from __future__ import annotations

import pytest

from dvabatch_backend.runtime.engine_loop import HandOverCost, hands_over


@pytest.mark.parametrize("requests", [1, 2, 8])
def test_work_in_flight_hands_every_call_over(requests: int) -> None:
    assert hands_over(idle=False, requests=requests, service_s=1e-6, handover_s=1.0)


def test_a_lone_request_at_an_idle_loop_runs_on_its_callers_thread() -> None:
    assert not hands_over(idle=True, requests=1, service_s=1.0, handover_s=1e-6)
    assert not hands_over(idle=True, requests=1, service_s=1.0, handover_s=None)


def test_requests_that_met_go_over_where_their_batch_outlasts_a_hand_over() -> None:
    assert hands_over(idle=True, requests=3, service_s=2e-3, handover_s=1e-4)
    assert not hands_over(idle=True, requests=3, service_s=1e-4, handover_s=2e-3)  # a hand-over costs more
    assert hands_over(idle=True, requests=3, service_s=1e-4, handover_s=None)  # not measured yet: measure it


def test_the_cost_is_the_wake_of_an_idle_loop_averaged() -> None:
    cost = HandOverCost()
    cost.stepped(5.0)  # a step nobody woke it for (its window passed): no sample
    assert cost.seconds is None
    cost.woken(10.0)
    cost.woken(10.5)  # a second wake-up before the step: the first counts
    cost.stepped(11.0)
    assert cost.seconds == pytest.approx(1.0)
    cost.woken(20.0)
    cost.stepped(20.0)
    assert cost.seconds == pytest.approx(1.0 - HandOverCost.WEIGHT)
