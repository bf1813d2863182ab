"""One query's fault is its own: when an engine fails on a batch, the rows that fail alone are the
only ones answered with the error; every other query of the batch gets its correct answer."""
from __future__ import annotations

from typing import Mapping

import numpy as np

from dvabatch_backend import RuntimeSettings, Scheduler, StageFailedError, run_until_idle, run_work
from policies import create_policy

from ..conftest import Collector, assert_matches_reference

POISON = 1e6  # a row whose first value is this makes the engine raise, as a bad index would


class PoisonedEngine:
    """A real engine that raises when any row it is given carries the poison value."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls = 0

    def run(self, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
        self.calls += 1
        if any(np.any(arr.reshape(arr.shape[0], -1)[:, 0] == POISON) for arr in inputs.values() if arr.dtype.kind == "f"):
            raise RuntimeError("indices element out of data bounds")
        self.inner.run(inputs, outputs)


def test_only_the_poisoned_query_of_a_batch_fails(zoo) -> None:
    model = zoo.stages("token", 3)
    engines = model.engines()
    engines[0] = PoisonedEngine(engines[0])
    scheduler = Scheduler(model.manifest, create_policy("pipelined"), RuntimeSettings(bs_max=8))
    rng = np.random.default_rng(21)
    queries = [model.query(rng) for _ in range(6)]
    queries[2]["x"][0, 0] = POISON
    collector = Collector()
    ids = scheduler.submit_many([(q, collector) for q in queries])

    run_until_idle(scheduler, engines)

    assert scheduler.stats.stages[0].batches == 1  # all six ran as one batch at stage 0
    bad = collector.one(ids[2])
    assert isinstance(bad.error, StageFailedError) and bad.error.stage == 0
    assert "out of data bounds" in str(bad.error)
    for qid, inputs in zip(ids, queries):
        if qid != ids[2]:
            assert_matches_reference(model, inputs, collector.one(qid))
    assert engines[0].calls == 1 + 6  # the batch, then each row alone
    assert scheduler.pending_count == 0 and scheduler.buffer_violations == []


def test_a_batch_whose_rows_all_fail_alone_fails_whole(zoo) -> None:
    model = zoo.stages("token", 2)
    engines = model.engines()
    engines[1] = PoisonedEngine(engines[1])
    scheduler = Scheduler(model.manifest, create_policy("pipelined"), RuntimeSettings(bs_max=4))
    rng = np.random.default_rng(22)
    queries = [model.query(rng) for _ in range(3)]
    collector = Collector()
    ids = scheduler.submit_many([(q, collector) for q in queries])
    work = scheduler.next_work(0)
    assert work is not None
    scheduler.finish_work(work, run_work(work, engines[0], scheduler))
    work = scheduler.next_work(1)
    assert work is not None
    work.inputs[next(iter(work.inputs))].reshape(len(work.queries), -1)[:, 0] = POISON  # every row poisoned
    scheduler.finish_work(work, run_work(work, engines[1], scheduler))
    assert all(isinstance(collector.one(q).error, StageFailedError) for q in ids)
