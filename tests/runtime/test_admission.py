"""Admission, driven from the test's one thread with a hand clock: the queue bound, timeouts,
cancellation and the latency target. Every query gets exactly one answer; a dropped one never runs."""
from __future__ import annotations

from typing import Sequence

import pytest

from dvabatch_backend import ArrivalPlan, RuntimeSettings, Scheduler, run_until_idle
from dvabatch_backend.runtime.admission import STANDING_SECONDS, STANDING_WAIT, Admission, ServiceModel
from dvabatch_backend.runtime.decisions import BatchTableView, New, Policy, QueryInfo
from dvabatch_backend.runtime.errors import (CancelledError, OverloadedError, QueueFullError, StandingQueueError,
                                             TimeoutExpiredError)
from dvabatch_backend.runtime.settings import QueuePolicy, SloPolicy
from policies import create_policy

import numpy as np

from ..conftest import Collector, assert_matches_reference


class HandClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class HoldPolicy(Policy):
    """Batches nothing until `release` is set; asks to be called again meanwhile."""

    name = "hold"

    def __init__(self) -> None:
        self.release = False
        self.inner = create_policy("pipelined")

    def bind(self, context) -> None:
        super().bind(context)
        self.inner.bind(context)

    def on_arrival(self, waiting: Sequence[QueryInfo], table: BatchTableView, now: float) -> ArrivalPlan:
        return self.inner.on_arrival(waiting, table, now) if self.release else ArrivalPlan((), wake_at=now + 1.0)


def _scheduler(model, clock, policy=None, **settings) -> Scheduler:
    return Scheduler(model.manifest, policy or create_policy("pipelined"), RuntimeSettings(bs_max=4, **settings),
                     clock=clock)


def _submit(scheduler, model, collector, n: int, seed: int = 0, timeout_us: int | None = None):
    rng = np.random.default_rng(seed)
    queries = [model.query(rng) for _ in range(n)]
    ids = [scheduler.submit_many([(q, collector)], timeout_us=timeout_us)[0] for q in queries]
    return ids, queries


def test_the_queue_bound_refuses_with_tritons_wording_and_loses_nothing(zoo) -> None:
    model = zoo.stages("token", 2)
    clock, collector = HandClock(), Collector()
    scheduler = _scheduler(model, clock, queue=QueuePolicy(max_queue_size=5))
    ids, queries = _submit(scheduler, model, collector, 8)

    refused = [qid for qid in ids if qid in collector.answers]  # answered before anything ran
    assert refused == ids[:3]  # the oldest, pushed out by the newer ones (admission.py says why)
    assert all(isinstance(collector.one(q).error, QueueFullError) for q in refused)
    assert "Exceeds maximum queue size" in str(collector.one(refused[0]).error)
    assert scheduler.stats.queued == 5 and scheduler.stats.queue_full == 3

    run_until_idle(scheduler, model.engines())
    assert scheduler.stats.queued == 0
    for qid, inputs in zip(ids, queries):
        if qid not in refused:
            assert_matches_reference(model, inputs, collector.one(qid))
    assert len(collector.answers) == 8  # each exactly once (Collector fails on a second answer)
    # room again: a new query is admitted
    more, _ = _submit(scheduler, model, collector, 1, seed=1)
    run_until_idle(scheduler, model.engines())
    assert collector.one(more[0]).ok


class FirstBatchPolicy(HoldPolicy):
    """Batches the first two queries at once, then holds the rest until `release` is set."""

    name = "first-batch"

    def __init__(self) -> None:
        super().__init__()
        self.batched = False

    def on_arrival(self, waiting: Sequence[QueryInfo], table: BatchTableView, now: float) -> ArrivalPlan:
        if not self.batched and len(waiting) >= 2:
            self.batched = True
            return ArrivalPlan((New(tuple(q.id for q in waiting[:2])),), wake_at=now + 1.0)
        return super().on_arrival(waiting, table, now)


def test_the_bound_pushes_out_waiting_requests_before_a_batch_the_policy_made(zoo) -> None:
    """A batch made but not yet started, queued less than STANDING_WAIT, is about to run: pushing
    out its rows would run the backlog in hollowed batches (a row or two), so the oldest *waiting*
    requests go first (on a hand clock that never moves: every query is fresh)."""
    model = zoo.stages("token", 2)
    collector, policy = Collector(), FirstBatchPolicy()
    scheduler = _scheduler(model, HandClock(), policy, queue=QueuePolicy(max_queue_size=5))
    batched, _ = _submit(scheduler, model, collector, 2)
    waiting, _ = _submit(scheduler, model, collector, 3, seed=1)
    newer, _ = _submit(scheduler, model, collector, 2, seed=2)  # 7 > 5: two rows must go
    assert [q for q in batched + waiting + newer if q in collector.answers] == waiting[:2]
    assert all(isinstance(collector.one(q).error, QueueFullError) for q in waiting[:2])
    policy.release = True
    run_until_idle(scheduler, model.engines())
    assert all(collector.one(q).ok for q in batched + waiting[2:] + newer)
    assert scheduler.stats.queue_full == 2 and len(collector.answers) == 7


def test_a_batch_queued_past_the_standing_wait_is_pushed_out_by_age(zoo) -> None:
    """Batched rows that have queued longer than STANDING_WAIT wait behind other batches: they go by
    age, as waiting ones do, so that a deep stage-0 queue cannot hold them whole for seconds."""
    model = zoo.stages("token", 2)
    clock, collector, policy = HandClock(), Collector(), FirstBatchPolicy()
    scheduler = _scheduler(model, clock, policy, queue=QueuePolicy(max_queue_size=5))
    batched, _ = _submit(scheduler, model, collector, 2)
    clock.now += STANDING_WAIT * 1.5
    waiting, _ = _submit(scheduler, model, collector, 3, seed=1)
    newer, _ = _submit(scheduler, model, collector, 2, seed=2)
    assert [q for q in batched + waiting + newer if q in collector.answers] == batched
    policy.release = True
    clock.now += 2.0  # past the wake-up the policy asked for: it is called again
    scheduler.on_window()
    run_until_idle(scheduler, model.engines())
    assert all(collector.one(q).ok for q in waiting + newer) and len(collector.answers) == 7


def test_a_multi_row_request_is_admitted_or_refused_whole(zoo) -> None:
    model = zoo.stages("token", 2)
    collector = Collector()
    scheduler = _scheduler(model, HandClock(), queue=QueuePolicy(max_queue_size=4))
    rng = np.random.default_rng(2)
    first = scheduler.submit_many([(model.query(rng), collector) for _ in range(3)])
    second = scheduler.submit_many([(model.query(rng), collector) for _ in range(2)])  # 3 + 2 > 4
    # room for the second takes one row, and the first is pushed out whole, not one row of it
    assert all(isinstance(collector.one(q).error, QueueFullError) for q in first)
    too_big = scheduler.submit_many([(model.query(rng), collector) for _ in range(5)])  # past the bound alone
    assert all(isinstance(collector.one(q).error, QueueFullError) for q in too_big)
    run_until_idle(scheduler, model.engines())
    assert all(collector.one(q).ok for q in second)
    assert scheduler.stats.queue_full == 8


def test_a_queue_that_stands_refuses_what_waited_and_a_burst_is_served_whole(zoo) -> None:
    """The standing-queue rule (admission.py), on a hand clock, bs_max 4, the policy holding what
    waits: a few queries (a batch or less) held past STANDING_SECONDS, and a burst over a batch held
    past STANDING_WAIT but not STANDING_SECONDS, are all served; a queue over a batch for
    STANDING_SECONDS has those queued past STANDING_WAIT refused "Request timeout expired", and the
    fresh ones run. A configured bound is the user's: no such refusal."""
    model = zoo.stages("token", 2)
    clock, collector = HandClock(), Collector()
    policy = HoldPolicy()
    scheduler = _scheduler(model, clock, policy)

    def held_for(n: int, seconds: float, seed: int) -> list[int]:
        policy.release = False
        ids, _ = _submit(scheduler, model, collector, n, seed=seed)
        clock.now += seconds
        return ids

    def release() -> None:
        policy.release = True
        clock.now = max(clock.now, scheduler.wake_at or clock.now)  # the policy's wake-up: it batches them
        scheduler.on_window()
        run_until_idle(scheduler, model.engines())

    few = held_for(4, STANDING_SECONDS + 1.0, seed=0)
    release()
    burst = held_for(6, (STANDING_WAIT + STANDING_SECONDS) / 2, seed=1)
    release()
    assert all(collector.one(q).ok for q in few + burst)

    old = held_for(6, STANDING_SECONDS + 0.1, seed=2)
    fresh, _ = _submit(scheduler, model, collector, 2, seed=3)  # its dispatch drops the old ones
    for q in old:
        assert isinstance(collector.one(q).error, StandingQueueError), collector.one(q).error
        assert "Request timeout expired" in str(collector.one(q).error)
    assert scheduler.stats.timed_out == 6
    release()
    assert all(collector.one(q).ok for q in fresh)

    configured, answers = _scheduler(model, clock, HoldPolicy(), queue=QueuePolicy(max_queue_size=100)), Collector()
    kept, _ = _submit(configured, model, answers, 6, seed=4)
    clock.now += STANDING_SECONDS + 0.1
    _submit(configured, model, answers, 1, seed=5)
    assert not answers.answers and configured.stats.queued == 7


def test_queries_past_their_timeout_are_dropped_before_any_stage_runs_them(zoo) -> None:
    model = zoo.stages("token", 2)
    clock, collector = HandClock(), Collector()
    scheduler = _scheduler(model, clock)
    late, _ = _submit(scheduler, model, collector, 3, timeout_us=1000)
    fine, fine_inputs = _submit(scheduler, model, collector, 2, seed=3)  # no timeout
    clock.now += 0.002

    run_until_idle(scheduler, model.engines())

    for qid in late:
        error = collector.one(qid).error
        assert isinstance(error, TimeoutExpiredError) and "Request timeout expired" in str(error)
    for qid, inputs in zip(fine, fine_inputs):
        assert_matches_reference(model, inputs, collector.one(qid))
    assert scheduler.stats.timed_out == 3
    assert scheduler.stats.stages[0].rows == 2  # the late ones never ran


def test_the_default_timeout_applies_and_delay_runs_late_queries(zoo) -> None:
    model = zoo.stages("token", 2)
    for action, expect_ok in (("reject", False), ("delay", True)):
        clock, collector = HandClock(), Collector()
        queue = QueuePolicy(default_timeout_us=500, allow_timeout_override=False, timeout_action=action)
        scheduler = _scheduler(model, clock, queue=queue)
        ids, _ = _submit(scheduler, model, collector, 2, timeout_us=10_000_000)  # override not allowed
        clock.now += 0.001
        run_until_idle(scheduler, model.engines())
        assert [collector.one(q).ok for q in ids] == [expect_ok] * 2, action


def test_waiting_queries_time_out_from_the_batch_window(zoo) -> None:
    model = zoo.stages("token", 2)
    clock, collector, policy = HandClock(), Collector(), HoldPolicy()
    scheduler = _scheduler(model, clock, policy=policy)
    ids, _ = _submit(scheduler, model, collector, 2, timeout_us=1000)
    assert scheduler.wake_at is not None and scheduler.wake_at <= clock.now + 0.001 + 1e-9  # the deadline wakes it
    clock.now += 0.002
    scheduler.on_window()
    assert all(isinstance(collector.one(q).error, TimeoutExpiredError) for q in ids)
    assert scheduler.pending_count == 0 and scheduler.stats.stages[0].batches == 0


def test_cancelled_queries_never_run_and_the_others_are_answered(zoo) -> None:
    model = zoo.stages("token", 3)
    clock, collector, policy = HandClock(), Collector(), HoldPolicy()
    scheduler = _scheduler(model, clock, policy=policy)
    waiting, _ = _submit(scheduler, model, collector, 2)
    scheduler.cancel(waiting[:1])  # waiting: answered at once
    assert isinstance(collector.one(waiting[0]).error, CancelledError)

    policy.release = True
    batched, inputs = _submit(scheduler, model, collector, 4, seed=5)  # batched at once with the waiting one
    assert scheduler.queries.any_queued(batched)
    scheduler.cancel(batched[:2])  # batched, not started: dropped when stage 0 reaches the batch
    run_until_idle(scheduler, model.engines())

    assert all(isinstance(collector.one(q).error, CancelledError) for q in batched[:2])
    for qid, query in zip(batched[2:], inputs[2:]):
        assert_matches_reference(model, query, collector.one(qid))
    assert collector.one(waiting[1]).ok
    assert scheduler.stats.cancelled == 3 and scheduler.stats.stages[0].rows == 3
    assert not scheduler.queries.any_queued(batched)


def test_a_query_that_cannot_meet_the_latency_target_is_refused_at_once(zoo) -> None:
    model = zoo.stages("token", 2)
    collector = Collector()
    scheduler = _scheduler(model, HandClock(), slo=SloPolicy(slo_ms=1e-6))  # no stage is that fast
    ids, _ = _submit(scheduler, model, collector, 2)
    error = collector.one(ids[0]).error
    assert isinstance(error, OverloadedError) and "overloaded: cannot meet" in str(error)
    assert scheduler.stats.slo_rejected == 2 and scheduler.pending_count == 0

    clock, collector = HandClock(), Collector()
    late = _scheduler(model, clock, slo=SloPolicy(slo_ms=1e-6, action="serve_late"))
    ids, inputs = _submit(late, model, collector, 2, seed=7)
    clock.now += 0.001
    run_until_idle(late, model.engines())
    for qid, query in zip(ids, inputs):
        assert_matches_reference(model, query, collector.one(qid))
    assert late.stats.answered_ok == 2 and late.stats.within_slo == 0  # served, but not goodput


def test_goodput_counts_results_within_the_target(zoo) -> None:
    model = zoo.stages("token", 2)
    clock, collector = HandClock(), Collector()
    scheduler = _scheduler(model, clock, slo=SloPolicy(slo_ms=50))
    ids, _ = _submit(scheduler, model, collector, 3)
    run_until_idle(scheduler, model.engines())  # the hand clock stands still: every answer is in time
    assert scheduler.stats.within_slo == 3 == scheduler.stats.answered_ok


def test_the_service_model_interpolates_the_profile_and_learns_a_correction() -> None:
    service = ServiceModel([{1: 0.001, 4: 0.004}, {1: 0.002, 4: 0.002}], 2)
    assert service.stage_time(0, 2) == pytest.approx(0.002)
    assert service.stage_time(1, 8) == pytest.approx(0.004)  # beyond the profile: per row of the largest
    assert service.peak_rate(4) == pytest.approx(1000.0)
    for _ in range(200):
        service.observe(0, 4, 0.008)  # twice the profile
    assert service.correction == pytest.approx(2.0, rel=0.01)


def test_a_backlogs_batches_stop_at_the_efficient_size_with_one_pair_and_a_long_passage() -> None:
    # per row: 100, 80, 75, 72.5 ms: 4 rows are within 5 % of the least
    service = ServiceModel([{1: 0.100, 2: 0.160, 4: 0.300, 8: 0.580}], 1)
    assert service.efficient_batch(8, 0.05) == 4 and service.efficient_batch(2, 0.05) == 2
    assert Admission(QueuePolicy(), SloPolicy(), service, 8, overlapping=False).backlog_batch == 4
    assert Admission(QueuePolicy(), SloPolicy(), service, 8, overlapping=True).backlog_batch == 8  # stages overlap
    quick = ServiceModel([{1: 0.0010, 2: 0.0016, 4: 0.0030, 8: 0.0058}], 1)  # a bs_max batch passes in 6 ms
    assert Admission(QueuePolicy(), SloPolicy(), quick, 8, overlapping=False).backlog_batch == 8


def test_a_full_calls_batches_stop_where_no_length_gains_from_a_larger_one() -> None:
    """`call_batch` and a backlog's `backlog_batch`: the largest of the efficient sizes over the
    profiled lengths (a long length's rows are at their least at 2, a short one's gain up to 8),
    where the batch-size profile alone says 2. A quick bs_max batch: not capped."""
    long_rows = {1: 0.100, 2: 0.160, 4: 0.320, 8: 0.640}  # at 2 rows, 80 ms each from then on
    short_rows = {1: 0.010, 2: 0.016, 4: 0.024, 8: 0.040}  # 10, 8, 6, 5 ms a row
    service = ServiceModel([long_rows], 1, by_length={64: [long_rows], 8: [short_rows]})
    assert service.efficient_batch(8, 0.05) == 2 and service.efficient_batch(8, 0.05, every_length=True) == 8
    admission = Admission(QueuePolicy(), SloPolicy(), service, 8, overlapping=False)
    assert admission.call_batch == 8 and admission.backlog_batch == 8
    quick = ServiceModel([{1: 0.0010, 2: 0.0016, 4: 0.0030, 8: 0.0058}], 1)
    assert Admission(QueuePolicy(), SloPolicy(), quick, 8, overlapping=False).call_batch == 8
    capped = ServiceModel([long_rows], 1)
    assert Admission(QueuePolicy(), SloPolicy(), capped, 8, overlapping=False).call_batch == 2


def test_a_backlog_is_carried_out_in_batches_of_the_efficient_size(zoo) -> None:
    """With more than a batch queued, a policy's `New` of bs_max is carried out as batches of
    `backlog_batch` (set by hand here: the test model's profile is too quick for one), every answer
    the model's; with a batch or less queued, as one batch."""
    model = zoo.stages("token", 2)
    clock, collector = HandClock(), Collector()
    policy = HoldPolicy()
    scheduler = _scheduler(model, clock, policy)  # bs_max 4, one buffer pair
    scheduler.admission.backlog_batch = 2
    ids, queries = _submit(scheduler, model, collector, 6)  # 6 queued > bs_max: a backlog
    policy.release = True
    clock.now += 1.0  # the policy's wake-up
    scheduler.on_window()  # the pipelined policy: a New of 4; then 2 are left, a batch or less
    assert scheduler.stats.new == 3  # 4 as 2 + 2, then the 2 left as one
    run_until_idle(scheduler, model.engines())
    for qid, inputs in zip(ids, queries):
        assert_matches_reference(model, inputs, collector.one(qid))
    assert scheduler.stats.stages[0].batches == 3


def test_the_door_opens_on_a_standing_queue_by_the_wait_it_makes_and_closes_when_idle() -> None:
    """The door rule (admission.py): refuses nothing until the queue has stood STANDING_SECONDS;
    then refuses an arrival that would wait past STANDING_WAIT at the backlog's rate (which follows
    the measured correction), admits one that would not, and stays shut, the queue short or not,
    until an arrival finds the pipeline idle. A configured bound is the user's: no door."""
    service = ServiceModel([{1: 0.050, 4: 0.200}, {1: 0.050, 4: 0.200}], 2)
    admission = Admission(QueuePolicy(), SloPolicy(), service, 4, overlapping=False)
    assert admission.backlog_rate() == pytest.approx(10.0)  # one pair: 4 rows through both stages in 0.4 s
    deep = 6  # 0.6 s of work
    stood = 10.0 - STANDING_SECONDS - 0.1
    assert admission.door_refusal(10.0, deep, None, idle=False) is None  # no more than a batch queued
    assert admission.door_refusal(10.0, deep, 10.0 - STANDING_SECONDS / 2, idle=False) is None  # a burst
    why = admission.door_refusal(10.0, deep, stood, idle=False)
    assert why is not None and why.startswith("Exceeds maximum queue size") and admission.door_since == 10.0
    assert admission.door_refusal(10.1, 4, stood, idle=False) is None  # 0.4 s: within the wait
    service.correction = 2.0  # the stages take twice their profile now
    assert admission.door_refusal(10.2, 4, None, idle=False) is not None  # 0.8 s; shut though the queue is short
    assert admission.door_refusal(10.3, 0, None, idle=True) is None and admission.door_since is None
    assert admission.door_refusal(10.4, deep * 2, None, idle=False) is None  # open again
    configured = Admission(QueuePolicy(max_queue_size=100), SloPolicy(), service, 4, overlapping=False)
    assert configured.door_refusal(10.0, 99, stood, idle=False) is None


def test_the_door_refuses_unread_arrivals_and_submitted_ones_once_a_queue_stood(zoo) -> None:
    """`Scheduler.refuse_at_door` (the Triton adapter asks it before reading a call's requests) and
    `submit_many` apply the door alike: a refusal each, named by a query id of its own, counted as
    the queue bound's; the queries queued meanwhile are the standing rule's; once the pipeline
    holds nothing the door opens and a query is served."""
    model = zoo.stages("token", 2)
    clock, collector = HandClock(), Collector()
    policy = HoldPolicy()
    scheduler = _scheduler(model, clock, policy)  # bs_max 4
    scheduler.admission.service.correction = 1e4  # stages this slow make a few queued rows a long wait
    held, _ = _submit(scheduler, model, collector, 6)  # more than a batch, held by the policy
    assert scheduler.refuse_at_door(2) == []  # not standing yet: a burst
    clock.now += STANDING_SECONDS + 0.1
    refused = scheduler.refuse_at_door(2)
    assert [type(e) for e in refused] == [QueueFullError] * 2 and len({e.query_id for e in refused}) == 2
    assert all("Exceeds maximum queue size" in str(e) for e in refused)
    late, _ = _submit(scheduler, model, collector, 1, seed=1)  # submitted all the same: refused alike
    assert isinstance(collector.one(late[0]).error, QueueFullError)
    assert scheduler.stats.queue_full == 3 and scheduler.stats.submitted == 6 + 2 + 1
    assert all(isinstance(collector.one(q).error, StandingQueueError) for q in held)  # waited past STANDING_WAIT
    assert scheduler.refuse_at_door(1) == [] and scheduler.admission.door_since is None  # idle: open
    scheduler.admission.service.correction = 1.0
    policy.release = True
    fresh, queries = _submit(scheduler, model, collector, 1, seed=2)
    run_until_idle(scheduler, model.engines())
    assert_matches_reference(model, queries[0], collector.one(fresh[0]))


def test_the_default_queue_bound_is_about_a_second_at_the_pipelines_peak() -> None:
    service = ServiceModel([{8: 0.010}, {8: 0.020}], 2)  # slowest stage: 8 rows per 20 ms -> 400/s
    assert Admission(QueuePolicy(), SloPolicy(), service, 8).max_queue_size == 400
    assert Admission(QueuePolicy(max_queue_size=0), SloPolicy(), service, 8).queue_refusal(10**6, 1) is None
    # one buffer pair: one batch at a time through both stages, 8 rows per 30 ms
    assert Admission(QueuePolicy(), SloPolicy(), service, 8, overlapping=False).max_queue_size == 267
    slow = ServiceModel([{8: 4.0}], 1)
    assert Admission(QueuePolicy(), SloPolicy(), slow, 8).max_queue_size == 16  # never below two batches
    budgets = Admission(QueuePolicy(), SloPolicy(slo_ms=90), service, 8).stage_budgets()
    assert budgets == pytest.approx([0.030, 0.060])


def test_the_correction_compares_with_the_profile_at_the_batchs_length() -> None:
    service = ServiceModel([{8: 0.008}], 1, by_length={16: [{8: 0.002}], 128: [{8: 0.008}]})
    admission = Admission(QueuePolicy(), SloPolicy(), service, 8)
    assert admission.max_queue_size == 1000  # 8 rows per 8 ms at the longest length, for a second
    for _ in range(300):
        service.observe(0, 8, 0.004, length=10)  # short batches: twice their length's profile (shared cores)
    assert service.correction == pytest.approx(2.0, rel=0.01)
    assert service.pipeline_time(8) == pytest.approx(0.016, rel=0.01)  # the target's predictions use it
    assert admission.max_queue_size == 1000  # the bound stays the profile's
