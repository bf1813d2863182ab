"""NVIDIA's real perf_analyzer against a real tritonserver serving a sliced model.

The module fixture installs what perf_analyzer needs (libb64-0d via apt-get, as root), slices
token_mlp into a temporary model repository and starts the server; the sweeps send JSON input
data of varied lengths, one entry per request, round-robin.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dvabatch_backend.tools.serve import TritonServer
from perf.load.perf_analyzer import (
    PerfAnalyzerError,
    PerfResult,
    build_command,
    ensure_system_deps,
    input_data_json,
    main,
    parse_csv,
    parse_range,
    perf_analyzer_env,
    run_perf_analyzer,
    write_input_data,
    write_request_intervals,
)
from perf.load.arrivals import gamma
from slicer import toy
from slicer.slice_model import SliceOptions, slice_model

HIDDEN = 16
MODEL = "tok"
LENGTHS = (1, 3, 7, 12, 16)
# short, smoke-test measurements: stability is judged over 3 windows, and a huge -s keeps a noisy
# machine from dropping a level out of the sweep
QUICK = dict(measurement_interval_ms=500, stability_percentage=1000.0, max_trials=3, timeout=120.0)


def _quick_run(url: str, **kwargs: object) -> PerfResult:
    return run_perf_analyzer(MODEL, url, **QUICK, **kwargs)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------
# without a server


def _token_queries(lengths: tuple[int, ...], seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((n, HIDDEN)).astype(np.float32), "mask": np.ones(n, np.float32)} for n in lengths]


def test_input_data_json_keeps_each_entry_shape(tmp_path: Path) -> None:
    queries = _token_queries((2, 5))
    path = write_input_data(tmp_path / "sub" / "data.json", queries)
    data = json.loads(path.read_text())
    assert data == input_data_json(queries)
    assert [e["x"]["shape"] for e in data["data"]] == [[2, HIDDEN], [5, HIDDEN]]
    assert [e["mask"]["shape"] for e in data["data"]] == [[2], [5]]
    np.testing.assert_allclose(np.array(data["data"][1]["x"]["content"], np.float32), queries[1]["x"].ravel())


def test_input_data_json_rejects_bad_queries() -> None:
    with pytest.raises(ValueError, match="at least one"):
        input_data_json([])
    with pytest.raises(ValueError, match="query 1"):
        input_data_json([{"x": np.zeros(2)}, {"y": np.zeros(2)}])
    with pytest.raises(ValueError, match="NaN"):
        input_data_json([{"x": np.array([np.nan], np.float32)}])


def test_parse_csv_sorts_rows_by_load_and_reads_avg_latency() -> None:
    text = ("Concurrency,Inferences/Second,Client Send,Network+Server Send/Recv,Server Queue,Server Compute Input,"
            "Server Compute Infer,Server Compute Output,Client Recv,p50 latency,p90 latency,p95 latency,p99 latency,"
            "Avg latency,request/response,response wait\n"
            "2,1046.92,6,1493,75,19,292,4,3,1731,2597,3137,5745,1895,9,1864\n"
            "1,1062.85,3,695,32,16,178,4,1,818,1217,1413,3057,933,4,915\n")
    rows = parse_csv(text)
    assert [r.concurrency for r in rows] == [1, 2]
    assert rows[0].throughput == pytest.approx(1062.85)
    assert (rows[0].p50_us, rows[0].p90_us, rows[0].p99_us, rows[0].avg_us) == (818, 1217, 3057, 933)
    # without --verbose-csv: the average is the sum of the client-side components
    plain = ("Request Rate,Inferences/Second,Client Send,Network+Server Send/Recv,Server Queue,Server Compute Input,"
             "Server Compute Infer,Server Compute Output,Client Recv,p50 latency,p90 latency,p95 latency,p99 latency\n"
             "200,190.299,203,1257,124,34,436,6,0,1855,3393,4645,6101\n100,76.0077,231,1397,60,48,468,6,0,2009,3059,3828,7429\n")
    rows = parse_csv(plain)
    assert [r.request_rate for r in rows] == [100, 200]
    assert rows[0].avg_us == 231 + 1397 + 0


def test_build_command_and_ranges() -> None:
    cmd, levels = build_command("m", "h:1", binary="/pa", csv_path="/r.csv", protocol="grpc", concurrency_range="2:6:2",
                                shape={"x": [5, 16]}, max_trials=3, extra_args=["--percentile", "95"])
    assert cmd[:3] == ["/pa", "-m", "m"] and levels == [2, 4, 6]
    assert "--concurrency-range" in cmd and cmd[cmd.index("--concurrency-range") + 1] == "2:6:2"
    assert cmd[cmd.index("-i") + 1] == "grpc" and cmd[cmd.index("--shape") + 1] == "x:5,16"
    assert cmd[-2:] == ["--percentile", "95"] and "--verbose-csv" in cmd
    cmd, levels = build_command("m", "h:1", binary="/pa", csv_path="/r.csv", request_rate_range=(50, 150, 50),
                                request_distribution="poisson")
    assert cmd[cmd.index("--request-rate-range") + 1] == "50:150:50" and levels == [50, 100, 150]
    assert cmd[cmd.index("--request-distribution") + 1] == "poisson"
    cmd, levels = build_command("m", "h:1", binary="/pa", csv_path="/r.csv", request_intervals="/gaps.txt")
    assert cmd[cmd.index("--request-intervals") + 1] == "/gaps.txt" and levels is None
    assert "--request-rate-range" not in cmd and "--concurrency-range" not in cmd
    assert parse_range((3,)) == (3, 3, 1) and parse_range("1:0") == (1, 0, 1)
    for bad in [dict(concurrency_range=(1, 2), request_rate_range=(1, 2)), dict(protocol="udp"),
                dict(request_rate_range=(1, 2), request_intervals="/gaps.txt"),
                dict(request_distribution="poisson"), dict(extra_args=["--streaming"]), dict(concurrency_range="1.5"),
                dict(max_trials=2)]:
        with pytest.raises(ValueError):
            build_command("m", "h:1", binary="/pa", csv_path="/r.csv", **bad)  # type: ignore[arg-type]


def test_env_puts_the_cuda_runtime_on_the_library_path() -> None:
    env = perf_analyzer_env({"LD_LIBRARY_PATH": "/already"})
    parts = env["LD_LIBRARY_PATH"].split(":")
    assert parts[-1] == "/already"
    assert any(Path(p, "libcudart.so.12").exists() for p in parts), "pip install nvidia-cuda-runtime-cu12"


# ----------------------------------------------------------------------------------------------
# against a real server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    ensure_system_deps()  # installs libb64-0d with apt-get when missing (CI runs as root)
    repo = tmp_path_factory.mktemp("pa_repo")
    slice_model(toy.token_mlp(HIDDEN, 4), repo / MODEL,
                SliceOptions(stages=3, max_batch_size=8, max_length=max(LENGTHS), repeats=3))
    triton = TritonServer(repo)
    with triton:
        triton.wait_model_ready(MODEL, 60)
        yield triton


@pytest.fixture(scope="module")
def varied_input(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_input_data(tmp_path_factory.mktemp("pa_data") / "varied.json", _token_queries(LENGTHS))


def _assert_sweep(result: PerfResult, levels: list[int]) -> None:
    detail = f"{result.describe()}\n{' '.join(result.command)}\n{result.stdout_tail}\n{result.stderr_tail}"
    assert result.returncode == 0, detail
    assert result.stable, detail
    assert [r.concurrency for r in result.rows] == levels, detail
    assert result.missing_levels == [] and result.ok, detail
    for row in result.rows:
        assert row.throughput > 0, detail
        assert 0 < row.p50_us <= row.p90_us <= row.p99_us, detail
        assert row.avg_us > 0, detail


@pytest.mark.server
def test_concurrency_sweep_over_http_with_varied_lengths(server: TritonServer, varied_input: Path) -> None:
    result = _quick_run(server.http_url, protocol="http", concurrency_range=(1, 4, 1), input_data=varied_input)
    _assert_sweep(result, [1, 2, 3, 4])


@pytest.mark.server
def test_concurrency_sweep_over_grpc_with_varied_lengths(server: TritonServer, varied_input: Path) -> None:
    result = _quick_run(server.grpc_url, protocol="grpc", concurrency_range="1:4:2", input_data=varied_input)
    _assert_sweep(result, [1, 3])


@pytest.mark.server
def test_poisson_request_rate_sweep(server: TritonServer, varied_input: Path) -> None:
    result = _quick_run(server.grpc_url, protocol="grpc", request_rate_range=(100, 200, 100),
                        request_distribution="poisson", input_data=varied_input)
    detail = f"{result.describe()}\n{result.stdout_tail}\n{result.stderr_tail}"
    assert result.ok, detail
    assert [r.request_rate for r in result.rows] == [100, 200], detail
    assert all(r.throughput > 0 for r in result.rows), detail


@pytest.mark.server
def test_bursty_arrivals_from_a_request_intervals_file(server: TritonServer, varied_input: Path,
                                                       tmp_path: Path) -> None:
    """A Gamma schedule (CV 4, 100/s) sent by --request-intervals: one row, reported by the rate sent."""
    gaps = write_request_intervals(tmp_path / "gaps.txt", gamma(100.0, 4.0, 2000, rng=0))
    result = _quick_run(server.grpc_url, protocol="grpc", request_intervals=gaps, input_data=varied_input,
                        async_mode=True)
    detail = f"{result.describe()}\n{result.stdout_tail}\n{result.stderr_tail}"
    assert result.returncode == 0 and result.expected_levels is None, detail
    assert len(result.rows) == 1 and result.rows[0].mode == "request_rate", detail
    assert result.rows[0].request_rate > 0 and result.rows[0].throughput > 0, detail


@pytest.mark.server
def test_variable_dims_need_shapes(server: TritonServer) -> None:
    """Without --input-data shapes or --shape, perf_analyzer refuses a model with -1 dims; --shape fixes it."""
    bare = _quick_run(server.http_url, concurrency_range=(1,), input_data="random")
    assert bare.returncode != 0 and not bare.rows
    assert "dynamic shape" in bare.stdout_tail + bare.stderr_tail
    shaped = _quick_run(server.http_url, concurrency_range=(1,), shape={"x": [5, HIDDEN], "mask": [5]})
    _assert_sweep(shaped, [1])


@pytest.mark.server
def test_cli(server: TritonServer, varied_input: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rows.json"
    code = main(["--model", MODEL, "--url", server.http_url, "--concurrency", "2", "--input-data", str(varied_input),
                 "-p", "500", "-s", "1000", "-r", "3", "--json", str(out)])
    assert code == 0, capsys.readouterr()
    report = json.loads(out.read_text())
    assert [r["level"] for r in report["rows"]] == [2] and report["rows"][0]["throughput"] > 0
    assert "concurrency=2" in capsys.readouterr().out


def test_missing_binary_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from perf.load import perf_analyzer

    monkeypatch.setenv("PERF_ANALYZER", str(tmp_path / "nope"))
    with pytest.raises(PerfAnalyzerError, match="PERF_ANALYZER=.*nope"):
        perf_analyzer.find_perf_analyzer()
