"""A 30-second soak against the real tritonserver (perf.reliability.soak): the test-size bert served as four
variants (pipelined, input, load, hybrid policies), open-loop Poisson load at 0.9 x a rough sustained
rate (0.8 x the closed-loop mixed peak), mixed lengths over gRPC and HTTP. Every query is answered,
once, without an error; the sampled answers (1 in 5) equal the unsliced model; the server and its
backend stubs are the processes that started; the stubs' RSS drifts at most 10 % after the warm-up.
Counts and correctness only: the rate is measured, never asserted."""
from __future__ import annotations

from pathlib import Path

from perf.reliability.soak import MAX_DRIFT_PCT, soak

SECONDS = 30.0


def test_soak_loses_nothing_and_holds_its_memory(tmp_path: Path) -> None:
    result = soak(SECONDS, tmp_path, zoo_name="bert", size="test", sample_every=5, peak_seconds=2.0)
    report = "\n".join(result.report())
    assert result.crashes == [], report
    assert result.sent > 0, report
    assert result.answered == result.sent, report
    assert sum(result.rejected.values()) == 0, report
    assert result.lost == 0, report
    assert result.duplicated == 0, report
    assert result.sampled >= result.sent // 5 - 1 and result.sampled > 0, report
    assert result.wrong == [], report
    assert len(result.by_variant) == 4 and len(result.by_protocol) == 2, report
    assert result.rss_samples >= SECONDS * 0.8, report
    assert result.drift_pct <= MAX_DRIFT_PCT, report
