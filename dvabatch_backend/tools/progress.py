"""Progress of a long command (`dvabatch slice`, `dvabatch compare`): a bar with a total and the time
left on a terminal (tqdm), one plain line per step elsewhere (CI logs, pipes), each with its count,
the time so far and, once the total is known, an estimate of the time left."""
from __future__ import annotations

import time
from typing import IO, Any


# the bar with a total (a bar, the count, the time so far and left, the step), and the count alone
BAR = "{desc}: {percentage:3.0f}%|{bar:24}| {n}/{total} [{elapsed}<{remaining}{postfix}]"
COUNT = "{desc}: {n} steps [{elapsed}{postfix}]"
MESSAGE = 70  # characters of a step's message on the bar's line, which must fit a terminal's


class StepProgress:
    """Called with each step's message. `expect(left)` says how many steps are left from here on:
    the total is then the steps so far and those, and the time left is estimated from the pace of
    the steps counted since (the early steps of a command are often unlike its later ones); before
    that, steps are counted without a total."""

    def __init__(self, desc: str, stream: IO[str], total: int | None = None) -> None:
        self.desc = desc
        self.stream = stream
        self.steps = 0
        self.total = total
        self._start = time.perf_counter()
        # (when, which step) the pace is measured from: the first step after the total was set
        self._paced_from: tuple[float, int] | None = None
        self._bar: Any = None
        if getattr(stream, "isatty", lambda: False)():
            from tqdm import tqdm

            self._bar = tqdm(desc=desc, total=total, unit="step", file=stream, dynamic_ncols=True,
                             bar_format=BAR if total else COUNT)

    def expect(self, left: int) -> None:
        """`left` more steps from here: the total becomes the steps so far and those."""
        self.total = self.steps + left
        self._paced_from = None
        if self._bar is not None:
            self._bar.bar_format = BAR
            self._bar.total = self.total
            self._bar.refresh()

    def __call__(self, message: str) -> None:
        self.steps += 1
        if self.total and self._paced_from is None:
            self._paced_from = (time.perf_counter(), self.steps)
        if self._bar is not None:
            self._bar.set_postfix_str(message[:MESSAGE], refresh=False)
            self._bar.update()
            return
        print(f"{self.desc}: {self.line(time.perf_counter())}: {message}", file=self.stream, flush=True)

    def line(self, now: float) -> str:
        """"step k of N (E s, about L s left)", or "step k (E s)" without a total."""
        elapsed = now - self._start
        if not self.total:
            return f"step {self.steps} ({elapsed:.1f} s)"
        left = self.left(now)
        estimate = "" if left != left else f", about {left:.0f} s left"  # none before a paced step (NaN)
        return f"step {self.steps} of {self.total} ({elapsed:.1f} s{estimate})"

    def left(self, now: float) -> float:
        """Seconds left, the step that just began included, at the pace of the steps done since the
        total was set (NaN before one is done: each message says what begins)."""
        if not self.total or self._paced_from is None:
            return float("nan")
        since, first = self._paced_from
        done = self.steps - first
        if done <= 0:
            return float("nan")
        return max(self.total - self.steps + 1, 0) * (now - since) / done

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
