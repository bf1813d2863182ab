"""The demo's closing side-by-side run against ZeroBatch (dvabatch_backend.tools.demo._side_by_side), on
the test-size BERT served by the real tritonserver with a few seconds of budget: every query sent
to either system is answered, the ratios are finite, and the table shows them."""
from __future__ import annotations

import argparse
import math

import pytest

from dvabatch_backend.tools import demo
from dvabatch_backend.tools.serve import TritonServer
from perf.baselines import zero_batch

from ..triton_support import add_variant, slice_zoo_model

DVA_NAME, ZERO_NAME = "bert_input", "bert_zerobatch"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repository")
    base = slice_zoo_model(repo / ".sliced", "bert")
    model = add_variant(repo, base, DVA_NAME, policy="input", policy_params={"window": 0.02})
    zero_batch(repo, base.version_dir, ZERO_NAME, threads=1, bs_max=base.manifest.max_batch_size)
    server = TritonServer(repo).start()
    try:
        for name in (DVA_NAME, ZERO_NAME):
            server.wait_model_ready(name, timeout=180)
        yield server, model
    finally:
        server.stop()


@pytest.mark.server
def test_every_query_is_answered_and_ratios_are_finite(served, monkeypatch, capsys) -> None:
    server, model = served
    seen: list = []
    table = demo._side_by_side_table

    def recording_table(rows):
        seen.extend(rows)
        return table(rows)

    monkeypatch.setattr(demo, "_side_by_side_table", recording_table)
    failed = demo._side_by_side(server, DVA_NAME, ZERO_NAME, model.manifest, model.int_high, seconds=6.0)
    out = capsys.readouterr().out
    assert failed == 0, out
    assert [row.fraction for row in seen] == list(demo.SIDE_BY_SIDE_LOADS)
    for row in seen:
        sent = len(row.dva.records)
        assert sent >= demo.MIN_QUERIES_PER_RUN and len(row.zero.records) == sent
        assert row.dva_summary["answered"] == sent == row.zero_summary["answered"], out
        assert row.rate > 0
        for ratio in (row.mean_ratio, row.p99_ratio):
            assert ratio is not None and math.isfinite(ratio) and ratio > 0
        assert f"{row.mean_ratio:.2f}" in out and f"{sent}/{sent}" in out
    assert "DVABatch/ZeroBatch" in out and "ERROR" not in out


def test_queries_per_run_fits_the_budget_within_bounds() -> None:
    rates = [30.0, 80.0]
    n = demo._queries_per_run(rates, 20.0)
    assert demo.MIN_QUERIES_PER_RUN <= n <= demo.MAX_QUERIES_PER_RUN
    assert 2 * sum(n / r for r in rates) <= 20.0  # both systems at each load, within the time left
    assert demo._queries_per_run(rates, 0.0) == demo.MIN_QUERIES_PER_RUN
    assert demo._queries_per_run([1e4, 1e4], 60.0) == demo.MAX_QUERIES_PER_RUN


def test_side_by_side_is_on_by_default_and_can_be_skipped() -> None:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    assert parser.parse_args([]).side_by_side_seconds == demo.SIDE_BY_SIDE_SECONDS
    assert parser.parse_args(["--no-side-by-side"]).side_by_side_seconds == 0
    assert parser.parse_args(["--side-by-side-seconds", "20"]).side_by_side_seconds == 20
