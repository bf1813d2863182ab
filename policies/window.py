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

With one buffer pair (`serial`) the pipeline's entry is busy as long as any batch is in flight,
not only while stage 0 runs: a batch holds the only pair until it has left the last stage, and the
next one waits for it in stage 0's queue. There "stage 0" above reads "the entry": busy while any
row is in flight (`entry_backlog`), and each released batch adds its time through every stage.
(Counting stage 0 alone, a query arriving while a batch is in a later stage would go at once as a
batch of its own, only to wait for the pair.) The upper bound too is the entry's there: stage 0's
time at bs_max times a batch's passage over its stage-0 time (`passage_ratio`). Bounded by stage 0's
time alone, queries would go after a fraction of a passage, each cluster a small batch queued
behind the running one, which nobody joins.
"""
from __future__ import annotations

from typing import Sequence

from .api import BatchTableView, PolicyContext, QueryInfo

from ._profile import BatchCost, StageProfile


def stage0_backlog(table: BatchTableView) -> int:
    """Rows that stage 0 has still to run (queued or running): 0 when stage 0 is idle."""
    return sum(max(batch.bs - batch.status_map[0], 0) for batch in table)


def entry_backlog(table: BatchTableView, serial: bool) -> int:
    """Rows that keep the pipeline's entry busy: those stage 0 has still to run, or, with one buffer
    pair (`serial`: a batch holds the only pair until it leaves the last stage), every row in flight."""
    return table.queries_in_flight() if serial else stage0_backlog(table)


class Stage0Time:
    """Profiled seconds of stage 0 by batch size and padded length: the per-length profile when
    there is one (interpolated between lengths, proportional beyond the longest), else the
    reference-length profile; 0 without a profile. `through` stages counted from stage 0: with
    one buffer pair the entry is busy while a batch passes every stage."""

    def __init__(self, context: PolicyContext, through: int = 1) -> None:
        self._by_length = BatchCost(context.stage_times_by_length, context.num_stages)
        self._reference = StageProfile(context.stage_times, context.num_stages)
        self.available = self._by_length.available or self._reference.available
        self._stages = range(min(max(through, 1), context.num_stages))
        self._known: dict[tuple[int, int], float] = {}  # (bs, length) -> seconds: asked on every batch made

    def seconds(self, bs: int, length: int) -> float:
        known = self._known.get((bs, length))
        if known is None:
            known = self._known[bs, length] = self._profiled(bs, length)
        return known

    def _profiled(self, bs: int, length: int) -> float:
        if self._by_length.available:
            return sum(self._by_length.stage_seconds(k, bs, length) for k in self._stages)
        return sum(self._reference.time(k, bs) for k in self._stages) if self._reference.available else 0.0


def passage_ratio(context: PolicyContext) -> float:
    """A batch's profiled time through every stage over its time in stage 0, at bs_max (or the
    largest profiled size): with one buffer pair the entry is busy that much longer than stage 0,
    and the window's upper bound (stage 0's time, the paper's) is read as the entry's. 1 without
    a profile."""
    profile = StageProfile(context.stage_times, context.num_stages)
    if not profile.available:
        return 1.0
    bs = min(context.bs_max, max(profile.profiled(0)))
    first = profile.time(0, bs)
    return sum(profile.time(k, bs) for k in range(context.num_stages)) / first if first > 0 else 1.0


class AdaptiveWindow:
    """When waiting queries should go (module docstring). One per policy; called under the
    scheduler's lock like the policy itself."""

    def __init__(self, stage0: Stage0Time, upper: float, recheck: float, serial: bool = False) -> None:
        if upper < 0 or recheck <= 0:
            raise ValueError(f"window bounds must be upper >= 0 and recheck > 0, got {upper}, {recheck}")
        self.serial = serial  # one buffer pair: the entry is busy while anything is in flight
        self.stage0 = stage0
        self.upper = upper
        self.recheck = recheck
        self._free_at = float("-inf")  # when stage 0 is expected to have run everything released

    @classmethod
    def from_context(cls, context: PolicyContext, upper: float) -> AdaptiveWindow:
        serial = context.num_buffer_pairs == 1
        stage0 = Stage0Time(context, context.num_stages if serial else 1)
        if serial:
            upper *= passage_ratio(context)
        shortest = min(context.stage_times_by_length, default=0)
        recheck = Stage0Time(context).seconds(1, shortest) if stage0.available else 0.0
        return cls(stage0, upper, recheck if recheck > 0 else 1e-3, serial)

    def go_at(self, waiting: Sequence[QueryInfo], table: BatchTableView, now: float, released: bool = False) -> float:
        """The time the waiting queries should be batched: `now` or earlier means at once.
        `released`: a batch went to stage 0 in this very call (stage 0 is busy, the view does not
        show it yet)."""
        if not waiting or self.upper <= 0 or (not released and entry_backlog(table, self.serial) == 0):
            self._free_at = now
            return now
        oldest = min(q.arrival for q in waiting)
        free_at = self._free_at if self._free_at > now else now + self.recheck
        return min(free_at, oldest + self.upper)

    def released(self, rows: int, pad_length: int, now: float) -> None:
        """A batch of `rows` padded to `pad_length` was just sent to stage 0: it runs after whatever
        stage 0 has already (the clock), for its profiled time."""
        self._free_at = max(self._free_at, now) + self.stage0.seconds(rows, pad_length)
