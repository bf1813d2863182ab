"""The ZeroBatch and DelayBatch baselines (perf.baselines): the unsliced model behind Triton's own
dynamic batcher, served beside dvabatch from one real tritonserver. Answers equal the unsliced
model on each query alone, requests of different lengths share a batch, bad requests get a clear
error, and the delay tuner measures every candidate."""
from __future__ import annotations

import json
import threading

import numpy as np
import onnxruntime as ort
import pytest

from slicer import model_config
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from dvabatch_backend.runtime.manifest import Manifest
from dvabatch_backend.tools.serve import TritonServer, infer_inputs
from perf.baselines import model as baseline_model
from perf.baselines import (
    add_baseline,
    delay_batch,
    load_tuning,
    random_query_maker,
    tune_delay,
    zero_batch,
)
from slicer import toy
from slicer.profiler import random_inputs
from slicer.slice_model import SliceOptions, slice_model

from ..triton_support import Clients, ServedModel, add_variant

MAX_LENGTH = 16
BS_MAX = 8
DELAY_US = 2000
ZERO, DELAY, DVABATCH = "tm_zerobatch", "tm_delaybatch", "tm_dvabatch"
# a DelayBatch whose queue delay never runs out in a test: a batch goes when it is full (BS_MAX)
FULL, FULL_DELAY_US = "tm_fullbatch", 600_000_000


@pytest.fixture(scope="module")
def sliced(tmp_path_factory) -> ServedModel:
    repo = tmp_path_factory.mktemp("repository")
    options = SliceOptions(stages=2, max_batch_size=BS_MAX, max_length=MAX_LENGTH, repeats=3)
    report = slice_model(toy.token_mlp(16, 4), repo / ".sliced" / "tm", options)
    return ServedModel("tm", report.out_dir / "1", report.manifest, {}, MAX_LENGTH)


@pytest.fixture(scope="module")
def served(sliced: ServedModel):
    repo = sliced.version_dir.parent.parent.parent
    zero_batch(repo, sliced.version_dir)
    delay_batch(repo, sliced.version_dir, DELAY_US)
    add_variant(repo, sliced, DVABATCH, policy="input")
    delay_batch(repo, sliced.version_dir, FULL_DELAY_US, name=FULL)
    server = TritonServer(repo).start()
    try:
        for name in (ZERO, DELAY, DVABATCH, FULL):
            server.wait_model_ready(name, timeout=120)
        yield server
    finally:
        server.stop()


def _send(module, url: str, model: str, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One request of [k, ...] rows; returns its outputs ([k, ...])."""
    inputs = infer_inputs(module, arrays, add_batch_dim=False)
    with module.InferenceServerClient(url) as client:
        result = client.infer(model, inputs)
    return {name: result.as_numpy(name) for name in ("tokens", "pooled")}


def _check_rows(model: ServedModel, arrays: dict[str, np.ndarray], got: dict[str, np.ndarray]) -> None:
    """Every row of a request equals the unsliced model run on that row alone."""
    for row in range(next(iter(arrays.values())).shape[0]):
        reference = model.reference({k: v[row] for k, v in arrays.items()})
        for name, ref in reference.items():
            assert got[name][row].shape == ref.shape, (name, got[name].shape, ref.shape)
            np.testing.assert_allclose(got[name][row], ref, atol=1e-4, rtol=0, err_msg=f"row {row} {name}")


def _stats(server: TritonServer, model: str) -> tuple[int, int, dict[int, int]]:
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        stats = client.get_inference_statistics(model, as_json=True)["model_stats"][0]
    batches = {int(b["batch_size"]): int(b["compute_infer"]["count"]) for b in stats.get("batch_stats", [])}
    return int(stats.get("inference_count", 0)), int(stats.get("execution_count", 0)), batches


# --- without a server -------------------------------------------------------------------------


def test_the_repository_entry_is_the_unsliced_model_behind_the_dynamic_batcher(sliced, tmp_path) -> None:
    model_dir = add_baseline(tmp_path, sliced.version_dir, "b", delay_us=750, threads=2, bs_max=4)
    config = model_config.read(model_dir / "config.pbtxt")
    assert (config.name, config.backend, config.max_batch_size) == ("b", "python", 4)
    assert [t.allow_ragged_batch for t in config.input] == [True, True]  # both inputs, no output
    x = next(t for t in config.input if t.name == "x")
    assert (x.data_type, list(x.dims)) == (model_config.DATA_TYPES["float32"], [-1, 16])
    pooled = next(t for t in config.output if t.name == "pooled")
    assert list(pooled.dims) == [16]
    assert config.dynamic_batching.max_queue_delay_microseconds == 750
    assert not config.dynamic_batching.preferred_batch_size
    assert [(g.kind, g.count) for g in config.instance_group] == [(model_config.pb.ModelInstanceGroup.KIND_CPU, 1)]
    assert model_config.parameters(config)["threads"] == "2"
    version = model_dir / "1"
    assert "\nfrom perf.baselines.model import TritonPythonModel" in (version / "model.py").read_text()
    for file in ("model.onnx", "manifest.json"):
        assert (version / file).is_symlink() and (version / file).resolve() == (sliced.version_dir / file).resolve()
    assert not list(version.glob("stage*.onnx"))
    add_baseline(tmp_path, sliced.version_dir, "b", delay_us=0)  # replaces the earlier one
    again = model_config.read(model_dir / "config.pbtxt")
    assert again.HasField("dynamic_batching") and again.dynamic_batching.max_queue_delay_microseconds == 0
    with pytest.raises(ValueError, match="delay_us"):
        add_baseline(tmp_path, sliced.version_dir, "c", delay_us=-1)


def test_padding_to_the_longest_request_and_cutting_back_equal_each_request_alone(sliced) -> None:
    manifest: Manifest = sliced.manifest
    session = ort.InferenceSession(str(sliced.version_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    requests = [baseline_model.parse_request(random_inputs(manifest.inputs, k, n, rng), manifest)
                for k, n in ((1, 3), (3, 16), (2, 1), (1, 9))]
    batch = baseline_model.pad_batch(requests, manifest.inputs)
    assert batch["x"].shape == (7, 16, 16) and batch["mask"][0, 3:].sum() == 0
    names = [t.name for t in manifest.outputs]
    outputs = dict(zip(names, session.run(names, batch)))
    for request, answer in zip(requests, baseline_model.split_outputs(outputs, manifest.outputs, requests)):
        assert answer["tokens"].shape == (request.rows, request.length, 16)
        _check_rows(sliced, request.arrays, answer)


@pytest.mark.parametrize("arrays, message", [
    ({"x": np.zeros((1, 5, 16), np.float32), "mask": np.ones((1, 3), np.float32)}, "disagree on the sequence length"),
    ({"x": np.zeros((2, 5, 16), np.float32), "mask": np.ones((1, 5), np.float32)}, "disagree on the number of rows"),
    ({"x": np.zeros((1, 17, 16), np.float32), "mask": np.ones((1, 17), np.float32)}, "outside 1..16"),
    ({"x": np.zeros((1, 4, 8), np.float32), "mask": np.ones((1, 4), np.float32)}, "dim 2 is 8, expected 16"),
    ({"x": np.zeros((1, 4, 16), np.float32)}, "missing input(s) ['mask']"),
])
def test_a_bad_request_is_refused_with_its_reason(sliced, arrays, message) -> None:
    with pytest.raises(baseline_model.BadRequest) as caught:
        baseline_model.parse_request(arrays, sliced.manifest)
    assert message in str(caught.value)


def test_parameters_are_checked_by_name(sliced) -> None:
    with pytest.raises(ValueError, match="unknown parameter"):
        baseline_model.parse_parameters({"thread": "2"}, sliced.version_dir)
    with pytest.raises(ValueError, match="'threads'"):
        baseline_model.parse_parameters({"threads": "0"}, sliced.version_dir)
    with pytest.raises(ValueError, match="'onnx_model'"):
        baseline_model.parse_parameters({"onnx_model": "nope.onnx"}, sliced.version_dir)


# --- the real server --------------------------------------------------------------------------


@pytest.mark.server
@pytest.mark.parametrize("model", [ZERO, DELAY])
def test_concurrent_mixed_lengths_over_http_and_grpc_equal_the_unsliced_model(served, sliced, model) -> None:
    clients = Clients(served.http_url, served.grpc_url)
    modes = clients.modes()
    rng = np.random.default_rng(len(model))
    single = [(mode, sliced.query(rng, int(rng.integers(1, MAX_LENGTH + 1)))) for mode in modes for _ in range(4)]
    multi = [(module, url, random_inputs(sliced.manifest.inputs, k, n, rng))  # [k, T] with masked tails
             for module, url in ((httpclient, served.http_url), (grpcclient, served.grpc_url))
             for k, n in ((2, 5), (3, 16))]
    failures: list[str] = []

    def one(mode: str, query: dict) -> None:
        try:
            got = modes[mode](model, query)
            _check_rows(sliced, {k: v[None] for k, v in query.items()}, {k: v[None] for k, v in got.items()})
        except Exception as exc:  # collected: every query must succeed
            failures.append(f"{mode}: {type(exc).__name__}: {exc}")

    def rows(module, url: str, arrays: dict) -> None:
        try:
            _check_rows(sliced, arrays, _send(module, url, model, arrays))
        except Exception as exc:
            failures.append(f"{module.__name__} k={len(arrays['x'])}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=one, args=w) for w in single] + \
              [threading.Thread(target=rows, args=w) for w in multi]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert failures == []


@pytest.mark.server
def test_the_delay_baseline_batches_requests_of_different_lengths(served, sliced) -> None:
    rng = np.random.default_rng(7)
    queries = [sliced.query(rng, n) for n in (1, 9, 3, 16, 5, 12, 2, 7)]  # BS_MAX of them
    inferences, executions, batches_before = _stats(served, FULL)
    answers: list = [None] * len(queries)
    done = threading.Semaphore(0)
    client = grpcclient.InferenceServerClient(served.grpc_url)

    def callback(i: int):
        def record(result, error) -> None:
            answers[i] = error if error is not None else result
            done.release()
        return record

    for i, query in enumerate(queries):
        client.async_infer(FULL, Clients.inputs(grpcclient, query), callback(i), client_timeout=60)
    for _ in queries:
        assert done.acquire(timeout=60), "an answer did not come"
    client.close()
    for query, answer in zip(queries, answers):
        assert not isinstance(answer, Exception), answer
        got = {name: answer.as_numpy(name) for name in ("tokens", "pooled")}
        _check_rows(sliced, {k: v[None] for k, v in query.items()}, got)
    # the queue delay cannot run out first: one execute of all eight lengths, whatever the timing
    after_inferences, after_executions, batches = _stats(served, FULL)
    assert after_inferences - inferences == len(queries)
    assert after_executions - executions == 1, "the requests of different lengths did not share one execute"
    assert batches.get(BS_MAX, 0) - batches_before.get(BS_MAX, 0) == 1, (batches_before, batches)


@pytest.mark.server
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_bad_request_gets_a_clear_error_and_its_neighbours_are_served(served, sliced, protocol) -> None:
    module, url = (httpclient, served.http_url) if protocol == "http" else (grpcclient, served.grpc_url)
    rng = np.random.default_rng(3)
    good = [sliced.query(rng, n) for n in (4, 11)]
    bad = {
        "disagree on the sequence length": {"x": np.zeros((1, 5, 16), np.float32), "mask": np.ones((1, 3), np.float32)},
        "outside 1..16": {"x": np.zeros((1, 17, 16), np.float32), "mask": np.ones((1, 17), np.float32)},
    }
    results: dict[str, object] = {}

    def call(key: str, arrays: dict) -> None:
        try:
            results[key] = _send(module, url, DELAY, arrays)
        except InferenceServerException as exc:
            results[key] = exc

    work = [(f"good{i}", {k: v[None] for k, v in q.items()}) for i, q in enumerate(good)] + list(bad.items())
    threads = [threading.Thread(target=call, args=w) for w in work]  # bad and good requests may share a batch
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for message in bad:
        error = results[message]
        assert isinstance(error, InferenceServerException), error
        assert message in str(error) and str(error.status()) in ("400", "StatusCode.INVALID_ARGUMENT")
    for i, query in enumerate(good):
        assert not isinstance(results[f"good{i}"], Exception), results[f"good{i}"]
        _check_rows(sliced, {k: v[None] for k, v in query.items()}, results[f"good{i}"])  # type: ignore[arg-type]
    with pytest.raises(InferenceServerException, match="(?i)fp64|data-type|datatype"):  # Triton's own check
        _send(module, url, ZERO, {"x": np.zeros((1, 4, 16), np.float64), "mask": np.ones((1, 4), np.float32)})


@pytest.mark.server
def test_dvabatch_and_the_baselines_answer_alike_on_one_server(served, sliced) -> None:
    clients = Clients(served.http_url, served.grpc_url)
    rng = np.random.default_rng(11)
    for n in (2, 13):
        query = sliced.query(rng, n)
        answers = [clients.grpc_sync(model, query) for model in (DVABATCH, ZERO, DELAY)]
        for other in answers[1:]:
            for name in ("tokens", "pooled"):
                np.testing.assert_allclose(other[name], answers[0][name], atol=1e-4, rtol=0)


@pytest.mark.server
def test_tune_delay_measures_every_candidate_and_records_the_best(served, sliced, tmp_path) -> None:
    record = tmp_path / "tuning.json"
    best, qps = tune_delay(served.grpc_url, {0: ZERO, DELAY_US: DELAY}, random_query_maker(sliced.manifest),
                           concurrency=4, seconds=0.75, record=record)
    assert set(qps) == {0, DELAY_US} and all(v > 0 for v in qps.values())
    assert best == max(qps, key=lambda d: (qps[d], -d))
    assert load_tuning(record) == (best, {d: round(v, 3) for d, v in qps.items()})
    assert json.loads(record.read_text())["models"] == {"0": ZERO, str(DELAY_US): DELAY}
