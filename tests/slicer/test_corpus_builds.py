"""The exporter-written corpus (tests/slicer/corpus.py) builds, runs in onnxruntime, and keeps
the dim names its exporters leave."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from .corpus import NAMES, CorpusModel, build_corpus, check_model, pad_difference, session

# Shapes as exported: a string is a dim_param, an int a dim_value, None a dim with neither;
# "*" a name the exporter made up (the exact text varies between torch versions).
EXPECTED_SHAPES = {
    "bert": {"input_ids": ("batch_size", "sequence_length"), "attention_mask": ("batch_size", "sequence_length"),
             "last_hidden_state": ("*", "*", 32), "pooler_output": ("*", 32)},
    "gpt2": {"input_ids": ("N", "T"), "attention_mask": ("N", "T"), "last_hidden_state": ("N", "T", "*")},
    "vit": {"pixel_values": (None, 3, 32, 32), "last_hidden_state": (None, "*", "*")},
    "resnet18": {"input": ("unk__214", 3, 32, 32), "output": ("unk__214", 10)},
    "crnn": {"x": ("p2o.DynamicDimension.0", 1, 32, "p2o.DynamicDimension.1"),
             "softmax_0.tmp_0": ("p2o.DynamicDimension.2", "p2o.DynamicDimension.0", 37)},
    "yolo": {"images": ("batch", 3, 32, "width"), "output0": ("batch", "*", "*", "*")},
    "conv_mean": {"x": ("batch", "len", 16), "y": ("batch", 8)},
    "yolov8": {"images": ("batch", 3, 64, "width"), "output0": ("batch", "*", "anchors")},
    "ctc": {"image": ("N", 1, 32, "image_width"), "logits": ("N", "T", 20)},
    "upsample": {"image": ("batch", 3, 32, "width"), "masks": ("batch", 4, 32, "out_width")},
    "ctc_fp16": {"image": ("N", 1, 32, "image_width"), "logits": ("N", "T", 20)},
    "ctc_external": {"image": ("N", 1, 32, "image_width"), "logits": ("N", "T", 20)},
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, CorpusModel]:
    return build_corpus(tmp_path_factory.mktemp("corpus"))


def test_every_model_is_built(corpus):
    assert set(corpus) == set(NAMES) == set(EXPECTED_SHAPES)
    again = build_corpus(next(iter(corpus.values())).path.parent, ["bert"])
    assert again["bert"] is corpus["bert"]  # cached: built once per folder


@pytest.mark.parametrize("name", NAMES)
def test_dim_names_as_the_exporter_left_them(corpus, name):
    got = {**corpus[name].inputs, **corpus[name].outputs}
    assert set(got) == set(EXPECTED_SHAPES[name])
    for tensor, want in EXPECTED_SHAPES[name].items():
        shape = got[tensor]
        assert len(shape) == len(want), (tensor, shape)
        for dim, w in zip(shape, want):
            if w == "*":
                assert isinstance(dim, str) and dim, (tensor, shape)
            else:
                assert dim == w, (tensor, shape)


@pytest.mark.parametrize("name", NAMES)
def test_runs_at_two_batches_and_two_lengths(corpus, name):
    m = corpus[name]
    sess = ort.InferenceSession(str(m.path), providers=["CPUExecutionProvider"])
    assert [i.name for i in sess.get_inputs()] == list(m.inputs)
    shapes = check_model(m, batches=(1, 3))
    lengths = sorted({length for _, length in shapes})
    assert len(lengths) == (2 if m.has_length else 1)
    for (batch, length), outs in shapes.items():
        for out, shape in outs.items():
            batch_axis = 1 if name == "crnn" else 0  # the CRNN's output is time-major
            assert shape[batch_axis] == batch, (out, shape)
        if name in ("bert", "gpt2"):
            assert outs["last_hidden_state"] == (batch, length, 32)
        if name == "crnn":
            assert outs["softmax_0.tmp_0"] == (length // 4, batch, 37)
        if name == "yolo":
            assert outs["output0"] == (batch, 3, length // 32, 6)
        if name == "yolov8":  # three strides of ceil(W/2) convs: 8 rows at 8, 4 at 16, 2 at 32
            cells = [-(-length // 2 ** k) for k in (3, 4, 5)]
            assert outs["output0"] == (batch, 7, 8 * cells[0] + 4 * cells[1] + 2 * cells[2])
        if name in ("ctc", "ctc_fp16", "ctc_external"):
            assert outs["logits"] == (batch, ((length - 5) // 2 + 1 - 2 - 1) // 2 + 1, 20)
        if name == "upsample":
            assert outs["masks"] == (batch, 4, 32, 4 * -(-length // 4))


def test_inputs_are_valid(corpus):
    rng = np.random.default_rng(1)
    bert = corpus["bert"]
    feeds = bert.make_inputs(rng, 3, 10, valid=[10, 4, 1])
    assert feeds["input_ids"].dtype == np.int64 and feeds["input_ids"].max() < bert.int_high["input_ids"]
    assert feeds["attention_mask"].tolist()[1] == [1] * 4 + [0] * 6
    with pytest.raises(ValueError):
        bert.make_inputs(rng, 1, bert.max_length + 1)
    with pytest.raises(ValueError):
        corpus["yolo"].make_inputs(rng, 1, 48)  # not a multiple of 32
    assert corpus["vit"].make_inputs(rng, 2)["pixel_values"].dtype == np.float32


def test_yolo_fails_off_its_width_multiple(corpus):
    m = corpus["yolo"]
    x = np.zeros((1, 3, 32, 100), np.float32)  # the grid has 100 // 32 = 3 cells, the features 4
    with pytest.raises(Exception):
        session(m).run(None, {"images": x})


def test_padding_safety_is_as_marked(corpus):
    assert pad_difference(corpus["bert"], 5, 12) < 1e-5
    assert pad_difference(corpus["gpt2"], 5, 12) < 1e-5
    assert pad_difference(corpus["conv_mean"], 5, 12) > 1e-3
    assert pad_difference(corpus["crnn"], 16, 32) > 1e-6
