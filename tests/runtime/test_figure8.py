"""The paper's Figure 8, replayed step by step on four stages: new 2 queries -> stretch 2 more
while stage 2 runs -> split at stage 3. Stage numbers in comments are the paper's (1-based);
code uses 0-based indices."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from dvabatch_backend import ArrivalPlan, BatchItem, ExecutorState, New, Policy, Split, Stretch
from dvabatch_backend.runtime.batch_table import BatchInfo
from dvabatch_backend.runtime.decisions import BatchTableView, QueryInfo

from ..conftest import Collector, GatedEngine, assert_matches_reference, make_scheduler


class Figure8Policy(Policy):
    """New for the first arrival, stretch the latest batch for the next, split 2+2 after stage 3."""

    name = "figure8"

    def on_arrival(self, waiting: Sequence[QueryInfo], table: BatchTableView, now: float) -> ArrivalPlan:
        ids = tuple(q.id for q in waiting)
        latest = table.latest()
        return ArrivalPlan((New(ids, pad_length=6) if latest is None else Stretch(latest.id, ids),))

    def on_stage_done(self, stage: int, batch: BatchInfo, table: BatchTableView, now: float) -> Split | None:
        return Split((2, 2)) if stage == 2 else None


def test_figure8_new_stretch_split(zoo) -> None:
    model = zoo.stages("token", 4)
    gates = [GatedEngine(e) for e in model.engines()]
    scheduler = make_scheduler(model, Figure8Policy(), gates, num_buffer_pairs=2)
    rng = np.random.default_rng(8)
    queries = [model.query(rng, length) for length in (3, 6, 2, 5)]
    collector = Collector()

    def rows() -> dict[int, tuple[int, tuple[int, ...]]]:
        return {r.id: (r.bs, r.status_map) for r in scheduler.snapshot().rows}

    def pushes() -> list[tuple[int, BatchItem]]:
        return [(e.stage, BatchItem(e.batch_id, e.start, e.num)) for e in scheduler.trace if e.kind == "push"]

    def settled(stage_done: int, count: int) -> None:
        """Wait until `stage_done` has finished `count` items (its bookkeeping included)."""
        assert scheduler.wait_until(lambda s: s.stats.stages[stage_done].batches >= count, 10)

    with scheduler:
        # (a) new: batch 0 with 2 queries; one item (0, start 0, num 2) for stage 1
        first = scheduler.submit_many([(q, collector) for q in queries[:2]])
        gates[0].wait_started()
        assert rows() == {0: (2, (0, 0, 0, 0))}
        assert pushes() == [(0, BatchItem(0, 0, 2))]
        gates[0].release()
        settled(0, 1)
        assert rows() == {0: (2, (2, 0, 0, 0))}
        assert pushes()[-1] == (1, BatchItem(0, 0, 2))

        # (b) stretch while stage 2 runs: bs 2 -> 4, new rows (0, 2, 2) go to stage 1's queue
        gates[1].wait_started()
        second = scheduler.submit_many([(q, collector) for q in queries[2:]])
        assert rows() == {0: (4, (2, 0, 0, 0))}
        assert pushes()[-1] == (0, BatchItem(0, 2, 2))
        # stage 1 wrote the first rows into this pair and stage 2 has not released it yet
        assert scheduler.wait_until(lambda s: s.executor_states()[0] is ExecutorState.CHECKING, 10)
        gates[1].release()
        settled(1, 1)
        # stage 2 completed 2 of 4: it holds them (nothing for stage 3) until the new rows catch up
        assert rows() == {0: (4, (2, 2, 0, 0))}
        assert [p for p in pushes() if p[0] == 2] == []
        gates[0].wait_started()
        gates[0].release()
        settled(0, 2)
        assert rows() == {0: (4, (4, 2, 0, 0))}
        assert pushes()[-1] == (1, BatchItem(0, 2, 2))
        gates[1].wait_started()
        gates[1].release()
        settled(1, 2)
        # caught up: one merged item (0, 0, 4) for stage 3
        assert rows() == {0: (4, (4, 4, 0, 0))}
        assert pushes()[-1] == (2, BatchItem(0, 0, 4))

        # (c) split at stage 3: batch 0 becomes two batches of 2 at its row offsets
        gates[2].wait_started()
        gates[2].release()
        settled(2, 1)
        assert rows() == {1: (2, (2, 2, 2, 0)), 2: (2, (2, 2, 2, 0))}
        assert pushes()[-2:] == [(3, BatchItem(1, 0, 2)), (3, BatchItem(2, 0, 2))]
        assert collector.answers == {}

        # each sub-batch exits on its own: the first two queries are answered before the others run
        gates[3].wait_started()
        gates[3].release()
        assert collector.wait_for(first)
        assert not any(q in collector.answers for q in second)
        assert rows() == {2: (2, (2, 2, 2, 0))}
        gates[3].wait_started()
        gates[3].release()
        assert collector.wait_for(second)
        assert scheduler.wait_until(lambda s: len(s.snapshot_unlocked().rows) == 0, 10)

    for qid, inputs in zip(first + second, queries):
        assert_matches_reference(model, inputs, collector.one(qid))
    assert scheduler.stats.new == 1 and scheduler.stats.stretch == 1 and scheduler.stats.split == 1
    assert scheduler.buffer_violations == []
