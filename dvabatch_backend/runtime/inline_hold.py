"""The fast path's hold on the pipeline (runtime/fast_path.py has the why).

`reserve` grants one run on the caller's thread only while the scheduler holds nothing (no query
unanswered, no batch, no stage working) and a query could meet the latency target now, and takes
the engine loop's step for it (engine_loop.py). While it is held, queries submitted are admitted
and batched as usual but the loop launches nothing, so none overtakes the run; `release` counts
what the run answered, gives the step back and wakes the loop where stages have work. `plan` is
the policy's batching of the run's rows. Each takes the scheduler's lock.

The caller's own queue. While a run holds the caller (a Triton `execute` call), requests wait in
the caller's queue (Triton's dynamic batcher), which the runtime's admission cannot see: left there,
overload would queue without bound, and the fast path cannot tell a burst from overload by how
long its calls have come full (the caller gives no arrival times). `caller_backlog` is told, for
each call, whether it came full (the caller had at least a batch waiting). Three steps:

1. **Handed over.** Once the calls have come full `STANDING_CALLS` times in a row and for
   `STANDING_WAIT`, they go to the pipeline (`handed_over`, counted in `inline_handovers`) until a
   call comes that is not full: the caller's queue drains into the runtime's, where each query's
   arrival is known and the admission judges it (admission.py: the derived bound pushes out the
   oldest, so under overload the answered cross the queue at the arrival rate; a queue standing
   `STANDING_SECONDS` is overload, and the door shuts). A burst is carried, not refused.
2. **Back to the fast path.** With one buffer pair the pipeline runs one batch at a time and
   carries a backlog more slowly than this path, so `reserve` waits (up to `STANDING_SECONDS`)
   for the pipeline to empty before a run (not a run whose rows carry a deadline: the pipeline
   keeps deadlines) and the next calls are served here, except while the pipeline judges an
   overload: its queue stands, its door is still open, and the caller's rows over the last
   `ARRIVALS_SECONDS` came `OUTPACED` times faster than the fast path served full calls
   (`arrivals_outpace`; once handed over the calls' rows are the arrivals, as `execute` returns
   at once). Without that last condition a load the fast path carries would stay with the slower
   pipeline once handed over.
3. **Drained.** Once the door has shut, overload is known (`door_shut_at`; until no call has come
   full for `STANDING_SECONDS`): the pipeline empties (the door keeps its queue to `STANDING_WAIT`
   of work), the fast path serves at its own rate, and after `STANDING_WAIT` of full calls
   `refusing` is set and the calls are refused whole, "Exceeds maximum queue size", until one comes
   that is not full (counted in `caller_drains`). A call holds the caller's oldest requests
   (Triton's batcher hands them over in arrival order), so this is the push-out of the oldest,
   done in the caller's queue; refused unread, a call costs next to nothing.

Where a bs_max batch passes quickly (not `Admission.long_passage`), the pipeline reads a backlog
more slowly than overload brings it (each request crosses `execute`'s reading and submission on
the stub's one thread), so there the calls are drained once they have come full for
`STANDING_SECONDS`, without a hand-over, and after a drain the overload is known. Draining every
model that way would make the first phase's answered wait out the drain, and handing over for
good would cap the answered rate at the pipeline's. With a configured queue bound or timeout (the
user's policy) nothing is drained: the calls are handed over, where that policy applies.

A call's rows run in batches of at most `Admission.call_batch` (no larger than buys throughput
at any profiled length), and where passages are long the adapter answers each request as its
batch is done, so a long call does not hold every answer until its last row.
"""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Iterator, Sequence

from .admission import STANDING_SECONDS, STANDING_WAIT
from .decisions import BatchTableView, Policy
from .plan_checks import inline_batches

if TYPE_CHECKING:
    from .scheduler import Scheduler

STANDING_CALLS = 2  # full calls in a row that say the caller's queue stands
ARRIVALS_SECONDS = STANDING_WAIT * 2  # the caller's arrival rate is counted over this long
OUTPACED = 1.25  # arrivals this much faster than the fast path serves full calls: overload to judge
_RATE_EWMA = 0.2  # weight of one full call's run in the fast path's rate


class RateWindow:
    """Rows counted over the last `seconds`: a rate (rows a second). One owner's lock guards it."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._counts: deque[tuple[float, int]] = deque()
        self._total = 0

    def note(self, now: float, rows: int) -> None:
        self._counts.append((now, rows))
        self._total += rows
        self._forget(now)

    def rate(self, now: float) -> float:
        self._forget(now)
        return self._total / self.seconds

    def _forget(self, now: float) -> None:
        while self._counts and self._counts[0][0] <= now - self.seconds:
            self._total -= self._counts.popleft()[1]


class InlineHold:
    def __init__(self, scheduler: Scheduler, policy: Policy, view: BatchTableView, ids: Iterator[int]) -> None:
        self._scheduler = scheduler
        self._policy = policy
        self._view = view
        self._ids = ids  # the scheduler's query ids: the planned rows get ids no real query has
        self._arrivals = RateWindow(ARRIVALS_SECONDS)  # the rows of the caller's calls
        self._last_call_full = False  # whether the caller's last call came full
        self._full_rate: float | None = None  # rows a second the fast path served full calls at (EWMA)
        self._full_calls = 0  # the caller's calls in a row that came full ...
        self._full_since = 0.0  # ... since the first of them
        # the caller's queue stands and its calls go to the pipeline (module docstring, step 1): a
        # backlog, whose batches the scheduler keeps at the backlog's size (admission.py)
        self.handed_over = False
        # the caller's queue is drained (module docstring): its calls are refused while set
        self.refusing = False
        self._known_at: float | None = None  # when overload was last known (a drain, the door shut); None: not
        self._forgotten_at = float("-inf")  # when it was last forgotten (an older door shut does not count)
        self._last_full = 0.0  # when a call last came full

    @property
    def allowed(self) -> bool:
        """Whether the fast path serves: the setting, and a policy that allows it."""
        return self._scheduler.settings.fast_path and type(self._policy).allows_inline()

    def caller_backlog(self, full: bool, rows: int = 1) -> bool:
        """One call of the caller of `rows` rows, `full` or not (module docstring): whether its
        queue is drained (`refusing`); True where its queue stands and the call's requests go to
        the pipeline instead of the fast path (`handed_over`)."""
        s = self._scheduler
        with s.lock:
            now = s.clock()
            self._arrivals.note(now, rows)
            self._last_call_full = full
            if not full:
                self._full_calls = 0
                self.handed_over = self.refusing = False
                return False
            if not self._full_calls:
                self._full_since = now
            self._full_calls += 1
            known = s.admission.refuses_standing and self._overload_known(now)
            self._last_full = now
            # quick batches: the pipeline reads a backlog more slowly than overload brings it
            drains_first = s.admission.refuses_standing and not s.admission.long_passage
            if known or drains_first:
                need = STANDING_WAIT if known else STANDING_SECONDS
                drains = not self.refusing and now - self._full_since >= need
                if drains:
                    self._known_at = now
                s.stats.caller_drains += drains
                self.refusing = self.refusing or drains
                return False
            standing = self._full_calls >= STANDING_CALLS and now - self._full_since >= STANDING_WAIT
            s.stats.inline_handovers += standing
            self.handed_over = standing
            return standing

    def _overload_known(self, now: float) -> bool:
        """Whether overload is known (module docstring): the pipeline's door shut, or a drain began,
        and calls have come full since with no gap of `STANDING_SECONDS` (after one, it is forgotten).
        Under the lock."""
        door = self._scheduler.admission.door_shut_at
        if door is not None and door > self._forgotten_at and (self._known_at is None or door > self._known_at):
            self._known_at = door
        if self._known_at is not None and now - max(self._known_at, self._last_full) >= STANDING_SECONDS:
            self._known_at, self._forgotten_at = None, now
        return self._known_at is not None

    def _pipeline_judges(self) -> bool:
        """Whether the pipeline's admission is judging an overload: its queue stands, its door is
        still open, and the caller's calls bring rows faster than the fast path serves full calls
        (arrivals must reach it). Under the lock."""
        s = self._scheduler
        return (s.queries.queue_since is not None and s.admission.door_since is None
                and self.arrivals_outpace(s.clock()))

    def arrivals_outpace(self, now: float) -> bool:
        """Whether the caller's rows over the last `ARRIVALS_SECONDS` came `OUTPACED` times faster
        than the fast path served full calls (True before it served one). Under the lock."""
        return self._full_rate is None or self._arrivals.rate(now) > OUTPACED * self._full_rate

    def reserve(self, rows: int, wait: bool = True) -> bool:
        """Hold the pipeline for one run of `rows` rows, if it holds nothing (module docstring);
        `wait`: with one buffer pair, for a busy pipeline to empty first."""
        s = self._scheduler
        with s.lock:
            if wait and not s.admission.overlapping and not self._pipeline_judges():
                # one pair: the pipeline runs one batch at a time, more slowly than this path; let
                # it empty, then serve here (module docstring)
                s.wait_for_nothing_held(STANDING_SECONDS)
            if not self._grants(rows):
                return False  # asked before the step: a busy loop's step is not waited for
        s.step.acquire()  # the loop holds nothing: at most the end of a step is waited for
        with s.lock:
            if self._grants(rows):
                return True
        s.step.release()
        return False

    def _grants(self, rows: int) -> bool:
        """Whether a run of `rows` rows may start now. Under the lock."""
        s = self._scheduler
        return rows >= 1 and s.holds_nothing() and not s.admission.arrival_refusal(s.clock(), 0)

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
            if self._last_call_full and seconds and rows:
                rate = rows / seconds
                self._full_rate = rate if self._full_rate is None else self._full_rate + _RATE_EWMA * (rate - self._full_rate)
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
        s.step.release()
