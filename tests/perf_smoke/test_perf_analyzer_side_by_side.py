"""`python -m perf.compare.by_perf_analyzer` at the zoo's test size, short windows: the slicer's
model beside ZeroBatch and DelayBatch in one real tritonserver, measured by the real perf_analyzer
(concurrency 1, closed loop at bs_max, stepping Poisson rates, the fixed 0.5x and 0.9x rates, and
Gamma CV 4 arrivals at 0.5x). A row per system, every request succeeded or was refused as overload
(Triton's own statistics: no other failure, some successes), and a verdict per figure; no timing
assertions. The closed-loop sweep
over client counts and the rounds' order are checked on perf_analyzer results given by the test."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from perf.compare import by_perf_analyzer as sbs


@pytest.mark.server
def test_a_row_per_system_and_every_request_succeeded(zoo_out: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = sbs.main(["--size", "test", "--quick", "--measurement-interval", "250", "--out", str(zoo_out), "--overhead",
                     "--no-closed-loop-sweep", "--rate-step", "0.35"])  # rates at 0.5x, 0.85x, 1.2x the peak
    out = capsys.readouterr().out
    results_path = zoo_out / "perf_analyzer_side_by_side" / "bert" / "test" / "results.json"
    results = json.loads(results_path.read_text())
    # the fixed loads' figures, drawn beside the results
    assert results_path.with_name("latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    systems = {s["label"]: s for s in results["systems"]}
    overhead = ("ZeroBatch-sender", "ZeroBatch-thread", "Echo", "DVABatch-pipeline")
    assert set(systems) == {"DVABatch", "ZeroBatch", "DelayBatch", *overhead}, out
    for label in overhead:  # --overhead: c=1 and the peak only
        assert systems[label]["failed"] == 0 and systems[label]["c1_mean_ms"] and systems[label]["closed_loop_peak"]
        assert systems[label]["stub_rss_mb"] > 0
        systems.pop(label)
    assert "served path, concurrency-1 mean" in out
    for label, system in systems.items():
        assert system["failed"] == 0 and system["succeeded"] > 0, (label, out)
        assert system["perf_analyzer_errors"] == [], (label, out)
        assert system["c1_p99_ms"] is not None and system["closed_loop_peak"] is not None, (label, out)
        # a rate step, unless the lowest rate was already past the target (perf_analyzer's latency stop)
        assert system["steps"] or system["sustained_rate"] is None, (label, out)
        # a load the model refused (overload, "Exceeds maximum queue size") has no figure
        assert set(system["loads"]) <= {"0.5x", "0.9x", "0.5x gamma4"}, (label, out)
        assert len(system["loads"]) == 3 or system["refused_levels"] and system["refused"] > 0, (label, out)
        assert system["closed_loop"] == {}, (label, out)  # --no-closed-loop-sweep
        assert all(load["mean_ms"] > 0 and load["p99_ms"] >= load["mean_ms"] * 0.5 for load in system["loads"].values())
        assert any(line.startswith(label) for line in out.splitlines()), out
    # the same fixed rates for every system, fractions of ZeroBatch's sustained rate (or its peak)
    for key in ("0.5x", "0.5x gamma4"):
        assert len({system["loads"][key]["rate"] for system in systems.values() if key in system["loads"]}) == 1
    assert {"c1 mean (ms over)", "0.5x mean", "0.5x p99", "0.9x mean", "0.9x p99", "0.5x gamma4 mean",
            "0.5x gamma4 p99"} <= set(results["verdicts"]), out
    assert all(isinstance(v["met"], bool) and v["baseline"] in ("ZeroBatch", "DelayBatch")
               for v in results["verdicts"].values())
    assert code == 0, out


def test_rates_step_over_a_peak() -> None:
    plan = sbs.Plan.for_args(quick=True, latency_target_ms=500.0)
    assert plan.rates(100.0) == [50.0, 60.0, 70.0, 80.0, 90.0, 100.0, 110.0, 120.0]
    assert sbs.Plan.for_args(quick=False, latency_target_ms=500.0).rates(100.0) == [30.0 + 10 * i for i in range(10)]
    assert sbs.Plan.for_args(quick=True, latency_target_ms=500.0, rate_step=0.35).rates(100.0) == [50.0, 85.0, 120.0]
    assert plan.rates(0.5) == [1.0]  # perf_analyzer needs a rate of at least 1/s; no level twice


def test_every_system_steps_over_one_grid_each_level_the_median_of_its_rounds(monkeypatch: pytest.MonkeyPatch,
                                                                                 tmp_path: Path) -> None:
    # the perf_analyzer runs are replaced by each system's answers at each rate (in the order asked):
    # "fast" keeps up to 40/s, one stalled round at 30/s outvoted by the other two; "slow" passes 30/s
    # on p99, then falls behind at 40/s; a level past its last is never run
    p99s = {("fast", 20.0): [10, 12, 11], ("fast", 30.0): [400, 20, 25], ("fast", 40.0): [30, 35, 32],
            ("fast", 50.0): [200, 300, 250], ("slow", 20.0): [15, 16, 14], ("slow", 30.0): [40, 45, 42],
            ("slow", 40.0): [60, 70, 65]}
    answered = {"fast": 0.75, "slow": 0.75}
    asked: list[tuple[str, float]] = []

    def run(url: str, model: str, data: Path, plan: sbs.Plan, windows_x: int = 1, **load: object) -> sbs.PerfResult:
        rate = load["request_rate_range"][0]  # type: ignore[index]
        n = sum(1 for a in asked if a == (model, rate))
        asked.append((model, rate))
        kept = answered[model] * (0.5 if (model, rate) == ("slow", 40.0) else 1.0)
        return sbs.PerfResult([], 0, "", "", [_row(rate, kept * rate, p99s[model, rate][n])], [rate], True)

    monkeypatch.setattr(sbs, "_run", run)
    fast, slow = sbs.SystemResult("DVABatch", "fast"), sbs.SystemResult("ZeroBatch", "slow")
    plan = sbs.Plan.for_args(quick=True, latency_target_ms=100.0, rounds=3)
    sbs.measure_sustained("url", [fast, slow], tmp_path, plan, [20.0, 30.0, 40.0, 50.0, 60.0], progress=lambda m: None)
    assert fast.sustained_rate == 40.0 and [s["p99_ms"] for s in fast.steps] == [11, 25, 32, 250]
    assert slow.sustained_rate == 30.0 and [s["rate"] for s in slow.steps] == [20.0, 30.0, 40.0]
    assert ("fast", 60.0) not in asked and ("slow", 50.0) not in asked
    # the systems' order alternates from round to round and from level to level
    assert [m for m, r in asked if r == 20.0] == ["fast", "slow", "slow", "fast", "fast", "slow"]
    assert [m for m, r in asked if r == 30.0][:2] == ["slow", "fast"]


def test_a_level_perf_analyzer_never_stabilises_at_ends_that_systems_steps(monkeypatch: pytest.MonkeyPatch,
                                                                           tmp_path: Path) -> None:
    # "fast" keeps up everywhere; "stuck" keeps up at 20/s, and at 30/s perf_analyzer runs past its
    # timeout (a system that fell behind): its last level, the other system steps on
    asked: list[tuple[str, float]] = []

    def run(url: str, model: str, data: Path, plan: sbs.Plan, windows_x: int = 1, **load: object) -> sbs.PerfResult:
        rate = load["request_rate_range"][0]  # type: ignore[index]
        asked.append((model, rate))
        if model == "stuck" and rate >= 30.0:
            raise sbs.PerfAnalyzerError("perf_analyzer ran past 120s: ...")
        return sbs.PerfResult([], 0, "", "", [_row(rate, 0.99 * rate, 20)], [rate], True)

    monkeypatch.setattr(sbs, "_run", run)
    fast, stuck = sbs.SystemResult("DVABatch", "fast"), sbs.SystemResult("ZeroBatch", "stuck")
    plan = sbs.Plan.for_args(quick=True, latency_target_ms=100.0, rounds=1)
    sbs.measure_sustained("url", [fast, stuck], tmp_path, plan, [20.0, 30.0, 40.0], progress=lambda m: None)
    assert stuck.sustained_rate == 20.0 and [s["rate"] for s in stuck.steps] == [20.0]
    assert fast.sustained_rate == 40.0 and ("stuck", 40.0) not in asked


def test_concurrency_one_and_the_closed_loop_sweep_alternate_the_order_and_keep_the_median(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # each run answers with the next figure of its system (latency in ms at c=1, throughput in the sweep)
    figures = {"a": iter([5.0, 9.0, 6.0, 100.0, 130.0, 120.0, 200.0, 210.0, 190.0]),
               "b": iter([7.0, 7.5, 20.0, 90.0, 95.0, 80.0, 150.0, 170.0, 160.0])}
    asked: list[tuple[str, int]] = []

    def run(url: str, model: str, data: Path, plan: sbs.Plan, windows_x: int = 1, **load: object) -> sbs.PerfResult:
        clients = load["concurrency_range"][0]  # type: ignore[index]
        asked.append((model, clients))
        value = next(figures[model])  # read as the mean (ms) at concurrency 1, as the throughput in the sweep
        row = sbs.PerfRow("concurrency", clients, value, *[value * 1e3] * 5)
        return sbs.PerfResult([], 0, "", "", [row], [clients], True)

    monkeypatch.setattr(sbs, "_run", run)
    a, b = sbs.SystemResult("DVABatch", "a"), sbs.SystemResult("ZeroBatch", "b")
    plan = sbs.Plan.for_args(quick=True, latency_target_ms=100.0, rounds=3)
    sbs.measure_lone("url", [a, b], tmp_path, plan)
    assert [m for m, _ in asked] == ["a", "b", "b", "a", "a", "b"]
    assert (a.c1_mean_ms, a.c1_mean_spread_ms) == (6.0, (5.0, 9.0)) and b.c1_mean_ms == 7.5
    asked.clear()
    sbs.measure_closed_loop("url", [a, b], tmp_path, plan, bs_max=2)  # clients 1 and 2, three rounds each
    assert asked == [("a", 1), ("b", 1), ("b", 1), ("a", 1), ("a", 1), ("b", 1),
                     ("b", 2), ("a", 2), ("a", 2), ("b", 2), ("b", 2), ("a", 2)]
    assert a.closed_loop == {"1": 120.0, "2": 200.0} and b.closed_loop == {"1": 90.0, "2": 160.0}


def test_verdicts_take_the_better_baseline_for_each_figure() -> None:
    dva = sbs.SystemResult("DVABatch", "m", c1_mean_ms=10.08, sustained_rate=30.0, closed_loop={"1": 99.0, "4": 310.0},
                           loads={"0.5x": {"mean_ms": 10.0, "p99_ms": 16.0, "mean_spread": (9.5, 11.0)},
                                  "0.9x": {"mean_ms": 20.0, "p99_ms": 40.0, "p99_spread": (38.0, 42.0)}})
    zero = sbs.SystemResult("ZeroBatch", "z", c1_mean_ms=10.0, sustained_rate=20.0, closed_loop={"1": 100.0, "4": 300.0},
                            loads={"0.5x": {"mean_ms": 12.0, "p99_ms": 30.0},
                                   "0.9x": {"mean_ms": 50.0, "p99_ms": 70.0, "p99_spread": (65.0, 80.0)}})
    delay = sbs.SystemResult("DelayBatch", "d", c1_mean_ms=11.0, sustained_rate=10.0, closed_loop={"4": 305.0},
                             loads={"0.5x": {"mean_ms": 9.0, "p99_ms": 40.0, "mean_spread": (8.5, 9.6)},
                                    "0.9x": {"mean_ms": 60.0, "p99_ms": 90.0}})
    v = sbs.verdicts([dva, zero, delay])
    assert v["c1 mean (ms over)"]["baseline"] == "ZeroBatch" and v["c1 mean (ms over)"]["met"]  # +0.08 ms
    assert not v["closed loop c1"]["met"] and v["closed loop c4"]["baseline"] == "DelayBatch"
    assert v["closed loop c4"]["met"]  # 310 / 305
    slow = sbs.verdicts([sbs.SystemResult("DVABatch", "m", c1_mean_ms=50.4), sbs.SystemResult("ZeroBatch", "z", c1_mean_ms=50.0)])
    assert slow["c1 mean (ms over)"]["met"]  # +0.4 ms is within 1 % of a 50 ms query
    assert v["0.5x mean"]["baseline"] == "DelayBatch" and not v["0.5x mean"]["met"]  # 10 / 9
    assert v["0.5x p99"]["baseline"] == "ZeroBatch" and v["0.5x p99"]["value"] == round(16 / 30, 3)
    assert v["0.9x mean"]["met"] and not v["0.9x p99"]["met"]  # 20/50 = 0.4; 40/70 = 0.57
    assert v["sustained"] == {"value": 1.5, "baseline": "ZeroBatch", "target": 1.5, "met": True}
    # the rounds' spreads, where both sides have them: 0.5x mean missed within them, 0.9x p99 apart from them
    assert v["0.5x mean"]["within_spread"] is True and v["0.9x p99"]["within_spread"] is False
    assert v["c1 mean (ms over)"]["within_spread"] is None and v["0.9x mean"]["within_spread"] is None
    assert sbs.spreads_overlap((1.0, 2.0), (2.0, 3.0)) and not sbs.spreads_overlap([1.0, 1.9], [2.0, 3.0])


def test_fixed_rates_are_fractions_of_the_better_baselines_sustained_rate_or_its_peak() -> None:
    zero = sbs.SystemResult("ZeroBatch", "z", closed_loop_peak=50.0, sustained_rate=40.0)
    delay = sbs.SystemResult("DelayBatch-2ms", "d", closed_loop_peak=48.0, sustained_rate=44.0)
    rates, of = sbs.fixed_rates([zero, delay])
    assert rates == {"0.5x": 22.0, "0.9x": 39.6, "0.5x gamma4": 22.0} and "DelayBatch-2ms's sustained" in of
    rates, of = sbs.fixed_rates([zero], [sbs.FixedLoad(0.5), sbs.FixedLoad(0.9)])
    assert rates == {"0.5x": 20.0, "0.9x": 36.0} and "sustained" in of
    rates, of = sbs.fixed_rates([sbs.SystemResult("ZeroBatch", "z", closed_loop_peak=50.0)], [sbs.FixedLoad(0.9, 2.5)])
    assert rates == {"0.9x gamma2.5": 45.0} and "peak" in of


def test_the_bursty_load_is_one_seeded_gamma_schedule_at_the_fixed_rate(tmp_path: Path) -> None:
    path = sbs.write_gamma_intervals(tmp_path / "i.txt", 200.0, 4.0)
    assert path.read_text() == sbs.write_gamma_intervals(tmp_path / "j.txt", 200.0, 4.0).read_text()
    gaps_s = np.loadtxt(path) / 1e6
    assert len(gaps_s) == sbs.GAMMA_SENDS - 1 and (gaps_s >= 0).all()
    assert abs(gaps_s.mean() - 1 / 200) < 0.15 / 200
    assert 3.0 < gaps_s.std() / gaps_s.mean() < 5.0  # far burstier than Poisson's 1
    assert sbs.arrivals(200.0, path) == {"request_intervals": path}
    assert sbs.arrivals(200.0, None) == {"request_rate_range": (200.0,), "request_distribution": "poisson"}


def test_every_delaybatch_of_the_sweep_is_a_baseline() -> None:
    assert all(sbs.is_baseline(x) for x in ("ZeroBatch", "DelayBatch", "DelayBatch-0.5ms", "DelayBatch-4ms"))
    assert not any(sbs.is_baseline(x) for x in ("DVABatch", "Echo", "ZeroBatch-sender"))
    dva = sbs.SystemResult("DVABatch", "m", sustained_rate=100.0)
    v = sbs.verdicts([dva, sbs.SystemResult("ZeroBatch", "z", sustained_rate=80.0),
                      sbs.SystemResult("DelayBatch-2ms", "d", sustained_rate=120.0)])
    assert v["sustained"]["baseline"] == "DelayBatch-2ms" and v["sustained"]["value"] == round(100 / 120, 3)


def test_light_verdicts_take_the_fastest_baseline_spinning_or_not_at_each_load() -> None:
    """`--light`: the spinning baselines count as baselines; 0.25x and 0.5x are judged at 1.0x on the
    mean and the p99, each against the lowest baseline; closed loop at 0.95x; no sustained verdict."""
    assert sbs.is_baseline("ZeroBatch-spin") and sbs.is_baseline("DelayBatch-2ms-spin")
    assert not sbs.is_baseline("DVABatch-spin")
    dva = sbs.SystemResult("DVABatch", "m", c1_mean_ms=1.65, sustained_rate=100.0, closed_loop={"1": 96.0},
                           loads={"0.25x": {"mean_ms": 3.0, "p99_ms": 9.0}, "0.5x": {"mean_ms": 4.0, "p99_ms": 12.0}})
    zero = sbs.SystemResult("ZeroBatch", "z", c1_mean_ms=2.0, sustained_rate=50.0, closed_loop={"1": 90.0},
                            loads={"0.25x": {"mean_ms": 2.9, "p99_ms": 20.0}, "0.5x": {"mean_ms": 5.0, "p99_ms": 11.0}})
    spin = sbs.SystemResult("ZeroBatch-spin", "zs", c1_mean_ms=1.5, closed_loop={"1": 100.0},
                            loads={"0.25x": {"mean_ms": 3.5, "p99_ms": 8.0}, "0.5x": {"mean_ms": 4.5, "p99_ms": 15.0}})
    v = sbs.verdicts([dva, zero, spin], light=True)
    assert v["c1 mean (ms over)"]["baseline"] == "ZeroBatch-spin" and not v["c1 mean (ms over)"]["met"]  # +0.15 ms
    assert v["closed loop c1"] == {"value": 0.96, "baseline": "ZeroBatch-spin", "target": 0.95, "met": True}
    assert v["0.25x mean"]["baseline"] == "ZeroBatch" and not v["0.25x mean"]["met"]  # 3.0 / 2.9
    assert v["0.25x p99"]["baseline"] == "ZeroBatch-spin" and not v["0.25x p99"]["met"]  # 9 / 8
    assert v["0.5x mean"]["met"] and v["0.5x p99"]["baseline"] == "ZeroBatch" and not v["0.5x p99"]["met"]
    assert "sustained" not in v and "0.9x mean" not in v
    assert "0.25x mean" not in sbs.verdicts([dva, zero, spin])  # the default plan's loads and targets


def test_batch_histograms_are_the_executions_between_two_readings() -> None:
    assert sbs.histogram_delta({1: 10, 4: 7, 16: 3}, {1: 8, 4: 7}) == {"1": 2, "16": 3}


def _row(rate: float, throughput: float, p99_ms: float) -> sbs.PerfRow:
    return sbs.PerfRow("request_rate", rate, throughput, p99_ms * 500, p99_ms * 900, p99_ms * 950, p99_ms * 1e3,
                       p99_ms * 600)


def test_sustained_is_judged_against_what_the_generator_delivered() -> None:
    # the generator delivers 0.75x at every rate; the system falls behind only at 40/s
    rows = [_row(10, 7.5, 40), _row(20, 15.0, 50), _row(30, 22.5, 80), _row(40, 24.0, 90), _row(50, 37.5, 150)]
    assert sbs.sustained(rows, latency_target_ms=100).level == 30
    assert sbs.sustained(rows, latency_target_ms=60).level == 20
    assert sbs.sustained([_row(10, 7.5, 120)], latency_target_ms=100) is None


def test_another_slicing_of_the_model_is_served_beside_under_its_own_name(tmp_path: Path) -> None:
    from perf.baselines.bench import sliced

    one, _, _, _ = sliced("bert", "test", tmp_path, stages=1)
    two, _, _, _ = sliced("bert", "test", tmp_path, stages=2)
    names = sbs.build_repository(tmp_path / "repo", one.parent, sliced=two.parent)
    assert names[sbs.SLICED] == f"{names[sbs.DVA]}_sliced"
    served = tmp_path / "repo" / names[sbs.SLICED]
    assert f'name: "{names[sbs.SLICED]}"' in (served / "config.pbtxt").read_text()
    assert (served / "1").resolve() == two.resolve() and (tmp_path / "repo" / names[sbs.DVA] / "1").resolve() == one.resolve()
    assert not sbs.is_baseline(sbs.SLICED)
