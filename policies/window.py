"""The adaptive batch window: wait for more queries only while waiting costs nothing.

A query batched now goes to stage 0's queue; if stage 0 is busy it waits there anyway, and a batch
already queued takes no one (the input policy does not stretch). So while stage 0 is busy, holding
the waiting queries back until it is about to be free lets the batch grow at no cost in latency,
and while stage 0 is idle any wait is pure loss. The rule:

- stage 0 idle (no batch has rows left to run there: `stage0_backlog` is 0): no wait;
- stage 0 busy: wait until the time stage 0 is expected to be free, but never past the oldest
  waiting query's arrival + `upper` (the paper's window, stage 0's time at bs_max).

The time stage 0 is free is a clock the window keeps: each batch released (`released`) adds its
profiled stage-0 time (at its size and padded length) from when stage 0 will take it; seeing
stage 0 idle resets it. When the clock says free but stage 0 is still busy (the machine is slower
than the profile), the window looks again after `recheck` (stage 0's time for one query at the
shortest profiled length), within the same upper bound. Without a profile `upper` is 0: no wait.

So at low load (nothing in flight) a query goes at once; the window grows only while queries queue
behind stage 0, with the load (more queued rows, a later free time), up to `upper`.
"""
from __future__ import annotations

from typing import Sequence

from .api import BatchTableView, PolicyContext, QueryInfo

from ._profile import BatchCost, StageProfile


def stage0_backlog(table: BatchTableView) -> int:
    """Rows that stage 0 has still to run (queued or running): 0 when stage 0 is idle."""
    return sum(max(batch.bs - batch.status_map[0], 0) for batch in table)


class Stage0Time:
    """Profiled seconds of stage 0 by batch size and padded length: the per-length profile when
    there is one (interpolated between lengths, proportional beyond the longest), else the
    reference-length profile; 0 without a profile."""

    def __init__(self, context: PolicyContext) -> None:
        self._by_length = BatchCost(context.stage_times_by_length, context.num_stages)
        self._reference = StageProfile(context.stage_times, context.num_stages)
        self.available = self._by_length.available or self._reference.available

    def seconds(self, bs: int, length: int) -> float:
        if self._by_length.available:
            return self._by_length.stage_seconds(0, bs, length)
        return self._reference.time(0, bs) if self._reference.available else 0.0


class AdaptiveWindow:
    """When waiting queries should go (module docstring). One per policy; called under the
    scheduler's lock like the policy itself."""

    def __init__(self, stage0: Stage0Time, upper: float, recheck: float) -> None:
        if upper < 0 or recheck <= 0:
            raise ValueError(f"window bounds must be upper >= 0 and recheck > 0, got {upper}, {recheck}")
        self.stage0 = stage0
        self.upper = upper
        self.recheck = recheck
        self._free_at = float("-inf")  # when stage 0 is expected to have run everything released

    @classmethod
    def from_context(cls, context: PolicyContext, upper: float) -> AdaptiveWindow:
        stage0 = Stage0Time(context)
        shortest = min(context.stage_times_by_length, default=0)
        recheck = stage0.seconds(1, shortest) if stage0.available else 0.0
        return cls(stage0, upper, recheck if recheck > 0 else 1e-3)

    def go_at(self, waiting: Sequence[QueryInfo], table: BatchTableView, now: float, released: bool = False) -> float:
        """The time the waiting queries should be batched: `now` or earlier means at once.
        `released`: a batch went to stage 0 in this very call (stage 0 is busy, the view does not
        show it yet)."""
        if not waiting or self.upper <= 0 or (not released and stage0_backlog(table) == 0):
            self._free_at = now
            return now
        oldest = min(q.arrival for q in waiting)
        free_at = self._free_at if self._free_at > now else now + self.recheck
        return min(free_at, oldest + self.upper)

    def released(self, rows: int, pad_length: int, now: float) -> None:
        """A batch of `rows` padded to `pad_length` was just sent to stage 0: it runs after whatever
        stage 0 has already (the clock), for its profiled time."""
        self._free_at = max(self._free_at, now) + self.stage0.seconds(rows, pad_length)
