"""Policy I, input diversity (paper §7.2): small batches of similar lengths, run in parallel.

While accepting queries, DVAScheduler clusters them by input size; queries of similar sizes
are batched and padded to the same size, and the batches run in parallel in the pipeline. As
the batches run in parallel, a small batch time window is preferred to batches as large as
possible: the window is the duration of the first stage at the largest allowed batch size
bs_max. The number of active queries in the pipeline does not exceed bs_max.

Here:

- Clusters: the waiting queries sorted by length; a new cluster starts when the next query is
  longer than (1 + pad_tolerance) x the cluster's shortest, or the cluster has bs_max queries.
  Each cluster is one `New`, padded to its longest, so before any merging no query is padded by
  more than pad_tolerance of its length (queries of length 0, models without a sequence axis,
  cluster together). A model that is not pad-safe (`context.pad_safe` False) is clustered exactly by
  length, with no merging: padding would change its answers. With a per-length profile (two or more lengths), neighbouring clusters (in length order) are then merged,
  the most profitable first, while one merged batch is cheaper than the two apart (profiled
  seconds over all stages, `BatchCost`) and within bs_max: on hardware where small batches are
  inefficient (a CPU at short lengths), a little padding buys more than it costs.
- Window: adaptive by default (`policies.window`): no wait while stage 0 is idle; while it is
  busy, the waiting queries are held until it is expected to be free (they would wait in its queue
  anyway), never longer than the paper's window after the oldest one's arrival. The paper's window,
  here the upper bound `window` (attribute), is the profiled time of stage 0 at bs_max
  (interpolated if bs_max lies between profiled sizes; the largest profiled size's time if bs_max
  is beyond them); `window_bs` names another batch size to read it at; without a profile, 0 (batch
  at once). The parameter `window` (seconds) makes the window fixed instead (the paper's rule:
  queries are batched once the oldest waiting query has waited it; 0 never waits). Inside the
  window only full clusters (bs_max queries) go, and the policy asks to be woken when it ends.
- Order and cap: queries in flight plus queries in new batches <= bs_max. When every ready
  cluster fits, the shortest go first (batch queues are FIFO: a batch never overtakes one
  ahead of it, so this is what lets short queries exit first). Otherwise clusters go
  oldest-first (by their oldest query), and one that does not fit whole gives its oldest
  queries up to the room left; the rest wait and are offered again when queries leave. In a
  backlog (more than bs_max waiting) the largest clusters go first, except those whose oldest
  query has waited half the admission's bound: they go before, oldest first.
"""
from __future__ import annotations

from typing import Callable, Sequence

from .api import ArrivalPlan, BatchTableView, New, Policy, PolicyContext, QueryInfo

from ._profile import BatchCost, StageProfile
from .clusters import length_clusters
from .window import AdaptiveWindow


class InputDiversityPolicy(Policy):
    name = "input"

    def __init__(self, pad_tolerance: float = 0.25, window: float | None = None, window_bs: int | None = None) -> None:
        """Policy I's clustering and batch window.

        Args:
            pad_tolerance: a length cluster takes queries up to (1 + pad_tolerance) times its shortest one's length,
                so before any merging no query is padded by more than this fraction of its length (exact lengths
                where the model is not pad-safe); >= 0. Default 0.25.
            window: a fixed batch window in seconds: queries are batched once the oldest waiting one has waited this
                long (0: never wait); >= 0. Default: the adaptive window (`policies.window`), bounded by stage 0's
                profiled time at `window_bs`, or no wait without a profile.
            window_bs: the batch size (rows) at which stage 0's profiled time bounds the adaptive window, capped at
                the largest profiled size; >= 1. Default: bs_max.
        """
        if pad_tolerance < 0:
            raise ValueError(f"pad_tolerance must be >= 0, got {pad_tolerance}")
        if window is not None and window < 0:
            raise ValueError(f"window must be >= 0 seconds, got {window}")
        if window_bs is not None and window_bs < 1:
            raise ValueError(f"window_bs must be >= 1, got {window_bs}")
        self.pad_tolerance = float(pad_tolerance)
        self._window_param = None if window is None else float(window)
        self._window_bs = window_bs

    def bind(self, context: PolicyContext) -> None:
        super().bind(context)
        profile = StageProfile(context.stage_times, context.num_stages)
        self.cost = BatchCost(context.stage_times_by_length, context.num_stages)
        self.window = self._window_param or 0.0  # fixed, or the adaptive window's upper bound
        if self._window_param is None and profile.available:
            largest = max(profile.profiled(0))
            self.window = profile.time(0, min(self._window_bs or context.bs_max, largest))
        self.adaptive = AdaptiveWindow.from_context(context, self.window) if self._window_param is None else None

    def _go_at(self, waiting: Sequence[QueryInfo], table: BatchTableView, now: float, released: bool = False) -> float:
        """When the waiting queries should be batched (<= now: at once)."""
        if self.adaptive is not None:
            return self.adaptive.go_at(waiting, table, now, released)
        return min(q.arrival for q in waiting) + self.window

    def clusters(self, waiting: Sequence[QueryInfo]) -> list[list[QueryInfo]]:
        """Waiting queries clustered by length, each sorted by length; oldest cluster first."""
        return length_clusters(waiting, self.context.bs_max, self.pad_tolerance, self.cost, self.context.pad_safe)

    def _backlog_order(self, now: float) -> Callable[[list[QueryInfo]], tuple[int, float]]:
        """A backlog's clusters in order: the largest first (more rows a run), the oldest among
        equals (the sort is stable); but a cluster whose oldest query has waited half the
        admission's bound (`PolicyContext.wait_bound`) goes before them, the oldest first, so that
        a query admitted within the bound does not starve behind larger clusters."""
        bound = self.context.wait_bound
        due_at = None if bound is None else now - bound / 2

        def order(cluster: list[QueryInfo]) -> tuple[int, float]:
            oldest = min(q.arrival for q in cluster)
            return (0, oldest) if due_at is not None and oldest <= due_at else (1, -len(cluster))
        return order

    def on_arrival(self, waiting: Sequence[QueryInfo], table: BatchTableView, now: float) -> ArrivalPlan:
        bs_max = self.context.bs_max
        room = bs_max - table.queries_in_flight()
        if not waiting or room <= 0:
            return ArrivalPlan()  # offered again when queries leave the pipeline
        clusters = self.clusters(waiting)
        window_open = now < self._go_at(waiting, table, now)
        ready = [c for c in clusters if len(c) >= bs_max] if window_open else clusters
        if sum(len(c) for c in ready) <= room:
            # all of them go: shortest first, so short queries leave the pipeline first (queues
            # are FIFO, a later batch never overtakes); when room is short, oldest first (fair)
            ready = sorted(ready, key=lambda c: max(q.length for q in c))
        elif len(waiting) > bs_max:
            ready = sorted(ready, key=self._backlog_order(now))
        decisions: list[New] = []
        taken: set[int] = set()
        for cluster in ready:
            if room <= 0:
                break
            group = cluster if len(cluster) <= room else sorted(cluster, key=lambda q: (q.arrival, q.id))[:room]
            pad = max(q.length for q in group)
            decisions.append(New(tuple(q.id for q in group), pad_length=pad))
            if self.adaptive is not None:
                self.adaptive.released(len(group), pad, now)
            taken.update(q.id for q in group)
            room -= len(group)
        wake_at = None
        left = [q for q in waiting if q.id not in taken]
        if window_open and left and room > 0:
            # > now: the window was open, and a release only makes stage 0 busier
            wake_at = max(self._go_at(left, table, now, released=bool(decisions)), now)
        return ArrivalPlan(tuple(decisions), wake_at)
