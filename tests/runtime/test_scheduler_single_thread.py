"""The scheduler driven by hand from the test's one thread: no executor, no thread, no fake.

The scheduler owns the runtime's state and no thread: `next_work(stage)` answers at once, the
test runs the stage's real onnxruntime engine (`run_work`) and hands the result back with
`finish_work`, exactly as an executor thread would.
"""
from __future__ import annotations

import threading
from typing import Sequence

import numpy as np

from dvabatch_backend import (
    ArrivalPlan,
    ExecutorState,
    New,
    Policy,
    QueryState,
    RuntimeSettings,
    Scheduler,
    WorkListener,
    run_until_idle,
    run_work,
)
from dvabatch_backend.runtime.decisions import BatchTableView, QueryInfo
from policies import create_policy

from ..conftest import Collector, assert_matches_reference


class RecordingListener(WorkListener):
    def __init__(self) -> None:
        self.ready: list[int] = []
        self.window_moves = 0
        self.stopped = False

    def stage_ready(self, stage: int) -> None:
        self.ready.append(stage)

    def window_moved(self) -> None:
        self.window_moves += 1

    def stopping(self) -> None:
        self.stopped = True


def _scheduler(model, policy: Policy, pairs: int = 2, bs_max: int = 2, clock=None) -> Scheduler:
    settings = RuntimeSettings(num_buffer_pairs=pairs, bs_max=bs_max)
    return Scheduler(model.manifest, policy, settings, clock=clock) if clock else Scheduler(model.manifest, policy, settings)


def test_driven_from_one_thread_answers_every_query_correctly(zoo) -> None:
    model = zoo.stages("token", 3)
    threads_before = set(threading.enumerate())
    scheduler = _scheduler(model, create_policy("pipelined"))
    listener = RecordingListener()
    scheduler.board.listener = listener
    engines = model.engines()
    rng = np.random.default_rng(1)
    queries = [model.query(rng) for _ in range(7)]
    collector = Collector()

    ids = scheduler.submit_many([(q, collector) for q in queries])
    assert listener.ready and listener.ready[0] == 0  # stage 0 was told it has work
    states = scheduler.query_states()
    assert set(states) == set(ids) and set(states.values()) == {QueryState.BATCHED}

    works = run_until_idle(scheduler, engines)

    assert works >= 3 * 4  # 7 queries at bs_max 2: at least 4 batches through 3 stages
    assert scheduler.pending_count == 0 and scheduler.query_states() == {}
    for qid, inputs in zip(ids, queries):
        assert_matches_reference(model, inputs, collector.one(qid))
    assert scheduler.buffer_violations == []
    assert scheduler.stats.answered_ok == 7
    assert set(threading.enumerate()) == threads_before  # nothing was started


def test_next_work_never_blocks(zoo) -> None:
    model = zoo.stages("token", 3)
    scheduler = _scheduler(model, create_policy("pipelined"))
    assert [scheduler.next_work(k) for k in range(3)] == [None, None, None]
    assert scheduler.executor_states()[0] is ExecutorState.ACTIVE  # holds legitimate pairs, no item
    scheduler.stop()
    assert scheduler.stopping and scheduler.next_work(0) is None


def _two_batches_in_flight(model, pairs: int) -> bool:
    """Start two batches; can stage 0 take the second while stage 1 holds the first?"""
    scheduler = _scheduler(model, create_policy("pipelined"), pairs=pairs, bs_max=1)
    engines = model.engines()
    rng = np.random.default_rng(2)
    collector = Collector()
    ids = scheduler.submit_many([(model.query(rng), collector) for _ in range(2)])
    first = scheduler.next_work(0)
    assert first is not None and [q.id for q in first.queries] == [ids[0]]
    scheduler.finish_work(first, run_work(first, engines[0], scheduler))
    in_stage1 = scheduler.next_work(1)
    assert in_stage1 is not None and in_stage1.item.batch_id == first.item.batch_id
    second = scheduler.next_work(0)  # stage 1 is still working on the first batch
    overlapped = second is not None
    if second is not None:
        scheduler.finish_work(second, run_work(second, engines[0], scheduler))
    scheduler.finish_work(in_stage1, run_work(in_stage1, engines[1], scheduler))
    run_until_idle(scheduler, engines)
    for qid in ids:
        assert collector.one(qid).ok
    assert scheduler.buffer_violations == []
    return overlapped


def test_one_pair_runs_serially_and_two_pairs_overlap(zoo) -> None:
    model = zoo.stages("token", 3)
    assert _two_batches_in_flight(model, pairs=1) is False
    assert _two_batches_in_flight(model, pairs=2) is True


class WindowPolicy(Policy):
    """Waits `window` seconds after the first arrival, then starts one batch of everyone waiting."""

    name = "window"

    def __init__(self, window: float) -> None:
        self.window = window

    def on_arrival(self, waiting: Sequence[QueryInfo], table: BatchTableView, now: float) -> ArrivalPlan:
        first = min(q.arrival for q in waiting)
        if now < first + self.window:
            return ArrivalPlan(wake_at=first + self.window)
        return ArrivalPlan((New(tuple(q.id for q in waiting)),))


def test_batch_window_by_hand_with_a_fake_clock(zoo) -> None:
    model = zoo.stages("token", 2)
    now = [100.0]
    scheduler = _scheduler(model, WindowPolicy(window=0.5), bs_max=4, clock=lambda: now[0])
    listener = RecordingListener()
    scheduler.board.listener = listener
    rng = np.random.default_rng(3)
    collector = Collector()
    ids = scheduler.submit_many([(model.query(rng), collector) for _ in range(3)])

    assert scheduler.wake_at == 100.5 and listener.window_moves == 1
    assert set(scheduler.query_states().values()) == {QueryState.WAITING}
    assert scheduler.on_window() == 100.5  # not yet: nothing happens
    assert scheduler.next_work(0) is None

    now[0] = 100.5
    assert scheduler.on_window() is None  # the window passed: one batch of all three
    assert set(scheduler.query_states().values()) == {QueryState.BATCHED}
    run_until_idle(scheduler, model.engines())
    assert all(collector.one(q).ok for q in ids)
    assert scheduler.stats.new == 1


def test_stop_answers_waiting_and_batched_queries(zoo) -> None:
    model = zoo.stages("token", 2)
    scheduler = _scheduler(model, create_policy("pipelined"), bs_max=1)
    listener = RecordingListener()
    scheduler.board.listener = listener
    rng = np.random.default_rng(4)
    collector = Collector()
    ids = scheduler.submit_many([(model.query(rng), collector) for _ in range(3)])
    work = scheduler.next_work(0)
    assert work is not None
    scheduler.stop()
    assert listener.stopped
    scheduler.finish_work(work, run_work(work, model.engines()[0], scheduler))  # a late finish is ignored
    assert [str(collector.one(q).error).endswith("shutting down") for q in ids] == [True] * 3


class _DoubleNamingPolicy(Policy):
    """Its first plan names the first query twice in one `New`, and the second query in two `New`s
    (the second no longer waiting once the first is carried out); afterwards it batches as it should."""

    name = "double-naming"

    def __init__(self) -> None:
        self.plans = 0

    def on_arrival(self, waiting: Sequence[QueryInfo], table: BatchTableView, now: float) -> ArrivalPlan:
        self.plans += 1
        ids = [q.id for q in waiting]
        if self.plans == 1:
            return ArrivalPlan((New((ids[0], ids[0])), New((ids[1],)), New((ids[1],))))
        return ArrivalPlan((New(tuple(ids)),) if ids else ())


def test_a_plan_naming_a_query_twice_or_one_not_waiting_never_answers_twice(zoo) -> None:
    model = zoo.stages("token", 2)
    scheduler = _scheduler(model, _DoubleNamingPolicy())
    collector = Collector()
    rng = np.random.default_rng(3)
    queries = [model.query(rng) for _ in range(2)]
    first, second = scheduler.submit_many([(q, collector) for q in queries])
    # the query named twice in one decision: refused, answered with the policy's error, once
    assert collector.one(first).error is not None and "not all distinct and waiting" in str(collector.one(first).error)
    run_until_idle(scheduler, model.engines())
    # the query named again once batched: the second decision is refused, the query runs once
    assert_matches_reference(model, queries[1], collector.one(second))
    assert scheduler.stats.policy_errors == 2 and scheduler.stats.new == 1
    assert scheduler.pending_count == 0 and scheduler.stats.answered_ok == 1 and scheduler.stats.answered_error == 1
    assert scheduler.stats.queued == 0 and scheduler.buffer_violations == []
