"""Errors from the real tritonserver (model control mode explicit): bad requests over HTTP and
gRPC are each answered with a Triton error naming the problem while a concurrent stream of good
requests loses nothing; requests of several rows answer row by row; bad config.pbtxt parameters
and missing manifests make loading fail with the parameter or file named, and the server and
the good models keep serving."""
from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import Mapping

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from dvabatch_backend.tools.serve import TritonServer, infer_inputs
from slicer.triton_files import add_model_variant, config_pbtxt
from slicer.model_config import with_parameters

from ..triton_support import Clients, ServedModel, add_variant, slice_zoo_model, control_client, stub_pids

PROTOCOLS = ("http", "grpc")
TIMEOUT = 30.0
BERT, VGG = "bert_good", "vgg19_good"
T = 7  # a sequence length within bert's profiled 32


# -- helpers -------------------------------------------------------------------------------------

def raw_infer(server: TritonServer, protocol: str, model: str, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One request with exactly these tensors (batch dimension included), any dtype or shape."""
    module = httpclient if protocol == "http" else grpcclient
    inputs = infer_inputs(module, feeds, add_batch_dim=False)
    if protocol == "http":
        client = httpclient.InferenceServerClient(server.http_url, connection_timeout=TIMEOUT, network_timeout=TIMEOUT)
        try:
            result = client.infer(model, inputs)
            names = [o["name"] for o in result.get_response()["outputs"]]
        finally:
            client.close()
    else:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            result = client.infer(model, inputs, client_timeout=TIMEOUT)
            names = [o.name for o in result.get_response().outputs]
        finally:
            client.close()
    return {name: result.as_numpy(name) for name in names}


def wait_no_stub(model_dir: Path, timeout: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := stub_pids(model_dir)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def assert_rows_equal(model: ServedModel, feeds: Mapping[str, np.ndarray], got: Mapping[str, np.ndarray]) -> None:
    rows = next(iter(feeds.values())).shape[0]
    for i in range(rows):
        ref = model.reference({k: v[i] for k, v in feeds.items()})
        assert set(got) == set(ref)
        for name, value in ref.items():
            assert got[name].shape[0] == rows, (name, got[name].shape)
            np.testing.assert_allclose(got[name][i], value, atol=1e-4, rtol=0, err_msg=f"row {i} output {name}")


def in_thread(fn, *args) -> None:
    """Run `fn` in a short-lived thread and re-raise what it raised. `Clients` keeps one HTTP client
    per thread; a live keep-alive connection makes tritonserver wait 30 s on SIGTERM, and a
    thread's clients are closed when it ends."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            fn(*args)
        except BaseException as exc:  # re-raised in the caller
            errors.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(120)
    assert not thread.is_alive(), f"{fn.__name__} hung"
    if errors:
        raise errors[0]


def check_serves(served: dict, model_name: str, count: int = 4) -> None:
    """`count` queries over each client mode; every answer equals the unsliced model."""
    in_thread(_check_serves, served, model_name, count)


def _check_serves(served: dict, model_name: str, count: int) -> None:
    model: ServedModel = served["models"][model_name]
    rng = np.random.default_rng(count)
    for mode, call in served["clients"].modes().items():
        for _ in range(count):
            query = model.query(rng)
            got = call(model_name, query)
            for name, ref in model.reference(query).items():
                np.testing.assert_allclose(got[name], ref, atol=1e-4, rtol=0, err_msg=f"{model_name} {mode} {name}")


# -- the repository and server -------------------------------------------------------------------

def _own_version_dir(repo: Path, base: ServedModel, name: str, skip: tuple[str, ...] = (),
                     rename: Mapping[str, str] | None = None) -> Path:
    """A model folder with its own copy of the sliced files (less `skip`, some renamed)."""
    version = repo / name / "1"
    version.mkdir(parents=True)
    for item in base.version_dir.iterdir():
        if item.name not in skip:
            shutil.copy(item, version / (rename or {}).get(item.name, item.name))
    return repo / name


def _param(key: str, value: str) -> str:
    return f'parameters: {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n'


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> dict:
    repo = tmp_path_factory.mktemp("errors_repository")
    bert = slice_zoo_model(repo / ".sliced", "bert")
    vgg = slice_zoo_model(repo / ".sliced", "vgg19")
    models = {BERT: add_variant(repo, bert, BERT), VGG: add_variant(repo, vgg, VGG, policy="hybrid")}

    # models whose loading must fail
    add_model_variant(repo, bert.version_dir, "bad_buffer_pairs", num_buffer_pairs="zero")
    add_model_variant(repo, bert.version_dir, "bad_policy", policy="no_such_policy")
    unknown = add_model_variant(repo, bert.version_dir, "bad_unknown_parameter")
    with open(unknown / "config.pbtxt", "a") as f:
        f.write(_param("num_bufer_pairs", "2"))
    add_model_variant(repo, bert.version_dir, "bad_policy_parameter", policy_params={"no_such_knob": 3})
    bs_max = add_model_variant(repo, bert.version_dir, "bad_bs_max")
    with open(bs_max / "config.pbtxt", "a") as f:
        f.write(_param("bs_max", "0"))
    missing_param = add_model_variant(repo, bert.version_dir, "bad_manifest_parameter")
    config = missing_param / "config.pbtxt"
    config.write_text(config.read_text().replace('"manifest.json"', '"no_such_manifest.json"'))
    _own_version_dir(repo, bert, "no_manifest", skip=("manifest.json",))
    (repo / "no_manifest" / "config.pbtxt").write_text(config_pbtxt(bert.manifest, name="no_manifest"))
    _own_version_dir(repo, bert, "no_stage_file", skip=("stage1.onnx",))
    (repo / "no_stage_file" / "config.pbtxt").write_text(config_pbtxt(bert.manifest, name="no_stage_file"))
    # a manifest under another name, named by the parameter: this one loads
    _own_version_dir(repo, bert, "renamed_manifest", rename={"manifest.json": "sliced.json"})
    (repo / "renamed_manifest" / "config.pbtxt").write_text(
        with_parameters(config_pbtxt(bert.manifest, name="renamed_manifest"), {"manifest": "sliced.json"}))

    server = TritonServer(repo, explicit=True, load=list(models)).start()
    try:
        for name in models:
            server.wait_model_ready(name, timeout=120)
        yield {"server": server, "models": models, "clients": Clients(server.http_url, server.grpc_url), "repo": repo}
    finally:
        server.stop()


# -- bad requests --------------------------------------------------------------------------------

def _ids(rows: int, length: int, dtype=np.int64) -> np.ndarray:
    return np.random.default_rng(rows * 100 + length).integers(1, 100, (rows, length)).astype(dtype)


def _ones(rows: int, length: int, dtype=np.int64) -> np.ndarray:
    return np.ones((rows, length), dtype)


# (model, feeds, fragments that the error message must contain)
BAD_REQUESTS: dict[str, tuple[str, dict[str, np.ndarray], tuple[str, ...]]] = {
    "wrong input name": (BERT, {"input_idz": _ids(1, T), "attention_mask": _ones(1, T)},
                         ("unexpected inference input 'input_idz'",)),
    "int32 ids": (BERT, {"input_ids": _ids(1, T, np.int32), "attention_mask": _ones(1, T)},
                  ("'input_ids' data-type is 'INT32'", "expects 'INT64'")),
    "float ids": (BERT, {"input_ids": _ids(1, T, np.float32), "attention_mask": _ones(1, T)},
                  ("'input_ids' data-type is 'FP32'", "expects 'INT64'")),
    "float64 image": (VGG, {"image": np.zeros((1, 3, 32, 32), np.float64)},
                      ("'image' data-type is 'FP64'", "expects 'FP32'")),
    "wrong rank": (BERT, {"input_ids": _ids(1, T)[..., None], "attention_mask": _ones(1, T)},
                   ("unexpected shape for input 'input_ids'", f"got [1,{T},1]")),
    "wrong image size": (VGG, {"image": np.zeros((1, 3, 16, 16), np.float32)},
                         ("unexpected shape for input 'image'", "got [1,3,16,16]")),
    # the only one of these that reaches the backend: Triton cannot know the profiled lengths
    "over-long input": (BERT, {"input_ids": _ids(1, 40), "attention_mask": _ones(1, 40)},
                        ("input 'input_ids' has length 40, longer than the largest profiled 32",)),
    "missing input": (BERT, {"input_ids": _ids(1, T)}, ("missing required input(s) ['attention_mask']",)),
    "extra input": (BERT, {"input_ids": _ids(1, T), "attention_mask": _ones(1, T), "token_type_ids": _ones(1, T)},
                    ("expected 2 inputs but got 3", "'token_type_ids'")),
    "rows disagree": (BERT, {"input_ids": _ids(2, T), "attention_mask": _ones(3, T)},
                      ("input 'input_ids' batch size does not match other inputs",)),
    "lengths disagree": (BERT, {"input_ids": _ids(1, 5), "attention_mask": _ones(1, 6)},
                         ("inputs disagree on the sequence length: [5, 6]",)),
    "empty sequence": (BERT, {"input_ids": _ids(1, 0), "attention_mask": _ones(1, 0)},
                       ("input 'input_ids' is empty",)),
    "too many rows": (BERT, {"input_ids": _ids(9, T), "attention_mask": _ones(9, T)},
                      ("batch-size must be <= 8",)),
}


def _bad_request_failure(served: dict, protocol: str, case: str) -> str | None:
    model, feeds, fragments = BAD_REQUESTS[case]
    try:
        raw_infer(served["server"], protocol, model, feeds)
    except InferenceServerException as exc:
        message = exc.message() or ""
        missing = [f for f in fragments if f not in message]
        return f"{protocol} {case!r}: message {message!r} lacks {missing}" if missing else None
    return f"{protocol} {case!r}: answered without an error"


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_request_gets_a_clear_error(served, case: str, protocol: str) -> None:
    assert _bad_request_failure(served, protocol, case) is None


def test_bad_requests_do_not_disturb_a_concurrent_good_stream(served) -> None:
    """~40 good one-row queries over all client modes (both models) while every bad request is sent
    over both protocols again and again: each good answer arrives and equals the unsliced model."""
    clients: Clients = served["clients"]
    modes = list(clients.modes().items())
    rng = np.random.default_rng(11)
    good = [(BERT if i % 4 else VGG, modes[i % len(modes)], None) for i in range(40)]
    good = [(name, mode, served["models"][name].query(rng)) for name, mode, _ in good]
    good_failures: list[str] = []
    answered = [0]
    overlapped = threading.Event()  # set once a bad request went out while the stream was running

    def stream() -> None:
        for i, (name, (mode, call), query) in enumerate(good):
            if i == len(good) // 2:  # the second half goes out only once the bad ones are under way
                overlapped.wait(60)
            try:
                got = call(name, query)
                for out, ref in served["models"][name].reference(query).items():
                    np.testing.assert_allclose(got[out], ref, atol=1e-4, rtol=0, err_msg=f"{name} {mode} {out}")
                answered[0] += 1
            except Exception as exc:  # collected: every good query must succeed
                good_failures.append(f"{name} {mode}: {type(exc).__name__}: {exc}")

    thread = threading.Thread(target=stream)
    bad_failures: list[str] = []
    sent_while_streaming = 0
    thread.start()
    deadline = time.monotonic() + 60
    rounds = 0
    while (rounds == 0 or thread.is_alive()) and time.monotonic() < deadline:
        for case in sorted(BAD_REQUESTS):
            for protocol in PROTOCOLS:
                alive = thread.is_alive()
                failure = _bad_request_failure(served, protocol, case)
                if failure:
                    bad_failures.append(failure)
                sent_while_streaming += alive
                if alive:
                    overlapped.set()
        rounds += 1
    thread.join(60)
    assert not thread.is_alive(), "the good stream hung"
    assert good_failures == []
    assert answered[0] == len(good)
    assert bad_failures == []
    assert sent_while_streaming > 0, "no bad request overlapped the good stream"


# -- requests of several rows --------------------------------------------------------------------

@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_request_of_three_rows_answers_each_row(served, protocol: str) -> None:
    model = served["models"][BERT]
    rng = np.random.default_rng(3)
    feeds = {"input_ids": rng.integers(1, model.int_high.get("input_ids", 100), (3, 19)).astype(np.int64),
             "attention_mask": _ones(3, 19)}
    feeds["attention_mask"][1, 12:] = 0  # a padded row: still the unsliced model's answer for that row
    got = raw_infer(served["server"], protocol, BERT, feeds)
    assert got["sentence_embedding"].shape == (3, 32)
    assert got["last_hidden_state"].shape == (3, 19, 32)
    assert_rows_equal(model, feeds, got)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_request_of_three_images_answers_each_row(served, protocol: str) -> None:
    model = served["models"][VGG]
    feeds = {"image": np.random.default_rng(5).standard_normal((3, 3, 32, 32)).astype(np.float32)}
    got = raw_infer(served["server"], protocol, VGG, feeds)
    assert got["logits"].shape == (3, 10)
    assert_rows_equal(model, feeds, got)


# -- models that must not load -------------------------------------------------------------------

BAD_MODELS: dict[str, tuple[str, tuple[str, ...]]] = {  # model -> (protocol, fragments of the load error)
    "bad_buffer_pairs": ("http", ("parameter 'num_buffer_pairs'", "'zero' is not an integer")),
    "bad_bs_max": ("grpc", ("parameter 'bs_max'", "must be >= 1, got 0")),
    "bad_unknown_parameter": ("grpc", ("unknown parameter(s) ['num_bufer_pairs']",)),
    "bad_policy": ("http", ("unknown policy 'no_such_policy'",)),
    "bad_policy_parameter": ("http", ("policy 'pipelined' does not accept", "'policy.no_such_knob'")),
    "bad_manifest_parameter": ("grpc", ("parameter 'manifest'", "no_such_manifest.json not found")),
    "no_manifest": ("http", ("parameter 'manifest'", "no_manifest/1/manifest.json not found")),
    "no_stage_file": ("grpc", ("'stage1.onnx' not found beside the manifest",)),
}


@pytest.mark.parametrize("name", list(BAD_MODELS))
def test_bad_model_fails_to_load_and_the_server_keeps_serving(served, name: str) -> None:
    server: TritonServer = served["server"]
    protocol, fragments = BAD_MODELS[name]
    client = control_client(server, protocol)
    try:
        with pytest.raises(InferenceServerException) as info:
            client.load_model(name)
        message = info.value.message() or ""
        assert f"load failed for model '{name}'" in message, message
        for fragment in fragments:
            assert fragment in message, (fragment, message)
        assert not client.is_model_ready(name)
    finally:
        client.close()
    assert not server.exited(), server.log_tail()
    # the failed model's stub is gone, the good ones still serve correctly
    assert wait_no_stub(server.model_repository / name) == []
    for good in served["models"]:
        assert server.model_ready(good)
    check_serves(served, BERT, count=2)
    check_serves(served, VGG, count=1)
    # a request to the model that did not load is refused clearly, over both protocols
    for protocol in PROTOCOLS:
        with pytest.raises(InferenceServerException) as refused:
            raw_infer(server, protocol, name, {"input_ids": _ids(1, T), "attention_mask": _ones(1, T)})
        assert name in (refused.value.message() or "")


def test_manifest_parameter_naming_another_file_loads(served) -> None:
    """The manifest parameter names the file used, also when it is not manifest.json."""
    server: TritonServer = served["server"]
    client = control_client(server, "http")
    try:
        client.load_model("renamed_manifest")
        assert not (server.model_repository / "renamed_manifest" / "1" / "manifest.json").exists()
        bert: ServedModel = served["models"][BERT]
        feeds = {"input_ids": _ids(2, T), "attention_mask": _ones(2, T)}
        assert_rows_equal(bert, feeds, raw_infer(server, "http", "renamed_manifest", feeds))
    finally:
        try:
            client.unload_model("renamed_manifest")
        except InferenceServerException:
            pass
        client.close()
