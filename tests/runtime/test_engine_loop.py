"""The engine loop (runtime/engine_loop.py): one owner of the engines. Ordered with gated engines
and events; no timing in the assertions."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from dvabatch_backend.runtime.errors import CancelledError, EngineLoopDiedError, StageFailedError
from dvabatch_backend.runtime.pipeline import Pipeline
from dvabatch_backend.runtime.query import QueryState
from dvabatch_backend.runtime.scheduler import Scheduler
from dvabatch_backend.runtime.settings import RuntimeSettings
from dvabatch_backend.runtime.work import Launch, launching
from policies import PipelinedPolicy, RandomLegalPolicy, create_policy

from ..conftest import Collector, GatedEngine, LaunchLedger, assert_matches_reference, make_scheduler


def test_while_stage_0_is_held_the_loop_admits_answers_and_launches_on_free_stages(zoo) -> None:
    """Two pairs, three stages. Batch A passes stage 0; batch B's stage 0 is then held. Meanwhile A
    runs stages 1 and 2 and is answered, and C is admitted: stage 0's held completion blocks nothing
    but stage 0."""
    model = zoo.stages("token", 3)
    engines = model.engines()
    gate = GatedEngine(engines[0])
    ledger = LaunchLedger()
    pipeline = ledger.watch(make_scheduler(model, PipelinedPolicy(), ledger.wrap([gate, *engines[1:]]),
                                           num_buffer_pairs=2, bs_max=1, fast_path=False))
    rng = np.random.default_rng(1)
    collector = Collector()
    queries = [model.query(rng) for _ in range(3)]
    with pipeline:
        [a] = pipeline.submit_many([(queries[0], collector)])
        gate.wait_started()
        [b] = pipeline.submit_many([(queries[1], collector)])
        gate.release()  # A leaves stage 0 ...
        gate.wait_started()  # ... and B's run at stage 0 is held from here on
        assert collector.wait_for([a])  # A's stages 1 and 2 ran and it was answered meanwhile
        [c] = pipeline.submit_many([(queries[2], collector)])
        states = pipeline.query_states()
        assert states[b] is QueryState.RUNNING and states[c] in (QueryState.WAITING, QueryState.BATCHED)
        assert b not in collector.answers and c not in collector.answers
        gate.open()
        assert collector.wait_for([b, c])
    for qid, inputs in zip((a, b, c), queries):
        assert_matches_reference(model, inputs, collector.one(qid))
    assert ledger.violations == [] and pipeline.buffer_violations == []


class _DiesOnWindow(Scheduler):
    """A scheduler whose batch-window call raises once `armed`: a fault in the loop itself."""

    armed = threading.Event()

    def on_window(self):  # type: ignore[no-untyped-def]
        if self.armed.is_set():
            raise RuntimeError("a bug in the loop's step")
        return super().on_window()


def test_when_the_loop_dies_every_query_gets_an_internal_error_and_none_hangs(zoo) -> None:
    model = zoo.stages("dense", 2)
    engines = model.engines()
    gate = GatedEngine(engines[0])
    scheduler = _DiesOnWindow(model.manifest, PipelinedPolicy(), RuntimeSettings(fast_path=False))
    collector = Collector()
    rng = np.random.default_rng(2)
    with Pipeline(scheduler, [gate, *engines[1:]]) as pipeline:
        [first] = pipeline.submit_many([(model.query(rng), collector)])
        gate.wait_started()
        [waiting] = pipeline.submit_many([(model.query(rng), collector)])
        scheduler.armed.set()
        gate.open()  # the step after the first run's completion raises
        assert collector.wait_for([first, waiting])
        pipeline.loop.thread.join(10)
        assert not pipeline.loop.thread.is_alive() and isinstance(pipeline.loop.died, RuntimeError)
        late = pipeline.submit(model.query(rng), collector)  # refused at once, not queued for nobody
        assert collector.wait_for([late])
    for qid in (waiting, late):
        error = collector.one(qid).error
        assert isinstance(error, EngineLoopDiedError) and "a bug in the loop's step" in str(error)
    assert collector.one(first).error is None or isinstance(collector.one(first).error, EngineLoopDiedError)


@pytest.mark.parametrize("pairs", [1, 2])
def test_a_failed_entry_wait_answers_that_batch_and_the_loop_serves_on(zoo, pairs: int) -> None:
    """The wait for the device after stage 0 (`Pipeline.wait_at_entry`) fails once: that batch's
    queries get the error naming stage 0, later ones their answers."""
    model = zoo.stages("dense", 3)
    failures = iter([True])

    def wait() -> None:
        if next(failures, False):
            raise RuntimeError("device fault")

    pipeline = make_scheduler(model, create_policy("load"), num_buffer_pairs=pairs, fast_path=False)
    pipeline.wait_at_entry(wait)
    collector = Collector()
    rng = np.random.default_rng(3)
    with pipeline:
        [bad] = pipeline.submit_many([(model.query(rng), collector)])
        assert collector.wait_for([bad])
        good_inputs = model.query(rng)
        [good] = pipeline.submit_many([(good_inputs, collector)])
        assert collector.wait_for([good])
    error = collector.one(bad).error
    assert isinstance(error, StageFailedError) and error.stage == 0 and "device fault" in str(error)
    assert_matches_reference(model, good_inputs, collector.one(good))


def test_a_cancelled_query_leaves_at_the_next_step_and_the_others_are_answered(zoo) -> None:
    """A batched query cancelled while stage 0 runs another batch leaves when a step next reaches
    stage 0 (answered "cancelled", never run); the batch beside it is answered."""
    model = zoo.stages("dense", 2)
    engines = model.engines()
    gate = GatedEngine(engines[0])
    pipeline = make_scheduler(model, create_policy("load"), [gate, *engines[1:]], bs_max=1, fast_path=False)
    collector = Collector()
    rng = np.random.default_rng(4)
    inputs = [model.query(rng) for _ in range(3)]
    with pipeline:
        [running] = pipeline.submit_many([(inputs[0], collector)])
        gate.wait_started()
        [cancelled] = pipeline.submit_many([(inputs[1], collector)])
        [kept] = pipeline.submit_many([(inputs[2], collector)])
        pipeline.cancel([cancelled])
        gate.open()
        assert collector.wait_for([running, cancelled, kept])
    assert isinstance(collector.one(cancelled).error, CancelledError)
    for qid, query in ((running, inputs[0]), (kept, inputs[2])):
        assert_matches_reference(model, query, collector.one(qid))
    assert gate.started.acquire(timeout=0) and not gate.started.acquire(timeout=0)  # stage 0 ran one more batch: kept's


@pytest.mark.parametrize("pairs", [1, 2])
def test_every_launch_of_the_pipeline_is_a_row_of_the_batch_table(zoo, pairs: int) -> None:
    """Random arrivals under random legal `new`, `stretch` and `split`: each launch's batch is a row
    of the batch table holding the launch's queries while it runs (the ledger checks `snapshot()`)."""
    model = zoo.stages("token", 3)
    ledger = LaunchLedger()
    policy = RandomLegalPolicy(seed=pairs, stretch=0.8, split=0.5, hold=0.1)
    pipeline = ledger.watch(make_scheduler(model, policy, ledger.wrap(model.engines()), num_buffer_pairs=pairs,
                                           fast_path=False), tabled=True)
    rng = np.random.default_rng(pairs)
    collector = Collector()
    sent: dict[int, dict[str, np.ndarray]] = {}
    with pipeline:
        for _ in range(40):
            batch = [model.query(rng) for _ in range(int(rng.integers(1, 4)))]
            sent.update(zip(pipeline.submit_many([(q, collector) for q in batch]), batch))
        assert collector.wait_for(set(sent), timeout=60)
    for qid, inputs in sent.items():
        assert_matches_reference(model, inputs, collector.one(qid))
    assert ledger.launches > 0 and ledger.violations == []


class _Noop:
    def run(self, inputs, outputs) -> None:  # type: ignore[no-untyped-def]
        pass


def test_the_ledger_names_a_launch_whose_batch_the_table_does_not_hold(zoo) -> None:
    model = zoo.stages("dense", 2)
    ledger = LaunchLedger()
    (engine,) = ledger.wrap([_Noop()])
    pipeline = ledger.watch(make_scheduler(model, PipelinedPolicy(), model.engines()), tabled=True)
    with launching(Launch(0, 1, False, batch=7, queries=(3,))):  # the table is empty
        engine.run({}, {})
    assert ledger.violations == ["engine 0: launched on MainThread batch 7 of queries [3], which the batch table "
                                 "does not hold"]
