"""Code written against the interface before the runtime's packages were split by layer keeps working."""
from __future__ import annotations

import numpy as np

from dvabatch_backend import RuntimeSettings, Scheduler, run_until_idle
from policies import load_policy

from ..conftest import Collector, assert_matches_reference

# A policy as the README taught before `policies.api` existed.
LEGACY_POLICY_PY = """from dvabatch_backend import ArrivalPlan, New, Policy, Split
from dvabatch_backend.batch_table import BatchInfo
from dvabatch_backend.decisions import BatchTableView, QueryInfo


class OldStylePolicy(Policy):
    name = "old-style"

    def on_arrival(self, waiting, table: BatchTableView, now: float) -> ArrivalPlan:
        ids = [q.id for q in waiting]
        bs = self.context.bs_max
        return ArrivalPlan(tuple(New(tuple(ids[i:i + bs])) for i in range(0, len(ids), bs)))

    def on_stage_done(self, stage: int, batch: BatchInfo, table: BatchTableView, now: float):
        if not table.stage_outputs():
            raise RuntimeError("the stage outputs are not shown")
        return Split((1, batch.bs - 1)) if stage == 0 and batch.bs > 1 else None
"""


def test_a_policy_with_the_old_imports_loads_and_runs(zoo, tmp_path) -> None:
    (tmp_path / "old_style.py").write_text(LEGACY_POLICY_PY)
    policy = load_policy("old_style.py:OldStylePolicy", {}, tmp_path)
    model = zoo.stages("token", 3)
    scheduler = Scheduler(model.manifest, policy, RuntimeSettings(bs_max=4))
    rng = np.random.default_rng(5)
    queries = [model.query(rng) for _ in range(4)]
    collector = Collector()
    ids = scheduler.submit_many([(q, collector) for q in queries])
    run_until_idle(scheduler, model.engines())
    for qid, inputs in zip(ids, queries):
        assert_matches_reference(model, inputs, collector.one(qid))
    assert scheduler.stats.split == 1 and scheduler.stats.policy_errors == 0  # it saw the stage outputs


def test_old_module_paths_are_the_new_objects() -> None:
    import dvabatch_backend.batch_table as old_table
    import dvabatch_backend.decisions as old_decisions
    from policies import api

    assert old_decisions.Policy is api.Policy and old_decisions.BatchTableView is api.BatchTableView
    assert old_table.BatchInfo is api.BatchInfo
