"""A test policy: random legal decisions, to exercise every meta operation in any order.

Arrivals are split into random groups; each group stretches the latest batch when that is
legal and a coin says so, starts a new batch otherwise, or waits for a short batch window.
Finished batches are split at random stages into random sizes.
"""
from __future__ import annotations

import random
from typing import Sequence

from .api import ArrivalPlan, BatchInfo, BatchTableView, New, Policy, QueryInfo, Split, Stretch


class RandomLegalPolicy(Policy):
    name = "random"
    runs_inline = True  # its splits change how a batch runs, never an answer

    def __init__(self, seed: int = 0, stretch: float = 0.5, split: float = 0.3, hold: float = 0.1,
                 window: float = 0.002) -> None:
        """A seeded random legal policy, for tests.

        Args:
            seed: the seed of the policy's own random generator. Default 0.
            stretch: the probability (0 to 1) that a group of arrivals stretches the latest batch where that is
                legal. Default 0.5.
            split: the probability (0 to 1) that a batch is split, at random sizes, after a stage other than the
                last. Default 0.3.
            hold: the probability (0 to 1) that an arrival holds every waiting query back for a random wait.
                Default 0.1.
            window: the longest such wait, in seconds (the wait is uniform below it). Default 0.002.
        """
        self._rng = random.Random(seed)
        self._p_stretch, self._p_split, self._p_hold, self._window = stretch, split, hold, window

    def on_arrival(self, waiting: Sequence[QueryInfo], table: BatchTableView, now: float) -> ArrivalPlan:
        rng, bs_max = self._rng, self.context.bs_max
        if rng.random() < self._p_hold:
            return ArrivalPlan((), wake_at=now + rng.random() * self._window)
        decisions: list[New | Stretch] = []
        latest = table.latest()
        room = 0 if latest is None or latest.no_stretch else bs_max - latest.bs
        queue = list(waiting)
        while queue:
            group = [queue.pop(0) for _ in range(min(len(queue), rng.randint(1, bs_max)))]
            ids = tuple(q.id for q in group)
            longest = max(q.length for q in group)
            if latest is not None and len(group) <= room and longest <= latest.pad_length and rng.random() < self._p_stretch:
                decisions.append(Stretch(latest.id, ids))
                room -= len(group)
                continue
            pad = rng.randint(longest, max(longest, self.context.max_length))
            decisions.append(New(ids, pad_length=pad, no_stretch=rng.random() < 0.2))
            latest, room = None, 0  # the new batch becomes the latest; its id is not known yet
        return ArrivalPlan(tuple(decisions))

    def on_stage_done(self, stage: int, batch: BatchInfo, table: BatchTableView, now: float) -> Split | None:
        if batch.bs < 2 or stage >= self.context.num_stages - 1 or self._rng.random() >= self._p_split:
            return None
        cuts = sorted(self._rng.sample(range(1, batch.bs), self._rng.randint(1, min(3, batch.bs - 1))))
        bounds = [0, *cuts, batch.bs]
        return Split(tuple(b - a for a, b in zip(bounds, bounds[1:])))
