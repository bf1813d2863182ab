"""Policy III, load diversity (paper §7.2): let later queries join the batch in flight.

A latter batch should be able to join a previous batch if that does not make the previous
batch violate its QoS. DVABatch uses `stretch` to enlarge the batch at runtime, and a time
threshold T_comp_wait rules out the QoS violation: once a batch has been processed for
T_comp_wait, no stretch is allowed on it.

Here, on arrival, the latest batch (`table.latest()`) is stretched with as many waiting queries
as fit when it

- is not marked `no_stretch` (a split is planned for it),
- has run for less than T_comp_wait (now - created), or has not started yet: while stage 0 is
  busy, the queries arriving join the batch that waits for it (the runtime runs a batch's
  queued rows as one item), which is what makes batches grow with the load,
- has room: its size stays <= bs_max,
- is padded at least to the joining queries' lengths (shorter ones join; longer ones do not).

The waiting queries that do not join start new batches at once, of up to bs_max queries each,
padded to their longest.

`t_comp_wait` (seconds) defaults to the profiled time of stage 0 at batch size 1, or 0.002 s
without a profile.
"""
from __future__ import annotations

from typing import Sequence

from .api import ArrivalPlan, BatchInfo, BatchTableView, New, Policy, PolicyContext, QueryInfo, Stretch

from ._profile import StageProfile

DEFAULT_T_COMP_WAIT = 0.002  # seconds, without a profile


class LoadDiversityPolicy(Policy):
    name = "load"

    def __init__(self, t_comp_wait: float | None = None) -> None:
        if t_comp_wait is not None and t_comp_wait < 0:
            raise ValueError(f"t_comp_wait must be >= 0 seconds, got {t_comp_wait}")
        self._t_comp_wait_param = t_comp_wait

    def bind(self, context: PolicyContext) -> None:
        super().bind(context)
        self.profile = StageProfile(context.stage_times, context.num_stages)
        if self._t_comp_wait_param is not None:
            self.t_comp_wait = float(self._t_comp_wait_param)
        elif self.profile.available:
            self.t_comp_wait = self.profile.time(0, 1)
        else:
            self.t_comp_wait = DEFAULT_T_COMP_WAIT

    def can_stretch(self, batch: BatchInfo, now: float) -> bool:
        """Whether `batch` may take more queries at all (room and lengths are checked apart): a
        batch no stage has begun yet always may (it waits for stage 0 anyway; the queries joining
        it run with it as one batch), a running one within T_comp_wait of its creation."""
        if batch.no_stretch:
            return False
        return not batch.started or now - batch.created < self.t_comp_wait

    def new_batch(self, query_ids: tuple[int, ...]) -> New:
        """The `New` for queries that do not join the latest batch."""
        return New(query_ids)

    def on_arrival(self, waiting: Sequence[QueryInfo], table: BatchTableView, now: float) -> ArrivalPlan:
        bs_max = self.context.bs_max
        decisions: list[New | Stretch] = []
        rest = list(waiting)
        latest = table.latest()
        if latest is not None and self.can_stretch(latest, now):
            room = bs_max - latest.bs
            joining = [q for q in rest if q.length <= latest.pad_length][:max(room, 0)]
            if joining:
                decisions.append(Stretch(latest.id, tuple(q.id for q in joining)))
                taken = {q.id for q in joining}
                rest = [q for q in rest if q.id not in taken]
        for i in range(0, len(rest), bs_max):
            decisions.append(self.new_batch(tuple(q.id for q in rest[i:i + bs_max])))
        return ArrivalPlan(tuple(decisions))
