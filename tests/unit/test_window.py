"""The adaptive batch window (policies/window.py) and the input policy that uses it: no wait while
stage 0 is idle, a wait that grows with the queue behind stage 0, never past the paper's window.

Deterministic: hand-made tables and queries, the policy called with made-up times (no clock read).
"""
from __future__ import annotations

import random

import pytest

from dvabatch_backend.runtime.decisions import QueryInfo
from policies.input_diversity import InputDiversityPolicy
from policies.window import AdaptiveWindow, Stage0Time, stage0_backlog

from .test_policies import MS, Table, bound, context, covered, queries

# stage 0 takes 1 ms per query (flat per-query time), every stage alike; bs_max 8: the paper's
# window (stage 0 at bs_max) is 8 ms
LINEAR = [{1: 1 * MS, 2: 2 * MS, 4: 4 * MS, 8: 8 * MS}] * 4
UPPER = 8 * MS


def adaptive_input(**ctx: object) -> InputDiversityPolicy:
    policy = bound(InputDiversityPolicy(), stage_times=LINEAR, **ctx)
    assert isinstance(policy, InputDiversityPolicy) and policy.adaptive is not None
    return policy


def busy_table(rows: int = 2) -> Table:
    """A batch that stage 0 has not finished: stage 0 is busy."""
    table = Table()
    table.new(rows)
    return table


def test_backlog_counts_rows_stage0_has_still_to_run() -> None:
    table = Table()
    assert stage0_backlog(table.view) == 0
    done_at_stage0 = table.new(3)
    table.table.get(done_at_stage0).status_map[0] = 3  # in later stages only
    assert stage0_backlog(table.view) == 0
    table.new(2)
    assert stage0_backlog(table.view) == 2


def test_low_load_nothing_in_flight_no_wait() -> None:
    policy = adaptive_input()
    for now in (0.0, 0.5, 7.25):
        plan = policy.on_arrival(queries([5], arrival=now), Table().view, now=now)
        assert covered(plan) == [100] and plan.wake_at is None


def test_no_wait_while_stage0_is_idle_even_with_later_stages_busy() -> None:
    policy = adaptive_input()
    table = Table()
    batch = table.new(4)
    table.table.get(batch).status_map[0] = 4  # through stage 0, running later stages
    plan = policy.on_arrival(queries([5, 6]), table.view, now=0.0)
    assert covered(plan) == [100, 101] and plan.wake_at is None


def test_waits_while_stage0_is_busy_and_goes_when_it_is_idle() -> None:
    policy = adaptive_input()
    waiting = queries([5], arrival=1.0)
    held = policy.on_arrival(waiting, busy_table().view, now=1.0)
    assert held.decisions == () and held.wake_at is not None and 1.0 < held.wake_at <= 1.0 + UPPER
    went = policy.on_arrival(waiting, Table().view, now=1.0005)  # stage 0 got idle
    assert covered(went) == [100] and went.wake_at is None


def test_the_window_grows_with_the_queue_but_never_past_the_upper_bound() -> None:
    window = AdaptiveWindow.from_context(context(stage_times=LINEAR), UPPER)
    table = busy_table()
    oldest = QueryInfo(1, 5, 0.0)
    waits = []
    for k in range(6):  # a batch of 2 released to a busy stage 0 every 0.5 ms
        now = k * 0.5 * MS
        window.released(2, 5, now)
        waits.append(window.go_at([oldest], table.view, now) - oldest.arrival)
    assert waits == sorted(waits) and waits[0] < waits[-1]  # grows with the queued rows
    assert waits[0] == pytest.approx(2 * MS)  # stage 0's time for what is queued
    assert max(waits) == pytest.approx(UPPER)  # 12 ms of queued rows, bounded by the paper's window
    # stage 0 idle again: no wait, and the clock starts over
    assert window.go_at([oldest], Table().view, now=20 * MS) == 20 * MS
    assert window.go_at([QueryInfo(2, 5, 20 * MS)], table.view, now=20 * MS) == pytest.approx(21 * MS)  # a recheck


def test_with_one_pair_the_upper_bound_is_a_batchs_passage_at_bs_max() -> None:
    """One buffer pair: the entry is busy while a batch passes every stage, so the paper's window
    (stage 0's time at bs_max) is read as the entry's: here 4 stages of 8 ms. Held that long, the
    queries that arrive behind a batch form the next one, instead of a batch each in stage 0's queue."""
    serial = AdaptiveWindow.from_context(context(stage_times=LINEAR, num_buffer_pairs=1), UPPER)
    assert serial.serial and serial.upper == pytest.approx(4 * UPPER)
    assert AdaptiveWindow.from_context(context(stage_times=LINEAR), UPPER).upper == pytest.approx(UPPER)
    assert AdaptiveWindow.from_context(context(num_buffer_pairs=1), 0.0).upper == 0.0  # no profile: no wait
    table = busy_table()
    serial.released(8, 5, 0.0)  # the entry is expected free after the batch's passage: 32 ms
    assert serial.go_at([QueryInfo(1, 5, 0.0)], table.view, now=1 * MS) == pytest.approx(4 * UPPER)


def test_stage0_slower_than_its_profile_is_looked_at_again_within_the_bound() -> None:
    window = AdaptiveWindow.from_context(context(stage_times=LINEAR), UPPER)
    assert window.recheck == pytest.approx(1 * MS)  # stage 0 at one query
    table = busy_table()
    window.released(2, 5, 0.0)  # the clock says free at 2 ms; stage 0 is still busy at 3 ms
    assert window.go_at([QueryInfo(1, 5, 0.0)], table.view, now=3 * MS) == pytest.approx(4 * MS)
    assert window.go_at([QueryInfo(1, 5, 0.0)], table.view, now=7.5 * MS) == pytest.approx(UPPER)


def test_stage0_time_reads_the_per_length_profile() -> None:
    by_length = {16: [{1: 1 * MS, 8: 4 * MS}] * 4, 64: [{1: 3 * MS, 8: 12 * MS}] * 4}
    stage0 = Stage0Time(context(stage_times=LINEAR, stage_times_by_length=by_length))
    assert stage0.seconds(1, 16) == pytest.approx(1 * MS)
    assert stage0.seconds(8, 40) == pytest.approx(8 * MS)  # halfway between 4 and 12 ms
    assert stage0.seconds(1, 128) == pytest.approx(6 * MS)  # proportional beyond the longest
    assert Stage0Time(context(stage_times=LINEAR)).seconds(4, 100) == pytest.approx(4 * MS)  # reference only
    assert not Stage0Time(context()).available


def test_without_a_profile_or_with_window_0_nothing_waits() -> None:
    for policy in (bound(InputDiversityPolicy()), bound(InputDiversityPolicy(window=0), stage_times=LINEAR)):
        plan = policy.on_arrival(queries([5, 9]), busy_table().view, now=0.0)
        assert covered(plan) == [100, 101] and plan.wake_at is None


def test_queries_behind_a_released_batch_wait_until_stage0_is_expected_free() -> None:
    policy = adaptive_input()
    first = policy.on_arrival(queries([5, 5, 5]), Table().view, now=0.0)
    assert covered(first) == [100, 101, 102]  # stage 0 idle: at once; it now has 3 ms of work
    table = busy_table(3)
    later = policy.on_arrival(queries([5], arrival=0.5 * MS, first_id=200), table.view, now=0.5 * MS)
    assert later.decisions == () and later.wake_at == pytest.approx(3 * MS)


def test_random_views_never_wait_past_the_bound_nor_ask_for_the_past() -> None:
    rng = random.Random(11)
    policy = adaptive_input()
    for _ in range(500):
        table = Table()
        for _ in range(rng.randint(0, 2)):
            batch = table.new(rng.randint(1, 3))
            if rng.random() < 0.5:
                table.table.get(batch).status_map[0] = table.table.get(batch).bs
        waiting = [QueryInfo(i, rng.randint(1, 12), rng.uniform(0, 0.01)) for i in range(rng.randint(1, 6))]
        now = max(q.arrival for q in waiting) + rng.uniform(0, 0.01)
        plan = policy.on_arrival(waiting, table.view, now)
        if stage0_backlog(table.view) == 0 and table.view.queries_in_flight() + len(waiting) <= 8:
            assert len(covered(plan)) == len(waiting)  # stage 0 idle: no wait
        if plan.wake_at is not None:
            assert now < plan.wake_at <= min(q.arrival for q in waiting) + UPPER + 1e-12


def test_with_one_buffer_pair_the_entry_is_busy_while_any_batch_is_in_flight() -> None:
    """One pair: a batch past stage 0 still holds the only pair, so a query arriving meanwhile is
    held (its batch would wait in stage 0's queue anyway), for the batch's time through every stage
    within the upper bound; with two pairs stage 0 is free and it goes at once."""
    from dataclasses import replace

    table = Table()
    batch = table.new(4)
    table.table.get(batch).status_map[0] = 4  # through stage 0, running later stages
    arrival = QueryInfo(1, 5, 0.0)
    serial = AdaptiveWindow.from_context(replace(context(stage_times=LINEAR), num_buffer_pairs=1), UPPER)
    overlapping = AdaptiveWindow.from_context(context(stage_times=LINEAR), UPPER)
    assert serial.serial and not overlapping.serial
    assert overlapping.go_at([arrival], table.view, now=0.0) == 0.0
    assert serial.go_at([arrival], table.view, now=0.0) == pytest.approx(1 * MS)  # a recheck: stage 0 at one query
    serial.released(2, 5, 0.0)  # a batch of 2 through all 4 stages: 8 ms
    assert serial.go_at([arrival], table.view, now=0.0) == pytest.approx(8 * MS)
    assert serial.go_at([arrival], Table().view, now=0.5 * MS) == 0.5 * MS  # nothing in flight: at once
