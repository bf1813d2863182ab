"""The early-exit example policy on the runtime: confident queries leave after the exit head,
answered with the head's result; the others run the whole model."""
from __future__ import annotations

import numpy as np
import pytest

from policies.examples.early_exit import EarlyExitPolicy, runs

from ..conftest import Collector, ExitQueries, GatedEngine, SlicedModel, make_scheduler, sliced_cascade


@pytest.fixture(scope="module")
def cascade(tmp_path_factory) -> SlicedModel:
    return sliced_cascade(tmp_path_factory.mktemp("cascade"))


def test_runs() -> None:
    assert runs(np.array([True, True, False, True])) == ((2, 1, 1), (True, False, True))


def test_confident_queries_exit_early_with_the_head_result(cascade: SlicedModel) -> None:
    exits = ExitQueries.make(cascade, 16, seed=0)
    queries, leaves = exits.queries, exits.leaves

    # the later stages are held until the confident queries are answered: they never wait for them
    gates = [GatedEngine(e) for e in cascade.engines()[1:]]
    engines = [cascade.engines()[0], *gates]
    scheduler = make_scheduler(cascade, EarlyExitPolicy(threshold=exits.threshold, exit_stage=0), engines,
                               num_buffer_pairs=2)
    collector = Collector()
    with scheduler:
        sent = scheduler.submit_many([(q, collector) for q in queries])  # one batch of 8 and another
        early_ids = [q for q, out in zip(sent, leaves) if out]
        late_ids = [q for q, out in zip(sent, leaves) if not out]
        assert collector.wait_for(early_ids)
        assert not any(q in collector.answers for q in late_ids)
        gates[0].wait_started()  # the others are held in the later stages, not lost
        for gate in gates:
            gate.open()
        assert collector.wait_for(sent)
    exits.assert_answered(collector, sent)
    assert scheduler.stats.early_exits == int(leaves.sum())
    assert scheduler.buffer_violations == []
