"""Real exports served from the real tritonserver: every model of the exporter corpus
(tests/slicer/corpus.py: bert, gpt2, vit, resnet18, crnn, yolo, conv_mean, yolov8, ctc, upsample,
ctc_fp16, ctc_external), sliced into three stages
with its original dim names, served from ONE tritonserver (variable-length models under the
`input` policy, fixed-shape ones under `load`), answers concurrent HTTP and gRPC requests of mixed
lengths drawn from each model's sweep (primes, odd widths; one row, and some of two rows of the
same length), none refused, equal to the ORIGINAL export (the
corpus file, not the sliced folder's model.onnx) run on each request alone: the same output names,
the exact shapes in the model's own layout (crnn's time-major [T, rows, 37]), the same values.

Tolerance: atol 1e-4 for every model but the fp16 one (5e-2); transformers (bert, gpt2, vit) also
rtol 1e-3 (their LayerNorm/softmax outputs are O(1), and a batched or stage-split run may reorder
reductions).
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Mapping

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from dvabatch_backend.runtime.manifest import Manifest
from dvabatch_backend.tools.serve import TritonServer, infer_inputs
from policies.auto import resolve
from slicer.slice_model import SliceOptions, SliceReport, slice_model
from slicer.triton_files import config_pbtxt
from slicer.model_config import parameters

from ..slicer.corpus import CorpusModel, build_corpus

MODELS = ("bert", "gpt2", "vit", "resnet18", "crnn", "yolo", "conv_mean", "yolov8", "ctc", "upsample", "ctc_fp16",
          "ctc_external")
TRANSFORMERS = {"bert", "gpt2", "vit"}
PROTOCOLS = ("http", "grpc")
PER_PROTOCOL = 8  # concurrent requests per protocol and model
TIMEOUT = 60.0
ATOL = 1e-4
ATOL_FP16 = 5e-2
RTOL_TRANSFORMERS = 1e-3


@dataclass
class Served:
    corpus: CorpusModel
    report: SliceReport
    policy: str
    original: ort.InferenceSession

    @property
    def manifest(self) -> Manifest:
        return self.report.manifest

    def reference(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The original export run on this request alone (all its rows)."""
        names = [o.name for o in self.original.get_outputs()]
        return dict(zip(names, self.original.run(names, dict(feeds))))


def _profile_lengths(m: CorpusModel) -> tuple[int, ...] | None:
    """Two profile buckets (a middle valid length and the largest) to keep slicing quick."""
    if not m.has_length:
        return None
    valid = m.valid_lengths()
    return tuple(sorted({valid[len(valid) // 2], valid[-1]}))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("real_exports")
    corpus = build_corpus(root / "corpus")
    repo = root / "repository"
    models: dict[str, Served] = {}
    chosen: dict[str, str] = {}
    for name in MODELS:
        m = corpus[name]
        options = SliceOptions(stages=3, max_batch_size=4, max_length=m.max_length or 128, repeats=2,
                               calibration_rounds=1, lengths=_profile_lengths(m))
        report = slice_model(m.path, repo / name, options)
        chosen[name] = _policy_in((repo / name / "config.pbtxt").read_text())  # the slicer's, as it wrote it
        policy = "input" if m.has_length else "load"  # served under one known policy per kind
        (repo / name / "config.pbtxt").write_text(config_pbtxt(report.manifest, policy=policy, name=name))
        original = ort.InferenceSession(str(m.path), providers=["CPUExecutionProvider"])
        models[name] = Served(m, report, policy, original)
    server = TritonServer(repo).start()
    try:
        for name in MODELS:
            server.wait_model_ready(name, timeout=180)
        yield {"server": server, "models": models, "chosen": chosen}
    finally:
        server.stop()


# -- calls ---------------------------------------------------------------------------------------

_local = threading.local()


def _client(server: TritonServer, protocol: str):
    """One client per thread and protocol (tritonclient.http clients are not shared across threads)."""
    key = f"{protocol}_{server.http_port}"
    client = getattr(_local, key, None)
    if client is None:
        client = (httpclient.InferenceServerClient(server.http_url, connection_timeout=TIMEOUT,
                                                   network_timeout=TIMEOUT)
                  if protocol == "http" else grpcclient.InferenceServerClient(server.grpc_url))
        setattr(_local, key, client)
    return client


def infer(server: TritonServer, protocol: str, model: str, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One request with exactly these tensors (batch dim included); every output, whole."""
    module = httpclient if protocol == "http" else grpcclient
    inputs = infer_inputs(module, feeds, add_batch_dim=False)
    client = _client(server, protocol)
    if protocol == "http":
        result = client.infer(model, inputs)
        names = [o["name"] for o in result.get_response()["outputs"]]
    else:
        result = client.infer(model, inputs, client_timeout=TIMEOUT)
        names = [o.name for o in result.get_response().outputs]
    return {name: result.as_numpy(name) for name in names}


def _close_clients() -> None:
    for key in list(vars(_local)):
        try:
            getattr(_local, key).close()
        except Exception:  # noqa: BLE001 - best effort
            pass
        delattr(_local, key)


def in_thread(fn, *args):
    """Run `fn` in a short-lived thread (its clients closed when it ends: a live keep-alive
    connection makes tritonserver wait on SIGTERM) and return or re-raise."""
    box: list = []

    def run() -> None:
        try:
            box.append(("ok", fn(*args)))
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            box.append(("err", exc))
        finally:
            _close_clients()

    t = threading.Thread(target=run)
    t.start()
    t.join(TIMEOUT * 2)
    assert box, "no answer in time"
    kind, value = box[0]
    if kind == "err":
        raise value
    return value


def assert_equal_to_original(model: Served, feeds: Mapping[str, np.ndarray], got: Mapping[str, np.ndarray],
                             what: str) -> None:
    want = model.reference(feeds)
    assert sorted(got) == sorted(want), f"{what}: output names {sorted(got)} != {sorted(want)}"
    rtol = RTOL_TRANSFORMERS if model.corpus.name in TRANSFORMERS else 0.0
    atol = ATOL_FP16 if model.corpus.name == "ctc_fp16" else ATOL
    for name, ref in want.items():
        assert got[name].shape == ref.shape, f"{what}: {name} shape {got[name].shape} != {ref.shape}"
        assert got[name].dtype == ref.dtype, f"{what}: {name} dtype {got[name].dtype} != {ref.dtype}"
        np.testing.assert_allclose(got[name], ref, atol=atol, rtol=rtol, err_msg=f"{what}: {name}")


def _requests(m: CorpusModel, rng: np.random.Generator) -> list[tuple[str, dict[str, np.ndarray]]]:
    """PER_PROTOCOL requests per protocol: mixed valid lengths (every protocol covers the smallest
    and the largest), one row each, and two rows of one length in two requests per protocol."""
    valid = [n for n in m.length_sweep(m.max_length) if n <= m.max_length] if m.has_length else [0]
    work = []
    for protocol in PROTOCOLS:
        lengths = [valid[0], valid[-1]] + [int(rng.choice(valid)) for _ in range(PER_PROTOCOL - 2)]
        rng.shuffle(lengths)
        for i, length in enumerate(lengths):
            rows = 2 if i in (1, 4) else 1
            work.append((protocol, m.make_inputs(rng, rows, length)))
    return work


# -- tests -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", MODELS)
def test_concurrent_mixed_lengths_equal_the_original_export(served, name: str) -> None:
    server: TritonServer = served["server"]
    model: Served = served["models"][name]
    m = model.corpus
    assert model.manifest.num_stages == 3
    rng = np.random.default_rng(MODELS.index(name) + 101)
    work = _requests(m, rng)
    failures: list[str] = []

    def send(i: int, protocol: str, feeds: dict[str, np.ndarray]) -> None:
        shape = {k: v.shape for k, v in feeds.items()}
        what = f"{name} request {i} ({protocol}, {shape})"
        try:
            assert_equal_to_original(model, feeds, infer(server, protocol, name, feeds), what)
        except Exception as exc:  # collected: every request must succeed
            failures.append(f"{what}: {type(exc).__name__}: {exc}")
        finally:
            _close_clients()

    threads = [threading.Thread(target=send, args=(i, p, f)) for i, (p, f) in enumerate(work)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT * 2)
    assert not any(t.is_alive() for t in threads), "requests still unanswered"
    assert failures == [], "\n".join(failures)
    if m.has_length:  # the mix really was mixed
        assert len({next(iter(f.values())).shape for _, f in work}) > 2


def _policy_in(config: str) -> str:
    return parameters(config)["policy"]


def test_the_slicer_chose_each_models_policy_by_the_rule(served) -> None:
    """What the slicer wrote in config.pbtxt is the rule's choice for the model (policies.auto): input
    diversity for a length, else hybrid or load by the profile; and the manifest records it."""
    for name, model in served["models"].items():
        doc = json.loads((model.report.out_dir / "1" / "manifest.json").read_text())
        written = served["chosen"][name]
        unrecorded = {k: v for k, v in doc.items() if k != "policy"}  # the rule applied afresh to the profile
        assert written == doc["policy"]["choice"] == resolve(unrecorded), (name, written, doc["policy"])
        assert (written == "input") == model.corpus.has_length, (name, written)


def test_what_the_slicer_recorded(served) -> None:
    models: dict[str, Served] = served["models"]
    crnn = models["crnn"].manifest
    assert crnn.output_batch_axes == {"softmax_0.tmp_0": 1}
    (out,) = crnn.outputs
    assert out.name == "softmax_0.tmp_0"
    assert out.dims[1] == "floor(floor(seq/2)/2)", out.dims
    assert models["yolo"].manifest.length_multiple == 32
    assert (models["ctc"].manifest.length_multiple, models["ctc"].manifest.min_length) == (1, 9)
    for name, model in models.items():
        # what was saved for the server equals what the slicer reported
        saved = Manifest.load(model.report.out_dir / "1" / "manifest.json")
        assert saved.pad_safe == model.manifest.pad_safe, name
        assert saved.output_batch_axes == model.manifest.output_batch_axes, name
        assert saved.length_multiple == model.manifest.length_multiple, name
        assert (saved.min_length, saved.length_rule) == (model.manifest.min_length, model.manifest.length_rule), name
        expected = model.corpus.pad_safe_expected
        if expected is not None:
            assert model.manifest.pad_safe is expected, (name, model.manifest.pad_safe, expected)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_yolo_width_not_a_multiple_of_32_is_refused_by_name(served, protocol: str) -> None:
    server: TritonServer = served["server"]
    model: Served = served["models"]["yolo"]
    rng = np.random.default_rng(5)
    bad = {"images": rng.standard_normal((1, 3, 32, 100)).astype(np.float32)}  # 100 <= max 256
    assert 100 <= model.manifest.max_length
    with pytest.raises(InferenceServerException) as info:
        in_thread(infer, server, protocol, "yolo", bad)
    assert "multiple of 32" in str(info.value), str(info.value)
    assert str(info.value.status()) in ("400", "StatusCode.INVALID_ARGUMENT"), info.value.status()  # the client's mistake
    # the server and the model still answer good requests afterwards
    for width in (64, 32, 256):
        good = model.corpus.make_inputs(rng, 1, width)
        got = in_thread(infer, server, protocol, "yolo", good)
        assert_equal_to_original(model, good, got, f"yolo after the refusal ({protocol}, width {width})")


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_the_recognizer_takes_every_width_it_runs_at_and_refuses_by_its_rule(served, protocol: str) -> None:
    """Widths such as 213 (no multiple of anything) are answered; under 9 the model itself fails, and
    the refusal says so (400, naming the rule and its evidence)."""
    server: TritonServer = served["server"]
    model: Served = served["models"]["ctc"]
    rng = np.random.default_rng(9)
    for width in (213, 9, 97, 250):
        feeds = model.corpus.make_inputs(rng, 1, width)
        got = in_thread(infer, server, protocol, "ctc", feeds)
        assert_equal_to_original(model, feeds, got, f"ctc width {width} ({protocol})")
    short = {"image": rng.standard_normal((1, 1, 32, 8)).astype(np.float32)}
    with pytest.raises(InferenceServerException) as info:
        in_thread(infer, server, protocol, "ctc", short)
    assert "at least 9" in str(info.value) and "fails" in str(info.value), str(info.value)
    assert str(info.value.status()) in ("400", "StatusCode.INVALID_ARGUMENT"), info.value.status()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_token_id_outside_the_embedding_is_the_clients_mistake(served, protocol: str) -> None:
    server: TritonServer = served["server"]
    model: Served = served["models"]["bert"]
    assert model.manifest.input_bounds.get("input_ids") == 100  # found in the graph: Gather of a 100-row table
    for bad_id in (100, -1):
        ids = np.array([[5, 7, bad_id, 9]], dtype=np.int64)
        with pytest.raises(InferenceServerException) as info:
            in_thread(infer, server, protocol, "bert", {"input_ids": ids, "attention_mask": np.ones_like(ids)})
        assert "outside [0, 100)" in str(info.value), str(info.value)
        assert str(info.value.status()) in ("400", "StatusCode.INVALID_ARGUMENT"), info.value.status()
