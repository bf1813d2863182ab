"""Load generators: arrival schedules and length presets (pure), results (hand-made records),
and open- and closed-loop runs against the real tritonserver serving a sliced test-size BERT."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest

from dvabatch_backend.tools.serve import TritonServer
from perf.load.arrivals import constant, gamma, poisson, stepping, stepping_rates
from perf.load.drivers import run_closed_loop, run_open_loop
from perf.load.lengths import PRESETS, describe, names, sample_lengths
from perf.load.stats import LoadResult, QueryRecord, peak_load, step_summaries
from perf.load.wire import grpc_request, query_length

from ..triton_support import add_variant, slice_zoo_model

N = 200_000


def _gaps(offsets: np.ndarray) -> np.ndarray:
    return np.diff(offsets)


# ----------------------------------------------------------------------------------------------
# schedules


def test_poisson_rate_and_cv() -> None:
    offsets = poisson(500.0, N, np.random.default_rng(1))
    gaps = _gaps(offsets)
    assert offsets.shape == (N,) and offsets[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / 500, rel=0.01)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.02)
    # counts per 100 ms window are Poisson: variance equals mean
    counts = np.bincount((offsets // 0.1).astype(int))[:-1]
    assert counts.var() / counts.mean() == pytest.approx(1.0, rel=0.1)


@pytest.mark.parametrize("cv", [0.25, 0.5, 2.0, 4.0])
def test_gamma_rate_and_cv(cv: float) -> None:
    gaps = _gaps(gamma(200.0, cv, N, np.random.default_rng(2)))
    assert gaps.mean() == pytest.approx(1 / 200, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.05)


def test_gamma_cv_one_is_poisson_and_cv_zero_is_constant() -> None:
    np.testing.assert_array_equal(gamma(300.0, 1.0, 1000, 7), poisson(300.0, 1000, 7))
    np.testing.assert_allclose(gamma(300.0, 0.0, 10, 7), constant(300.0, 10))
    np.testing.assert_allclose(np.diff(constant(250.0, 100)), 1 / 250)


def test_stepping_rates_steps_and_cap() -> None:
    # the paper's §8.3 shape: 66 qps, raised every 2000 queries, 4000 qps from query 28 000 on
    step = (4000 - 66) / 14
    rates = stepping_rates(66.0, step, 2000, 32_000, max_rate=4000.0)
    assert rates[0] == 66.0 and rates[1999] == 66.0 and rates[2000] == pytest.approx(66.0 + step)
    assert rates[28_000] == pytest.approx(4000.0) and rates.max() == pytest.approx(4000.0)
    assert np.all(np.diff(rates) >= 0)
    np.testing.assert_allclose(stepping_rates(10.0, 5.0, 3, 9), [10, 10, 10, 15, 15, 15, 20, 20, 20])
    np.testing.assert_allclose(stepping_rates(10.0, 5.0, 3, 9, max_rate=12.0), [10, 10, 10] + [12] * 6)


def test_stepping_is_poisson_within_each_step() -> None:
    every = 40_000
    offsets = stepping(100.0, 300.0, every, 4 * every, max_rate=None, rng=np.random.default_rng(3))
    assert offsets[0] == 0.0 and np.all(np.diff(offsets) >= 0)
    gaps = np.diff(offsets)
    for k, rate in enumerate([100.0, 400.0, 700.0, 1000.0]):
        block = gaps[max(k * every - 1, 0):(k + 1) * every - 1]  # the gaps before block k's queries
        assert block.mean() == pytest.approx(1 / rate, rel=0.03), k
        assert block.std() / block.mean() == pytest.approx(1.0, rel=0.05), k


def test_schedules_are_seeded() -> None:
    for make in (lambda s: poisson(100, 500, s), lambda s: gamma(100, 3.0, 500, s),
                 lambda s: stepping(50, 10, 100, 500, 120, s)):
        np.testing.assert_array_equal(make(11), make(11))
        np.testing.assert_array_equal(make(np.random.default_rng(11)), make(11))
        assert not np.array_equal(make(11), make(12))


@pytest.mark.parametrize("call", [lambda: poisson(0, 10), lambda: poisson(-1, 10), lambda: poisson(10, -1),
                                  lambda: gamma(10, -0.5, 10), lambda: stepping(10, 1, 0, 10),
                                  lambda: stepping(10, -1, 5, 10), lambda: constant(float("inf"), 3)])
def test_schedules_refuse_bad_arguments(call) -> None:
    with pytest.raises(ValueError):
        call()


# ----------------------------------------------------------------------------------------------
# length presets


@pytest.mark.parametrize("name", names())
@pytest.mark.parametrize("max_length", [1, 32, 512])
def test_lengths_shape_dtype_bounds(name: str, max_length: int) -> None:
    lengths = sample_lengths(name, 5000, max_length, np.random.default_rng(0))
    assert lengths.shape == (5000,) and lengths.dtype == np.int64
    assert lengths.min() >= 1 and lengths.max() <= max_length
    np.testing.assert_array_equal(lengths, sample_lengths(name, 5000, max_length, 0))
    assert describe(name)


def test_sst2_mostly_short_rte_has_a_long_tail() -> None:
    sst2 = sample_lengths("sst2", 20_000, 512, 1)
    assert np.mean((sst2 >= 5) & (sst2 <= 20)) >= 0.7
    assert np.mean(sst2 > 20) > 0.05  # a tail
    rte = sample_lengths("rte", 20_000, 512, 1)
    assert np.mean(rte > 100) >= 0.05 and rte.max() > 200
    assert np.median(rte) > 2 * np.median(sst2)
    capped = sample_lengths("rte", 20_000, 128, 1)
    assert capped.max() == 128 and np.mean(capped == 128) > 0.02  # the tail piles up at the cap
    # pair tasks are longer than single-sentence ones; SST-2 more skewed than CoLA
    medians = {n: np.median(sample_lengths(n, 20_000, 512, 2)) for n in PRESETS}
    assert min(medians["mrpc"], medians["qnli"], medians["rte"]) > max(medians["sst2"], medians["cola"])
    cola = sample_lengths("cola", 20_000, 512, 2)
    assert np.percentile(sst2, 99) / np.median(sst2) > np.percentile(cola, 99) / np.median(cola)


def test_uniform_and_fixed() -> None:
    uniform = sample_lengths("uniform", 20_000, 32, 3)
    assert set(np.unique(uniform)) == set(range(1, 33))
    assert np.all(sample_lengths("fixed", 10, 32, 0) == 32)
    assert np.all(sample_lengths("fixed", 10, 32, 0, length=7) == 7)
    assert np.all(sample_lengths("fixed:9", 10, 32, 0) == 9)
    assert np.all(sample_lengths("fixed:90", 10, 32, 0) == 32)  # clipped like every sample


@pytest.mark.parametrize("call", [lambda: sample_lengths("squad", 3, 32), lambda: sample_lengths("rte", 3, 0),
                                  lambda: sample_lengths("fixed:x", 3, 32), lambda: sample_lengths("sst2:4", 3, 32),
                                  lambda: sample_lengths("fixed", 3, 32, length=0)])
def test_lengths_refuse_bad_arguments(call) -> None:
    with pytest.raises(ValueError):
        call()


# ----------------------------------------------------------------------------------------------
# results and requests, without a server


def _result() -> LoadResult:
    # 10 queries scheduled every 0.1 s, sent 1 ms late, latency 10..100 ms; query 9 failed
    records = [QueryRecord(i, 0.1 * i + 0.001, 0.1 * i + 0.001 + 0.01 * (i + 1), ok=i != 9,
                           error=None if i != 9 else "INTERNAL: boom", length=i + 1, scheduled=0.1 * i)
               for i in range(10)]
    return LoadResult("open", "m", "u", "grpc", 0.0, records, {"rate": 10})


def test_summary_figures() -> None:
    result = _result()
    s = result.summary(latency_target=0.05)
    window = (0.9 + 0.001 + 0.1) - 0.001  # first send to last answer
    assert (s["queries"], s["answered"], s["errors"]) == (10, 9, 1)
    assert s["latency_mean_ms"] == pytest.approx(50.0) and s["latency_p50_ms"] == pytest.approx(50.0)
    assert s["latency_max_ms"] == pytest.approx(90.0) and s["latency_p99_ms"] == pytest.approx(89.2)
    assert s["duration_s"] == pytest.approx(window)
    assert s["throughput_qps"] == pytest.approx(9 / window)
    assert s["goodput_qps"] == pytest.approx(5 / window) and result.goodput(0.05) == s["goodput_qps"]
    assert s["send_lag_p99_ms"] == pytest.approx(1.0) and s["offered_qps"] == pytest.approx(10.0)
    assert [r.id for r in result.errors()] == [9]
    closed = LoadResult("closed", "m", "u", "grpc", 0.0, [QueryRecord(0, 0.0, 0.5, ok=True)]).summary()
    assert "send_lag_p99_ms" not in closed and "goodput_qps" not in closed
    empty = LoadResult("open", "m", "u", "grpc", 0.0, []).summary(0.1)
    assert empty["throughput_qps"] == 0.0 and empty["latency_p99_ms"] is None


def test_json_round_trip_and_segments() -> None:
    result = _result()
    data = json.loads(result.to_json(latency_target=0.05))
    assert data["summary"]["errors"] == 1 and len(data["records"]) == 10 and data["params"] == {"rate": 10}
    back = LoadResult.from_json(result.to_json())
    assert back.records == result.records and back.summary() == result.summary()
    parts = result.segments(4)
    assert [len(p.records) for p in parts] == [4, 4, 2] and parts[2].summary()["errors"] == 1


def test_step_summaries_and_peak_load() -> None:
    # three steps of 4 queries at 10, 20, 30 qps; latency 10 ms, then 40 ms, then 300 ms
    latency = [0.01] * 4 + [0.04] * 4 + [0.3] * 4
    records = [QueryRecord(i, float(i), float(i) + latency[i], ok=True, scheduled=float(i)) for i in range(12)]
    result = LoadResult("open", "m", "u", "grpc", 0.0, records)
    rates = stepping_rates(10.0, 10.0, 4, 12)
    steps = step_summaries(result, rates)
    assert [s["rate_qps"] for s in steps] == [10.0, 20.0, 30.0] and [s["queries"] for s in steps] == [4, 4, 4]
    assert peak_load(result, rates, latency_target=0.05) == 20.0
    assert peak_load(result, rates, latency_target=0.005) is None
    assert peak_load(result, rates, latency_target=1.0) == 30.0


def test_requests_carry_batch_dim_and_dtypes() -> None:
    from tritonclient.grpc import service_pb2

    query: dict[str, np.ndarray] = {"input_ids": np.arange(5, dtype=np.int64), "x": np.ones((5, 3), np.float32),
             "attention_mask": np.array([1, 1, 1, 0, 0], np.int64)}
    request = service_pb2.ModelInferRequest.FromString(grpc_request("bert", query, request_id="7"))
    assert request.model_name == "bert" and request.id == "7"
    got = {t.name: (t.datatype, list(t.shape)) for t in request.inputs}
    assert got == {"input_ids": ("INT64", [1, 5]), "x": ("FP32", [1, 5, 3]), "attention_mask": ("INT64", [1, 5])}
    np.testing.assert_array_equal(np.frombuffer(request.raw_input_contents[1], np.float32), np.ones(15))
    assert query_length(query) == 3  # the mask's ones
    assert query_length({"input_ids": np.arange(6)}) == 6
    assert query_length({"image": np.zeros((3, 8, 8), np.float32)}) is None


# ----------------------------------------------------------------------------------------------
# against the real server


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repository")
    base = slice_zoo_model(repo / ".sliced", "bert")
    model = add_variant(repo, base, "bert_load", policy="pipelined")
    server = TritonServer(repo).start()
    try:
        server.wait_model_ready(model.name, timeout=180)
        warm = np.random.default_rng(99)
        run_open_loop(server.grpc_url, model.name, [model.query(warm) for _ in range(10)], constant(100.0, 10))
        yield server, model
    finally:
        server.stop()


def _well_formed(summary: dict) -> None:
    for key in ("latency_mean_ms", "latency_p50_ms", "latency_p90_ms", "latency_p99_ms", "latency_max_ms",
                "throughput_qps", "duration_s", "send_rate_qps"):
        assert isinstance(summary[key], float) and np.isfinite(summary[key]) and summary[key] > 0, key
    assert summary["latency_p50_ms"] <= summary["latency_p90_ms"] <= summary["latency_p99_ms"] <= summary["latency_max_ms"]
    json.dumps(summary, allow_nan=False)


@pytest.mark.server
def test_open_loop_poisson_stays_on_schedule(served) -> None:
    server, model = served
    rng = np.random.default_rng(5)
    lengths = sample_lengths("sst2", 200, model.max_length, rng)
    queries = [model.query(rng, int(n)) for n in lengths]
    offsets = poisson(200.0, 200, rng)
    result = run_open_loop(server.grpc_url, model.name, queries, offsets, params={"rate": 200.0})

    assert [r.error for r in result.records if not r.ok] == []
    assert [r.id for r in result.records] == list(range(200))
    assert [r.length for r in result.records] == lengths.tolist()
    assert all(r.answer is not None and r.answer >= r.send for r in result.records)
    summary = result.summary(latency_target=0.5)
    _well_formed(summary)
    assert (summary["queries"], summary["answered"], summary["errors"]) == (200, 200, 0)
    assert summary["goodput_qps"] <= summary["throughput_qps"]
    assert summary["throughput_qps"] == pytest.approx(200 / result.window())
    # each query is sent at its offset, never before it; how late is the machine's speed (a
    # benchmark's business, not asserted here)
    assert [r.scheduled for r in result.records] == offsets.tolist()
    assert all(r.send >= r.scheduled for r in result.records)
    assert summary["offered_qps"] == pytest.approx(199 / (offsets.max() - offsets.min()))
    assert summary["send_lag_p50_ms"] >= 0.0
    assert result.params["rate"] == 200.0 and result.to_json()


@pytest.mark.server
def test_closed_loop_keeps_concurrency(served) -> None:
    server, model = served
    result = run_closed_loop(server.grpc_url, model.name, lambda i: model.query(np.random.default_rng(i)),
                             concurrency=4, n=60)
    assert [r.error for r in result.records if not r.ok] == []
    assert [r.id for r in result.records] == list(range(60))
    summary = result.summary(latency_target=0.5)
    _well_formed(summary)
    assert summary["answered"] == summary["queries"] == 60 and summary["errors"] == 0
    assert "send_lag_p99_ms" not in summary
    # with a duration instead: it stops by itself, and what it sent is answered
    timed = run_closed_loop(server.grpc_url, model.name, lambda i: model.query(np.random.default_rng(i)),
                            concurrency=4, duration=0.5)
    assert [r.error for r in timed.records if not r.ok] == []
    assert timed.summary(latency_target=0.5)["answered"] == len(timed.records)
    # never more than `concurrency` queries in flight
    events = sorted([(r.send, 1) for r in result.records] + [(r.answer, -1) for r in result.records],
                    key=lambda e: (e[0], e[1]))
    assert max(np.cumsum([e[1] for e in events])) <= 4


@pytest.mark.server
def test_http_open_loop_answers_equal_the_model(served) -> None:
    server, model = served
    rng = np.random.default_rng(6)
    queries = [model.query(rng) for _ in range(30)]
    result = run_open_loop(server.http_url, model.name, queries, poisson(100.0, 30, rng), protocol="http",
                           keep_outputs=True)
    assert result.summary()["errors"] == 0
    for i, query in enumerate(queries):
        for name, ref in model.reference(query).items():
            np.testing.assert_allclose(result.outputs[i][name][0], ref, atol=1e-4, rtol=0)


@pytest.mark.server
def test_errors_are_recorded_per_query(served) -> None:
    server, model = served
    rng = np.random.default_rng(7)
    good = model.query(rng)
    bad = {"input_ids": good["input_ids"]}  # attention_mask missing
    result = run_open_loop(server.grpc_url, model.name, [good, bad, good], [0.0, 0.0, 0.01])
    assert [r.ok for r in result.records] == [True, False, True]
    assert "attention_mask" in str(result.records[1].error)
    assert result.summary()["errors"] == 1
    missing = run_open_loop(server.grpc_url, "no_such_model", [good], [0.0])
    assert str(missing.records[0].error).startswith("NOT_FOUND")


@pytest.mark.server
def test_closed_loop_raises_what_make_query_raised(served) -> None:
    server, model = served

    def make_query(i: int) -> dict[str, np.ndarray]:
        if i == 3:
            raise RuntimeError("no query 3")
        return model.query(np.random.default_rng(i))

    with pytest.raises(RuntimeError, match="no query 3"):
        run_closed_loop(server.grpc_url, model.name, make_query, concurrency=2, n=10)


def test_paced_yields_each_query_no_earlier_than_its_time_in_the_order_given() -> None:
    from perf.load.arrivals import paced

    starts: list[float] = []
    seen = []
    for i in paced([0.0, 0.02, 0.01], order=[0, 2, 1], on_start=starts.append):
        seen.append((i, time.perf_counter() - starts[0]))
    assert [i for i, _ in seen] == [0, 2, 1]
    assert all(elapsed >= offset - 1e-3 for (_, elapsed), offset in zip(seen, (0.0, 0.01, 0.02)))  # never early (lateness is not checked)
