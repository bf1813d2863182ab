"""Work manner (paper §6.2): one buffer pair runs the pipeline serially, two let stages overlap.

Overlap is shown with gated engines, not by timing: stage 1 is held on batch A while the test
watches whether stage 0 gets to run batch B."""
from __future__ import annotations

import threading

import numpy as np

from dvabatch_backend import ExecutorState
from policies import PipelinedPolicy

from ..conftest import Collector, GatedEngine, make_scheduler


def _run_intervals(zoo, pairs: int) -> list[tuple[float, float, int]]:
    model = zoo.stages("token", 4)
    scheduler = make_scheduler(model, PipelinedPolicy(), num_buffer_pairs=pairs, bs_max=2)
    rng = np.random.default_rng(pairs)
    collector = Collector()
    with scheduler:
        ids = []
        for _ in range(12):  # a burst: 12 batches of 2
            ids += scheduler.submit_many([(model.query(rng), collector) for _ in range(2)])
        assert collector.wait_for(ids)
    assert all(collector.one(q).ok for q in ids)
    assert scheduler.buffer_violations == []
    return sorted((e.t0, e.t1, e.stage) for e in scheduler.trace if e.kind == "run")


def _overlaps(intervals: list[tuple[float, float, int]]) -> int:
    return sum(1 for (_, end, _), (start, _, _) in zip(intervals, intervals[1:]) if start < end)


def test_one_buffer_pair_runs_stages_serially(zoo) -> None:
    # an invariant of one pair, whatever the timing: no two stage runs ever overlap
    intervals = _run_intervals(zoo, pairs=1)
    assert len(intervals) == 12 * 4
    assert _overlaps(intervals) == 0
    # serial also means each batch goes through every stage before the next batch starts
    assert [stage for _, _, stage in intervals] == [0, 1, 2, 3] * 12


def _gated_two_batches(zoo, pairs: int):
    """Batches A and B (2 queries each, bs_max 2) in a 4-stage pipeline of gated engines; A has
    run stage 0 and is held in stage 1."""
    model = zoo.stages("token", 4)
    gates = [GatedEngine(e) for e in model.engines()]
    scheduler = make_scheduler(model, PipelinedPolicy(), gates, num_buffer_pairs=pairs, bs_max=2)
    rng = np.random.default_rng(pairs)
    collector = Collector()
    scheduler.start()
    ids = scheduler.submit_many([(model.query(rng), collector) for _ in range(4)])
    assert scheduler.wait_until(lambda s: s.stats.new == 2, 10)  # two batches of 2
    gates[0].wait_started()  # A in stage 0
    gates[0].release()
    gates[1].wait_started()  # A in stage 1, held there
    return model, gates, scheduler, collector, ids


def _finish(gates, scheduler, collector, ids) -> None:
    for gate in gates:
        gate.open()
    assert collector.wait_for(ids)
    scheduler.stop()
    assert all(collector.one(q).ok for q in ids)
    assert scheduler.buffer_violations == []


def test_two_buffer_pairs_let_stage_0_run_the_next_batch_while_stage_1_holds_one(zoo) -> None:
    model, gates, scheduler, collector, ids = _gated_two_batches(zoo, pairs=2)
    # stage 0 takes B on the second pair while stage 1 is still running A on the first
    gates[0].wait_started()
    assert scheduler.executor_states()[:2] == [ExecutorState.WORKING, ExecutorState.WORKING]
    rows = {r.id: r.status_map for r in scheduler.snapshot().rows}
    assert rows == {0: (2, 0, 0, 0), 1: (0, 0, 0, 0)}  # A done with stage 0, B with nothing yet
    _finish(gates, scheduler, collector, ids)


def test_one_buffer_pair_keeps_stage_0_from_the_next_batch_while_stage_1_holds_one(zoo) -> None:
    model, gates, scheduler, collector, ids = _gated_two_batches(zoo, pairs=1)
    # stage 0 has B queued but no pair to write it into: it settles without running B
    assert scheduler.wait_until(
        lambda s: s.executor_states()[0] in (ExecutorState.CHECKING, ExecutorState.INACTIVE), 10
    ), scheduler.executor_states()
    assert scheduler.executor_states()[1] is ExecutorState.WORKING
    assert not gates[0].started.acquire(blocking=False), "stage 0 ran B while A held the only pair"
    # B runs stage 0 only once A has left the pipeline
    gates[1].release()
    for stage in (2, 3):
        gates[stage].wait_started()
        gates[stage].release()
    a = ids[:2]
    assert collector.wait_for(a)
    gates[0].wait_started()  # now B
    _finish(gates, scheduler, collector, ids)


class ThreadRecordingEngine:
    """A real engine that notes which thread ran it, for each run."""

    def __init__(self, inner, stage: int, runs: list[tuple[int, str]]) -> None:
        self.inner, self.stage, self.runs = inner, stage, runs

    def run(self, inputs, outputs) -> None:
        self.runs.append((self.stage, threading.current_thread().name))
        self.inner.run(inputs, outputs)


def _lone_queries(zoo, pairs: int, queries: int = 2):
    model = zoo.stages("token", 4)
    runs: list[tuple[int, str]] = []
    engines = [ThreadRecordingEngine(e, i, runs) for i, e in enumerate(model.engines())]
    scheduler = make_scheduler(model, PipelinedPolicy(), engines, num_buffer_pairs=pairs, bs_max=2, fast_path=False)
    rng = np.random.default_rng(3)
    collector = Collector()
    per_query = []
    with scheduler:
        for _ in range(queries):  # one at a time: each query alone in the pipeline
            [qid] = scheduler.submit_many([(model.query(rng), collector)])
            assert collector.wait_for([qid])
            assert collector.one(qid).ok
            per_query.append(list(runs))
            runs.clear()
        wakeups = scheduler.loop.wakeups
    assert scheduler.buffer_violations == []
    return scheduler, per_query, wakeups


def test_with_one_pair_a_lone_query_runs_every_stage_on_the_loops_thread(zoo) -> None:
    # one pair: nothing could run beside a stage, so the step runs it, with no hand-off between stages
    scheduler, per_query, wakeups = _lone_queries(zoo, pairs=1)
    for runs in per_query:
        assert runs == [(stage, "dvabatch-engine-loop") for stage in range(4)]
    assert wakeups <= 2  # each query woke the loop once at most (its arrival), no stage woke it


def test_with_two_pairs_each_launch_runs_on_a_worker(zoo) -> None:
    # two pairs: stages may overlap, so the step hands each launch to a worker and stays free
    _, per_query, _ = _lone_queries(zoo, pairs=2)
    for runs in per_query:
        assert [stage for stage, _ in runs] == [0, 1, 2, 3]
        assert all(name.startswith("dvabatch-launch") for _, name in runs)
