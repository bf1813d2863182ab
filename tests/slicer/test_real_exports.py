"""Models as exporters write them (tests/slicer/corpus.py), their dim names untouched, sliced into
three stages: the stages run in order equal the original export at batch 1 and 3 and at every
length of a sweep of at least 20 (primes, odd lengths, and lengths past 4x the longest probe where
the model takes them), output shapes included; each length dim is the exact expression symbolic
inference gives; a length is refused only where the model itself fails; positions are legal
through shape arithmetic; balance is reported honestly."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from dvabatch_backend.runtime.manifest import Manifest
from slicer.analysis import legal_cut_points
from slicer.cut import MergedSpec, cut_model, probe_settings, probe_specs
from slicer.slice_model import SliceOptions, SliceReport, slice_model

from .corpus import CorpusModel, build_corpus

MODELS = ("bert", "gpt2", "vit", "resnet18", "crnn", "yolo", "conv_mean", "yolov8", "ctc", "upsample", "ctc_fp16",
          "ctc_external")
TRANSFORMERS = {"bert", "gpt2", "vit"}
FP16 = {"ctc_fp16"}  # atol 5e-2: half precision, a stage-split run may round differently


@pytest.fixture(scope="module")
def sliced(tmp_path_factory) -> dict[str, tuple[CorpusModel, SliceReport]]:
    root = tmp_path_factory.mktemp("exports")
    corpus = build_corpus(root / "corpus")
    out = {}
    for name in MODELS:
        m = corpus[name]
        options = SliceOptions(stages=3, max_batch_size=4, max_length=m.max_length or 128, repeats=2,
                               calibration_rounds=1)
        out[name] = (m, slice_model(m.path, root / "repo" / name, options))
    return out


def _chain(sessions: list[ort.InferenceSession], manifest: Manifest,
           feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    tensors = dict(feeds)
    for stage, session in zip(manifest.stages, sessions):
        names = [o.name for o in session.get_outputs()]
        results = session.run(names, {t.name: tensors[t.name] for t in stage.inputs})
        tensors.update(zip(names, results))
    return {t.name: tensors[t.name] for t in manifest.outputs}


def _longest_probe(report: SliceReport) -> int:
    model = onnx.load(str(report.out_dir / "1" / "model.onnx"), load_external_data=False)
    return max(n for _, n in probe_settings(model))


@pytest.mark.parametrize("name", MODELS)
def test_stages_in_order_equal_the_original_export(sliced, name: str) -> None:
    m, report = sliced[name]
    manifest = report.manifest
    assert manifest.num_stages == 3
    original = ort.InferenceSession(str(m.path), providers=["CPUExecutionProvider"])
    stages = [ort.InferenceSession(str(report.out_dir / "1" / s.file), providers=["CPUExecutionProvider"])
              for s in manifest.stages]
    out_names = [o.name for o in original.get_outputs()]
    assert sorted(out_names) == sorted(t.name for t in manifest.outputs)
    lengths = m.length_sweep(_longest_probe(report)) if m.has_length else [0]
    assert len(lengths) >= (20 if m.has_length else 1)
    rng = np.random.default_rng(13)
    for batch in (1, 3):
        for length in lengths:
            feeds = m.make_inputs(rng, batch, length)
            want = dict(zip(out_names, original.run(out_names, feeds)))
            got = _chain(stages, manifest, feeds)
            for out in out_names:
                axis = manifest.output_batch_axes.get(out, 0)
                mine = np.moveaxis(got[out], 0, axis)  # the runtime keeps rows first
                assert mine.shape == want[out].shape, (out, batch, length)
                spec = next(t for t in manifest.outputs if t.name == out)
                assert spec.shape(batch, length) == got[out].shape, (out, spec.dims, length)  # the manifest's dims
                rtol = 1e-3 if name in TRANSFORMERS else 1e-4
                atol = 5e-2 if name in FP16 else 1e-4
                assert mine.dtype == want[out].dtype, (out, mine.dtype)
                np.testing.assert_allclose(mine, want[out], atol=atol, rtol=rtol, err_msg=f"{out} b={batch} L={length}")


def test_what_the_slicer_learned_of_each_export(sliced) -> None:
    crnn = sliced["crnn"][1].manifest
    assert crnn.output_batch_axes == {"softmax_0.tmp_0": 1}
    assert crnn.outputs[0].dims == ("batch", "floor(floor(seq/2)/2)", 37)
    assert (crnn.min_length, crnn.length_multiple) == (4, 1) and "graph gives" in crnn.length_rule  # onnxruntime pads the pools under 4
    # the YOLOv8-style head: three strides concatenated; the CTC recognizer's time steps
    anchors = sliced["yolov8"][1].manifest.outputs[0].dims[2]
    assert anchors.count("floor") >= 10 and anchors.endswith("+ 14"), anchors
    assert (sliced["yolov8"][1].manifest.length_multiple, sliced["yolov8"][1].manifest.min_length) == (1, 1)
    ctc = sliced["ctc"][1].manifest
    assert ctc.outputs[0].dims == ("batch", "floor(floor(seq/2 - 5/2)/2)", 20)
    assert (ctc.length_multiple, ctc.min_length) == (1, 9) and "at 8" in ctc.length_rule
    masks = sliced["upsample"][1].manifest.outputs[0].dims[3]  # Resize by scales: 4 * ceil(ceil(W/2)/2)
    assert "2.0*" in masks and sliced["upsample"][1].manifest.min_length == 1, masks
    assert sliced["ctc_fp16"][1].manifest.outputs[0].dtype == "float16"
    yolo = sliced["yolo"][1].manifest  # truly constrained: a width that is not a multiple of 32 fails past 64
    assert yolo.length_multiple == 32 and "fails" in yolo.length_rule
    assert sliced["bert"][1].manifest.pad_safe and sliced["gpt2"][1].manifest.pad_safe
    assert not sliced["conv_mean"][1].manifest.pad_safe
    for name in ("bert", "gpt2", "vit", "resnet18"):  # shape arithmetic no longer makes positions illegal
        report = sliced[name][1]
        assert report.legal_points >= 0.85 * report.nodes, (name, report.legal_points, report.nodes)


def _cut_and_compare(m: CorpusModel, report: SliceReport, positions: list[int], tmp_path) -> Manifest:
    """Cut the sliced folder's model.onnx at `positions`; the stages equal the original at batch 1 and 3
    and every length of the sweep."""
    model = onnx.load(str(report.out_dir / "1" / "model.onnx"))
    manifest = cut_model(model, positions, tmp_path / "1", m.name, 4, m.max_length)
    original = ort.InferenceSession(str(m.path), providers=["CPUExecutionProvider"])
    names = [o.name for o in original.get_outputs()]
    stages = [ort.InferenceSession(str(tmp_path / "1" / s.file), providers=["CPUExecutionProvider"])
              for s in manifest.stages]
    rng = np.random.default_rng(3)
    for batch in (1, 3):
        for length in m.length_sweep(_longest_probe(report)):
            feeds = m.make_inputs(rng, batch, length)
            got = _chain(stages, manifest, feeds)
            for name, want in zip(names, original.run(names, feeds)):
                np.testing.assert_allclose(got[name], want, atol=1e-4, rtol=1e-3, err_msg=f"{name} b={batch} L={length}")
    return manifest


def test_a_cut_where_batch_and_length_are_one_dim(sliced, tmp_path) -> None:
    """GPT-2's MLP runs on [batch*seq, hidden]: cut there, the tensor crosses as [batch, seq, hidden]
    and the stages still equal the original at every length of the sweep."""
    m, report = sliced["gpt2"]
    model = onnx.load(str(report.out_dir / "1" / "model.onnx"))
    points = legal_cut_points(model, 8)
    specs = probe_specs(model, sorted({t for p in points for t in p.tensors}))
    merged = [p for p in points if any(isinstance(specs[t], MergedSpec) for t in p.tensors)]
    assert len(merged) >= 20, len(merged)
    manifest = _cut_and_compare(m, report, [merged[len(merged) // 3].position,
                                            merged[2 * len(merged) // 3].position], tmp_path)
    crossing = [t for t in manifest.stages[1].inputs  # renamed at the boundary: it crosses reshaped
                if isinstance(specs.get(t.name.rpartition("__")[0]), MergedSpec)]
    assert crossing and crossing[0].dims[:2] == ("batch", "seq"), manifest.stages[1].inputs


def test_cuts_through_a_multi_scale_head(sliced, tmp_path) -> None:
    """Cut the YOLOv8-style detector inside its head, where each scale's grid is made from its feature
    map's shape: the later stages remake the grids from the length (carried), computing each nested
    ceiling in ONNX ops, and equal the original at every width of the sweep."""
    m, report = sliced["yolov8"]
    assert report.legal_points >= report.nodes - 2 and not report.illegal, (report.legal_points, report.illegal)
    model = onnx.load(str(report.out_dir / "1" / "model.onnx"))
    points = [p.position for p in legal_cut_points(model, 64)]
    head = points[-len(points) // 4:]  # the last quarter: the heads, the grids, the concatenation
    manifest = _cut_and_compare(m, report, [head[len(head) // 3], head[2 * len(head) // 3]], tmp_path)
    later = [onnx.load(str(tmp_path / "1" / s.file)).graph for s in manifest.stages[1:]]
    assert any(n.op_type == "Mod" for g in later for n in g.node)  # a floor of the length, remade exactly


@pytest.mark.parametrize("name", MODELS)
def test_balance_is_reported_honestly(sliced, name: str) -> None:
    _, report = sliced[name]
    summary = report.summary()
    print(f"{name}: balance {report.chosen.balance:.2f}, legal {report.legal_points}/{report.nodes}, "
          f"achievable {report.achievable}")
    assert f"legal cut points: {report.legal_points} of {report.nodes}" in summary
    assert ("NOT BALANCED" in summary) == (report.chosen.balance > report.balance_goal)
