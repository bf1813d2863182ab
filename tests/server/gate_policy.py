"""A policy for tests against the real server: it holds every arriving query until the file `gate`
exists, then hands the waiting queries to the built-in policy `inner` (with the other parameters).

The test copies this file into the model's version folder and names it in config.pbtxt as
`gate_policy.py:GatePolicy`; it lets the test decide, from outside the server process, when the
queries it has sent are seen by the policy: all at once, whatever the timing of the sends.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from policies import create_policy
from policies.api import ArrivalPlan, BatchInfo, BatchTableView, Policy, PolicyContext, QueryInfo, Split


class GatePolicy(Policy):
    name = "gate"

    def __init__(self, gate: str, inner: str, poll: float = 0.005, **params: object) -> None:
        self.gate, self.poll = Path(gate), float(poll)
        self.inner = create_policy(inner, **params)

    def bind(self, context: PolicyContext) -> None:
        super().bind(context)
        self.inner.bind(context)

    def on_arrival(self, waiting: Sequence[QueryInfo], table: BatchTableView, now: float) -> ArrivalPlan:
        if not self.gate.exists():
            return ArrivalPlan((), wake_at=now + self.poll)  # look again soon
        return self.inner.on_arrival(waiting, table, now)

    def on_stage_done(self, stage: int, batch: BatchInfo, table: BatchTableView, now: float) -> Split | None:
        return self.inner.on_stage_done(stage, batch, table, now)
