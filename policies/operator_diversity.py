"""Policy II, operator diversity (paper §7.2, Figure 13): split a batch when the rest of the
model prefers smaller batches.

When a stage completes a batch of `bs` queries, DVAScheduler compares the processing time of
all the remaining stages at different batch sizes. With T_remain(i) the time the remaining
stages take at batch size i, if T_remain(bs) >= 2 x T_remain(bs/2) the batch is split into two
halves, which then run serially (the hardware is already fully used at bs/2). The rule is
applied again to each half, so 64 -> 32 + 32 -> 16 + 16 + 16 + 16 when it keeps paying; one
`Split` carries the final sizes. An odd size splits into ceil and floor halves, compared as
T_remain(bs) >= T_remain(ceil) + T_remain(floor). `factor` (default 2) generalises the 2.

Times come from the slicer's offline profile (`PolicyContext.stage_times`; see `_profile` for
interpolation). Without a profile, for bs < 2, or after the last stage nothing is split.

Arrivals start new batches at once, of up to bs_max queries each, padded to their longest.
A batch whose split is foreseeable at its size (at any stage) is created with `no_stretch`
(paper §5.2.2: stretch is disabled for a batch with a perceived split).
"""
from __future__ import annotations

from typing import Sequence

from .api import ArrivalPlan, BatchInfo, BatchTableView, New, Policy, PolicyContext, QueryInfo, Split

from ._profile import StageProfile

_EPS = 1e-9  # relative: equal times compare as equal despite float rounding


class OperatorDiversityPolicy(Policy):
    name = "operator"
    runs_inline = True  # its splits change how a batch runs, never an answer

    def __init__(self, factor: float = 2.0) -> None:
        """Policy II's split rule.

        Args:
            factor: a batch is split after a stage where the remaining stages take at least `factor` times as long
                at its size as at half of it (T_remain(bs) >= factor x T_remain(bs/2)); > 0. Default 2.0.
        """
        if factor <= 0:
            raise ValueError(f"factor must be > 0, got {factor}")
        self.factor = float(factor)

    def bind(self, context: PolicyContext) -> None:
        super().bind(context)
        self.profile = StageProfile(context.stage_times, context.num_stages)
        self._sizes: dict[tuple[int, int], tuple[int, ...]] = {}

    # -- the rule ---------------------------------------------------------------------

    def split_sizes(self, stage: int, bs: int) -> tuple[int, ...]:
        """The sizes a batch of `bs` that just finished `stage` splits into; (bs,) for no split."""
        key = (stage, bs)
        if key not in self._sizes:
            self._sizes[key] = self._compute(stage, bs)
        return self._sizes[key]

    def _compute(self, stage: int, bs: int) -> tuple[int, ...]:
        if bs < 2 or not self.profile.available or stage >= self.context.num_stages - 1:
            return (bs,)
        whole = self.profile.remaining(stage, bs)
        big, small = (bs + 1) // 2, bs // 2
        halves = self.profile.remaining(stage, big) + self.profile.remaining(stage, small)
        if whole <= 0 or whole < self.factor / 2 * halves * (1 - _EPS):
            return (bs,)
        return self.split_sizes(stage, big) + self.split_sizes(stage, small)

    def split_foreseeable(self, bs: int) -> bool:
        """Whether a batch of `bs` would be split after some stage."""
        return any(len(self.split_sizes(s, bs)) > 1 for s in range(self.context.num_stages - 1))

    # -- the policy -------------------------------------------------------------------

    def on_arrival(self, waiting: Sequence[QueryInfo], table: BatchTableView, now: float) -> ArrivalPlan:
        bs_max = self.context.bs_max
        groups = [waiting[i:i + bs_max] for i in range(0, len(waiting), bs_max)]
        return ArrivalPlan(tuple(
            New(tuple(q.id for q in g), no_stretch=self.split_foreseeable(len(g))) for g in groups
        ))

    def on_stage_done(self, stage: int, batch: BatchInfo, table: BatchTableView, now: float) -> Split | None:
        sizes = self.split_sizes(stage, batch.bs)
        return Split(sizes) if len(sizes) > 1 else None
