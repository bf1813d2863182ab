"""The load hold: near the knee, hold a fast-path call back so that the next one brings a bigger batch.

On the fast path a call (a Triton `execute`) runs at once the requests that queued while the last
one ran, so batches are as big as that queue: ZeroBatch's. Where batching makes a query much
cheaper (a residual MLP: 1.3 ms for one row, 2.3 ms for 16), that is too little near the knee: the
instance is busy nearly all the time with small batches, and a fixed queue delay (DelayBatch's)
sustains more by making bigger ones, at the price of its delay at every load. The hold makes the
same bigger batches only where they are needed: held, the instance takes no call, arrivals queue
(in Triton's queue, which costs nothing), and the next call brings them all.

What it measures, over its last `WINDOW` calls: the rows arriving a second (lambda), the rows a
call brings, the share of the time spent running batches, and how much slower runs are than the
profile says (kappa: CPU taken by the server and the clients). What it decides, at each call:

- the batch the load needs, x*: the smallest x with lambda * kappa * T(x) / x <= TARGET_BUSY, the
  instance busy at most that share of the time running batches of x (T: the profiled run time);
  where no x <= bs_max gets there, the x with the cheapest row;
- the hold: x* / lambda (the time x* rows take to arrive) less the cycle the calls have without
  holding (a run and the way to and from the server), so the next call brings about x* rows. It is
  at most the run time of x* rows: never a wait longer than the run it pays for.

No hold at all while calls bring fewer than `MIN_ROWS` rows on average: no queue forms, so a hold
would bring nobody (a lone client waits for its answer before it sends again) and costs its whole
length; nor before `MIN_CALLS` calls, nor without a profile. So at low load, where x* is the batch
a call already brings, the fast path is what it was; the hold grows with the load, from nothing.

One per fast path; `hold` and `ran` are called by the one thread that runs the fast path at a time
(the `InlineHold` reservation), and keep no lock.
"""
from __future__ import annotations

from collections import deque

import numpy as np

from .cost import StageCost

WINDOW = 32  # calls: about a tenth of a second of them at the MLP's knee
MIN_CALLS = 8
MIN_ROWS = 2.0
TARGET_BUSY = 0.8  # the busy share held to: below it batches form in the queue as they are


class LoadHold:
    """When to hold a fast-path call, and for how long (module docstring)."""

    def __init__(self, cost: StageCost, bs_max: int, target_busy: float = TARGET_BUSY,
                 window: int = WINDOW) -> None:
        if not 0 < target_busy <= 1:
            raise ValueError(f"target_busy must be in (0, 1], got {target_busy}")
        self.available = cost.available and bs_max >= 2
        sizes = np.arange(1, max(bs_max, 1) + 1)
        self._seconds = np.array([cost.seconds(int(x)) for x in sizes]) if cost.available else np.ones(len(sizes))
        self._per_row = self._seconds / sizes  # index x - 1: the profiled seconds a row in a batch of x
        self.target_busy = target_busy
        self._calls: deque[tuple[float, int, float, float, float]] = deque(maxlen=window)  # (time, rows, run, profiled, held)
        self._rows = 0
        self._run = self._profiled = self._held = 0.0
        self._pending: tuple[float, int, float] | None = None  # this call's (time, rows, held) until `ran`

    def hold(self, rows: int, now: float) -> float:
        """A call bringing `rows` rows at `now`: the seconds to hold it before it runs (0: none)."""
        seconds = self._decide(rows, now)
        self._pending = (now, rows, seconds)
        return seconds

    def ran(self, seconds: float) -> None:
        """The call's run took `seconds` (not counting the hold); after `hold`."""
        if self._pending is not None:
            now, rows, held = self._pending
            self._pending = None
            self.record(now, rows, held, seconds)

    def record(self, now: float, rows: int, held: float, run: float) -> None:
        """A call at `now` that brought `rows` rows, was held `held` s and ran `run` s."""
        profiled = float(self._seconds[min(rows, len(self._seconds)) - 1]) if rows >= 1 else 0.0
        if len(self._calls) == self._calls.maxlen:
            _, r, s, p, h = self._calls[0]
            self._rows -= r
            self._run -= s
            self._profiled -= p
            self._held -= h
        self._calls.append((now, rows, run, profiled, held))
        self._rows += rows
        self._run += run
        self._profiled += profiled
        self._held += held

    def _decide(self, rows: int, now: float) -> float:
        calls = len(self._calls)
        if not self.available or calls < MIN_CALLS or self._rows / calls < MIN_ROWS:
            return 0.0
        span = now - self._calls[0][0]
        if span <= 0 or self._profiled <= 0:
            return 0.0
        rate = (self._rows - self._calls[0][1] + rows) / span  # rows arriving a second since the oldest call
        kappa = self._run / self._profiled
        busy_per_row = rate * kappa * self._per_row  # the busy share at each batch size
        fits = np.flatnonzero(busy_per_row <= self.target_busy)
        x = int(fits[0]) + 1 if len(fits) else int(np.argmin(self._per_row)) + 1
        cycle = (span - self._held) / calls  # a call's cycle without holding
        wait = x / rate - cycle
        if wait <= 0:
            return 0.0
        return min(wait, kappa * float(self._seconds[x - 1]))
