"""`python -m perf.compare --demo DIR` (our own driver, `perf.compare.by_own_driver`) on a repository as
`dvabatch demo --out DIR` leaves it (the test-size BERT sliced under DIR/.sliced, a served variant,
DIR/demo.json), and `--model-dir` on the served folder itself, served by the real tritonserver beside
ZeroBatch with a few seconds of budget: every query sent to either system is answered, the ratios are
finite, the table shows them, and DIR is left as it was."""
from __future__ import annotations

import math

import pytest

from dvabatch_backend.tools import demo
from perf.compare import by_own_driver as side_by_side
from perf.compare.__main__ import main as compare

from ..triton_support import add_variant, slice_zoo_model

DVA_NAME = "bert_input"


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    repo = tmp_path_factory.mktemp("demo")
    base = slice_zoo_model(repo / ".sliced", "bert")
    add_variant(repo, base, DVA_NAME, policy="input", policy_params={"window": 0.02})
    demo.write_record(repo, "bert", DVA_NAME, base.version_dir)
    return repo


@pytest.mark.server
@pytest.mark.parametrize("how", ["demo", "model-dir"])
def test_every_query_is_answered_and_ratios_are_finite(demo_dir, how, monkeypatch, capsys, tmp_path) -> None:
    """Every query has an answer: its result, or, from DVABatch, a refusal as overload (the test-size
    model at 0.9x of ZeroBatch's peak can be more than it serves), counted and told apart from a
    failure; the ratios are finite."""
    before = sorted(p.name for p in demo_dir.iterdir())
    seen: list = []
    table = side_by_side.table

    def recording_table(rows):
        seen.extend(rows)
        return table(rows)

    monkeypatch.setattr(side_by_side, "table", recording_table)
    where = ["--demo", str(demo_dir)] if how == "demo" else ["--model-dir", str(demo_dir / DVA_NAME), "--driver", "own"]
    code = compare([*where, "--seconds", "6", "--out", str(tmp_path / "compare")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert [row.fraction for row in seen] == list(side_by_side.LOADS)
    for row in seen:
        sent = len(row.dva.records)
        assert sent >= side_by_side.MIN_QUERIES_PER_RUN and len(row.zero.records) == sent
        refused = len(row.dva.errors()) - len(side_by_side.failures(row.dva))
        assert row.dva_summary["answered"] + refused == sent == row.zero_summary["answered"], out
        assert not refused or f"DVABatch at {row.fraction:g}x refused {refused} of {sent}" in out, out
        assert row.rate > 0
        for ratio in (row.mean_ratio, row.p99_ratio):
            assert ratio is not None and math.isfinite(ratio) and ratio > 0
        assert f"{row.mean_ratio:.2f}" in out and f"{sent - refused}/{sent}" in out
    assert "DVABatch/ZeroBatch" in out and "ERROR" not in out
    lone = [line for line in out.splitlines() if line.startswith("concurrency 1")]
    assert len(lone) == 1 and "mean DVABatch" in lone[0] and "ZeroBatch" in lone[0], out
    assert sorted(p.name for p in demo_dir.iterdir()) == before  # ZeroBatch went to a scratch repository
    plot = tmp_path / "compare" / "latency.png"  # the same figures, drawn
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {plot}" in out, out


def test_queries_per_run_fits_the_budget_within_bounds() -> None:
    rates = [30.0, 80.0]
    n = side_by_side.queries_per_run(rates, 20.0)
    assert side_by_side.MIN_QUERIES_PER_RUN <= n <= side_by_side.MAX_QUERIES_PER_RUN
    assert 2 * sum(n / r for r in rates) <= 20.0  # both systems at each load, within the time left
    assert side_by_side.queries_per_run(rates, 0.0) == side_by_side.MIN_QUERIES_PER_RUN
    assert side_by_side.queries_per_run([1e4, 1e4], 60.0) == side_by_side.MAX_QUERIES_PER_RUN


def test_a_folder_the_demo_did_not_write_is_refused(tmp_path, capsys) -> None:
    assert compare(["--demo", str(tmp_path)]) == 2
    assert "dvabatch demo --out" in capsys.readouterr().err
