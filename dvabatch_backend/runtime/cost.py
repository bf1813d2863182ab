"""Profiled stage times, read one way by everyone who predicts what a batch costs: the policies
(whether a split or padding pays, how long a batch window is) and admission (the latency target,
the queue bound). One rule, so a policy and admission price one batch the same.

The slicer's profile gives, per stage, seconds keyed by batch size, and for models with a length
the same per profiled length. Along either axis (batch size, then length):

- at a profiled point its time, and between two points linear interpolation (`numpy.interp`);
- below the smallest point the smallest's time (flat): fixed per-batch costs dominate small
  batches and short lengths, so nothing below the profile is taken to be cheaper (a split never
  looks profitable there, and a latency prediction never looks better than what was measured);
- beyond the largest point proportional, t(x) = t(largest) * x / largest: no better per-row cost
  than the largest shows.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

_Points = tuple[np.ndarray, np.ndarray]  # (sorted points, seconds at each)


def _points(times: Mapping[int, float]) -> _Points:
    xs = sorted(int(x) for x in times if int(x) >= 1)
    return np.array(xs, dtype=np.float64), np.array([float(times[x]) for x in xs], dtype=np.float64)


def along(points: _Points, x: float) -> float:
    """Seconds at `x` from profiled (x, seconds) points, by the module's rule."""
    xs, ts = points
    if x >= xs[-1]:
        return float(ts[-1] * x / xs[-1])
    return float(np.interp(x, xs, ts))  # flat below the smallest point


class StageCost:
    """Seconds a stage takes for a batch of `bs` rows (at a padded `length`, where the profile has
    lengths). `available`: every stage has a batch-size profile; `by_length_available`: at least two
    profiled lengths (one says nothing of what padding costs)."""

    def __init__(self, stage_times: Sequence[Mapping[int, float]], num_stages: int,
                 by_length: Mapping[int, Sequence[Mapping[int, float]]] | None = None) -> None:
        self.num_stages = num_stages
        self._stages = [_points(t) for t in stage_times]
        self.available = len(self._stages) == num_stages > 0 and all(len(xs) for xs, _ in self._stages)
        items = sorted((int(n), times) for n, times in (by_length or {}).items())
        self._lengths = np.array([n for n, _ in items], dtype=np.float64)
        self._by_length = [[_points(t) for t in times] for _, times in items]
        self.by_length_available = len(self._lengths) >= 2 and all(
            len(stages) == num_stages and all(len(xs) for xs, _ in stages) for stages in self._by_length)
        # the profile never changes: each price is computed once and read from this table after
        # (a policy prices every cluster and merge of every call, so interpolating each time
        # would be a large share of the served stub's time)
        self._prices: dict[tuple[int, int | None, int, int], float] = {}

    @property
    def lengths(self) -> list[int]:
        """The profiled lengths (none without a per-length profile)."""
        return [int(n) for n in self._lengths]

    def profiled(self, stage: int) -> dict[int, float]:
        xs, ts = self._stages[stage]
        return {int(x): float(t) for x, t in zip(xs, ts)}

    def time(self, stage: int, bs: int, length: int | None = None) -> float:
        """One stage's seconds for `bs` rows; at `length` along the per-length profile if there is one."""
        key = (bs, length, stage, -1)
        price = self._prices.get(key)
        if price is None:
            price = self._prices[key] = self._interpolated(stage, bs, length)
        return price

    def _interpolated(self, stage: int, bs: int, length: int | None) -> float:
        if length is None or not len(self._lengths):
            return along(self._stages[stage], bs)
        return along((self._lengths, np.array([along(stages[stage], bs) for stages in self._by_length])), length)

    def seconds(self, bs: int, length: int | None = None, stages: range | None = None) -> float:
        """The summed seconds of `stages` (default: every stage) for `bs` rows at `length`."""
        span = stages if stages is not None else range(self.num_stages)
        key = (bs, length, span.start, span.stop)
        price = self._prices.get(key)
        if price is None:
            price = self._prices[key] = sum(self.time(s, bs, length) for s in span)
        return price
