"""Profiled stage times as the diversity policies read them (paper §7.1-§7.2).

The slicer's profile gives, per stage, seconds keyed by batch size (`PolicyContext.stage_times`).
`StageProfile` answers the time of a stage at any batch size:

- a profiled batch size: its time;
- between two profiled sizes: linear interpolation;
- beyond the largest profiled size: proportional extrapolation, t(bs) = t(largest) * bs / largest;
- below the smallest profiled size: the smallest size's time (flat). The hardware is not busier
  at a smaller batch, so nothing below the profile is taken to get cheaper: splitting never
  looks profitable there.
"""
from __future__ import annotations

import bisect
from typing import Mapping, Sequence


class StageProfile:
    """Per-stage times by batch size; `available` is False unless every stage has a profile."""

    def __init__(self, stage_times: Sequence[Mapping[int, float]], num_stages: int) -> None:
        self._points: list[tuple[list[int], list[float]]] = []
        for stage in stage_times:
            sizes = sorted(int(bs) for bs in stage if int(bs) >= 1)
            self._points.append((sizes, [float(stage[bs]) for bs in sizes]))
        self.available = len(self._points) == num_stages > 0 and all(s for s, _ in self._points)
        self.num_stages = num_stages

    def profiled(self, stage: int) -> dict[int, float]:
        sizes, times = self._points[stage]
        return dict(zip(sizes, times))

    def time(self, stage: int, bs: int) -> float:
        """Seconds `stage` takes for a batch of `bs` queries (see the module docstring)."""
        sizes, times = self._points[stage]
        if bs <= sizes[0]:
            return times[0]
        if bs >= sizes[-1]:
            return times[-1] * bs / sizes[-1]
        i = bisect.bisect_left(sizes, bs)
        if sizes[i] == bs:
            return times[i]
        lo, hi = sizes[i - 1], sizes[i]
        return times[i - 1] + (times[i] - times[i - 1]) * (bs - lo) / (hi - lo)

    def remaining(self, stage: int, bs: int) -> float:
        """T_remain(bs) after `stage`: the summed times of the stages after it."""
        return sum(self.time(s, bs) for s in range(stage + 1, self.num_stages))


class BatchCost:
    """Profiled seconds of a whole batch (all stages) by batch size and padded length, from the
    per-length stage profile (`PolicyContext.stage_times_by_length`).

    Between two profiled lengths: linear interpolation; below the shortest: the shortest's time
    (a short batch is not taken to be cheaper than the profile shows: fixed per-batch costs
    dominate there); beyond the longest: proportional to the length.
    """

    def __init__(self, by_length: Mapping[int, Sequence[Mapping[int, float]]], num_stages: int) -> None:
        self._lengths = sorted(int(n) for n in by_length)
        self._profiles = [StageProfile(by_length[n], num_stages) for n in self._lengths]
        # one profiled length says nothing of what padding costs: the merging needs two or more
        self.available = len(self._lengths) >= 2 and all(p.available for p in self._profiles)
        self.num_stages = num_stages

    def _total(self, index: int, bs: int, stages: range) -> float:
        profile = self._profiles[index]
        return sum(profile.time(s, bs) for s in stages)

    def seconds(self, bs: int, length: int) -> float:
        """The whole batch: every stage."""
        return self._at_length(bs, length, range(self.num_stages))

    def stage_seconds(self, stage: int, bs: int, length: int) -> float:
        """One stage of the batch."""
        return self._at_length(bs, length, range(stage, stage + 1))

    def _at_length(self, bs: int, length: int, stages: range) -> float:
        lengths = self._lengths
        if length <= lengths[0]:
            return self._total(0, bs, stages)
        if length >= lengths[-1]:
            return self._total(len(lengths) - 1, bs, stages) * length / lengths[-1]
        i = bisect.bisect_left(lengths, length)
        if lengths[i] == length:
            return self._total(i, bs, stages)
        lo, hi = lengths[i - 1], lengths[i]
        t_lo, t_hi = self._total(i - 1, bs, stages), self._total(i, bs, stages)
        return t_lo + (t_hi - t_lo) * (length - lo) / (hi - lo)
