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
- is padded at least to the joining queries' lengths (shorter ones join; longer ones do not),
- and the padding pays: with a per-length profile (`BatchCost`), the queries that fit join longest
  first while each one's marginal time inside the batch is no more than its share of a batch of its
  own with the shorter ones (`_paying`); without one (a model without a sequence axis, or
  no profile) what padding costs is unknown, and every query that fits joins, as in the paper.

The waiting queries that do not join start new batches at once: with a per-length profile,
clustered by length as the input policy clusters them (`policies.clusters`: within pad_tolerance,
merged while one batch costs less than two, at most bs_max each), shortest first; without one, up
to bs_max each in arrival order.

Why the padding rule (overload): under load stage 0 is busy, so the latest batch has not started
and every arrival may join it. With skewed lengths (most short, a long tail) a batch started by one
long query would take every short query after it, each padded to the long length. Where a batch's
time is nearly proportional to its rows x padded length (a CPU), such a batch costs as much as
that many long queries: throughput falls below that of batches of one and the queue grows without
bound.

Parameters (`policy.NAME` in config.pbtxt): see `LoadDiversityPolicy.__init__`.
"""
from __future__ import annotations

from typing import Sequence

from .api import ArrivalPlan, BatchInfo, BatchTableView, New, Policy, PolicyContext, QueryInfo, Stretch

from ._profile import BatchCost, StageProfile
from .clusters import length_clusters

DEFAULT_T_COMP_WAIT = 0.002  # seconds, without a profile


class LoadDiversityPolicy(Policy):
    name = "load"

    def __init__(self, t_comp_wait: float | None = None, pad_tolerance: float = 0.25) -> None:
        """Policy III's stretch rule.

        Args:
            t_comp_wait: seconds after its creation during which a batch that has started may still be stretched
                (T_comp_wait); one no stage has begun always may. Default: the profiled time of stage 0 at batch
                size 1, or 0.002 s without a profile.
            pad_tolerance: with a per-length profile, the queries that start new batches are clustered by length, a
                cluster taking queries up to (1 + pad_tolerance) times its shortest one's length (a fraction;
                exact lengths where the model is not pad-safe). Default 0.25.
        """
        if t_comp_wait is not None and t_comp_wait < 0:
            raise ValueError(f"t_comp_wait must be >= 0 seconds, got {t_comp_wait}")
        if pad_tolerance < 0:
            raise ValueError(f"pad_tolerance must be >= 0, got {pad_tolerance}")
        self._t_comp_wait_param = t_comp_wait
        self.pad_tolerance = float(pad_tolerance)

    def bind(self, context: PolicyContext) -> None:
        super().bind(context)
        self.profile = StageProfile(context.stage_times, context.num_stages)
        self.cost = BatchCost(context.stage_times_by_length, context.num_stages)
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

    def joining(self, batch: BatchInfo, waiting: Sequence[QueryInfo]) -> list[QueryInfo]:
        """The waiting queries that join `batch`: they fit its padding and its room, and padding
        them pays (module docstring)."""
        room = self.context.bs_max - batch.bs
        pad = batch.pad_length
        fitting = sorted((q for q in waiting if q.length <= pad), key=lambda q: (-q.length, q.arrival, q.id))
        fitting = fitting[:max(room, 0)]
        if fitting and pad > 0 and self.cost.available:
            fitting = fitting[:self._paying(batch.bs, pad, fitting)]
        order = {q.id: i for i, q in enumerate(waiting)}
        return sorted(fitting, key=lambda q: order[q.id])

    def _paying(self, bs: int, pad: int, fitting: Sequence[QueryInfo]) -> int:
        """How many of `fitting` (longest first) join a batch of `bs` padded to `pad`: each while its
        marginal time inside, T(bs + j + 1, pad) - T(bs + j, pad), is no more than its share of a
        batch of its own with every shorter one, T(m, its length) / m."""
        for j, q in enumerate(fitting):
            marginal = self.cost.seconds(bs + j + 1, pad) - self.cost.seconds(bs + j, pad)
            m = len(fitting) - j
            if marginal > self.cost.seconds(m, q.length) / m:
                return j
        return len(fitting)

    def new_batches(self, rest: Sequence[QueryInfo]) -> list[tuple[int, ...]]:
        """The queries that join no batch, as new batches: length clusters (shortest first) with a
        per-length profile, else up to bs_max each in arrival order (the paper's)."""
        bs_max = self.context.bs_max
        if not self.cost.available:
            return [tuple(q.id for q in rest[i:i + bs_max]) for i in range(0, len(rest), bs_max)]
        clusters = length_clusters(rest, bs_max, self.pad_tolerance, self.cost, self.context.pad_safe)
        return [tuple(q.id for q in c) for c in sorted(clusters, key=lambda c: max(q.length for q in c))]

    def on_arrival(self, waiting: Sequence[QueryInfo], table: BatchTableView, now: float) -> ArrivalPlan:
        decisions: list[New | Stretch] = []
        rest = list(waiting)
        latest = table.latest()
        if latest is not None and self.can_stretch(latest, now):
            joining = self.joining(latest, rest)
            if joining:
                decisions.append(Stretch(latest.id, tuple(q.id for q in joining)))
                taken = {q.id for q in joining}
                rest = [q for q in rest if q.id not in taken]
        decisions += [self.new_batch(ids) for ids in self.new_batches(rest)]
        return ArrivalPlan(tuple(decisions))
