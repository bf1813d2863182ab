"""Models as exporters write them (tests/slicer/corpus.py), their dim names untouched, sliced into
three stages: the stages run in order equal the original export at several batch sizes and
lengths, output layout included; positions are legal through shape arithmetic; balance is reported
honestly."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from dvabatch_backend.runtime.manifest import Manifest
from slicer.slice_model import SliceOptions, SliceReport, slice_model

from .corpus import CorpusModel, build_corpus

MODELS = ("bert", "gpt2", "vit", "resnet18", "crnn", "yolo", "conv_mean")
TRANSFORMERS = {"bert", "gpt2", "vit"}


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


def _chain(version_dir, manifest: Manifest, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    tensors = dict(feeds)
    for stage in manifest.stages:
        session = ort.InferenceSession(str(version_dir / stage.file), providers=["CPUExecutionProvider"])
        names = [o.name for o in session.get_outputs()]
        results = session.run(names, {t.name: tensors[t.name] for t in stage.inputs})
        tensors.update(zip(names, results))
    return {t.name: tensors[t.name] for t in manifest.outputs}


@pytest.mark.parametrize("name", MODELS)
def test_stages_in_order_equal_the_original_export(sliced, name: str) -> None:
    m, report = sliced[name]
    manifest = report.manifest
    assert manifest.num_stages == 3
    original = ort.InferenceSession(str(m.path), providers=["CPUExecutionProvider"])
    out_names = [o.name for o in original.get_outputs()]
    assert sorted(out_names) == sorted(t.name for t in manifest.outputs)
    lengths = m.valid_lengths()
    lengths = sorted({lengths[0], lengths[len(lengths) // 2], lengths[-1]}) if m.has_length else [0]
    rng = np.random.default_rng(13)
    for batch in (1, 3):
        for length in lengths:
            feeds = m.make_inputs(rng, batch, length)
            want = dict(zip(out_names, original.run(out_names, feeds)))
            got = _chain(report.out_dir / "1", manifest, feeds)
            for out in out_names:
                axis = manifest.output_batch_axes.get(out, 0)
                mine = np.moveaxis(got[out], 0, axis)  # the runtime keeps rows first
                assert mine.shape == want[out].shape, (out, batch, length)
                rtol = 1e-3 if name in TRANSFORMERS else 0.0
                np.testing.assert_allclose(mine, want[out], atol=1e-4, rtol=rtol, err_msg=f"{out} b={batch} L={length}")


def test_what_the_slicer_learned_of_each_export(sliced) -> None:
    crnn = sliced["crnn"][1].manifest
    assert crnn.output_batch_axes == {"softmax_0.tmp_0": 1}
    assert crnn.outputs[0].dims == ("batch", "seq//4", 37)
    assert sliced["yolo"][1].manifest.length_multiple == 32
    assert sliced["bert"][1].manifest.pad_safe and sliced["gpt2"][1].manifest.pad_safe
    assert not sliced["conv_mean"][1].manifest.pad_safe
    for name in ("bert", "gpt2", "vit", "resnet18"):  # shape arithmetic no longer makes positions illegal
        report = sliced[name][1]
        assert report.legal_points >= 0.85 * report.nodes, (name, report.legal_points, report.nodes)


@pytest.mark.parametrize("name", MODELS)
def test_balance_is_reported_honestly(sliced, name: str) -> None:
    _, report = sliced[name]
    summary = report.summary()
    print(f"{name}: balance {report.chosen.balance:.2f}, legal {report.legal_points}/{report.nodes}, "
          f"achievable {report.achievable}")
    assert f"legal cut points: {report.legal_points} of {report.nodes}" in summary
    assert ("NOT BALANCED" in summary) == (report.chosen.balance > report.balance_goal)
