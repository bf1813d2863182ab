"""Stopping the runtime answers every pending query and joins every thread."""
from __future__ import annotations

import threading

import numpy as np

from dvabatch_backend import ShuttingDownError
from policies import PipelinedPolicy

from ..conftest import Collector, GatedEngine, assert_matches_reference, make_scheduler


def test_stop_with_batches_in_flight_answers_everything_and_joins(zoo) -> None:
    model = zoo.stages("token", 4)
    engines = model.engines()
    last = engines[-1] = GatedEngine(engines[-1])  # the test decides when batches leave
    scheduler = make_scheduler(model, PipelinedPolicy(), engines, num_buffer_pairs=2, bs_max=2)
    rng = np.random.default_rng(3)
    collector = Collector()
    scheduler.start()
    queries = [model.query(rng) for _ in range(30)]
    ids = [i for k in range(0, 30, 2) for i in scheduler.submit_many([(q, collector) for q in queries[k:k + 2]])]
    # batches of 2 (bs_max): the first leaves; the second is mid-run in the last stage, others queue in earlier stages
    last.wait_started()
    last.release()
    assert collector.wait_for(ids[:2])
    last.wait_started()
    assert scheduler.wait_until(lambda s: s.stats.stages[0].batches >= 3, 10)
    stopper = threading.Thread(target=scheduler.stop)
    stopper.start()
    assert collector.wait_for(ids, timeout=10)  # everything answered while the last stage still runs
    last.open()
    stopper.join(10)
    assert not stopper.is_alive() and not any(t.is_alive() for t in scheduler.threads)
    assert set(collector.answers) == set(ids)
    results = [collector.one(q) for q in ids]  # once each, also the batch that was mid-run
    for answer, inputs in zip(results[:2], queries[:2]):
        assert_matches_reference(model, inputs, answer)
    for answer in results[2:]:  # nothing more ran to the end after stop
        assert isinstance(answer.error, ShuttingDownError) and "shutting down" in str(answer.error)
    # after stop: new queries get the same clear answer at once, and stop is idempotent
    late = scheduler.submit(model.query(rng), collector)
    assert isinstance(collector.one(late).error, ShuttingDownError)
    scheduler.stop()
    assert not any(t.is_alive() for t in scheduler.threads)


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
    # later stops, concurrent ones, return once everything is stopped: the first stop came from a
    # reply callback and could not join its own thread, so it must not leave them waiting
    # (the 10 s bound is only how long the test waits for a hang to show)
    stoppers = [threading.Thread(target=scheduler.stop) for _ in range(2)]
    for stopper in stoppers:
        stopper.start()
    for stopper in stoppers:
        stopper.join(10)
    assert not any(s.is_alive() for s in stoppers), "a later stop() hung after a stop() from a reply callback"
    assert not any(t.is_alive() for t in scheduler.threads)
    assert collector.one(first).ok
