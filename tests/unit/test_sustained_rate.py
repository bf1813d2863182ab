"""The sustained-rate search of `perf.compare --device` (`sustained_fraction`): the highest load on the
grid (0.5, 0.6, ... x ZeroBatch's peak) whose run passes, found by stepping up from 0.5 while runs
pass, or down from it until one does; the loads it tried are the ones it needed."""
from __future__ import annotations

import pytest

from perf.compare.on_device import sustained_fraction


@pytest.mark.parametrize("highest, expected, tried", [
    (1.34, 1.3, [0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.4]),  # up from 0.5 to the first miss
    (0.3, 0.3, [0.5, 0.4, 0.3]),  # 0.5 missed: down until one passes
    (0.0, 0.0, [0.5, 0.4, 0.3, 0.2, 0.1]),  # nothing passes
    (9.0, 2.5, [round(0.5 + k / 10, 6) for k in range(21)]),  # capped at the grid's end
])
def test_the_highest_passing_load_on_the_grid(highest: float, expected: float, tried: list[float]) -> None:
    asked: list[float] = []

    def passes(fraction: float) -> bool:
        asked.append(fraction)
        return fraction <= highest

    assert sustained_fraction(passes) == expected
    assert asked == tried
