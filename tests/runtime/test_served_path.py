"""The served path: every query a row of the batch table, its steps run by the engine loop or, while
the loop is idle, by the caller that submitted it (`Pipeline.serve_here`); a batch that meets
nobody may run the unsliced model, the one-stage route (`Scheduler.serve_whole_model`).

Ordered by events and gated engines, never by time.
"""
from __future__ import annotations

import threading
from typing import Any, Mapping, Sequence

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dvabatch_backend.runtime.decisions import ArrivalPlan, BatchTableView, New, Policy
from dvabatch_backend.runtime.engine import OrtStageEngine
from dvabatch_backend.runtime.errors import QueueFullError, StageFailedError
from dvabatch_backend.runtime.admission import QUEUE_BATCHES
from dvabatch_backend.runtime.pipeline import CallRoute, Pipeline
from dvabatch_backend.runtime.query import QueryInfo
from dvabatch_backend.runtime.settings import QueuePolicy, RuntimeSettings
from policies import RandomLegalPolicy, create_policy
from policies.examples.early_exit import EarlyExitPolicy

from ..conftest import Collector, GatedEngine, LaunchLedger, SlicedModel, assert_matches_reference, call, make_scheduler


class EachAlone(Policy):
    """Every waiting query a batch of its own, at once."""

    name = "each-alone"

    def on_arrival(self, waiting: Sequence[QueryInfo], table: BatchTableView, now: float) -> ArrivalPlan:
        return ArrivalPlan(tuple(New((q.id,)) for q in waiting))


class Threads:
    """Wraps engines: records which thread ran which engine (-1: the unsliced model), in one order."""

    def __init__(self) -> None:
        self.runs: list[tuple[str, int]] = []
        self._lock = threading.Lock()

    def wrap(self, index: int, engine: Any) -> Any:
        threads = self

        class Recorded:
            def run(self, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
                with threads._lock:
                    threads.runs.append((threading.current_thread().name, index))
                engine.run(inputs, outputs)

        return Recorded()


def whole_model(model: SlicedModel) -> OrtStageEngine:
    return OrtStageEngine(model.dir / "model.onnx")


def served(model: SlicedModel, policy: Policy, engines: list[Any] | None = None, whole: Any = None,
           **options: Any) -> Pipeline:
    return Pipeline.create(model.manifest, engines or model.engines(), policy,
                           RuntimeSettings(record_trace=True, **options), whole_model=whole)


def test_a_calls_queries_are_rows_of_the_table_run_on_the_callers_thread(zoo) -> None:
    """The caller submits and runs the loop's steps itself while the loop is idle: each stage runs
    on its thread, in stage order, each launch a row of the batch table holding its queries; the
    loop's thread is not woken for it."""
    model = zoo.stages("token", 3)
    threads, ledger = Threads(), LaunchLedger()
    engines = ledger.wrap([threads.wrap(k, e) for k, e in enumerate(model.engines())])
    rng = np.random.default_rng(0)
    collector = Collector()
    with ledger.watch(make_scheduler(model, create_policy("input"), engines), tabled=True) as pipeline:
        assert pipeline.wait_until(lambda s: pipeline.loop.steps >= 1, 10)  # the loop's first step
        woken = pipeline.loop.wakeups
        queries = [model.query(rng, length=5) for _ in range(3)]
        ids, answered = call(pipeline, queries, collector)
        assert answered
        me = threading.current_thread().name
        assert threads.runs == [(me, k) for k in range(3)]
        for qid, query in zip(ids, queries):
            assert_matches_reference(model, query, collector.one(qid))
        stats = pipeline.stats
        assert stats.new == 1 and stats.table_answered == stats.answered_ok == 3
        assert ledger.launches == 3 and ledger.violations == []
        assert pipeline.loop.wakeups == woken  # nothing left for the loop: not woken
        assert len(pipeline.snapshot().rows) == 0


def test_a_caller_runs_the_steps_whenever_no_step_runs_though_the_loops_thread_is_not_asleep(zoo) -> None:
    """A caller claims the step whenever no step runs, whether or not the loop's thread is asleep
    waiting for work (awake between steps, it would wait for the step): here the loop's thread was
    never started, and calls one after another are each answered on the caller's thread. Were the
    loop's sleep required, each would be left to a thread that never runs."""
    model = zoo.stages("token", 2)
    rng = np.random.default_rng(1)
    pipeline = make_scheduler(model, create_policy("input"))  # not started: the loop's thread never waits
    try:
        for _ in range(3):
            collector = Collector()
            queries = [model.query(rng, length=5) for _ in range(2)]
            ids, answered = call(pipeline, queries, collector)
            assert answered
            for qid, query in zip(ids, queries):
                assert_matches_reference(model, query, collector.one(qid))
        assert pipeline.stats.table_answered == 6
    finally:
        pipeline.stop()


@pytest.mark.parametrize("pairs", [1, 2])
def test_a_batch_that_no_other_could_overlap_runs_the_unsliced_model(zoo, pairs: int) -> None:
    """The one-stage route: a batch runs the unsliced model (a row like any other, marked
    no-stretch) where no other batch could run in its stages beside it: with one buffer pair
    always (stages run batches one at a time); with two, where it is the table's only row at its
    launch, else the stages."""
    model = zoo.stages("token", 3)
    ledger = LaunchLedger()
    engines = ledger.wrap([*model.engines(), whole_model(model)])
    rng = np.random.default_rng(1)
    collector = Collector()
    pipeline = served(model, EachAlone(), engines[:3], engines[3], num_buffer_pairs=pairs)
    with ledger.watch(pipeline, tabled=True):
        assert pipeline.fast_path_engine == "model"
        lone = model.query(rng, length=4)
        (qid,), answered = call(pipeline, [lone], collector)
        assert answered
        assert_matches_reference(model, lone, collector.one(qid))
        assert (pipeline.stats.whole_runs, pipeline.stats.whole_rows) == (1, 1)
        assert pipeline.stats.stages[0].batches == 0
        assert any(e.kind == "run" and e.detail == "whole model" for e in pipeline.trace)

        pair = [model.query(rng, length=n) for n in (3, 7)]  # two rows of the table at once
        ids, _ = call(pipeline, pair, collector)
        assert collector.wait_for(ids)
        for i, query in zip(ids, pair):
            assert_matches_reference(model, query, collector.one(i))
        stats = pipeline.stats
        stage_batches = [s.batches for s in stats.stages]
        if pairs == 1:
            assert stats.whole_runs == 3 and stage_batches == [0, 0, 0]
        else:  # each launched while the other was in the table: the stages
            assert stats.whole_runs == 1 and stage_batches == [2, 2, 2]
        assert stats.table_answered == stats.answered_ok == 3
        assert ledger.violations == [] and pipeline.buffer_violations == []


def test_a_policy_that_may_answer_early_never_runs_the_unsliced_model(zoo) -> None:
    model = zoo.stages("dense", 2)
    assert not EarlyExitPolicy.allows_inline() and RandomLegalPolicy.allows_inline()
    assert create_policy("hybrid").allows_inline() and create_policy("input").allows_inline()
    with served(model, EarlyExitPolicy(exit_stage=0, threshold=0.5), whole=whole_model(model)) as pipeline:
        assert pipeline.fast_path_engine == "stages" and not pipeline.scheduler.runs_whole
    with served(model, create_policy("load"), whole=whole_model(model), fast_path=False) as pipeline:
        assert pipeline.fast_path_engine == "stages"
        collector = Collector()
        (qid,), _ = call(pipeline, [model.query(np.random.default_rng(2))], collector)  # off: the loop's steps
        assert collector.wait_for([qid]) and collector.one(qid).ok
        assert pipeline.loop.wakeups >= 1


def test_the_caller_does_not_step_while_the_loop_is_busy(zoo) -> None:
    model = zoo.stages("token", 2)
    gate = GatedEngine(model.engines()[0])
    rng = np.random.default_rng(3)
    collector = Collector()
    with make_scheduler(model, create_policy("input"), [gate, model.engines()[1]]) as pipeline:
        first = pipeline.submit(model.query(rng, length=3), collector)
        gate.wait_started()  # the loop runs stage 0
        (second,), answered = call(pipeline, [model.query(rng, length=3)], collector)
        assert not answered  # at once: the loop's work
        gate.open()
        assert collector.wait_for([first, second])
        assert collector.one(first).ok and collector.one(second).ok


def test_queries_arriving_during_a_callers_steps_join_the_table_and_are_answered(zoo) -> None:
    """While a caller runs the steps (held inside stage 1), other queries arrive: the loop launches
    nothing meanwhile (the step is the caller's), they are batched in the table, and every one is
    answered, by the caller's steps or, once it lets go, the loop's."""
    model = zoo.stages("token", 3)
    gate = GatedEngine(model.engines()[1])
    threads, ledger = Threads(), LaunchLedger()
    engines = ledger.wrap([threads.wrap(k, e) for k, e in enumerate([model.engines()[0], gate, model.engines()[2]])])
    rng = np.random.default_rng(4)
    collector = Collector()
    with ledger.watch(make_scheduler(model, create_policy("load"), engines), tabled=True) as pipeline:
        lone = model.query(rng, length=6)
        result: dict[str, Any] = {}
        caller = threading.Thread(target=lambda: result.setdefault("call", call(pipeline, [lone], collector)),
                                  name="caller")
        caller.start()
        gate.wait_started()  # the caller's step is inside stage 1
        arrivals = [model.query(rng, length=6) for _ in range(4)]
        ids = pipeline.submit_many([(q, collector) for q in arrivals])
        assert pipeline.snapshot().rows  # batched, waiting for the step
        assert all(name == "caller" for name, _ in threads.runs)
        gate.open()
        caller.join(20)
        assert not caller.is_alive()
        (lone_id,), answered = result["call"]
        assert answered
        assert collector.wait_for([lone_id, *ids])
        for qid, query in zip([lone_id, *ids], [lone, *arrivals]):
            assert_matches_reference(model, query, collector.one(qid))
        assert ledger.violations == [] and pipeline.buffer_violations == []


def test_a_failing_stage_answers_its_rows_with_their_error_on_the_callers_steps(zoo) -> None:
    model = zoo.stages("dense", 3)

    class Failing:
        def run(self, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
            raise RuntimeError("injected")

    engines: list[Any] = model.engines()
    engines[1] = Failing()
    rng = np.random.default_rng(5)
    collector = Collector()
    with make_scheduler(model, create_policy("load"), engines) as pipeline:
        (qid,), answered = call(pipeline, [model.query(rng)], collector)
        assert answered
        error = collector.one(qid).error
        assert isinstance(error, StageFailedError) and "stage 1" in str(error) and "injected" in str(error)
        assert pipeline.wait_until(lambda s: s.pending_count == 0, 10)


@pytest.mark.parametrize("pairs", [1, 2])
def test_a_failure_after_a_stage_answers_its_queries_and_the_pipeline_serves_on(zoo, pairs: int) -> None:
    """`finish_work` raises once (a runtime bug): that batch's queries are answered with an error
    naming the stage and the cause, nothing is left unanswered, and later queries are served."""
    from dvabatch_backend.runtime.scheduler import Scheduler

    model = zoo.stages("dense", 3)

    class BrokenOnce(Scheduler):
        broken = False

        def finish_work(self, work, result):  # type: ignore[no-untyped-def]
            if work.stage == 1 and not BrokenOnce.broken:
                BrokenOnce.broken = True
                raise RuntimeError("bookkeeping bug")
            return super().finish_work(work, result)

    scheduler = BrokenOnce(model.manifest, create_policy("load"), RuntimeSettings(num_buffer_pairs=pairs, fast_path=False))
    gate = GatedEngine(model.engines()[0])
    rng = np.random.default_rng(7)
    collector = Collector()
    with Pipeline(scheduler, [gate, *model.engines()[1:]]) as pipeline:
        first = [model.query(rng) for _ in range(3)]
        first_ids = pipeline.submit_many([(q, collector) for q in first])
        gate.wait_started()
        gate.open()
        assert collector.wait_for(first_ids)
        for qid in first_ids:
            error = collector.one(qid).error
            assert isinstance(error, StageFailedError), error
            assert "stage 1" in str(error) and "bookkeeping bug" in str(error)
        later = [model.query(rng) for _ in range(5)]
        later_ids = pipeline.submit_many([(q, collector) for q in later])
        assert collector.wait_for(later_ids)
        for qid, query in zip(later_ids, later):
            assert_matches_reference(model, query, collector.one(qid))
        assert pipeline.buffer_violations == []


# -- the property: callers' steps and the loop's, under concurrency ---------------------------


@st.composite
def schedules(draw: st.DrawFn) -> dict:
    steps = draw(st.lists(st.tuples(
        st.sampled_from(["submit", "call", "held_call"]),
        st.integers(1, 5),  # rows
        st.integers(0, 4),  # queries that arrive while a call's step is held
    ), min_size=1, max_size=8))
    return {"kind": draw(st.sampled_from(["token", "dense"])), "stages": draw(st.integers(1, 3)),
            "bs_max": draw(st.integers(2, 6)), "pairs": draw(st.integers(1, 2)), "seed": draw(st.integers(0, 2**16)),
            "p_stretch": draw(st.sampled_from([0.0, 0.7])), "p_split": draw(st.sampled_from([0.0, 0.5])),
            "whole": draw(st.booleans()), "held_stage": draw(st.integers(0, 2)), "steps": steps}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schedule=schedules())
def test_random_schedules_of_callers_and_the_loop_answer_every_query_once_from_the_table(zoo, schedule: dict) -> None:
    """Queries from several callers: some left to the loop, some whose caller runs the steps, some
    while such a caller is held inside a stage. Every query is answered exactly once, equal to the
    unsliced model; every launch is a row of the batch table holding its queries, made in a step
    its thread holds; no buffer rule breaks."""
    model = zoo.stages(schedule["kind"], schedule["stages"])
    n = model.manifest.num_stages
    held_engine = -1 if schedule["whole"] and n > 1 else min(schedule["held_stage"], n - 1)
    hold = threading.Event()  # set: a caller's launch of `held_engine` waits until `release` is set
    entered, release = threading.Event(), threading.Event()

    def holding(index: int, engine: Any) -> Any:
        class Held:
            def run(self, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
                if threading.current_thread().name.startswith("caller") and index == held_engine and hold.is_set():
                    entered.set()
                    assert release.wait(20), "the test never released the caller"
                engine.run(inputs, outputs)

        return Held()

    ledger = LaunchLedger()
    engines = ledger.wrap([holding(k, e) for k, e in enumerate(model.engines())])
    whole = ledger.wrap([holding(-1, whole_model(model))])[0] if schedule["whole"] and n > 1 else None
    policy = RandomLegalPolicy(seed=schedule["seed"], stretch=schedule["p_stretch"], split=schedule["p_split"])
    rng = np.random.default_rng(schedule["seed"])
    collector = Collector()
    sent: dict[int, dict[str, np.ndarray]] = {}

    def rows(count: int) -> list[dict[str, np.ndarray]]:
        length = int(rng.integers(1, model.manifest.max_length + 1))
        return [model.query(rng, length=length) for _ in range(min(count, schedule["bs_max"]))]

    def submit(queries: list[dict[str, np.ndarray]]) -> list[int]:
        ids = pipeline.submit_many([(q, collector) for q in queries])
        sent.update(zip(ids, queries))
        return ids

    # unbounded: what is asked is that every query is answered, whatever the schedule queues
    pipeline = served(model, policy, engines, whole, num_buffer_pairs=schedule["pairs"], bs_max=schedule["bs_max"],
                      queue=QueuePolicy(max_queue_size=0))
    with ledger.watch(pipeline, tabled=True):
        for i, (kind, count, during) in enumerate(schedule["steps"]):
            queries = rows(count)
            if kind == "submit":
                submit(queries)
                continue
            hold.set() if kind == "held_call" else hold.clear()
            entered.clear()
            release.clear()
            ids: list[int] = []
            caller = threading.Thread(target=pipeline.serve_here, name=f"caller-{i}", args=(
                lambda _, queries=queries, ids=ids: ids.extend(submit(queries)),
                lambda ids=ids: all(q in collector.answers for q in ids)))
            caller.start()
            while caller.is_alive() and not entered.wait(0.05):
                pass
            if entered.is_set():  # held inside an engine: others arrive now
                submit(rows(during)) if during else None
                release.set()
            caller.join(20)
            assert not caller.is_alive()
            hold.clear()
        assert collector.wait_for(set(sent), timeout=30), f"unanswered: {set(sent) - set(collector.answers)}"
        stats = pipeline.stats
        assert stats.table_answered == stats.answered_ok == len(sent)
    for qid, inputs in sent.items():
        assert_matches_reference(model, inputs, collector.one(qid))
    assert pipeline.buffer_violations == []
    assert ledger.violations == []


# -- the caller's own queue (`Pipeline.route_call`) -----------------------------------------------


class _Calls:
    """A caller's calls of two one-row requests, the oldest having waited `waited` in the caller's
    queue, as `execute` makes them: "served" (routed here, each answer the model's) or "refused"
    (both, "Exceeds maximum queue size")."""

    def __init__(self, model: SlicedModel) -> None:
        rng = np.random.default_rng(0)
        self.model = model
        self.queries = [model.query(rng) for _ in range(2)]

    def __call__(self, pipeline: Pipeline, waited: float | None = None) -> str:
        route = pipeline.route_call(2, 2, waited=waited)
        if route is CallRoute.REFUSED:
            errors = pipeline.scheduler.refuse_caller_backlog(2, waited or 0.0)
            assert all(isinstance(e, QueueFullError) and "Exceeds maximum queue size" in str(e) for e in errors)
            return "refused"
        assert route is CallRoute.HERE
        collector = Collector()
        ids, _ = call(pipeline, self.queries, collector)
        assert collector.wait_for(ids)
        for qid, query in zip(ids, self.queries):
            assert_matches_reference(self.model, query, collector.one(qid))
        return "served"


def test_with_the_derived_bound_a_call_whose_oldest_waited_past_it_is_refused_whole(zoo) -> None:
    """With the derived bound (no queue policy configured), a call is served on the caller's thread
    while its oldest request has waited through no more than QUEUE_BATCHES calls in the caller's
    queue (or that wait is not measured); past it, refused whole, "Exceeds maximum queue size"."""
    model = zoo.stages("token", 2)
    call = _Calls(model)
    with make_scheduler(model, create_policy("load"), num_buffer_pairs=1, queue=QueuePolicy()) as pipeline:
        bound = pipeline.admission.caller_bound()
        assert bound == QUEUE_BATCHES  # calls served
        assert call(pipeline) == "served"  # not measured
        assert call(pipeline, bound * 0.9) == "served"
        assert [call(pipeline, bound * 1.1) for _ in range(2)] == ["refused", "refused"]
        assert call(pipeline, bound * 0.5) == "served"
        stats = pipeline.stats
        assert stats.queue_full == 4 and stats.caller_drains == 4


def test_a_configured_bound_bounds_the_callers_queue_by_the_time_its_rows_take(zoo) -> None:
    """With a configured queue bound (rows of the runtime's queue, Triton's left unbounded), the
    caller's bound is the calls that many rows make; a call whose oldest waited through more is
    refused whole. With none (max_queue_size 0 and no timeout) nothing is refused."""
    model = zoo.stages("token", 2)
    call = _Calls(model)
    with make_scheduler(model, create_policy("load"), num_buffer_pairs=1, queue=QueuePolicy(max_queue_size=4)) as pipeline:
        admission = pipeline.admission
        bound = admission.caller_bound()
        assert admission.wait_bound() is None
        assert bound == pytest.approx(4 / pipeline.bs_max)  # calls: a full call is bs_max rows
        assert call(pipeline, bound * 0.9) == "served"
        assert call(pipeline, bound * 1.1) == "refused"
    with make_scheduler(model, create_policy("load"), num_buffer_pairs=1, queue=QueuePolicy(max_queue_size=0)) as pipeline:
        assert pipeline.admission.caller_bound() is None
        assert call(pipeline, 10.0 ** 6) == "served"
        assert pipeline.stats.queue_full == 0


def test_a_callers_borrowed_inputs_are_copied_for_the_rows_still_queued_when_it_lets_go(zoo) -> None:
    """A caller lends its requests' memory while it holds the loop's step (`submit_call(borrowed=True)`):
    the rows the policy holds back past its steps (a fixed window here) get copies before it lets go,
    so the caller reusing its memory afterwards changes no answer."""
    model = zoo.stages("token", 2)
    rng = np.random.default_rng(8)
    collector = Collector()
    with make_scheduler(model, create_policy("input", window=0.05), num_buffer_pairs=1) as pipeline:
        queries = [model.query(rng, length=5) for _ in range(2)]
        lent = [{name: value.copy() for name, value in q.items()} for q in queries]  # the caller's memory
        ids: list[int] = []
        claims: list[bool] = []

        def submit(claimed: bool) -> None:
            claims.append(claimed)
            ids.extend(i for group in pipeline.submit_call([[(q, collector)] for q in lent], borrowed=claimed)
                       for i in group)

        assert not pipeline.serve_here(submit, lambda: all(i in collector.answers for i in ids))  # the window holds them
        assert claims == [True]
        for q in lent:  # the caller's memory is reused once execute returns
            for value in q.values():
                value[...] = 0
        assert collector.wait_for(ids)
        for qid, query in zip(ids, queries):
            assert_matches_reference(model, query, collector.one(qid))
