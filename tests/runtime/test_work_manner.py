"""Work manner (paper §6.2): one buffer pair runs the pipeline serially, two let stages overlap."""
from __future__ import annotations

import numpy as np

from policies import PipelinedPolicy

from ..conftest import Collector, SlowEngine, make_scheduler


def _run_intervals(zoo, pairs: int) -> list[tuple[float, float, int]]:
    model = zoo.stages("token", 4)
    engines = [SlowEngine(e, 0.002) for e in model.engines()]
    scheduler = make_scheduler(model, PipelinedPolicy(), engines, num_buffer_pairs=pairs, bs_max=2)
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
    intervals = _run_intervals(zoo, pairs=1)
    assert len(intervals) == 12 * 4
    assert _overlaps(intervals) == 0
    # serial also means each batch goes through every stage before the next batch starts
    assert [stage for _, _, stage in intervals] == [0, 1, 2, 3] * 12


def test_two_buffer_pairs_overlap_stages_under_load(zoo) -> None:
    intervals = _run_intervals(zoo, pairs=2)
    assert len(intervals) == 12 * 4
    assert _overlaps(intervals) >= 6
