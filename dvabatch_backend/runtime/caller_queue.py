"""The caller's own queue: what the runtime learns of it from the calls it hands over.

A Triton `execute` call hands over what queued in Triton's dynamic batcher while the last call
ran. That queue is the caller's, and the runtime's admission cannot see it: left there, overload
would queue without bound, and the runtime cannot tell a burst from overload by how long its calls
have come full (the caller gives no arrival times). `caller_backlog` is told, for each call,
whether it came full (the caller had at least a batch waiting). Two steps:

1. **Handed over.** Once the calls have come full `STANDING_CALLS` times in a row and for
   `STANDING_WAIT`, `execute` returns as soon as it has submitted them (`handed_over`, counted in
   `inline_handovers`) rather than running the loop's steps itself, until a call comes that is not
   full: the caller's queue drains into the runtime's, where each query's arrival is known and the
   admission judges it (admission.py: the derived bound pushes out the oldest, so under overload
   the answered cross the queue at the arrival rate; a queue standing `STANDING_SECONDS` is
   overload, and the door shuts). A burst is carried, not refused.
2. **Drained.** Once the door has shut, overload is known (`door_shut_at`; until no call has come
   full for `STANDING_SECONDS`): after `STANDING_WAIT` of full calls `refusing` is set and the
   calls are refused whole, "Exceeds maximum queue size", until one comes that is not full
   (counted in `caller_drains`). A call holds the caller's oldest requests (Triton's batcher hands
   them over in arrival order), so this is the push-out of the oldest, done in the caller's queue;
   refused unread, a call costs next to nothing.

Where a bs_max batch passes quickly (not `Admission.long_passage`), the pipeline reads a backlog
more slowly than overload brings it (each request crosses `execute`'s reading and submission on
the stub's one thread), so there the calls are drained once they have come full for
`STANDING_SECONDS`, without a hand-over, and after a drain the overload is known. With a
configured queue bound or timeout (the user's policy) nothing is drained: the calls are handed
over, where that policy applies. Each method takes the scheduler's lock.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .admission import STANDING_SECONDS, STANDING_WAIT

if TYPE_CHECKING:
    from .scheduler import Scheduler

STANDING_CALLS = 2  # full calls in a row that say the caller's queue stands


class CallerQueue:
    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
        self._full_calls = 0  # the caller's calls in a row that came full ...
        self._full_since = 0.0  # ... since the first of them
        # the caller's queue stands and its calls go to the loop (module docstring, step 1): a
        # backlog, whose batches the scheduler keeps at the backlog's size (admission.py)
        self.handed_over = False
        # the caller's queue is drained (module docstring): its calls are refused while set
        self.refusing = False
        self._known_at: float | None = None  # when overload was last known (a drain, the door shut); None: not
        self._forgotten_at = float("-inf")  # when it was last forgotten (an older door shut does not count)
        self._last_full = 0.0  # when a call last came full

    def caller_backlog(self, full: bool) -> bool:
        """One call of the caller's, `full` or not (module docstring): whether its queue is drained
        (`refusing`); True where its queue stands and the call's requests are left to the loop
        (`handed_over`)."""
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
