"""The slicer's time-balanced cuts (slicer.partition), on given node costs: no timing involved.

How balanced real models come out is measured (stage timings) and so is a benchmark's claim; what
is checked here is that, for the costs it is given, the partition minimizes the slowest stage."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from slicer.analysis import CutPoint
from slicer.partition import NoLegalCut, balanced_partition


def _points(positions) -> list[CutPoint]:
    return [CutPoint(int(p), (f"t{p}",), 4) for p in positions]


def _slowest_by_brute_force(costs: np.ndarray, positions: list[int], stages: int) -> float:
    best = np.inf
    for cuts in itertools.combinations(positions, stages - 1):
        bounds = [0, *cuts, len(costs)]
        best = min(best, max(float(costs[a:b].sum()) for a, b in zip(bounds, bounds[1:])))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_the_partition_minimizes_the_slowest_stage(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(6, 30))
    costs = rng.exponential(1.0, n)
    positions = sorted(rng.choice(np.arange(1, n), size=int(rng.integers(3, n)), replace=False).tolist())
    stages = int(rng.integers(2, min(5, len(positions) + 1) + 1))
    part = balanced_partition(costs, _points(positions), stages, tolerance=0.0)
    assert len(part.cuts) == stages - 1 and len(part.stage_costs) == stages
    assert list(part.positions) == sorted(set(part.positions)) and set(part.positions) <= set(positions)
    assert sum(part.stage_costs) == pytest.approx(costs.sum())
    assert max(part.stage_costs) == pytest.approx(_slowest_by_brute_force(costs, positions, stages))
    # with a tolerance, the slowest stage stays within it of the best (one level of choice per cut)
    loose = balanced_partition(costs, _points(positions), stages, tolerance=0.05)
    assert max(loose.stage_costs) <= max(part.stage_costs) * 1.05 ** (stages - 1) + 1e-12


def test_equal_costs_cut_evenly_and_too_few_points_is_an_error() -> None:
    part = balanced_partition(np.ones(12), _points(range(1, 12)), 4, tolerance=0.0)
    assert part.positions == (3, 6, 9) and part.imbalance == pytest.approx(1.0)
    with pytest.raises(NoLegalCut):
        balanced_partition(np.ones(12), _points([6]), 3)
