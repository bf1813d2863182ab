"""Pipelined new-only: every arrival starts new batches at once; batches co-run in the pipeline."""
from __future__ import annotations

from typing import Sequence

from .api import ArrivalPlan, BatchTableView, New, Policy, QueryInfo


class PipelinedPolicy(Policy):
    name = "pipelined"

    def on_arrival(self, waiting: Sequence[QueryInfo], table: BatchTableView, now: float) -> ArrivalPlan:
        bs_max = self.context.bs_max
        ids = [q.id for q in waiting]
        return ArrivalPlan(tuple(New(tuple(ids[i:i + bs_max])) for i in range(0, len(ids), bs_max)))
