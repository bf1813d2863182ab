"""The load hold (runtime/load_hold.py): no hold from a lone client or at low load, a hold near the
knee that makes the next batch the one the load needs, and one that stays once it works.

Deterministic: calls fed with made-up times and run lengths (no clock read, no sleep).
"""
from __future__ import annotations

import pytest

from dvabatch_backend.runtime.cost import StageCost
from dvabatch_backend.runtime.load_hold import MIN_CALLS, WINDOW, LoadHold

# one stage: 1 s for one row, 2 s for 16 (linear between): a row in a batch of x costs (14 + x) / 15x s
ECONOMY = StageCost([{1: 1.0, 16: 2.0}], 1)
NO_ECONOMY = StageCost([{1: 1.0, 16: 16.0}], 1)  # a batch costs its rows: batching saves nothing


def fed(cost: StageCost, calls: int, rows: int, gap: float, run: float, held: float = 0.0,
        **options: float) -> tuple[LoadHold, float]:
    """A hold that saw `calls` calls of `rows` rows, one every `gap` s, each held `held` s (as it
    decided or not) and run for `run` s; and the time of the next call."""
    hold = LoadHold(cost, 16, **options)
    for k in range(calls):
        hold.record(k * gap, rows, held, run)
    return hold, calls * gap


def test_near_the_knee_the_hold_makes_the_next_batch_the_one_the_load_needs() -> None:
    # 4 rows a second in calls of 4, the instance running 95 % of the time: kappa = 0.95 / T(4) =
    # 0.79; busy at x rows a call = 4 * 0.79 * (14 + x) / 15x, first <= 0.8 at x = 6 (x = 5: 0.802);
    # 6 rows take 1.5 s to arrive, the calls' cycle is 1 s: hold 0.5 s (under the run of 6, 1.06 s)
    hold, now = fed(ECONOMY, WINDOW, rows=4, gap=1.0, run=0.95)
    assert hold.hold(4, now) == pytest.approx(0.5)


def test_a_hold_that_works_stays() -> None:
    # the same load held as above: calls of 6 rows every 1.5 s, 0.5 s of it held. The cycle without
    # the hold is still 1 s, so the hold is still 0.5 s (it does not switch itself off once batches grew)
    hold, now = fed(ECONOMY, WINDOW, rows=6, gap=1.5, run=0.95 * 20 / 18, held=0.5)
    assert hold.hold(6, now) == pytest.approx(0.5)


def test_the_hold_is_at_most_the_run_it_pays_for() -> None:
    # held to a tenth busy, no batch gets there: the cheapest row's, 16. Calls of 2 a second, each
    # run 0.99 s (kappa = 0.99 / T(2) = 0.93): 16 rows take 8 s to arrive, a run of 16 takes
    # kappa * T(16) = 1.86 s, and the hold is that
    hold, now = fed(ECONOMY, WINDOW, rows=2, gap=1.0, run=0.99, target_busy=0.1)
    assert hold.hold(2, now) == pytest.approx(0.99 / (1 + 1 / 15) * 2.0)


def test_a_lone_client_is_never_held() -> None:
    # one row a call, the instance busy nearly all the time (a client that sends when answered):
    # nobody would arrive during a hold
    hold, now = fed(ECONOMY, WINDOW, rows=1, gap=1.0, run=0.99)
    assert hold.hold(1, now) == 0.0


def test_no_hold_at_low_load() -> None:
    # calls of 2 rows, the instance busy a fifth of the time: batches form as they are
    hold, now = fed(ECONOMY, WINDOW, rows=2, gap=5.0, run=1.0)
    assert hold.hold(2, now) == 0.0


def test_no_hold_where_batching_saves_nothing() -> None:
    hold, now = fed(NO_ECONOMY, WINDOW, rows=4, gap=4.0, run=3.8)  # 95 % busy
    assert hold.hold(4, now) == 0.0


def test_no_hold_before_enough_calls_or_without_a_profile() -> None:
    hold, now = fed(ECONOMY, MIN_CALLS - 1, rows=4, gap=1.0, run=0.95)
    assert hold.hold(4, now) == 0.0
    unprofiled = StageCost([], 1)
    hold, now = fed(unprofiled, WINDOW, rows=4, gap=1.0, run=0.95)
    assert not hold.available and hold.hold(4, now) == 0.0


def test_the_window_forgets_old_calls() -> None:
    # a quiet past then a window's worth of knee load: the hold sees only the knee
    hold, now = fed(ECONOMY, WINDOW, rows=1, gap=10.0, run=1.0)
    for k in range(WINDOW):
        hold.record(now + k, 4, 0.0, 0.95)
    assert hold.hold(4, now + WINDOW) == pytest.approx(0.5)


def test_a_call_is_recorded_with_the_hold_it_was_given() -> None:
    hold, now = fed(ECONOMY, WINDOW, rows=4, gap=1.0, run=0.95)
    seconds = hold.hold(4, now)
    hold.ran(0.95)
    hold.ran(5.0)  # a second report for the same call is not a call
    assert hold._calls[-1] == pytest.approx((now, 4, 0.95, 1.2, seconds))  # noqa: SLF001
