"""Pad safety, measured at slice time: a model that zero-padding changes (`slicer.toy.conv_pool`: a
conv over the sequence, no mask, a plain mean) is detected and marked `pad_safe: false`, and the
runtime then answers its mixed-length queries like the model alone; masked transformers are pad-safe."""
from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest

from dvabatch_backend.runtime.loading import load_pipeline
from dvabatch_backend.runtime.manifest import Manifest
from policies import create_policy
from slicer import toy, zoo
from slicer.cut import input_specs
from slicer.pad_safety import check_pad_safety
from slicer.preflight import full_session
from slicer.slice_model import SliceOptions, slice_model

from ..conftest import Collector

QUICK = SliceOptions(max_batch_size=4, max_length=12, repeats=2, calibration_rounds=0, batch_sizes=(1, 2), stages=2)


def test_a_conv_over_the_sequence_without_a_mask_is_not_pad_safe(tmp_path) -> None:
    report = slice_model(toy.conv_pool(hidden=8, layers=3), tmp_path / "conv", QUICK)
    assert report.manifest.pad_safe is False
    doc = json.loads((tmp_path / "conv" / "1" / "manifest.json").read_text())
    assert doc["pad_safe"] is False and "differs from the query alone" in doc["slicing"]["pad_check"]
    assert Manifest.load(tmp_path / "conv" / "1" / "manifest.json").pad_safe is False
    summary = report.summary()
    assert "pad-safe: NO — queries are batched only with queries of the same length" in summary

    # served: mixed lengths under the input policy (pad tolerance that would pad) answer like the model alone
    rng = np.random.default_rng(1)
    queries = [{"x": rng.standard_normal((n, 8)).astype(np.float32)} for n in (12, 3, 11, 4, 12, 1, 10, 9)]
    full = ort.InferenceSession(str(tmp_path / "conv" / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    collector = Collector()
    with load_pipeline(tmp_path / "conv", create_policy("input", pad_tolerance=1.0)) as pipeline:
        ids = pipeline.submit_many([(q, collector) for q in queries])
        assert collector.wait_for(ids)
    for qid, query in zip(ids, queries):
        expected = full.run(["pooled"], {"x": query["x"][None]})[0][0]
        np.testing.assert_allclose(collector.one(qid).outputs["pooled"], expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["token_mlp", "bert"])
def test_masked_models_are_pad_safe(tmp_path, name: str) -> None:
    model = toy.token_mlp(8, 4) if name == "token_mlp" else zoo.build("bert", "test")
    report = slice_model(model, tmp_path / name, QUICK)
    assert report.manifest.pad_safe is True
    assert "pad-safe: yes" in report.summary()


def test_models_without_a_sequence_axis_are_pad_safe_by_definition() -> None:
    model = toy.dense_mlp(8, 3)
    specs = list(input_specs(model).values())
    result = check_pad_safety(full_session(model), specs, specs, 0, 1e-4)
    assert result.safe and "no sequence axis" in result.detail


def test_the_check_at_another_max_length() -> None:
    """bert (its mask zero past each query, as the runtime pads it) agrees; conv_pool differs."""
    model = zoo.build("bert", "test")
    specs = list(input_specs(model).values())
    from slicer.cut import probe_specs

    outputs = [probe_specs(model, [o.name])[o.name] for o in model.graph.output]
    assert check_pad_safety(full_session(model), specs, outputs, 32, 1e-4).safe
    conv = toy.conv_pool(hidden=8)
    conv_specs = list(input_specs(conv).values())
    conv_outputs = [probe_specs(conv, ["pooled"])["pooled"]]
    result = check_pad_safety(full_session(conv), conv_specs, conv_outputs, 32, 1e-4)
    assert not result.safe and "'pooled'" in result.detail


@pytest.mark.parametrize("name", ["bert", "gpt2", "conv_mean"])
def test_exporter_written_models_are_measured_as_the_corpus_expects(tmp_path_factory, name: str) -> None:
    """Models torch.onnx.export wrote (tests/slicer/corpus.py): BERT and GPT-2 with their attention
    masks are pad-safe, a conv over the sequence then a mean is not."""
    from .corpus import build_corpus

    m = build_corpus(tmp_path_factory.getbasetemp() / "pad_corpus", [name])[name]
    options = SliceOptions(**{**QUICK.__dict__, "max_length": min(m.max_length, 32)})
    report = slice_model(m.path, tmp_path_factory.mktemp(name) / name, options)
    assert report.manifest.pad_safe is m.pad_safe_expected, report.manifest.extra["slicing"]["pad_check"]
