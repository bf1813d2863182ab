"""Profiled stage times as the diversity policies read them (paper §7.1-§7.2).

Both read the slicer's profile by the runtime's one rule (`dvabatch_backend.runtime.cost`, which
admission reads it by too, so a policy and admission price one batch the same): linear between
profiled points, flat below the smallest, proportional beyond the largest, along batch size and
along length.

- `StageProfile`: per stage, seconds by batch size (`PolicyContext.stage_times`), and the sizes a
  new batch runs as where the profile says smaller batches answer sooner (`arrival_sizes`);
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

    def arrival_sizes(self, n: int, slack: float) -> tuple[int, ...]:
        """The sizes in which `n` queries that arrive together run, one batch after another (the
        paper's split, decided for the whole model before stage 0: a batch splits where the
        hardware is already busy at a smaller size).

        Candidates are chunks of one profiled batch size c (a size the slicer measured: between
        two, the times are interpolated and say nothing new) in arrival order, the remainder last.
        Each query waits until its chunk is done, so the chunks are judged by the summed time to
        answer all n queries (each chunk's queries answered at the running total of the chunks'
        times); among the c whose chunks take at most (1 + slack) x the time of one batch of n (a
        split never gives up throughput beyond `slack`, by the profile), the one answering soonest
        wins. (n,) without a
        profile, for n < 2, past the largest profiled size, or with a negative `slack`.

        E.g. a CNN at 12.7 ms for 8 queries and 112 ms for 64 runs 64 arrivals as 8 batches of 8
        (101 ms in all; the first eight answered after 12.7 ms, not 112); a model whose time per
        query keeps falling up to 64 runs them as one."""
        if n < 2 or slack < 0 or not self.available:
            return (n,)
        profiled = set().union(*(self.profiled(stage) for stage in range(self.num_stages)))
        if n > max(profiled):
            return (n,)  # past the profile times are extrapolated in proportion: a split would look free
        times: dict[int, float] = {}

        def t(bs: int) -> float:
            if bs not in times:
                times[bs] = self.seconds(bs)
            return times[bs]

        budget = t(n) * (1 + slack)
        best: tuple[int, ...] = (n,)
        best_wait = t(n) * n
        for c in sorted(size for size in profiled if size < n):
            full, rest = divmod(n, c)
            sizes = (c,) * full + ((rest,) if rest else ())
            if sum(t(s) for s in sizes) > budget:
                continue
            done = wait = 0.0
            for s in sizes:
                done += t(s)
                wait += s * done
            if wait < best_wait * (1 - 1e-9):
                best, best_wait = sizes, wait
        return best


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
