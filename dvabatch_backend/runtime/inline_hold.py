"""The fast path's hold on the pipeline (runtime/fast_path.py has the why).

`reserve` grants one run on the caller's thread only while the scheduler holds nothing (no query
unanswered, no batch, no stage working) and a query could meet the latency target now. While it
is held, queries submitted are admitted and batched as usual but no stage starts work
(`Scheduler` asks `held`), so none overtakes the run; `release` counts what the run answered and
wakes the stages that have work. `plan` is the policy's batching of the run's rows. Each takes
the scheduler's lock; the hold is owned by the scheduler.

The caller's own queue. While a run holds the caller (a Triton `execute` call), requests wait in
the caller's queue (Triton's dynamic batcher), which the runtime's admission cannot see: left there,
overload would queue without bound. `caller_backlog` is told, for each call, whether it came full
(the caller had at least a batch waiting). Once the calls have come full for `STANDING_SECONDS` (a
queue over a batch that long is overload, not a burst: the runtime's standing-queue rule,
admission.py; 1 s was tried: the bench BERT's bursts at half its rate, Gamma CV 4, lost a call or
two of 16 in 2 of 2 seeds, and 1.5 s still cut overload's first-phase p99 only to 1.0-1.3 s),
`refusing` is set and the calls are refused whole, "Exceeds maximum queue size", until one comes
that is not full (counted in `caller_drains`). A call holds the caller's oldest requests (Triton's
batcher hands them over in arrival order), so this is the runtime's push-out of the oldest, done in
the caller's queue; refused unread, a call costs next to nothing, and the queue drains at once.
After a drain the overload is known: the next drain comes after `STANDING_WAIT` of full calls,
until no call has come full for `STANDING_SECONDS`. With a configured queue bound or timeout (the
user's policy) nothing is drained.

Drained, not handed to the pipeline (as the calls were where a bs_max batch's passage is long):
with one buffer pair, the only case where several requests run inline, the pipeline carries a
backlog more slowly than the fast path (the bench BERT at 3x its sustained rate, 2 cores: 74-81 %
of that rate answered once handed over, 90-133 % drained; the test-size BERT about 600 queries a
second against 1,536), and under overload the answered rate is what is left of the fast path's.
Under a configured queue bound or timeout (the user's policy), where nothing is drained, the
calls go to the pipeline once they have come full `STANDING_CALLS` times in a row and for
`STANDING_WAIT` (counted in `inline_handovers`): the caller's queue drains into the runtime's,
whose admission applies the user's policy; the fast path resumes once a call comes that is not
full.

A call's rows run in batches of at most `Admission.call_batch` (no larger than buys throughput
at any profiled length), and where passages are long the adapter answers each request as its batch
is done: a call of the zoo UNet (up to 64 rows, 0.6-1.5 s under load) no longer holds every answer
until its last row (Poisson at 0.9x its rate, 2 seeds: mean 135 / 144 ms with only full calls so
cut, 69 / 46 ms with every call).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Sequence

from .admission import STANDING_SECONDS, STANDING_WAIT
from .decisions import BatchTableView, Policy
from .plan_checks import inline_batches

if TYPE_CHECKING:
    from .scheduler import Scheduler

STANDING_CALLS = 2  # full calls in a row that say the caller's queue stands (under a configured policy)


class InlineHold:
    def __init__(self, scheduler: Scheduler, policy: Policy, view: BatchTableView, ids: Iterator[int]) -> None:
        self._scheduler = scheduler
        self._policy = policy
        self._view = view
        self._ids = ids  # the scheduler's query ids: the planned rows get ids no real query has
        self.held = False
        self._full_calls = 0  # the caller's calls in a row that came full ...
        self._full_since = 0.0  # ... since the first of them
        # under a configured queue policy, the caller's queue stands and its calls go to the
        # pipeline: a backlog, whose batches the scheduler keeps at the backlog's size (admission.py)
        self.handed_over = False
        # the caller's queue is drained (module docstring): its calls are refused while set
        self.refusing = False
        self._last_drain: float | None = None  # when the last drain began
        self._last_full = 0.0  # when a call last came full

    @property
    def allowed(self) -> bool:
        """Whether the fast path serves: the setting, and a policy that allows it."""
        return self._scheduler.settings.fast_path and type(self._policy).allows_inline()

    def caller_backlog(self, full: bool) -> bool:
        """One call of the caller, `full` or not (module docstring): whether its queue is drained
        (`refusing`); True where, under a configured queue policy, its queue stands and the call's
        requests go to the pipeline instead of the fast path."""
        s = self._scheduler
        with s.lock:
            now = s.clock()
            if not full:
                self._full_calls = 0
                self.handed_over = self.refusing = False
                return False
            if not self._full_calls:
                self._full_since = now
            self._full_calls += 1
            if s.admission.refuses_standing:
                drains = self._drains(now)
                s.stats.caller_drains += drains and not self.refusing
                self.refusing = drains
                return False
            standing = self._full_calls >= STANDING_CALLS and now - self._full_since >= STANDING_WAIT
            s.stats.inline_handovers += standing
            self.handed_over = standing
            return standing

    def _drains(self, now: float) -> bool:
        """Whether this full call is refused (module docstring). Under the lock."""
        if self._last_drain is not None and self._last_full < now - STANDING_SECONDS:
            self._last_drain = None  # no full call for that long: the overload is over
        self._last_full = now
        need = STANDING_SECONDS if self._last_drain is None else STANDING_WAIT
        if not self.refusing and now - self._full_since >= need:
            self._last_drain = now
            return True
        return self.refusing

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
        pipeline, at most `Admission.call_batch` rows each, as (row indices, pad length), in the order
        to run them (`plan_checks.inline_batches`)."""
        s = self._scheduler
        with s.lock:
            batches, failures, reshaped = inline_batches(self._policy, self._view, lengths, now, self._ids,
                                                         s.admission.call_batch, s.manifest)
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
