"""The fast path's hold on the pipeline (runtime/fast_path.py has the why).

`reserve` grants one run on the caller's thread only while the scheduler holds nothing (no query
unanswered, no batch, no stage working) and a query could meet the latency target now. While it
is held, queries submitted are admitted and batched as usual but no stage starts work
(`Scheduler` asks `held`), so none overtakes the run; `release` counts what the run answered and
wakes the stages that have work. `plan` is the policy's batching of the run's rows. Each takes
the scheduler's lock; the hold is owned by the scheduler.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Sequence

from .decisions import BatchTableView, Policy
from .plan_checks import inline_batches

if TYPE_CHECKING:
    from .scheduler import Scheduler


class InlineHold:
    def __init__(self, scheduler: Scheduler, policy: Policy, view: BatchTableView, ids: Iterator[int]) -> None:
        self._scheduler = scheduler
        self._policy = policy
        self._view = view
        self._ids = ids  # the scheduler's query ids: the planned rows get ids no real query has
        self.held = False

    @property
    def allowed(self) -> bool:
        """Whether the fast path serves: the setting, and a policy that allows it."""
        return self._scheduler.settings.fast_path and type(self._policy).allows_inline()

    def reserve(self, rows: int) -> bool:
        """Hold the pipeline for one run of `rows` rows, if it holds nothing (module docstring)."""
        s = self._scheduler
        with s.lock:
            if self.held or rows < 1 or not s.holds_nothing() or s.admission.arrival_refusal(s.clock(), 0):
                return False
            self.held = True
            return True

    def plan(self, lengths: Sequence[int], now: float) -> list[tuple[list[int], int]]:
        """While held: the batches the policy makes of rows of these lengths arriving now at an empty
        pipeline, as (row indices, pad length), in the order to run them (`plan_checks.inline_batches`)."""
        s = self._scheduler
        with s.lock:
            batches, failures, reshaped = inline_batches(self._policy, self._view, lengths, now, self._ids,
                                                         s.bs_max, s.manifest)
            s.stats.policy_errors += failures
            s.stats.pad_unsafe_splits += reshaped
        return batches

    def release(self, rows: int, seconds: float | None, runs: int = 1, fell_back: bool = False) -> None:
        """The run ended: `rows` rows answered in `runs` batches, the last `seconds` after they arrived
        (None: none answered); `fell_back`: some rows were not answered (a batch failed) and the caller
        sends them the usual way."""
        s = self._scheduler
        with s.lock:
            self.held = False
            stats = s.stats
            stats.inline_fallbacks += fell_back
            if seconds is not None and rows:
                stats.inline_runs += runs
                stats.inline_queries += rows
                stats.submitted += rows
                stats.answered_ok += rows
                stats.within_slo += rows if s.admission.within_slo(seconds) else 0
            s.board.signal_ready()
            s.progress.notify()
