"""The torch stage engine on the CPU: every stage of every zoo model (test size) and of the
real-export corpus (tests/slicer/corpus.py), sliced into three stages, converted to torch and run
eagerly equals onnxruntime on the same stage inputs, at two batch sizes and two lengths; an op the
converter does not know fails at load, naming the op and the node; `make_engines` builds the torch
engine when the settings ask for it."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from dvabatch_backend import Manifest, RuntimeSettings
from dvabatch_backend.runtime.loading import make_engines
from slicer.model_config import parameters
from slicer.profiler import int_bounds, random_inputs
from slicer.slice_model import SliceOptions, slice_model
from slicer.zoo import ZOO, build

from ..slicer.corpus import build_corpus

torch = pytest.importorskip("torch")
from dvabatch_backend.runtime.settings import graph_buckets  # noqa: E402
from dvabatch_backend.runtime.torch_engine import OPS, TorchStageEngine, UnsupportedOpError  # noqa: E402

CORPUS = ("bert", "gpt2", "vit", "resnet18", "crnn", "yolo", "conv_mean")
MODELS = tuple(f"zoo_{name}" for name in sorted(ZOO)) + CORPUS
TRANSFORMERS = {"zoo_bert", "zoo_minilm", "bert", "gpt2", "vit"}  # fp32 attention: relative error too
BATCHES = (1, 3)


@dataclass
class Sliced:
    folder: Path  # the version folder
    manifest: Manifest
    int_high: dict[str, int]

    def lengths(self) -> list[int]:
        """Two lengths the model takes (a short one and the longest); [0] without a length."""
        valid = self.manifest.valid_lengths()
        return [next(n for n in valid if n >= self.manifest.max_length // 4), valid[-1]] if self.manifest.has_seq else [0]


class SlicedCache:
    """Each model sliced into three stages once per module (quick options: no real profiling)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._models: dict[str, Sliced] = {}

    def get(self, name: str) -> Sliced:
        if name not in self._models:
            source, max_length = self._source(name)
            options = SliceOptions(stages=3, max_batch_size=4, max_length=max_length or 128, repeats=1,
                                   calibration_rounds=0, batch_sizes=(1, 4),
                                   lengths=(max_length,) if max_length else None)
            report = slice_model(source, self.root / name, options)
            folder = report.out_dir / "1"
            self._models[name] = Sliced(folder, report.manifest, int_bounds(onnx.load(str(folder / "model.onnx"))))
        return self._models[name]

    def _source(self, name: str) -> tuple[object, int]:
        if name.startswith("zoo_"):
            zoo_name = name[len("zoo_"):]
            return build(zoo_name, "test"), ZOO[zoo_name].max_length.get("test", 0)
        model = build_corpus(self.root / "corpus", [name])[name]
        return model.path, model.max_length


@pytest.fixture(scope="module")
def sliced(tmp_path_factory: pytest.TempPathFactory) -> SlicedCache:
    return SlicedCache(tmp_path_factory.mktemp("torch_engine"))


def _ort_session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("name", MODELS)
def test_every_stage_on_torch_equals_onnxruntime(sliced: SlicedCache, name: str) -> None:
    model = sliced.get(name)
    stages = model.manifest.stages
    sessions = [_ort_session(model.folder / s.file) for s in stages]
    engines = [TorchStageEngine(model.folder / s.file) for s in stages]
    rtol = 1e-3 if name in TRANSFORMERS else 0.0
    rng = np.random.default_rng(0)
    worst = 0.0
    for batch in BATCHES:
        for length in model.lengths():
            values = random_inputs(model.manifest.inputs, batch, length, rng, model.int_high)
            for spec, session, engine in zip(stages, sessions, engines):
                feeds = {t.name: values[t.name] for t in spec.inputs}
                names = [t.name for t in spec.outputs]
                expected = dict(zip(names, session.run(names, feeds)))
                got = {n: np.full_like(v, np.nan) if v.dtype.kind == "f" else np.zeros_like(v) for n, v in expected.items()}
                engine.run(feeds, got)
                for n in names:
                    where = f"{name} {spec.file} output {n} at batch {batch}, length {length}"
                    np.testing.assert_allclose(got[n], expected[n], atol=1e-4, rtol=rtol, err_msg=where)
                    if expected[n].size and expected[n].dtype.kind == "f":  # equal infinities (masks) are no error
                        with np.errstate(invalid="ignore"):  # inf - inf, where both are the same infinity
                            error = np.where(got[n] == expected[n], 0.0, np.abs(got[n] - expected[n]))
                        worst = max(worst, float(np.max(error)))
                values.update(expected)  # the next stage reads onnxruntime's tensors: errors do not add up
    print(f"\nTORCH {name}: {len(stages)} stages x batches {BATCHES} x lengths {model.lengths()}, max |err| {worst:.2e}")


def _model_with(op_type: str) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch"])
    nodes = [helper.make_node("Relu", ["x"], ["h"], name="relu0"),
             helper.make_node(op_type, ["h"], ["y"], name="the_unknown_node")]
    return helper.make_model(helper.make_graph(nodes, "unknown_op", [x], [y]),
                             opset_imports=[helper.make_opsetid("", 17)])


def test_an_unknown_op_fails_at_load_naming_the_op_and_the_node(tmp_path: Path) -> None:
    assert "Det" not in OPS
    path = tmp_path / "stage0.onnx"
    onnx.save(_model_with("Det"), str(path))
    with pytest.raises(UnsupportedOpError, match=r"stage0\.onnx: op 'Det' \(node 'the_unknown_node' \(Det\)\) is not supported"):
        TorchStageEngine(path)


def test_input_shapes_follow_the_stage_dims(sliced: SlicedCache) -> None:
    """The shapes a CUDA graph would be captured at: derived lengths (crnn's `seq//4`) included."""
    model = sliced.get("crnn")
    for spec in model.manifest.stages:
        engine = TorchStageEngine(model.folder / spec.file)
        assert engine.input_shapes(3, 32) == {t.name: t.shape(3, 32) for t in spec.inputs}
    with pytest.raises(RuntimeError, match="capture needs device 'cuda'"):
        engine.capture(1, 32)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_cuda_without_a_gpu_fails_clearly(sliced: SlicedCache) -> None:
    model = sliced.get("conv_mean")
    with pytest.raises(RuntimeError, match="torch sees no CUDA device"):
        TorchStageEngine(model.folder / model.manifest.stages[0].file, device="cuda")


def test_make_engines_builds_the_torch_engine_when_asked(sliced: SlicedCache) -> None:
    model = sliced.get("conv_mean")
    engines = make_engines(model.folder, model.manifest, RuntimeSettings(engine="torch"))
    assert [type(e) for e in engines] == [TorchStageEngine] * model.manifest.num_stages
    # per_stage: a global onnxruntime pool made in this process would outlive the test
    default = make_engines(model.folder, model.manifest, RuntimeSettings(thread_pool="per_stage"))
    assert not any(isinstance(e, TorchStageEngine) for e in default)


def test_the_baselines_run_the_unsliced_model_on_either_engine(sliced: SlicedCache, tmp_path: Path) -> None:
    """ZeroBatch/DelayBatch's model (perf/baselines/model.py) with `engine` torch answers a padded
    batch of requests of different lengths as with onnxruntime; the config carries the choice."""
    from perf.baselines import model as baseline_model
    from perf.baselines import add_baseline

    model = sliced.get("bert")
    manifest = model.manifest
    rng = np.random.default_rng(3)
    requests = [baseline_model.parse_request(random_inputs(manifest.inputs, k, n, rng, model.int_high), manifest)
                for k, n in ((1, 5), (2, 16), (1, 9))]
    batch = baseline_model.pad_batch(requests, manifest.inputs)
    answers = {}
    for engine in ("onnxruntime", "torch"):
        settings = baseline_model.parse_parameters({"engine": engine}, model.folder)
        runner = baseline_model.make_runner(settings, manifest)
        answers[engine] = runner.run(batch, manifest.outputs, 4, 16)
    for name, expected in answers["onnxruntime"].items():
        np.testing.assert_allclose(answers["torch"][name], expected, atol=1e-4, rtol=1e-3, err_msg=name)
    with pytest.raises(ValueError, match="'cuda' needs engine 'torch'"):
        baseline_model.parse_parameters({"device": "cuda"}, model.folder)
    config = (add_baseline(tmp_path, model.folder, "b", 0, engine="torch") / "config.pbtxt").read_text()
    assert parameters(config)["engine"] == "torch"


class _CaptureRecorder:
    """Stands in for `TorchStageEngine` on "cuda" (no GPU here) only to record the graph buckets
    each engine is asked to capture."""

    captured: dict[str, tuple] = {}

    def __init__(self, path: Path, device: str = "cpu", threads: int = 1) -> None:
        self.path = Path(path)
        onnx_model = onnx.load(str(path), load_external_data=False)
        self.input_names = [i.name for i in onnx_model.graph.input]
        self.output_names = [o.name for o in onnx_model.graph.output]

    def capture_buckets(self, batch_sizes, lengths, pad_length: bool) -> int:
        _CaptureRecorder.captured[self.path.name] = (list(batch_sizes), list(lengths))
        return len(batch_sizes) * len(lengths)


def test_the_baselines_capture_the_graph_buckets_the_dvabatch_model_captures(sliced: SlicedCache,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Served on CUDA, ZeroBatch's unsliced model replays graphs at the buckets dvabatch's stages
    and unsliced model capture (the manifest's bs_max and lengths), not eagerly."""
    import dvabatch_backend.runtime.torch_engine as torch_engine
    from dvabatch_backend.runtime.loading import load_pipeline
    from perf.baselines import model as baseline_model
    from policies import load_policy

    model = sliced.get("bert")
    folder = model.folder
    monkeypatch.setattr(torch_engine, "TorchStageEngine", _CaptureRecorder)
    _CaptureRecorder.captured = {}
    settings = baseline_model.parse_parameters({"engine": "torch", "device": "cuda"}, folder)
    baseline_model.make_runner(settings, baseline_model.load_manifest(settings.manifest))
    baseline = _CaptureRecorder.captured.pop("model.onnx")
    load_pipeline(folder, load_policy("load", {}, folder), RuntimeSettings(engine="torch", device="cuda")).stop()
    stages = _CaptureRecorder.captured
    assert set(stages) >= {s.file for s in model.manifest.stages}  # and the fast path's unsliced model, if loaded
    assert all(buckets == baseline for buckets in stages.values())
    assert baseline == graph_buckets(model.manifest.max_batch_size, model.manifest.max_length, True)


def test_graph_buckets_cover_every_batch_size_and_length() -> None:
    """The CUDA-graph buckets: powers of two and the maximum itself, so every batch a bs_max and
    max_length allow fits one bucket; a model without a length has one, 0."""
    sizes, lengths = graph_buckets(16, 128, has_seq=True)
    assert sizes == [1, 2, 4, 8, 16] and lengths == [16, 32, 64, 128]
    sizes, lengths = graph_buckets(12, 100, has_seq=True)
    assert sizes == [1, 2, 4, 8, 12] and lengths == [16, 32, 64, 100]
    assert graph_buckets(1, 0, has_seq=False) == ([1], [0])
    for bs_max, max_length in ((16, 128), (12, 100), (7, 12), (1, 1)):
        sizes, lengths = graph_buckets(bs_max, max_length, True)
        assert all(any(s >= bs for s in sizes) for bs in range(1, bs_max + 1))
        assert all(any(n >= length for n in lengths) for length in range(1, max_length + 1))


def test_make_engine_captures_no_graph_off_cuda(sliced: SlicedCache) -> None:
    """cuda_graphs is the served default, and it touches only CUDA engines: on the CPU nothing is captured."""
    model = sliced.get("zoo_bert")
    engines = make_engines(model.folder, model.manifest, RuntimeSettings(engine="torch", device="cpu"))
    assert RuntimeSettings().cuda_graphs and all(e.captured == [] for e in engines)
