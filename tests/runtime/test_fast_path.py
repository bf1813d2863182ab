"""The fast path (runtime/fast_path.py): a batch that meets nobody runs inline on the caller's thread.

Ordered by events and gated engines, never by time: a run is held inside an engine while other
queries arrive, and the tests check that no stage starts them before the run ends.
"""
from __future__ import annotations

import itertools
import threading
import time
from typing import Any, Mapping

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dvabatch_backend.runtime.admission import STANDING_SECONDS, STANDING_WAIT
from dvabatch_backend.runtime.errors import QueueFullError, StageFailedError
from dvabatch_backend.runtime.inline_hold import ARRIVALS_SECONDS, RateWindow
from dvabatch_backend.runtime.settings import QueuePolicy
from dvabatch_backend.runtime.work import ExecutorState
from policies import RandomLegalPolicy, create_policy
from policies.examples.early_exit import EarlyExitPolicy

from ..conftest import Collector, GatedEngine, SlicedModel, assert_matches_reference, make_scheduler


def batch_of(queries: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {name: np.stack([q[name] for q in queries]) for name in queries[0]}


def assert_rows_match(model: SlicedModel, queries: list[dict[str, np.ndarray]], outputs: Mapping[str, np.ndarray]) -> None:
    for row, query in enumerate(queries):
        for name, ref in model.reference(query).items():
            assert outputs[name].shape[0] == len(queries)
            np.testing.assert_allclose(outputs[name][row], ref, atol=1e-4, rtol=0, err_msg=f"row {row} output {name}")


class Recorder:
    """Wraps engines: records, in one sequence, which thread ran which stage."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []
        self._lock = threading.Lock()

    def note(self, kind: str, what: Any) -> None:
        with self._lock:
            self.events.append((kind, what))

    def wrap(self, stage: int, engine: Any) -> Any:
        recorder = self

        class Recording:
            def run(self, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
                recorder.note("run", (threading.current_thread().name, stage))
                engine.run(inputs, outputs)

        return Recording()


def test_a_lone_batch_runs_inline_on_the_callers_thread(zoo) -> None:
    model = zoo.stages("token", 3)
    recorder = Recorder()
    engines = [recorder.wrap(k, e) for k, e in enumerate(model.engines())]
    rng = np.random.default_rng(0)
    with make_scheduler(model, create_policy("input"), engines) as pipeline:
        queries = [model.query(rng, length=5) for _ in range(3)]
        outputs = pipeline.run_inline(batch_of(queries))
        assert outputs is not None
        assert_rows_match(model, queries, outputs)
        me = threading.current_thread().name
        assert recorder.events == [("run", (me, k)) for k in range(3)]
        assert pipeline.loop.wakeups == 0  # the engine loop was not woken
        stats = pipeline.stats
        assert (stats.inline_runs, stats.inline_queries, stats.submitted, stats.answered_ok) == (1, 3, 3, 3)
        assert stats.new == 0 and len(pipeline.snapshot().rows) == 0


def test_rows_that_are_not_one_batch_or_not_well_formed_are_not_taken(zoo) -> None:
    model = zoo.stages("token", 2)
    rng = np.random.default_rng(1)
    good = batch_of([model.query(rng, length=4) for _ in range(2)])
    with make_scheduler(model, create_policy("input"), bs_max=4) as pipeline:
        too_many = batch_of([model.query(rng, length=4) for _ in range(5)])
        wrong_dtype = {**good, "x": good["x"].astype(np.float64)}
        unbatched = {k: v[0] for k, v in good.items()}
        too_long = batch_of([model.query(rng, length=model.manifest.max_length + 1)])
        missing = {"x": good["x"]}
        for rows in (too_many, wrong_dtype, unbatched, too_long, missing, {}):
            assert pipeline.run_inline(rows) is None
        assert pipeline.stats.inline_runs == 0 and pipeline.stats.inline_fallbacks == 0
        assert pipeline.run_inline(good) is not None


def test_a_fixed_shape_models_rows_are_checked_in_one_comparison_and_bad_ones_not_taken(zoo) -> None:
    """An input of one shape is checked by dtype and shape alone (`BatchCheck`): each way a batch
    of it can be wrong still sends it the usual way, where its rows get their own errors."""
    model = zoo.stages("dense", 2)
    rng = np.random.default_rng(2)
    queries = [model.query(rng) for _ in range(2)]
    good = batch_of(queries)
    (name, x), = good.items()
    with make_scheduler(model, create_policy("load"), bs_max=4, num_buffer_pairs=1) as pipeline:
        bad = {"dtype": x.astype(np.float64), "a dim": np.concatenate([x, x], axis=-1), "unbatched": x[0],
               "a rank more": x[:, None], "no rows": x[:0], "more rows than a batch": np.concatenate([x, x, x]),
               "not an array": x.tolist()}
        for why, tensor in bad.items():
            assert pipeline.run_inline({name: tensor}) is None, why
            assert pipeline.run_inline_requests([good, {name: tensor}], lambda i, out: None) is None, why
        assert pipeline.stats.inline_runs == 0
        answered: dict[int, dict[str, np.ndarray]] = {}
        assert pipeline.run_inline_requests([good, batch_of([model.query(rng)])], answered.__setitem__) == []
        assert_rows_match(model, queries, answered[0])


def test_a_busy_pipeline_refuses_the_fast_path(zoo) -> None:
    model = zoo.stages("token", 2)
    gated = GatedEngine(model.engines()[0])
    rng = np.random.default_rng(2)
    collector = Collector()
    with make_scheduler(model, create_policy("input"), [gated, model.engines()[1]]) as pipeline:
        held = model.query(rng, length=3)
        qid = pipeline.submit(held, collector)
        gated.wait_started()
        assert pipeline.run_inline(batch_of([model.query(rng, length=3)])) is None  # stage 0 is working
        gated.open()
        assert collector.wait_for([qid])
        assert collector.one(qid).ok
        # drained: the fast path serves again
        assert pipeline.wait_until(lambda s: s.pending_count == 0 and ExecutorState.WORKING not in s.executor_states(), 10)
        assert pipeline.run_inline(batch_of([model.query(rng, length=3)])) is not None


def test_queries_arriving_during_an_inline_run_wait_for_it_and_are_answered(zoo) -> None:
    model = zoo.stages("token", 3)
    recorder = Recorder()
    gate = GatedEngine(model.engines()[1])
    engines = [recorder.wrap(k, e) for k, e in enumerate([model.engines()[0], gate, model.engines()[2]])]
    rng = np.random.default_rng(3)
    collector = Collector()
    with make_scheduler(model, create_policy("input"), engines) as pipeline:
        lone = [model.query(rng, length=6)]
        result: dict[str, Any] = {}
        runner = threading.Thread(target=lambda: result.setdefault("out", pipeline.run_inline(batch_of(lone))),
                                  name="inline-caller")
        runner.start()
        gate.wait_started()  # the inline run is inside stage 1
        arrivals = [model.query(rng) for _ in range(4)]
        ids = pipeline.submit_many([(q, collector) for q in arrivals])
        recorder.note("arrived", None)
        assert pipeline.query_states()  # admitted and batched, not run
        assert ExecutorState.WORKING not in pipeline.executor_states()
        gate.open()
        runner.join(10)
        assert not runner.is_alive()
        assert_rows_match(model, lone, result["out"])
        assert collector.wait_for(ids)
        for qid, query in zip(ids, arrivals):
            assert_matches_reference(model, query, collector.one(qid))
        assert pipeline.stats.answered_ok == len(ids) + 1 and pipeline.stats.inline_queries == 1
        assert pipeline.buffer_violations == []
        # between the arrivals and the inline run's last stage, no executor ran anything
        after = recorder.events[recorder.events.index(("arrived", None)):]
        inline_end = after.index(("run", ("inline-caller", 2)))
        assert all(e[1][0] == "inline-caller" for e in after[1:inline_end + 1])
        assert any(e[0] == "run" and e[1][0] != "inline-caller" for e in after[inline_end + 1:])


def test_a_failed_inline_run_answers_nothing_and_the_rows_get_their_own_error(zoo) -> None:
    model = zoo.stages("dense", 3)

    class Failing:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def run(self, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
            raise RuntimeError("injected")

    engines = model.engines()
    engines[1] = Failing(engines[1])
    rng = np.random.default_rng(4)
    collector = Collector()
    with make_scheduler(model, create_policy("load"), engines) as pipeline:
        query = model.query(rng)
        assert pipeline.run_inline(batch_of([query])) is None
        assert pipeline.stats.inline_fallbacks == 1 and pipeline.stats.inline_runs == 0
        qid = pipeline.submit(query, collector)  # the way the caller sends it on
        assert collector.wait_for([qid])
        error = collector.one(qid).error
        assert isinstance(error, StageFailedError) and "stage 1" in str(error) and "injected" in str(error)
        # the pipeline is whole: a good model serves after the failure
        assert pipeline.wait_until(lambda s: s.pending_count == 0, 10)


def test_a_policy_that_may_answer_early_turns_the_fast_path_off(zoo) -> None:
    model = zoo.stages("dense", 2)
    assert not EarlyExitPolicy.allows_inline() and RandomLegalPolicy.allows_inline()
    assert create_policy("hybrid").allows_inline() and create_policy("input").allows_inline()
    with make_scheduler(model, EarlyExitPolicy(exit_stage=0, threshold=0.5)) as pipeline:
        assert pipeline.fast_path_engine == "off"
        assert pipeline.run_inline(batch_of([model.query(np.random.default_rng(5))])) is None
    with make_scheduler(model, create_policy("load"), fast_path=False) as pipeline:
        assert pipeline.fast_path_engine == "off"


# -- the property: the switch under concurrency --------------------------------------------


@st.composite
def schedules(draw: st.DrawFn) -> dict:
    steps = draw(st.lists(st.tuples(
        st.sampled_from(["submit", "inline", "inline_after_drain", "inline_many"]),
        st.integers(1, 5),  # rows
        st.integers(0, 4),  # queries that arrive while an inline run is held
    ), min_size=1, max_size=8))
    return {"kind": draw(st.sampled_from(["token", "dense"])), "stages": draw(st.integers(1, 3)),
            "bs_max": draw(st.integers(2, 6)), "pairs": draw(st.integers(1, 2)), "seed": draw(st.integers(0, 2**16)),
            "p_stretch": draw(st.sampled_from([0.0, 0.7])), "p_split": draw(st.sampled_from([0.0, 0.5])),
            "held_stage": draw(st.integers(0, 2)), "steps": steps}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schedule=schedules())
def test_random_schedules_with_the_fast_path_answer_every_query_once_and_correctly(zoo, schedule: dict) -> None:
    """Requests from several callers: some submitted, some offered to the fast path (refused while the
    pipeline holds anything; then submitted, as the adapter does), some while an inline run is held
    inside a stage. Every query is answered exactly once, equal to the unsliced model; no stage starts
    work while an inline run holds the pipeline; no buffer rule breaks."""
    model = zoo.stages(schedule["kind"], schedule["stages"])
    n = model.manifest.num_stages
    held_stage = min(schedule["held_stage"], n - 1)
    order = itertools.count()
    log: list[tuple[int, str, int]] = []  # (when, thread, stage): every engine run, in one order
    log_lock = threading.Lock()
    hold = threading.Event()  # set: an inline run waits in `held_stage` until `release` is set
    entered, release = threading.Event(), threading.Event()

    def wrap(stage: int, engine: Any) -> Any:
        class Run:
            def run(self, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
                name = threading.current_thread().name
                with log_lock:
                    log.append((next(order), name, stage))
                if name.startswith("inline") and stage == held_stage and hold.is_set():
                    entered.set()
                    assert release.wait(20), "the test never released the inline run"
                engine.run(inputs, outputs)

        return Run()

    engines = [wrap(k, e) for k, e in enumerate(model.engines())]
    policy = RandomLegalPolicy(seed=schedule["seed"], stretch=schedule["p_stretch"], split=schedule["p_split"])
    rng = np.random.default_rng(schedule["seed"])
    collector = Collector()
    sent: dict[int, dict[str, np.ndarray]] = {}
    inline_results: list[tuple[list[dict[str, np.ndarray]], dict[str, np.ndarray]]] = []
    windows: list[tuple[int, str]] = []  # each held inline run: when others began to arrive, its thread

    def rows(count: int) -> list[dict[str, np.ndarray]]:
        length = int(rng.integers(1, model.manifest.max_length + 1))
        return [model.query(rng, length=length) for _ in range(count)]

    with make_scheduler(model, policy, engines, num_buffer_pairs=schedule["pairs"], bs_max=schedule["bs_max"]) as pipeline:
        for i, (kind, count, during) in enumerate(schedule["steps"]):
            queries = rows(min(count, schedule["bs_max"]))
            # several requests, each of its own length, offered to the fast path in one call
            requests = [rows(min(c, schedule["bs_max"])) for c in (count, during + 1, 2)]
            answered: dict[int, dict[str, np.ndarray]] = {}
            if kind == "submit":
                sent.update(zip(pipeline.submit_many([(q, collector) for q in queries]), queries))
                continue
            if kind in ("inline_after_drain", "inline_many"):
                assert pipeline.wait_until(
                    lambda s: s.pending_count == 0 and ExecutorState.WORKING not in s.executor_states(), 20)
            hold.set()
            entered.clear()
            release.clear()
            result: dict[str, Any] = {}
            if kind == "inline_many":
                def offer() -> Any:
                    return pipeline.run_inline_requests([batch_of(r) for r in requests], answered.__setitem__)
            else:
                def offer() -> Any:
                    return pipeline.run_inline(batch_of(queries))
            caller = threading.Thread(target=lambda: result.setdefault("out", offer()), name=f"inline-{i}")
            caller.start()
            while caller.is_alive() and not entered.wait(0.05):
                pass
            if entered.is_set():  # held inside a stage: others arrive now
                with log_lock:
                    first = next(order)
                arrivals = rows(during) if during else []
                if arrivals:
                    sent.update(zip(pipeline.submit_many([(q, collector) for q in arrivals]), arrivals))
                assert ExecutorState.WORKING not in pipeline.executor_states()
                release.set()
            caller.join(20)
            assert not caller.is_alive()
            hold.clear()
            if entered.is_set():
                windows.append((first, caller.name))
            if kind == "inline_after_drain" or (kind == "inline_many" and schedule["pairs"] == 1):
                assert result["out"] is not None, "a drained pipeline refused the fast path"
            if kind == "inline_many":
                left = range(len(requests)) if result["out"] is None else result["out"]
                assert not set(left) & set(answered)  # each request answered one way only
                inline_results += [(requests[j], out) for j, out in answered.items()]
                for j in left:  # refused, or left by a failed batch: the usual way
                    sent.update(zip(pipeline.submit_many([(q, collector) for q in requests[j]]), requests[j]))
            elif result["out"] is None:  # refused: the rows go the usual way
                sent.update(zip(pipeline.submit_many([(q, collector) for q in queries]), queries))
            else:
                inline_results.append((queries, result["out"]))
        assert collector.wait_for(set(sent), timeout=30), f"unanswered: {set(sent) - set(collector.answers)}"
        for queries, outputs in inline_results:
            assert_rows_match(model, queries, outputs)
        assert pipeline.stats.inline_queries == sum(len(q) for q, _ in inline_results)
        pipeline_stats_ok = pipeline.stats.answered_ok - pipeline.stats.inline_queries
        assert pipeline_stats_ok == len(sent)
    for qid, inputs in sent.items():
        assert_matches_reference(model, inputs, collector.one(qid))
    assert pipeline.buffer_violations == []
    for first, caller_name in windows:  # from the arrivals to the run's last stage, no executor started
        last = max(when for when, name, _ in log if name == caller_name)
        assert all(name.startswith("inline") for when, name, _ in log if first < when < last)


@pytest.mark.parametrize("engine", ["stages", "model"])
def test_the_whole_model_or_the_stages_run_the_fast_path(zoo, engine: str) -> None:
    from dvabatch_backend.runtime.engine import OrtStageEngine
    from dvabatch_backend.runtime.pipeline import Pipeline
    from dvabatch_backend.runtime.settings import RuntimeSettings

    model = zoo.stages("token", 3)
    whole = OrtStageEngine(model.dir / "model.onnx") if engine == "model" else None
    pipeline = Pipeline.create(model.manifest, model.engines(), create_policy("input"), RuntimeSettings(),
                               whole_model=whole)
    with pipeline:
        assert pipeline.fast_path_engine == engine
        queries = [model.query(np.random.default_rng(6), length=7) for _ in range(2)]
        outputs = pipeline.run_inline(batch_of(queries))
        assert outputs is not None
        assert_rows_match(model, queries, outputs)


# -- no work dropped: a failure in the runtime's own bookkeeping ----------------------------


@pytest.mark.parametrize("pairs", [1, 2])
def test_a_failure_after_a_stage_answers_its_queries_and_the_pipeline_serves_on(zoo, pairs: int) -> None:
    """`finish_work` raises once (a runtime bug): that batch's queries are answered with an error
    naming the stage and the cause, nothing is left unanswered, and later queries are served."""
    from dvabatch_backend.runtime.pipeline import Pipeline
    from dvabatch_backend.runtime.scheduler import Scheduler
    from dvabatch_backend.runtime.settings import RuntimeSettings

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


def test_several_requests_run_inline_in_the_batches_the_policy_makes(zoo) -> None:
    """Rows of several requests at an empty pipeline: batched as the input policy clusters them
    (close lengths padded together, far ones apart), each request answered once, as soon as its
    last row is done, cut back to its own length."""
    model = zoo.stages("token", 3)
    rng = np.random.default_rng(8)
    with make_scheduler(model, create_policy("input", window=0), bs_max=8, num_buffer_pairs=1) as pipeline:
        requests = [[model.query(rng, length=8) for _ in range(2)], [model.query(rng, length=2)],
                    [model.query(rng, length=9) for _ in range(3)], [model.query(rng, length=12)]]
        answered: list[tuple[int, dict[str, np.ndarray]]] = []
        left = pipeline.run_inline_requests([batch_of(r) for r in requests], lambda i, out: answered.append((i, out)))
        assert left == []
        assert sorted(i for i, _ in answered) == [0, 1, 2, 3]
        for i, outputs in answered:
            assert_rows_match(model, requests[i], outputs)
        stats = pipeline.stats
        assert stats.inline_queries == 7 and stats.answered_ok == 7 and 2 <= stats.inline_runs <= 4
        assert answered[0][0] == 1  # the shortest cluster runs, and is answered, first
        assert stats.new == 0 and len(pipeline.snapshot().rows) == 0


def test_more_rows_than_a_batch_run_inline_as_several_batches(zoo) -> None:
    model = zoo.stages("dense", 2)
    rng = np.random.default_rng(9)
    with make_scheduler(model, create_policy("load"), bs_max=4, num_buffer_pairs=1) as pipeline:
        requests = [[model.query(rng) for _ in range(3)] for _ in range(4)]
        answered: dict[int, dict[str, np.ndarray]] = {}
        assert pipeline.run_inline_requests([batch_of(r) for r in requests], answered.__setitem__) == []
        for i, outputs in answered.items():
            assert_rows_match(model, requests[i], outputs)
        assert len(answered) == 4 and pipeline.stats.inline_runs >= 3


def test_a_batch_failing_midway_leaves_the_requests_it_did_not_answer_to_the_pipeline(zoo) -> None:
    model = zoo.stages("dense", 2)

    class FailsSecond:
        def __init__(self, inner: Any) -> None:
            self.inner, self.runs = inner, 0

        def run(self, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
            self.runs += 1
            if self.runs == 2:
                raise RuntimeError("injected")
            self.inner.run(inputs, outputs)

    engines = model.engines()
    engines[1] = FailsSecond(engines[1])
    rng = np.random.default_rng(10)
    collector = Collector()
    with make_scheduler(model, create_policy("load"), engines, bs_max=2, num_buffer_pairs=1) as pipeline:
        requests = [[model.query(rng) for _ in range(2)] for _ in range(3)]
        answered: dict[int, dict[str, np.ndarray]] = {}
        left = pipeline.run_inline_requests([batch_of(r) for r in requests], answered.__setitem__)
        assert left and not set(left) & set(answered) and set(left) | set(answered) == {0, 1, 2}
        assert pipeline.stats.inline_fallbacks == 1
        for i, outputs in answered.items():
            assert_rows_match(model, requests[i], outputs)
        ids = pipeline.submit_many([(q, collector) for i in left for q in requests[i]])  # as the adapter does
        assert collector.wait_for(ids)
        for qid, query in zip(ids, [q for i in left for q in requests[i]]):
            assert_matches_reference(model, query, collector.one(qid))


def test_a_model_that_is_not_pad_safe_gets_one_inline_batch_per_length(zoo) -> None:
    import dataclasses

    from dvabatch_backend.runtime.pipeline import Pipeline
    from dvabatch_backend.runtime.settings import RuntimeSettings

    model = zoo.stages("token", 2)
    recorder = Recorder()
    manifest = dataclasses.replace(model.manifest, pad_safe=False)
    engines = [recorder.wrap(k, e) for k, e in enumerate(model.engines())]
    rng = np.random.default_rng(11)
    with Pipeline.create(manifest, engines, create_policy("input", window=0), RuntimeSettings(num_buffer_pairs=1)) as pipeline:
        requests = [[model.query(rng, length=8)], [model.query(rng, length=9)], [model.query(rng, length=8)]]
        answered: dict[int, dict[str, np.ndarray]] = {}
        assert pipeline.run_inline_requests([batch_of(r) for r in requests], answered.__setitem__) == []
        assert pipeline.stats.inline_runs == 2  # lengths 8 and 9 apart, never padded together
        for i, outputs in answered.items():
            assert_rows_match(model, requests[i], outputs)


def test_with_overlapping_stages_only_a_lone_request_takes_the_fast_path(zoo) -> None:
    """Two buffer pairs: the pipeline overlaps stages, so several requests' batches go there."""
    model = zoo.stages("dense", 2)
    rng = np.random.default_rng(12)
    with make_scheduler(model, create_policy("load"), num_buffer_pairs=2) as pipeline:
        requests = [batch_of([model.query(rng)]) for _ in range(2)]
        assert pipeline.run_inline_requests(requests, lambda i, out: None) is None
        assert pipeline.run_inline(requests[0]) is not None


def test_a_request_whose_answer_cannot_be_taken_goes_the_usual_way(zoo) -> None:
    """`answer` raising for a request (its response could not be built): that request, and those not
    yet run, are left to the caller; the ones answered before stay answered, none twice."""
    model = zoo.stages("token", 2)
    rng = np.random.default_rng(13)
    with make_scheduler(model, create_policy("input", window=0), bs_max=8, num_buffer_pairs=1) as pipeline:
        requests = [batch_of([model.query(rng, length=n)]) for n in (2, 12, 3)]
        answered: list[int] = []

        def answer(i: int, outputs: dict[str, np.ndarray]) -> None:
            if i == 1:
                raise RuntimeError("cannot build the response")
            answered.append(i)

        left = pipeline.run_inline_requests(requests, answer)
        assert left is not None and 1 in left and not set(left) & set(answered)
        assert set(left) | set(answered) == {0, 1, 2}
        assert pipeline.stats.inline_fallbacks == 1


def test_a_request_cancelled_while_it_waits_for_an_earlier_inline_batch_is_not_run(zoo) -> None:
    """Several requests inline run batch after batch: before each batch after the first, its requests
    are asked whether they were cancelled (once each); a cancelled one's rows are left out, it is
    returned among those not answered, and every other request is answered with its own rows."""
    model = zoo.stages("dense", 2)
    rng = np.random.default_rng(12)
    with make_scheduler(model, create_policy("load"), bs_max=4, num_buffer_pairs=1) as pipeline:
        requests = [[model.query(rng) for _ in range(3)] for _ in range(4)]  # 12 rows: 3 batches of 4
        answered: dict[int, dict[str, np.ndarray]] = {}
        asked: list[int] = []

        def cancelled(i: int) -> bool:
            asked.append(i)
            return i == 2

        left = pipeline.run_inline_requests([batch_of(r) for r in requests], answered.__setitem__, cancelled)
        assert left == [2]
        assert sorted(answered) == [0, 1, 3]
        for i, outputs in answered.items():
            assert_rows_match(model, requests[i], outputs)
        assert 0 not in asked and len(asked) == len(set(asked)), asked  # the first batch's requests were not waiting
        assert 2 in asked
        stats = pipeline.stats
        assert stats.inline_queries == 9 and stats.answered_ok == 9
        assert stats.inline_fallbacks == 0  # a cancellation is no failure
        assert len(pipeline.snapshot().rows) == 0


def test_a_calls_rows_run_in_call_batches_each_request_answered_as_its_batch_is_done(zoo) -> None:
    """A call's rows run in batches of at most `Admission.call_batch` (set by hand here: the test
    model's profile is too quick for one), each request answered as its batch is done, full or
    not; at bs_max, as the policy batches them (one batch). Every answer is the model's."""
    model = zoo.stages("token", 2)
    pipeline = make_scheduler(model, create_policy("load"), num_buffer_pairs=1)
    rng = np.random.default_rng(0)
    queries = [model.query(rng, length=6) for _ in range(3)]
    requests = [{k: v[None] for k, v in q.items()} for q in queries]
    order: list[int] = []
    answers: dict[int, Any] = {}

    def answer(i: int, outputs: Any) -> None:
        order.append(i)
        answers[i] = outputs

    assert pipeline.run_inline_group(requests, answer) == []
    assert pipeline.stats.inline_runs == 1 and order == [0, 1, 2]  # call_batch is bs_max: one batch
    pipeline.scheduler.admission.call_batch = 1
    for full in (False, True):
        order.clear()
        answers.clear()
        assert pipeline.run_inline_group(requests, answer, full=full) == []
        assert order == [0, 1, 2]
        for i, query in enumerate(queries):
            for name, rows in answers[i].items():
                np.testing.assert_allclose(rows[0], model.reference(query)[name], atol=1e-4, rtol=0)
    assert pipeline.stats.inline_runs == 1 + 3 + 3 and pipeline.stats.inline_queries == 9


def test_between_a_calls_batches_the_caller_hears_what_was_answered_before_the_next_runs(zoo) -> None:
    """`between_batches` runs before each batch after the first, once the earlier batches'
    requests are answered (the adapter sends those then); a call run as one batch never calls it
    (the adapter returns its answers from `execute`: one message, not a send each)."""
    model = zoo.stages("token", 2)
    pipeline = make_scheduler(model, create_policy("load"), num_buffer_pairs=1)
    rng = np.random.default_rng(0)
    requests = [{k: v[None] for k, v in model.query(rng, length=6).items()} for _ in range(3)]
    events: list[Any] = []
    answer = lambda i, outputs: events.append(i)  # noqa: E731
    between = lambda: events.append("between")  # noqa: E731
    assert pipeline.run_inline_group(requests, answer, between_batches=between) == []
    assert events == [0, 1, 2]  # call_batch is bs_max: one batch, nothing between
    pipeline.scheduler.admission.call_batch = 1
    events.clear()
    assert pipeline.run_inline_group(requests, answer, between_batches=between) == []
    assert events == [0, "between", 1, "between", 2]


class _Calls:
    """A caller's calls of two one-row requests on the fast path (`run_inline_group`), each told
    whether it came full: "served" (each answer the model's), "refused" (both, "Exceeds maximum
    queue size") or "handed over" (both left to the pipeline)."""

    def __init__(self, model: SlicedModel) -> None:
        rng = np.random.default_rng(0)
        self.model = model
        self.queries = [model.query(rng) for _ in range(2)]
        self.requests = [{k: v[None] for k, v in q.items()} for q in self.queries]

    def __call__(self, pipeline, full: bool) -> str:
        answered: dict[int, Any] = {}
        refused: dict[int, Any] = {}
        left = pipeline.run_inline_group(self.requests, answered.__setitem__, full=full, refuse=refused.__setitem__)
        if left == [0, 1] and not answered and not refused:
            return "handed over"
        assert left == []
        if refused:
            assert sorted(refused) == [0, 1] and not answered
            assert all(isinstance(e, QueueFullError) and "Exceeds maximum queue size" in str(e) for e in refused.values())
            return "refused"
        for i, query in enumerate(self.queries):
            for name, rows in answered[i].items():
                np.testing.assert_allclose(rows[0], self.model.reference(query)[name], atol=1e-4, rtol=0)
        return "served"


def _drains_until_forgotten(call: _Calls, pipeline, now: list[float], then: str) -> None:
    """From a full call due to drain: two calls refused whole, until one is not full; with overload
    known, STANDING_WAIT of full calls drains again; no full call for STANDING_SECONDS forgets it,
    and STANDING_WAIT of full calls then gives `then` (where the first phase leads)."""
    assert [call(pipeline, True) for _ in range(2)] == ["refused", "refused"]  # drained ...
    assert call(pipeline, False) == "served"  # ... until a call is not full
    assert call(pipeline, True) == "served"
    now[0] += STANDING_WAIT + 0.01
    assert call(pipeline, True) == "refused"  # the overload is known: half a second of full calls
    assert call(pipeline, False) == "served"
    now[0] += STANDING_SECONDS + 0.1  # no full call for that long: over
    assert call(pipeline, True) == "served"
    now[0] += STANDING_WAIT + 0.01
    assert call(pipeline, True) == then


def test_quick_batches_drain_the_callers_queue_once_its_calls_came_full_for_long(zoo) -> None:
    """Where a bs_max batch passes quickly (not `Admission.long_passage`), calls that came full for
    STANDING_SECONDS are refused whole, "Exceeds maximum queue size", until one comes that is not
    full; after a drain, STANDING_WAIT of full calls drains again, until no call came full for
    STANDING_SECONDS; nothing is handed over. The calls served meanwhile are answered inline, each
    the model's."""
    model = zoo.stages("token", 2)
    now = [0.0]
    call = _Calls(model)
    pipeline = make_scheduler(model, create_policy("load"), clock=lambda: now[0], num_buffer_pairs=1)
    assert not pipeline.scheduler.admission.long_passage  # the test model's batches are quick
    assert call(pipeline, True) == "served"
    now[0] += STANDING_SECONDS - 0.1
    assert call(pipeline, True) == "served"  # full, but not for long enough: a burst
    now[0] += 0.2
    _drains_until_forgotten(call, pipeline, now, then="served")
    assert pipeline.stats.queue_full == 6 and pipeline.stats.caller_drains == 2
    assert pipeline.stats.inline_handovers == 0


def test_long_batches_hand_the_callers_queue_over_then_drain_it_once_overload_is_known(zoo) -> None:
    """Where a bs_max batch's passage is long (`Admission.long_passage`), calls that came full
    STANDING_CALLS times and for STANDING_WAIT are handed to the pipeline (its admission sees each
    arrival; a burst is carried, not refused), until a call is not full. Once the pipeline's door
    has shut (overload known), STANDING_WAIT of full calls drains: they are refused whole, "Exceeds
    maximum queue size", until one comes that is not full; the next drain comes after STANDING_WAIT
    again, until no call came full for STANDING_SECONDS, when full calls are handed over again.
    The calls served meanwhile are answered inline, each the model's. A configured bound drains
    nothing: its full calls are handed over, where that bound applies."""
    model = zoo.stages("token", 2)
    now = [0.0]
    call = _Calls(model)
    pipeline = make_scheduler(model, create_policy("load"), clock=lambda: now[0], num_buffer_pairs=1)
    admission = pipeline.scheduler.admission
    admission.long_passage = True  # as if a bs_max batch took long
    assert call(pipeline, True) == "served"
    now[0] += STANDING_WAIT - 0.1
    assert call(pipeline, True) == "served"  # full, but not for long enough
    now[0] += 0.2
    assert [call(pipeline, True) for _ in range(2)] == ["handed over", "handed over"]  # the pipeline judges ...
    assert call(pipeline, False) == "served"  # ... until a call is not full
    assert pipeline.stats.caller_drains == 0 and pipeline.stats.queue_full == 0
    # the pipeline's queue stood STANDING_SECONDS and a request would wait past STANDING_WAIT: its door shuts
    assert admission.door_refusal(now[0], 10 ** 6, now[0] - STANDING_SECONDS - 0.1, idle=False) is not None
    assert admission.door_refusal(now[0], 0, None, idle=True) is None  # the pipeline emptied: open again
    assert call(pipeline, True) == "served"  # overload known: full calls stay here ...
    now[0] += STANDING_WAIT + 0.01
    _drains_until_forgotten(call, pipeline, now, then="handed over")
    assert pipeline.stats.queue_full == 6 and pipeline.stats.caller_drains == 2

    configured = make_scheduler(model, create_policy("load"), clock=lambda: now[0], num_buffer_pairs=1,
                                queue=QueuePolicy(max_queue_size=100))
    assert not configured.scheduler.admission.long_passage  # quick batches too
    assert call(configured, True) == "served"
    now[0] += STANDING_SECONDS + 0.1
    assert call(configured, True) == "handed over"  # the user's bound applies in the pipeline
    assert configured.stats.inline_handovers == 1 and configured.scheduler.inline.handed_over
    assert call(configured, False) == "served" and not configured.scheduler.inline.handed_over
    assert configured.stats.queue_full == 0 and configured.stats.caller_drains == 0


def test_the_pipeline_judges_only_arrivals_that_outpace_the_fast_paths_full_calls(zoo) -> None:
    """`InlineHold.arrivals_outpace`: the caller's rows over the last ARRIVALS_SECONDS against the rate
    the fast path served full calls at (OUTPACED times it): a load the fast path carries (0.9x) goes
    back to it, an overload (3x) stays with the pipeline's admission; before a full call was served,
    the pipeline judges. The rate window forgets what is older than its span."""
    window = RateWindow(1.0)
    window.note(0.0, 4)
    window.note(0.5, 6)
    assert window.rate(0.9) == pytest.approx(10.0) and window.rate(1.2) == pytest.approx(6.0)
    assert window.rate(3.0) == 0.0
    model = zoo.stages("token", 2)
    now = [0.0]
    call = _Calls(model)
    pipeline = make_scheduler(model, create_policy("load"), clock=lambda: now[0], num_buffer_pairs=1)
    hold = pipeline.scheduler.inline
    assert hold.arrivals_outpace(now[0])  # no full call served yet
    assert call(pipeline, True) == "served"  # a full call of 2 rows, run ...
    rate = hold._full_rate
    assert rate is not None and rate > 0  # ... at the rate the fast path serves full calls
    now[0] += 10.0
    for _ in range(int(0.9 * rate * ARRIVALS_SECONDS)):  # 0.9x of that rate over the window, a row a call
        hold.caller_backlog(False, 1)
    assert not hold.arrivals_outpace(now[0])
    for _ in range(int(2.1 * rate * ARRIVALS_SECONDS)):  # 3x
        hold.caller_backlog(False, 1)
    assert hold.arrivals_outpace(now[0])
    now[0] += ARRIVALS_SECONDS + 0.01
    assert not hold.arrivals_outpace(now[0])  # forgotten


def test_with_one_pair_a_run_waits_for_the_pipeline_to_empty_and_is_served_inline(zoo) -> None:
    """One buffer pair: the pipeline runs one batch at a time, more slowly than the fast path, so a
    run that finds it busy waits for it to empty (`InlineHold.reserve`), then runs inline, rather
    than queue behind it; one whose rows have a deadline (`wait=False`) goes to the pipeline at
    once. The pipeline's batch is held in stage 0 (a gated engine) until the run waits on the
    scheduler's progress; then both are answered, each the model's."""
    model = zoo.stages("token", 2)
    gated = GatedEngine(model.engines()[0])
    rng = np.random.default_rng(5)
    collector = Collector()
    with make_scheduler(model, create_policy("input"), [gated, model.engines()[1]], num_buffer_pairs=1) as pipeline:
        held = model.query(rng, length=3)
        qid = pipeline.submit(held, collector)
        gated.wait_started()
        lone = [model.query(rng, length=4)]
        assert pipeline.run_inline(batch_of(lone), wait=False) is None  # rows with a deadline: not waited
        result: dict[str, Any] = {}
        runner = threading.Thread(target=lambda: result.setdefault("out", pipeline.run_inline(batch_of(lone))),
                                  name="inline-caller")
        runner.start()
        progress, deadline = pipeline.scheduler.progress, time.monotonic() + 10
        while not progress.waiters and time.monotonic() < deadline:  # until the run waits for the pipeline
            time.sleep(0.001)
        assert progress.waiters == 1
        gated.open()
        runner.join(10)
        assert not runner.is_alive()
        assert result["out"] is not None  # served inline, not left to the pipeline
        assert_rows_match(model, lone, result["out"])
        assert collector.wait_for([qid]) and collector.one(qid).ok
        assert pipeline.stats.inline_queries == 1
