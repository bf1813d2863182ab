"""Admission, driven from the test's one thread with a hand clock: the one rule (the wait ahead
against the bound, the deadline and the latency target), timeouts, cancellation. Every query gets
exactly one answer; a dropped one never runs."""
from __future__ import annotations

from typing import Sequence

import pytest

from dvabatch_backend import ArrivalPlan, RuntimeSettings, Scheduler, run_until_idle
from dvabatch_backend.runtime.admission import QUEUE_BATCHES, Admission, ServiceModel
from dvabatch_backend.runtime.decisions import BatchTableView, Policy, QueryInfo
from dvabatch_backend.runtime.errors import CancelledError, OverloadedError, QueueFullError, TimeoutExpiredError
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


def _submit(scheduler, model, collector, n: int, seed: int = 0, timeout_us: int | None = None,
            length: int | None = None):
    rng = np.random.default_rng(seed)
    queries = [model.query(rng, length) for _ in range(n)]
    ids = [scheduler.submit_many([(q, collector)], timeout_us=timeout_us)[0] for q in queries]
    return ids, queries


def test_the_queue_bound_refuses_with_tritons_wording_and_loses_nothing(zoo) -> None:
    model = zoo.stages("token", 2)
    clock, collector = HandClock(), Collector()
    scheduler = _scheduler(model, clock, queue=QueuePolicy(max_queue_size=5))
    ids, queries = _submit(scheduler, model, collector, 8)

    refused = [qid for qid in ids if qid in collector.answers]  # answered before anything ran
    assert refused == ids[5:]  # the arrivals past the bound, as Triton refuses
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


def test_a_multi_row_request_is_admitted_or_refused_whole(zoo) -> None:
    model = zoo.stages("token", 2)
    collector = Collector()
    scheduler = _scheduler(model, HandClock(), queue=QueuePolicy(max_queue_size=4))
    rng = np.random.default_rng(2)
    first = scheduler.submit_many([(model.query(rng), collector) for _ in range(3)])
    second = scheduler.submit_many([(model.query(rng), collector) for _ in range(2)])  # 3 + 2 > 4: refused whole
    assert all(isinstance(collector.one(q).error, QueueFullError) for q in second)
    one = scheduler.submit_many([(model.query(rng), collector)])  # 3 + 1 fits
    run_until_idle(scheduler, model.engines())
    assert all(collector.one(q).ok for q in first + one)
    assert scheduler.stats.queue_full == 2


def test_an_arrival_that_would_wait_past_the_bound_is_refused_and_a_burst_within_it_is_carried(zoo) -> None:
    """The derived bound (admission.py), bs_max 4, the policy holding what waits: arrivals are
    admitted while the work queued (each row's share of a batch at its length) stays within
    QUEUE_BATCHES batches at the longest length, so at least that many rows; the next is refused
    at arrival, "Exceeds maximum queue size", whatever the clock says (the wait is the work
    queued, not how long it stood); what was admitted is answered. A configured bound is the
    user's: none of that."""
    model = zoo.stages("token", 2)
    clock, collector, policy = HandClock(), Collector(), HoldPolicy()
    scheduler = _scheduler(model, clock, policy)
    admission = scheduler.admission
    bound_work = QUEUE_BATCHES * admission.bs_max * admission.row_work()
    assert admission.wait_bound() == pytest.approx(bound_work * admission.service.correction)
    admitted, inputs, refused = [], [], None
    for seed in range(QUEUE_BATCHES * admission.bs_max * 20):
        ids, queries = _submit(scheduler, model, collector, 1, seed=seed)
        if ids[0] in collector.answers:
            refused = ids[0]
            break
        admitted += ids
        inputs += queries
    assert refused is not None and len(admitted) >= QUEUE_BATCHES * admission.bs_max  # a burst of that many carried
    assert scheduler.queries.queued_work <= bound_work + 1e-12
    error = collector.one(refused).error
    assert isinstance(error, QueueFullError) and "Exceeds maximum queue size" in str(error)
    clock.now += 10.0  # time alone refuses nothing queued
    late, _ = _submit(scheduler, model, collector, 1, seed=10 ** 6)
    assert isinstance(collector.one(late[0]).error, QueueFullError)
    assert scheduler.stats.queue_full == 2 and scheduler.stats.queued == len(admitted)
    policy.release = True
    clock.now = max(clock.now, scheduler.wake_at or clock.now)
    scheduler.on_window()
    run_until_idle(scheduler, model.engines())
    for qid, query in zip(admitted, inputs):
        assert_matches_reference(model, query, collector.one(qid))
    assert scheduler.queries.queued_work == 0.0

    configured, answers = _scheduler(model, clock, HoldPolicy(), queue=QueuePolicy(max_queue_size=1000)), Collector()
    _submit(configured, model, answers, len(admitted) + 1, seed=4)
    assert not answers.answers and configured.stats.queued == len(admitted) + 1


def test_queries_past_their_timeout_are_dropped_before_any_stage_runs_them(zoo) -> None:
    model = zoo.stages("token", 2)
    clock, collector = HandClock(), Collector()
    scheduler = _scheduler(model, clock)
    late, _ = _submit(scheduler, model, collector, 3, timeout_us=1_000_000)  # admitted: they would start in time
    fine, fine_inputs = _submit(scheduler, model, collector, 2, seed=3)  # no timeout
    clock.now += 2.0  # ... but nothing ran meanwhile

    run_until_idle(scheduler, model.engines())

    for qid in late:
        error = collector.one(qid).error
        assert isinstance(error, TimeoutExpiredError) and "Request timeout expired" in str(error)
    for qid, inputs in zip(fine, fine_inputs):
        assert_matches_reference(model, inputs, collector.one(qid))
    assert scheduler.stats.timed_out == 3
    assert scheduler.stats.stages[0].rows == 2  # the late ones never ran


def test_a_request_that_would_wait_past_its_timeout_is_refused_at_arrival_as_a_timeout(zoo) -> None:
    """The rule's deadline: behind a queue whose work would outlast a request's own timeout (the
    stages as slow as the correction says), it is answered "Request timeout expired" at once,
    counted as a timeout, and never queued; one whose timeout it would not outlast is queued."""
    model = zoo.stages("token", 2)
    clock, collector, policy = HandClock(), Collector(), HoldPolicy()
    scheduler = _scheduler(model, clock, policy, queue=QueuePolicy(max_queue_size=0))
    queued, _ = _submit(scheduler, model, collector, 6)
    scheduler.admission.service.correction = 1e4  # each queued row now takes well over a second
    doomed, _ = _submit(scheduler, model, collector, 1, seed=1, timeout_us=1_000_000)
    error = collector.one(doomed[0]).error
    assert isinstance(error, TimeoutExpiredError) and "past its timeout" in str(error)
    assert scheduler.stats.timed_out == 1 and scheduler.stats.queued == 6
    patient, _ = _submit(scheduler, model, collector, 1, seed=2, timeout_us=10 ** 12)
    assert patient[0] not in collector.answers and scheduler.stats.queued == 7


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
    ids, _ = _submit(scheduler, model, collector, 2, timeout_us=1_000_000)
    assert scheduler.wake_at is not None and scheduler.wake_at <= clock.now + 1.0 + 1e-9  # the deadline wakes it
    clock.now += 2.0
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
    for _ in range(200):
        service.observe(0, 4, 0.008)  # twice the profile
    assert service.correction == pytest.approx(2.0, rel=0.01)


def test_one_run_held_far_past_the_profile_moves_the_correction_by_a_step_only() -> None:
    """A run held or preempted (a gate, a collection) is an outlier: one observation pulls the
    correction at most a factor of 2 towards it, at the EWMA's weight; a steady change is still
    followed."""
    service = ServiceModel([{4: 0.004}], 1)
    service.observe(0, 4, 40.0)  # 10,000 times the profile
    assert 1.0 < service.correction <= 1.0 + 0.05 * 1.0 + 1e-12
    service.observe(0, 4, 4e-9)  # and far below it
    assert service.correction < 1.05
    for _ in range(400):
        service.observe(0, 4, 0.032)  # eight times the profile, every run
    assert service.correction == pytest.approx(8.0, rel=0.01)


def test_the_rule_reckons_the_wait_at_the_stages_rate_and_a_deadline_too() -> None:
    """`queue_refusal`: the work queued (each row's share of a bs_max batch: through both stages in
    a row with one pair, through the slowest where stages overlap) against the bound, QUEUE_BATCHES
    batches at the longest length, and against a request's timeout as the stages run now; a row's
    work follows its length."""
    service = ServiceModel([{1: 0.050, 4: 0.200}, {1: 0.050, 4: 0.200}], 2)
    admission = Admission(QueuePolicy(), SloPolicy(), service, 4, overlapping=False)
    assert admission.row_work() == pytest.approx(0.1) and admission.drain_rate() == pytest.approx(10.0)
    assert admission.wait_bound() == pytest.approx(QUEUE_BATCHES * 0.4)
    rows = QUEUE_BATCHES * 4
    assert admission.queue_refusal(rows, rows * 0.1) is None
    why = admission.queue_refusal(rows + 1, (rows + 1) * 0.1)
    assert why is not None and why.startswith("Exceeds maximum queue size")
    service.correction = 2.0  # the stages take twice their profile now: the bound in seconds doubles
    assert admission.wait_bound() == pytest.approx(QUEUE_BATCHES * 0.8)
    overlapping = Admission(QueuePolicy(), SloPolicy(), ServiceModel([{4: 0.200}, {4: 0.100}], 2), 4)
    assert overlapping.drain_rate() == pytest.approx(20.0)  # through the slowest stage alone
    slow = ServiceModel([{4: 0.400}], 1)
    timed = Admission(QueuePolicy(default_timeout_us=300_000), SloPolicy(), slow, 4)
    assert timed.wait_bound() is None  # a configured timeout is the user's policy
    assert timed.queue_refusal(10 ** 6, 10.0 ** 6) is None  # no bound, only the timeout
    assert timed.timeout_refusal(0.3) is None  # 0.3 s: within the timeout
    assert "past its timeout" in (timed.timeout_refusal(0.4) or "")
    assert timed.timeout_refusal(0.4, timeout_us=10_000_000) is None  # a request's own, longer
    slow.correction = 2.0
    assert timed.timeout_refusal(0.2) is not None  # 0.4 s as the stages run now
    unbounded = Admission(QueuePolicy(max_queue_size=0), SloPolicy(), service, 4)
    assert unbounded.queue_refusal(10 ** 6, 10.0 ** 6) is None and unbounded.wait_bound() is None
    assert unbounded.timeout_refusal(10.0 ** 6) is None
    lengths = ServiceModel([{4: 0.400}], 1, by_length={16: [{4: 0.100}], 128: [{4: 0.400}]})
    by_length = Admission(QueuePolicy(), SloPolicy(), lengths, 4)
    assert by_length.row_work(16) == pytest.approx(0.025) and by_length.row_work() == pytest.approx(0.1)


def test_the_latency_targets_budgets_follow_the_profile() -> None:
    service = ServiceModel([{8: 0.010}, {8: 0.020}], 2)
    budgets = Admission(QueuePolicy(), SloPolicy(slo_ms=90), service, 8).stage_budgets()
    assert budgets == pytest.approx([0.030, 0.060])


def test_the_correction_compares_with_the_profile_at_the_batchs_length() -> None:
    service = ServiceModel([{8: 0.008}], 1, by_length={16: [{8: 0.002}], 128: [{8: 0.008}]})
    admission = Admission(QueuePolicy(), SloPolicy(), service, 8)
    assert admission.batch_seconds() == pytest.approx(0.008)  # at the longest length
    for _ in range(300):
        service.observe(0, 8, 0.004, length=10)  # short batches: twice their length's profile (shared cores)
    assert service.correction == pytest.approx(2.0, rel=0.01)
    assert service.pipeline_time(8) == pytest.approx(0.016, rel=0.01)  # the target's predictions use it
    assert admission.batch_seconds() == pytest.approx(0.016, rel=0.01)  # and so does the bound
