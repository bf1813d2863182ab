"""Profiled stage times as the diversity policies read them (paper §7.1-§7.2).

Both read the slicer's profile by the runtime's one rule (`dvabatch_backend.runtime.cost`, which
admission reads it by too, so a policy and admission price one batch the same): linear between
profiled points, flat below the smallest, proportional beyond the largest, along batch size and
along length.

- `StageProfile`: per stage, seconds by batch size (`PolicyContext.stage_times`);
- `BatchCost`: a whole batch (or one stage of it) by batch size and padded length
  (`PolicyContext.stage_times_by_length`).
"""
from __future__ import annotations

from typing import Mapping, Sequence

from dvabatch_backend.runtime.cost import StageCost


class StageProfile(StageCost):
    """Per-stage times by batch size; `available` is False unless every stage has a profile."""

    def __init__(self, stage_times: Sequence[Mapping[int, float]], num_stages: int) -> None:
        super().__init__(stage_times, num_stages)

    def remaining(self, stage: int, bs: int) -> float:
        """T_remain(bs) after `stage`: the summed times of the stages after it."""
        return self.seconds(bs, stages=range(stage + 1, self.num_stages))


class BatchCost:
    """Profiled seconds of a batch by batch size and padded length; `available` with two or more
    profiled lengths (one says nothing of what padding costs)."""

    def __init__(self, by_length: Mapping[int, Sequence[Mapping[int, float]]], num_stages: int) -> None:
        self._cost = StageCost((), num_stages, by_length)
        self.available = self._cost.by_length_available
        self.num_stages = num_stages

    def seconds(self, bs: int, length: int) -> float:
        """The whole batch: every stage."""
        return self._cost.seconds(bs, length)

    def stage_seconds(self, stage: int, bs: int, length: int) -> float:
        """One stage of the batch."""
        return self._cost.time(stage, bs, length)
