"""Stopping the runtime answers every pending query and joins every thread."""
from __future__ import annotations

import threading
import time

import numpy as np

from dvabatch_backend import ShuttingDownError
from policies import PipelinedPolicy

from ..conftest import Collector, SlowEngine, assert_matches_reference, make_scheduler


def test_stop_with_batches_in_flight_answers_everything_and_joins(zoo) -> None:
    model = zoo.stages("token", 4)
    engines = [SlowEngine(e, 0.01) for e in model.engines()]
    scheduler = make_scheduler(model, PipelinedPolicy(), engines, num_buffer_pairs=2, bs_max=2)
    rng = np.random.default_rng(3)
    collector = Collector()
    scheduler.start()
    queries = [model.query(rng) for _ in range(30)]
    ids = [scheduler.submit(q, collector) for q in queries]
    # some batches have finished, others are in flight in several stages
    assert scheduler.wait_until(lambda s: s.stats.answered_ok >= 2 and s.stats.stages[1].batches >= 2, 10)
    t0 = time.perf_counter()
    scheduler.stop()
    assert time.perf_counter() - t0 < 5
    assert not any(t.is_alive() for t in scheduler.threads)
    assert set(collector.answers) == set(ids)
    results = [collector.one(q) for q in ids]
    finished = [(a, q) for a, q in zip(results, queries) if a.ok]
    stopped = [a for a in results if not a.ok]
    assert finished and stopped
    for answer, inputs in finished:
        assert_matches_reference(model, inputs, answer)
    for answer in stopped:
        assert isinstance(answer.error, ShuttingDownError) and "shutting down" in str(answer.error)
    # after stop: new queries get the same clear answer at once, and stop is idempotent
    late = scheduler.submit(model.query(rng), collector)
    assert isinstance(collector.one(late).error, ShuttingDownError)
    scheduler.stop()
    assert threading.active_count() >= 1


def test_stop_while_a_stage_is_mid_run_does_not_answer_twice(zoo) -> None:
    model = zoo.stages("dense", 2)
    started, release = threading.Event(), threading.Event()

    class Blocking:
        def __init__(self, inner) -> None:
            self.inner = inner

        def run(self, inputs, outputs) -> None:
            started.set()
            release.wait(10)
            self.inner.run(inputs, outputs)

    engines = model.engines()
    engines[1] = Blocking(engines[1])
    scheduler = make_scheduler(model, PipelinedPolicy(), engines)
    collector = Collector()
    scheduler.start()
    qid = scheduler.submit(model.query(np.random.default_rng(4)), collector)
    assert started.wait(10)
    stopper = threading.Thread(target=scheduler.stop)
    stopper.start()
    assert collector.wait_for([qid], timeout=10)  # answered "shutting down" before the stage returns
    release.set()
    stopper.join(10)
    assert not stopper.is_alive() and not any(t.is_alive() for t in scheduler.threads)
    assert isinstance(collector.one(qid).error, ShuttingDownError)


def test_stop_from_a_reply_callback_and_concurrent_stops(zoo) -> None:
    model = zoo.stages("dense", 3)
    scheduler = make_scheduler(model, PipelinedPolicy())
    collector = Collector()
    rng = np.random.default_rng(5)

    def stop_on_first_answer(answer) -> None:
        collector(answer)
        scheduler.stop()  # runs on the last stage's thread: must not try to join itself

    scheduler.start()
    first = scheduler.submit(model.query(rng), stop_on_first_answer)
    assert collector.wait_for([first])
    others = threading.Thread(target=scheduler.stop)
    others.start()
    scheduler.stop()  # a concurrent stop returns only once everything is stopped
    others.join(10)
    assert not any(t.is_alive() for t in scheduler.threads)
    assert collector.one(first).ok
