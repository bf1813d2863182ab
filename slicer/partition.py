"""Time-balanced cuts: choose N-1 legal cut points minimizing the slowest stage.

Dynamic programming over the legal positions with prefix sums of node costs. Among cuts whose
slowest stage is within `tolerance` of the best, it prefers cuts at preferred positions
(where the preferred batch size changes, for operator diversity) and then fewer bytes crossing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Sequence

import numpy as np

from .analysis import CutPoint


class NoLegalCut(ValueError):
    """The graph has too few legal cut points for the number of stages asked."""


@dataclass(frozen=True)
class Partition:
    cuts: tuple[CutPoint, ...]
    stage_costs: tuple[float, ...]

    @property
    def positions(self) -> tuple[int, ...]:
        return tuple(c.position for c in self.cuts)

    @property
    def imbalance(self) -> float:
        """Slowest stage over the mean stage (1.0 is perfect balance)."""
        return max(self.stage_costs) / (sum(self.stage_costs) / len(self.stage_costs))


def balanced_partition(costs: np.ndarray, points: Sequence[CutPoint], num_stages: int, tolerance: float = 0.02,
                       preferred: Collection[int] = ()) -> Partition:
    """The partition of nodes into `num_stages` contiguous stages at legal `points`."""
    n = len(costs)
    if num_stages < 1:
        raise ValueError(f"the number of stages must be >= 1, got {num_stages}")
    if num_stages > n:
        raise NoLegalCut(f"{num_stages} stages asked for a graph of only {n} nodes")
    if num_stages - 1 > len(points):
        raise NoLegalCut(
            f"{num_stages} stages need {num_stages - 1} cuts but the graph has only {len(points)} legal cut "
            f"point(s) (positions {[p.position for p in points][:20]})"
        )
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    if num_stages == 1:
        return Partition((), (float(prefix[-1]),))
    pos = np.array([p.position for p in points])
    at = prefix[pos]
    penalty = np.array([p.bytes_per_row for p in points], dtype=float)
    penalty /= max(penalty.max(), 1.0) * 2 * num_stages  # bytes only break ties: < 1 in total
    penalty -= np.array([1.0 if p.position in preferred else 0.0 for p in points])

    # best[j]: (slowest stage so far, tie-break score) with the latest cut at points[j]
    best = at.copy()
    score = penalty.copy()
    back: list[np.ndarray] = []
    for _ in range(num_stages - 2):
        new_best = np.full(len(points), np.inf)
        new_score = np.full(len(points), np.inf)
        choice = np.full(len(points), -1)
        for j in range(1, len(points)):
            value = np.maximum(best[:j], at[j] - at[:j])
            i = _pick(value, score[:j], tolerance)
            new_best[j], new_score[j], choice[j] = value[i], score[i] + penalty[j], i
        best, score = new_best, new_score
        back.append(choice)
    final = np.maximum(best, prefix[-1] - at)
    j = _pick(final, score, tolerance)
    chosen = [j]
    for choice in reversed(back):
        j = int(choice[j])
        chosen.append(j)
    cuts = tuple(points[j] for j in reversed(chosen))
    bounds = [0, *(c.position for c in cuts), n]
    return Partition(cuts, tuple(float(prefix[b] - prefix[a]) for a, b in zip(bounds, bounds[1:])))


def achievable_balance(costs: np.ndarray, points: Sequence[CutPoint], num_stages: int) -> float:
    """The best slowest/mean any cut at `points` can reach for `num_stages` (by node costs): the
    mean stage, or the costliest run of nodes between two neighbouring legal cuts if it is larger
    (a node that dominates the model cannot be split)."""
    total = float(np.sum(costs))
    if total <= 0:
        return 1.0
    bounds = [0, *(p.position for p in points), len(costs)]
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    largest_run = max(float(prefix[b] - prefix[a]) for a, b in zip(bounds, bounds[1:]))
    return max(1.0, largest_run / (total / num_stages))


def _pick(value: np.ndarray, score: np.ndarray, tolerance: float) -> int:
    """Index of the best value; among values within `tolerance` of it, the lowest score."""
    finite = np.isfinite(value) & np.isfinite(score)
    if not finite.any():
        return int(np.argmin(value))
    limit = value[finite].min() * (1 + tolerance)
    candidates = np.flatnonzero(finite & (value <= limit))
    return int(candidates[np.argmin(score[candidates])])
