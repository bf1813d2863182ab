"""The caller's queue (Triton's, before `execute`), as markers measure it.

A call says how many requests it holds, not when they came. A marker, a request the adapter sends
its own model (`triton_adapter.queue_marker`), joins the back of the queue and comes out after
everything before it. So the requests out between two markers arrived between their sends (the
arrival rate), and one out `c` requests after a marker sent at `s` arrived at about
`s + c / rate`, and for certain before every marker still out was sent: each call's oldest
request's wait, which the bound is about (`Pipeline.route_call`). Times are on any one clock:
the adapter's counts calls served. A call that is not full says nothing older waits. Owned by the
caller's thread (`execute`'s): no lock.
"""
from __future__ import annotations

from typing import Sequence


class CallerQueue:
    def __init__(self) -> None:
        self._sent: float | None = None  # when the last marker out was sent; None: none since the queue emptied
        self._behind = 0  # requests out since that marker: they arrived after it was sent
        self.rate: float | None = None  # requests per tick of the clock, between the last two markers' sends

    def oldest_arrival(self, marker_out: float | None = None) -> float | None:
        """When the next call's oldest request arrived, at the latest: None where no marker has
        measured the queue since it last emptied (or no two markers its rate) and none is out.
        `marker_out`: when the earliest marker still out was sent, if one is (it came before it)."""
        arrival = self._sent + self._behind / self.rate if self._sent is not None and self.rate else None
        if marker_out is not None:
            arrival = marker_out if arrival is None else min(arrival, marker_out)
        return arrival

    def came(self, requests: int, markers: Sequence[tuple[int, float]], full: bool) -> None:
        """A call of `requests` requests came out, markers included; `markers`: the position in the
        call and the send time of each marker in it, in order; `full`: whether the call was full
        (the queue held more than it)."""
        before = 0
        for position, sent in markers:
            self._behind += position - before
            if self._sent is not None and sent > self._sent:
                self.rate = self._behind / (sent - self._sent)
            self._sent, self._behind, before = sent, 0, position + 1
        self._behind += requests - before
        if not full:
            self._sent, self._behind = None, 0
