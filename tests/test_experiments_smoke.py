"""Smoke run of the Figure 14/16 experiment (perf.experiments.figure14) against the real tritonserver:
the test-size BERT, a few seconds of load; every sent query is answered, and results.json and
report.md are well-formed."""
from __future__ import annotations

import json

import pytest

from perf.experiments import SYSTEMS, figure14, main, write_report

FRACTIONS = (0.25, 0.6, 0.9)
QUERIES = 30


@pytest.fixture(scope="module")
def fig14(tmp_path_factory):
    out = tmp_path_factory.mktemp("fig14")
    results = figure14(["bert"], "test", None, out, queries_per_load=QUERIES, seconds_for_peak=1.0,
                       fractions=FRACTIONS, delays_us=(0, 2000), tune_seconds=0.5, timeout=30.0)
    return out, results, write_report(results, out)


def test_every_query_is_answered(fig14) -> None:
    _, results, _ = fig14
    entry = results["models"]["bert"]
    assert entry["policy"] == "input"
    assert entry["peak"]["throughput_qps"] > 0 and entry["peak"]["summary"]["errors"] == 0
    assert entry["delay_tuning"]["best_delay_us"] in (0, 2000)
    assert entry["names"]["delaybatch"] == f"bert_delay{entry['delay_tuning']['best_delay_us']}"
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
    assert {"policy", "bs_max", "delay_tuning", "peak", "loads", "names"} <= set(saved["models"]["bert"])
    assert saved["models"]["bert"]["loads"][0]["ratios"] == results["models"]["bert"]["loads"][0]["ratios"]
    report = (out / "report.md").read_text()
    assert "## bert" in report and "| load | rate qps | system | mean ms |" in report
    assert "DVA/this mean" in report and "DVA/this p99" in report
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
