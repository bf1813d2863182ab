"""A 10-second soak against the real tritonserver (perf.reliability.soak): the test-size bert served as four
variants (pipelined, input, load, hybrid policies), open-loop Poisson load at 0.9 x a rough sustained
rate (0.8 x the closed-loop mixed peak), mixed lengths over gRPC and HTTP. Every query is answered,
once: with its result, or refused with Triton's overload codes (the load is set from a measured rate,
so a slow moment of the machine may fill the queue: a refusal is an answer, never a loss); the
sampled answers (1 in 5) equal the unsliced model; the server and its backend stubs are the
processes that started. Counts and correctness only: the rate and the stubs' memory drift are
measured and reported (`python -m perf.reliability.soak` judges the drift), never asserted here."""
from __future__ import annotations

from pathlib import Path

from perf.reliability.soak import soak

SECONDS = 10.0


def test_soak_loses_nothing_and_answers_right(zoo_out: Path) -> None:
    result = soak(SECONDS, zoo_out, zoo_name="bert", size="test", sample_every=5, peak_seconds=2.0)
    report = "\n".join(result.report())
    assert result.crashes == [], report
    assert result.sent > 0, report
    assert result.answered + sum(result.rejected.values()) == result.sent, report
    overload = ("Exceeds maximum queue size", "overloaded: cannot meet")
    assert all(any(o in message for o in overload) for message in result.rejected), report
    assert result.lost == 0, report
    assert result.duplicated == 0, report
    # every answer with a result at a sampled index (1 in 5 sent) is checked; refused ones have none
    assert result.sampled == result.sample_due > 0, report
    assert result.wrong == [], report
    assert len(result.by_variant) == 4 and len(result.by_protocol) == 2, report
    assert result.rss_samples > 0, report
