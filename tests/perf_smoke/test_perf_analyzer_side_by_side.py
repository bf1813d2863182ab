"""`python -m perf.perf_analyzer_side_by_side` at the zoo's test size, short windows: the slicer's
model beside ZeroBatch in one real tritonserver, measured by the real perf_analyzer (concurrency 1,
closed loop at bs_max, Poisson request rates). A row per system, and every request succeeded
(Triton's own statistics: no failure, some successes); no timing assertions."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from perf import perf_analyzer_side_by_side as sbs


@pytest.mark.server
def test_a_row_per_system_and_every_request_succeeded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = sbs.main(["--size", "test", "--quick", "--measurement-interval", "500", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    results = json.loads((tmp_path / "perf_analyzer_side_by_side" / "test" / "results.json").read_text())
    systems = {s["label"]: s for s in results["systems"]}
    assert set(systems) == {"DVABatch", "ZeroBatch"}, out
    for label, system in systems.items():
        assert system["failed"] == 0 and system["succeeded"] > 0, (label, out)
        assert system["perf_analyzer_errors"] == [], (label, out)
        assert system["c1_p99_ms"] is not None and system["closed_loop_peak"] is not None, (label, out)
        # a rate step, unless the lowest rate was already past the target (perf_analyzer's latency stop)
        assert system["steps"] or system["sustained_rate"] is None, (label, out)
        assert any(line.startswith(label) for line in out.splitlines()), out
    assert code == 0, out


def test_rates_step_over_the_larger_peak() -> None:
    plan = sbs.Plan.for_args(quick=True, latency_target_ms=500.0)
    assert plan.rates(100.0) == (40.0, 120.0, 20.0)
    assert sbs.Plan.for_args(quick=False, latency_target_ms=500.0).rates(100.0) == (30.0, 120.0, 10.0)
    assert plan.rates(0.5)[0] >= 1.0  # perf_analyzer needs a rate of at least 1/s
