"""Smoke run of the harness (perf.paper.experiments) against the real tritonserver: the test-size BERT, a
few seconds of load per experiment; every sent query is answered, and results.json, report.md and
the PNG plot are well-formed."""
from __future__ import annotations

import json

import pytest

from perf.paper.experiments import SYSTEMS, ExperimentSettings, figure14, figure15, figure21, main, write_report

pytestmark = pytest.mark.server  # every test here runs the harness against the real tritonserver

FRACTIONS = (0.25, 0.6, 0.9)
QUERIES = 30
SETTINGS = ExperimentSettings(size="test", queries=QUERIES, peak_seconds=1.0, fractions=FRACTIONS, delays_us=(0, 2000),
                              tune_seconds=0.5, timeout=30.0, steps=3, step_queries=20)


@pytest.fixture(scope="module")
def fig14(zoo_out):
    results = figure14(["bert"], zoo_out, SETTINGS)  # the test-size slice other perf commands made, reused
    return zoo_out, results, write_report(results, zoo_out)


def test_every_query_is_answered(fig14) -> None:
    _, results, _ = fig14
    entry = results["models"]["bert"]
    assert entry["policy"] == "input"
    assert entry["peak"]["throughput_qps"] > 0 and entry["peak"]["summary"]["errors"] == 0
    assert entry["delay_tuning"]["best_delay_us"] in (0, 2000)
    assert entry["names"]["DelayBatch"] == f"bert_delay{entry['delay_tuning']['best_delay_us']}"
    assert [lv["fraction"] for lv in entry["loads"]] == list(FRACTIONS)
    orders = [tuple(lv["order"]) for lv in entry["loads"]]
    assert len(set(orders)) == len(orders), "the order of systems rotates per load level"
    for level in entry["loads"]:
        assert set(level["systems"]) == set(SYSTEMS)
        assert level["rate_qps"] == pytest.approx(level["fraction"] * entry["peak"]["throughput_qps"])
        for system, summary in level["systems"].items():
            assert summary["sent"] == QUERIES == summary["queries"], system
            assert summary["errors"] == 0 and summary["error_messages"] == [], (system, summary["error_messages"])
            assert summary["answered"] == summary["sent"], system
            assert summary["latency_mean_ms"] > 0 and summary["latency_p99_ms"] >= summary["latency_p50_ms"]
            assert summary["goodput_qps"] <= summary["throughput_qps"] + 1e-9
        for key, value in level["ratios"].items():
            assert key.startswith("dvabatch_vs_") and value is not None and value > 0


def test_outputs_are_well_formed(fig14) -> None:
    out, results, paths = fig14
    assert paths["json"] == out / "results.json" and paths["markdown"] == out / "report.md"
    saved = json.loads((out / "results.json").read_text())
    assert {"experiment", "size", "params", "models"} <= set(saved)
    assert saved["experiment"] == "figure14" and saved["size"] == "test"
    assert {"policy", "bs_max", "delay_tuning", "peak", "loads", "names", "limit"} <= set(saved["models"]["bert"])
    limit = saved["models"]["bert"]["limit"]
    assert limit["errors"] == 0 and limit["compute_bound"]["qps"] > 0 and limit["dvabatch_peak_qps"] > 0
    assert limit["ratio"] == pytest.approx(limit["dvabatch_peak_qps"] / limit["compute_bound"]["qps"])
    assert paths["png"] == out / "figure14.png" and (out / "figure14.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert saved["models"]["bert"]["loads"][0]["ratios"] == results["models"]["bert"]["loads"][0]["ratios"]
    report = (out / "report.md").read_text()
    assert "## bert" in report and "| load | rate qps | system | mean ms |" in report
    assert "DVABatch/this mean" in report and "DVABatch/this p99" in report and "Limit: " in report
    rows = [line for line in report.splitlines() if line.startswith("| 0.")]
    assert len(rows) == len(FRACTIONS) * len(SYSTEMS)
    for label in ("ZeroBatch", "DelayBatch", "DVABatch"):
        assert sum(label in row for row in rows) == len(FRACTIONS)
    ratio_cells = [row.split("|")[-3:-1] for row in rows if "DVABatch" not in row]
    assert all(cell.strip() != "—" for cells in ratio_cells for cell in cells)


def test_slices_are_reused_and_cli_rejects_bad_policy(fig14, capsys) -> None:
    out, _, _ = fig14
    assert (out / "sliced" / "test" / "bert" / "1" / "manifest.json").is_file()
    with pytest.raises(SystemExit):
        main(["figure14", "--models", "bert", "--policy", "bert", "--out", str(out)])


def test_stepping_load_and_overhead_smoke(zoo_out, tmp_path) -> None:
    """Figure 15 (stepping load) and Figure 21 (closed loop at concurrency 1): every query answered
    (past its peak DVABatch may refuse, as overload: "Exceeds maximum queue size"; nothing else
    fails), the peak loads read off the steps, and both reports written."""
    stepping = figure15(["bert"], zoo_out, SETTINGS)
    entry = stepping["models"]["bert"]
    n = SETTINGS.steps * SETTINGS.step_queries
    assert len(entry["rates_qps"]) == n and sorted(entry["rates_qps"]) == entry["rates_qps"]
    for label in SYSTEMS:
        run = entry["stepping"][label]
        summary = run["summary"]
        assert summary["sent"] == n and summary["answered"] + summary["errors"] == n, label
        assert summary["errors"] == 0 or label == "DVABatch", label
        assert all("Exceeds maximum queue size" in m for m in summary["error_messages"]), (label, summary)
        assert len(run["latency_ms"]) == n
        assert sum(v is not None and v > 0 for v in run["latency_ms"]) >= summary["answered"], label
        assert [step["queries"] for step in run["steps"]] == [SETTINGS.step_queries] * SETTINGS.steps
        assert run["peak_load_qps"] is None or run["peak_load_qps"] in entry["rates_qps"]
    paths = write_report(stepping, tmp_path / "figure15")
    assert paths["png"].stat().st_size > 0 and "peak load under target" in paths["markdown"].read_text()

    overhead = figure21(["bert"], zoo_out, SETTINGS, rounds=2)
    entry = overhead["models"]["bert"]
    assert entry["systems"]["DVABatch"]["settings"]["policy_params"]["window"] == 0
    for label, stats in entry["closed_loop"].items():
        assert stats["errors"] == 0 and stats["queries"] >= 1, label  # how many fit in the time is speed
    assert entry["overhead_ms"] == pytest.approx(
        entry["closed_loop"]["DVABatch"]["latency_mean_ms"] - entry["closed_loop"]["ZeroBatch"]["latency_mean_ms"])
    assert "Overhead: DVABatch mean" in write_report(overhead, tmp_path / "figure21")["markdown"].read_text()
