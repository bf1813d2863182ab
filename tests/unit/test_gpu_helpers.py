"""The GPU runs' CPU-checkable parts: the overlap arithmetic over stage intervals, and the sized
toy model the overlap check slices (its stages run in order equal the whole, on onnxruntime)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from perf.gpu.pipelines import sliced_token_mlp
from perf.gpu.timeline import Interval, busy_overlap_ms, overlapping_pairs


def test_serial_intervals_do_not_overlap() -> None:
    serial = [Interval(0, 0.0, 1.0), Interval(1, 1.0, 2.0), Interval(0, 2.5, 3.0), Interval(1, 3.0, 4.0)]
    assert overlapping_pairs(serial) == []
    assert busy_overlap_ms(serial) == 0.0


def test_overlap_only_between_different_stages() -> None:
    runs = [Interval(0, 0.0, 2.0), Interval(1, 1.5, 3.0), Interval(0, 2.5, 4.0), Interval(1, 3.5, 5.0)]
    pairs = overlapping_pairs(runs)
    assert [(a.stage, b.stage) for a, b in pairs] == [(0, 1), (1, 0), (0, 1)]
    assert busy_overlap_ms(runs) == 0.5 + 0.5 + 0.5
    same_stage = [Interval(2, 0.0, 2.0), Interval(2, 1.0, 3.0)]
    assert overlapping_pairs(same_stage) == []


def test_sliced_token_mlp_stages_equal_the_whole(tmp_path: Path) -> None:
    model_dir, manifest = sliced_token_mlp(tmp_path / "m", hidden=32, layers=6, stages=3, bs_max=4, max_length=16)
    assert manifest.num_stages == 3
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((2, 5, 32)).astype(np.float32), "mask": np.ones((2, 5), np.float32)}
    whole = ort.InferenceSession(str(model_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    tensors = dict(feeds)
    for spec in manifest.stages:
        session = ort.InferenceSession(str(model_dir / spec.file), providers=["CPUExecutionProvider"])
        out = session.run(None, {i.name: tensors[i.name] for i in session.get_inputs()})
        tensors.update({o.name: v for o, v in zip(session.get_outputs(), out)})
    for output, value in zip(whole.get_outputs(), whole.run(None, feeds)):
        np.testing.assert_allclose(tensors[output.name], value, atol=1e-5)
