"""A corpus of small ONNX models written the way real exporters write them, for the slicer's tests.

Every model is generated here (random, seeded weights; nothing is downloaded) and exported with
`torch.onnx.export` as a user calls it: input/output names and `dynamic_axes` as users write them,
dim names as the exporter leaves them, or renamed afterwards the way other exporters name them
(tf2onnx's `unk__214`, paddle2onnx's `p2o.DynamicDimension.0`, a dim with neither name nor value).

Exporter: the TorchScript exporter (`dynamo=False`). torch 2.13's default, the dynamo exporter,
needs `onnxscript`, which is not installed here (`ModuleNotFoundError: No module named
'onnxscript'`).

The Hugging Face models are exported through a thin wrapper module (`forward(input_ids,
attention_mask)` calling the model by keyword, returning a tuple), as export scripts commonly do:
exporting `BertModel` directly with `args=(input_ids, attention_mask)` fails in this transformers
(5.x) with `TypeError: BertModel.forward() got multiple values for argument 'use_cache'` (the
TorchScript exporter fills the remaining positional parameters with their defaults, and
transformers' config-default decorator then also passes `use_cache` by keyword).

Use:

    models = build_corpus(tmp_path)            # all; or build_corpus(tmp_path, ["bert", "crnn"])
    m = models["bert"]
    feeds = m.make_inputs(np.random.default_rng(0), batch=3, length=16)
    shapes = check_model(m)                    # runs it in onnxruntime at two batches x two lengths
"""
from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import onnx

SEED = 0
EXPORTER = "torch.onnx.export (TorchScript, dynamo=False)"

InputMaker = Callable[[np.random.Generator, int, int], "dict[str, np.ndarray]"]


@dataclass
class CorpusModel:
    name: str
    path: Path
    kind: str  # "text" | "image" | "variable_width" | "sequence"
    opset: int
    max_length: int  # largest valid length/width of the variable axis; 0 when there is none
    int_high: dict[str, int] = field(default_factory=dict)  # integer input -> exclusive upper bound
    variable_axis_multiple: int = 1  # valid lengths are multiples of this
    min_length: int = 0  # smallest valid length/width; 0 when there is no variable axis
    longest: int = 0  # the longest length the model itself takes (a text model's positions); 0: max_length
    pad_safe_expected: bool | None = None  # do zero/masked padding of the variable axis leave the answer alone?
    notes: str = ""
    # input / output name -> shape as exported: dim_param str, dim_value int, or None (neither)
    inputs: dict[str, tuple] = field(default_factory=dict)
    outputs: dict[str, tuple] = field(default_factory=dict)
    _make: InputMaker | None = field(default=None, repr=False)

    @property
    def has_length(self) -> bool:
        return self.max_length > 0

    def valid_lengths(self) -> list[int]:
        """Every valid length of the variable axis (empty for fixed-shape models)."""
        if not self.has_length:
            return []
        step = self.variable_axis_multiple
        first = max(self.min_length, step)
        first = -(-first // step) * step
        return list(range(first, self.max_length + 1, step))

    def length_sweep(self, longest_probe: int, count: int = 20) -> list[int]:
        """At least `count` valid lengths: the smallest and the largest the slicer profiles, primes,
        odd lengths (no multiple of any stride), and lengths past 4x `longest_probe` where the
        model itself takes them; [0] for a fixed-shape model."""
        if not self.has_length:
            return [0]
        step, top = self.variable_axis_multiple, self.longest or self.max_length
        valid = [n for n in range(max(self.min_length, step), top + 1) if n % step == 0]
        inside = [n for n in valid if n <= self.max_length]
        primes = [n for n in inside if n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))]
        past = [n for n in valid if n >= 4 * longest_probe]
        picked = {inside[0], inside[-1], *primes[::max(1, len(primes) // 8)], *past[:2], *past[-2:]}
        picked |= set(sorted(n for n in past if n % 2)[:2])
        rest = [n for n in valid if n not in picked]
        for n in rest[::max(1, len(rest) // count)]:
            if len(picked) >= count:
                break
            picked.add(n)
        return sorted(picked)

    def make_inputs(self, rng: np.random.Generator, batch: int, length: int = 0,
                    valid: Sequence[int] | None = None) -> dict[str, np.ndarray]:
        """Valid inputs at this batch size and length (ignored by fixed-shape models).

        `valid` (text models only): per row, how many leading tokens are real; the attention
        mask is ones then zeros and the padding ids are 0. Default: every token is real."""
        top = self.longest or self.max_length
        if self.has_length and not (self.min_length <= length <= top and length % self.variable_axis_multiple == 0):
            raise ValueError(f"{self.name}: length {length} is not valid (min {self.min_length}, max "
                             f"{top}, multiple of {self.variable_axis_multiple})")
        assert self._make is not None
        feeds = self._make(rng, batch, length)
        if valid is not None:
            if "attention_mask" not in feeds:
                raise ValueError(f"{self.name} has no attention_mask to pad with")
            if len(valid) != batch:
                raise ValueError("one valid length per row")
            for row, n in enumerate(valid):
                feeds["attention_mask"][row, n:] = 0
                feeds["input_ids"][row, n:] = 0
        return feeds


# ---------------------------------------------------------------------------------------------
# export helpers


def _export(module, args: tuple, path: Path, opset: int, input_names: list[str], output_names: list[str],
            dynamic_axes: dict | None) -> None:
    import torch

    module.eval()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, str(path), input_names=input_names, output_names=output_names,
                          dynamic_axes=dynamic_axes, opset_version=opset, dynamo=False)


def _shape(vi: onnx.ValueInfoProto) -> tuple:
    out = []
    for d in vi.type.tensor_type.shape.dim:
        out.append(d.dim_param if d.HasField("dim_param") else d.dim_value if d.HasField("dim_value") else None)
    return tuple(out)


def _rename_dims(path: Path, renames: dict[str, str]) -> None:
    """Rename dim_params everywhere in the graph (inputs, outputs, value_info), as another exporter
    would have named them."""
    model = onnx.load(str(path))
    g = model.graph
    for vi in [*g.input, *g.output, *g.value_info]:
        for d in vi.type.tensor_type.shape.dim:
            if d.HasField("dim_param") and d.dim_param in renames:
                d.dim_param = renames[d.dim_param]
    onnx.save(model, str(path))


def _unname_batch(path: Path) -> None:
    """Make dim 0 of every graph input and output dynamic with neither a name nor a value (what
    some exporters leave for a -1 / unknown batch dim)."""
    model = onnx.load(str(path))
    g = model.graph
    for vi in [*g.input, *g.output]:
        vi.type.tensor_type.shape.dim[0].Clear()
    onnx.save(model, str(path))


def _text_inputs(vocab: int, with_mask: bool) -> InputMaker:
    def make(rng: np.random.Generator, batch: int, length: int) -> dict[str, np.ndarray]:
        feeds = {"input_ids": rng.integers(0, vocab, size=(batch, length), dtype=np.int64)}
        if with_mask:
            feeds["attention_mask"] = np.ones((batch, length), dtype=np.int64)
        return feeds
    return make


def _float_inputs(name: str, shape_of: Callable[[int, int], tuple]) -> InputMaker:
    def make(rng: np.random.Generator, batch: int, length: int) -> dict[str, np.ndarray]:
        return {name: rng.standard_normal(shape_of(batch, length)).astype(np.float32)}
    return make


# ---------------------------------------------------------------------------------------------
# the models; each builder writes `path` and returns its CorpusModel (shapes filled in later)


def _hf_wrapper(model, with_mask: bool):
    import torch

    class TextModel(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask=None):
            kwargs = {"input_ids": input_ids}
            if with_mask:
                kwargs["attention_mask"] = attention_mask
            out = self.inner(**kwargs, use_cache=False) if "GPT2" in type(self.inner).__name__ else self.inner(**kwargs)
            if getattr(out, "pooler_output", None) is not None:
                return out.last_hidden_state, out.pooler_output
            return out.last_hidden_state

    return TextModel(model)


def _bert(path: Path) -> CorpusModel:
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(SEED)
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64)
    model = _hf_wrapper(BertModel(config).eval(), with_mask=True)
    ids = torch.randint(0, 100, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    axes = {0: "batch_size", 1: "sequence_length"}
    _export(model, (ids, mask), path, 14, ["input_ids", "attention_mask"], ["last_hidden_state", "pooler_output"],
            {"input_ids": axes, "attention_mask": axes})
    return CorpusModel("bert", path, "text", 14, max_length=64, int_high={"input_ids": 100, "attention_mask": 2},
                       min_length=1, pad_safe_expected=True,
                       notes="transformers BertModel (vocab 100, hidden 32, 2 layers, 2 heads, 64 positions); "
                             "masked padding leaves the real tokens' outputs and pooler_output alone",
                       _make=_text_inputs(100, with_mask=True))


def _gpt2(path: Path) -> CorpusModel:
    import torch
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(SEED)
    config = GPT2Config(vocab_size=100, n_positions=64, n_embd=32, n_layer=2, n_head=2, use_cache=False,
                        bos_token_id=99, eos_token_id=99)
    model = _hf_wrapper(GPT2Model(config).eval(), with_mask=True)
    ids = torch.randint(0, 100, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    axes = {0: "N", 1: "T"}
    _export(model, (ids, mask), path, 17, ["input_ids", "attention_mask"], ["last_hidden_state"],
            {"input_ids": axes, "attention_mask": axes, "last_hidden_state": axes})
    return CorpusModel("gpt2", path, "text", 17, max_length=64, int_high={"input_ids": 100, "attention_mask": 2},
                       min_length=1, pad_safe_expected=True,
                       notes="transformers GPT2Model (vocab 100, n_embd 32, 2 layers, 64 positions), use_cache=False; "
                             "causal attention: right padding leaves the real tokens alone",
                       _make=_text_inputs(100, with_mask=True))


def _vit(path: Path) -> CorpusModel:
    import torch
    from transformers import ViTConfig, ViTModel

    torch.manual_seed(SEED)
    config = ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2,
                       num_attention_heads=2, intermediate_size=64)
    vit = ViTModel(config, add_pooling_layer=False).eval()

    class ImageModel(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, pixel_values):
            return self.inner(pixel_values=pixel_values).last_hidden_state

    pixels = torch.randn(2, 3, 32, 32)
    # opset 13 fails: "Exporting the operator 'aten::scaled_dot_product_attention' to ONNX opset
    # version 13 is not supported" (ViT's default attention is SDPA); 14 is the lowest that exports.
    _export(ImageModel(vit), (pixels,), path, 14, ["pixel_values"], ["last_hidden_state"],
            {"pixel_values": {0: "batch"}})
    _unname_batch(path)
    return CorpusModel("vit", path, "image", 14, max_length=0,
                       notes="transformers ViTModel (32x32, patch 8, hidden 32, 2 layers), no pooler; the batch dim "
                             "of input and output is dynamic with neither dim_param nor dim_value; opset 14, "
                             "the lowest it exports with (SDPA attention)",
                       _make=_float_inputs("pixel_values", lambda b, n: (b, 3, 32, 32)))


def _resnet_module():
    import torch
    from torch import nn

    class BasicBlock(nn.Module):
        expansion = 1

        def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
            super().__init__()
            self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(planes)
            self.relu = nn.ReLU(inplace=True)
            self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(planes)
            self.downsample = downsample

        def forward(self, x):
            identity = x
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.bn2(self.conv2(out))
            if self.downsample is not None:
                identity = self.downsample(x)
            return self.relu(out + identity)

    class ResNet(nn.Module):
        """torchvision's resnet18 layout, narrow (widths 8/16/32/64)."""

        def __init__(self, layers=(2, 2, 2, 2), widths=(8, 16, 32, 64), num_classes: int = 10):
            super().__init__()
            self.inplanes = widths[0]
            self.conv1 = nn.Conv2d(3, self.inplanes, 7, 2, 3, bias=False)
            self.bn1 = nn.BatchNorm2d(self.inplanes)
            self.relu = nn.ReLU(inplace=True)
            self.maxpool = nn.MaxPool2d(3, 2, 1)
            self.layer1 = self._make_layer(widths[0], layers[0])
            self.layer2 = self._make_layer(widths[1], layers[1], 2)
            self.layer3 = self._make_layer(widths[2], layers[2], 2)
            self.layer4 = self._make_layer(widths[3], layers[3], 2)
            self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
            self.fc = nn.Linear(widths[3], num_classes)
            for m in self.modules():
                if isinstance(m, nn.BatchNorm2d):  # non-trivial running statistics
                    m.running_mean.uniform_(-0.1, 0.1)
                    m.running_var.uniform_(0.5, 1.5)

        def _make_layer(self, planes: int, blocks: int, stride: int = 1):
            downsample = None
            if stride != 1 or self.inplanes != planes:
                downsample = nn.Sequential(nn.Conv2d(self.inplanes, planes, 1, stride, bias=False),
                                           nn.BatchNorm2d(planes))
            layers = [BasicBlock(self.inplanes, planes, stride, downsample)]
            self.inplanes = planes
            layers += [BasicBlock(planes, planes) for _ in range(1, blocks)]
            return nn.Sequential(*layers)

        def forward(self, x):
            x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
            x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
            return self.fc(torch.flatten(self.avgpool(x), 1))

    return ResNet()


def _resnet(path: Path) -> CorpusModel:
    import torch

    torch.manual_seed(SEED)
    model = _resnet_module().eval()
    opset = 18  # the TorchScript exporter goes up to 20
    _export(model, (torch.randn(2, 3, 32, 32),), path, opset, ["input"], ["output"],
            {"input": {0: "batch_size"}, "output": {0: "batch_size"}})
    _rename_dims(path, {"batch_size": "unk__214"})
    return CorpusModel("resnet18", path, "image", opset, max_length=0,
                       notes="torchvision-style resnet18 in plain torch (BasicBlock x [2,2,2,2], widths 8/16/32/64), "
                             "3x32x32, BatchNorm in eval mode; batch dim renamed unk__214 (tf2onnx style)",
                       _make=_float_inputs("input", lambda b, n: (b, 3, 32, 32)))


def _crnn(path: Path) -> CorpusModel:
    import torch
    from torch import nn

    class CRNN(nn.Module):
        """Conv features over a [N, 1, 32, W] text line, width / 4 time steps, a bidirectional LSTM
        over time (time-major, as the RNN exports), per-step class scores [T, N, classes]."""

        def __init__(self, num_classes: int = 37, hidden: int = 32):
            super().__init__()
            self.cnn = nn.Sequential(
                nn.Conv2d(1, 16, 3, 1, 1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2, 2),  # 16 x W/2
                nn.Conv2d(16, 32, 3, 1, 1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2, 2),  # 8 x W/4
                nn.Conv2d(32, 32, 3, 1, 1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d((8, 1), (8, 1)),  # 1 x W/4
            )
            self.rnn = nn.LSTM(32, hidden, num_layers=1, bidirectional=True)
            self.fc = nn.Linear(2 * hidden, num_classes)

        def forward(self, x):
            f = self.cnn(x).squeeze(2)  # [N, C, T]
            f = f.permute(2, 0, 1)  # [T, N, C]
            out, _ = self.rnn(f)  # [T, N, 2H]
            return self.fc(out).softmax(-1)  # [T, N, classes]

    torch.manual_seed(SEED)
    model = CRNN().eval()
    x = torch.randn(2, 1, 32, 64)
    _export(model, (x,), path, 15, ["x"], ["softmax_0.tmp_0"],
            {"x": {0: "batch", 3: "width"}, "softmax_0.tmp_0": {0: "time", 1: "batch"}})
    _rename_dims(path, {"batch": "p2o.DynamicDimension.0", "width": "p2o.DynamicDimension.1",
                        "time": "p2o.DynamicDimension.2"})
    return CorpusModel("crnn", path, "variable_width", 15, max_length=128, min_length=4, longest=1024,
                       pad_safe_expected=False,
                       notes="CRNN: 3 conv blocks, width pooled by 4 (floor: T = W // 4; under 4 the output is empty), "
                             "bidirectional LSTM, TIME-MAJOR output [T, N, 37]; dims renamed paddle2onnx style "
                             "(p2o.DynamicDimension.0 batch, .1 width, .2 time); zero padding of the width changes "
                             "every step (the backward LSTM reads it)",
                       _make=_float_inputs("x", lambda b, w: (b, 1, 32, w)))


def _yolo(path: Path) -> CorpusModel:
    import torch
    from torch import nn

    class TinyDetector(nn.Module):
        """Five stride-2 convs over [N, 3, 32, W]; a detect head reshaped by W // 32 with a W // 32
        grid added (as YOLO's Detect does with the grid it computes): a width that is not a multiple
        of 32 fails (W = 100: 3 grid cells, 4 feature cells) or gives a wrong-sized answer (W = 48)."""

        def __init__(self, anchors: int = 3, no: int = 6):
            super().__init__()
            chans = [3, 8, 16, 32, 32, 64]
            layers = []
            for cin, cout in zip(chans, chans[1:]):
                layers += [nn.Conv2d(cin, cout, 3, 2, 1), nn.BatchNorm2d(cout), nn.SiLU()]
            self.backbone = nn.Sequential(*layers)
            self.head = nn.Conv2d(64, anchors * no, 1)
            self.na, self.no = anchors, no

        def forward(self, images):
            bs = images.shape[0]
            nx = images.shape[3] // 32
            p = self.head(self.backbone(images))  # [N, na*no, 1, ceil(W/32)]
            p = p.view(bs, self.na, self.no, nx).permute(0, 1, 3, 2).sigmoid()  # [N, na, nx, no]
            grid = torch.arange(nx, dtype=p.dtype).view(1, 1, nx, 1)
            xy = (p[..., 0:1] * 2 - 0.5 + grid) * 32
            return torch.cat([xy, p[..., 1:]], -1)  # [N, na, W/32, 6]

    torch.manual_seed(SEED)
    model = TinyDetector().eval()
    _export(model, (torch.randn(2, 3, 32, 64),), path, 17, ["images"], ["output0"],
            {"images": {0: "batch", 3: "width"}, "output0": {0: "batch"}})
    return CorpusModel("yolo", path, "variable_width", 17, max_length=256, variable_axis_multiple=32, min_length=32,
                       longest=1024,
                       pad_safe_expected=None,
                       notes="YOLO-like: 5 stride-2 convs over [N, 3, 32, W], W a multiple of 32 (the head reshapes "
                             "by W // 32 and adds a W // 32 grid: W = 100 fails in the grid Add, W = 48 runs but gives "
                             "ceil(W/32) = 2 cells); output [N, 3, W/32, 6]",
                       _make=_float_inputs("images", lambda b, w: (b, 3, 32, w)))


def _conv_mean(path: Path) -> CorpusModel:
    import torch
    from torch import nn

    class ConvMean(nn.Module):
        """1-D conv (kernel 3, padding 1) over [N, L, C], no mask, global mean over L: zero padding
        changes the answer (the mean divides by the padded length; the conv sees the zeros)."""

        def __init__(self, channels: int = 16, hidden: int = 32, out: int = 8):
            super().__init__()
            self.conv = nn.Conv1d(channels, hidden, 3, padding=1)
            self.fc = nn.Linear(hidden, out)

        def forward(self, x):
            h = torch.relu(self.conv(x.transpose(1, 2)))  # [N, hidden, L]
            return self.fc(h.mean(dim=2))  # [N, out]

    torch.manual_seed(SEED)
    model = ConvMean().eval()
    _export(model, (torch.randn(2, 10, 16),), path, 17, ["x"], ["y"],
            {"x": {0: "batch", 1: "len"}, "y": {0: "batch"}})
    return CorpusModel("conv_mean", path, "sequence", 17, max_length=128, min_length=1, longest=1024,
                       pad_safe_expected=False,
                       notes="pad-UNSAFE: Conv1d(k3, p1) over [N, L, 16] without a mask, then a mean over L; "
                             "output [N, 8]",
                       _make=_float_inputs("x", lambda b, n: (b, n, 16)))


def _yolov8(path: Path) -> CorpusModel:
    import torch
    from torch import nn

    class MultiScaleDetector(nn.Module):
        """YOLOv8's head in small: stride-2 convs (k3, p1: ceil(W/2) each) over a letterboxed
        [N, 3, 64, W]; three scales (strides 8, 16, 32) each give [N, 4 + classes, h*w], and the
        grid of cell centres of each is made from its own feature map's shape (ultralytics'
        `make_anchors`), so any width runs. The anchor dim of the output is 8*w8 + 4*w16 + 2*w32, a
        sum of three nested ceilings of the width."""

        def __init__(self, classes: int = 3):
            super().__init__()
            chans = [3, 8, 16, 16, 32, 32]
            self.down = nn.ModuleList(nn.Sequential(nn.Conv2d(a, b, 3, 2, 1), nn.SiLU()) for a, b in zip(chans, chans[1:]))
            self.heads = nn.ModuleList(nn.Conv2d(c, 4 + classes, 1) for c in chans[3:])
            self.strides = (8, 16, 32)

        def forward(self, images):
            x, feats = images, []
            for i, block in enumerate(self.down):
                x = block(x)
                if i >= 2:
                    feats.append(x)
            boxes, points = [], []
            for head, feat, stride in zip(self.heads, feats, self.strides):
                p = head(feat)
                h, w = feat.shape[2], feat.shape[3]
                sy = torch.arange(h, dtype=p.dtype) + 0.5
                sx = torch.arange(w, dtype=p.dtype) + 0.5
                gy, gx = torch.meshgrid(sy, sx, indexing="ij")
                points.append(torch.stack((gx, gy), 0).view(1, 2, -1) * stride)
                boxes.append(p.flatten(2))
            out = torch.cat(boxes, 2)  # [N, 4 + classes, anchors]
            anchors = torch.cat(points, 2)  # [1, 2, anchors]
            xy = out[:, :2] * 4 + anchors
            return torch.cat([xy, out[:, 2:4].exp(), out[:, 4:].sigmoid()], 1)

    torch.manual_seed(SEED)
    model = MultiScaleDetector().eval()
    _export(model, (torch.randn(1, 3, 64, 96),), path, 17, ["images"], ["output0"],
            {"images": {0: "batch", 3: "width"}, "output0": {0: "batch", 2: "anchors"}})
    return CorpusModel("yolov8", path, "variable_width", 17, max_length=256, min_length=1, longest=1024,
                       pad_safe_expected=False,
                       notes="YOLOv8-style multi-scale head over a letterboxed [N, 3, 64, W]: three strides "
                             "concatenated, grids from each feature map's shape; any width; output [N, 7, anchors], "
                             "anchors = 8*ceil(W/8) + 4*ceil(W/16) + 2*ceil(W/32) (nested ceilings)",
                       _make=_float_inputs("images", lambda b, w: (b, 3, 64, w)))


def _ctc(path: Path) -> CorpusModel:
    import torch
    from torch import nn

    class CtcRecognizer(nn.Module):
        """A captcha recognizer for CTC decoding: odd-size convs and pools over [N, 1, 32, W] (any
        width from 9), T = floor((floor((W - 2 - 3) / 2) + 1 - 2) / 2) + 1 steps, batch-first
        log-probabilities [N, T, classes]."""

        def __init__(self, classes: int = 20):
            super().__init__()
            self.cnn = nn.Sequential(
                nn.Conv2d(1, 8, (3, 3)), nn.ReLU(),  # 30 x W-2
                nn.MaxPool2d((2, 3), (2, 2)),  # 15 x floor((W-5)/2)+1
                nn.Conv2d(8, 16, (3, 3), padding=(1, 0)), nn.ReLU(),  # 15 x that - 2
                nn.MaxPool2d((15, 1), (1, 2), ceil_mode=False),  # 1 x floor((that-2-1)/2)+1
            )
            self.fc = nn.Linear(16, classes)

        def forward(self, image):
            f = self.cnn(image).squeeze(2).transpose(1, 2)  # [N, T, 16]
            return self.fc(f).log_softmax(-1)

    torch.manual_seed(SEED)
    model = CtcRecognizer().eval()
    _export(model, (torch.randn(2, 1, 32, 100),), path, 13, ["image"], ["logits"],
            {"image": {0: "N", 3: "image_width"}, "logits": {0: "N", 1: "T"}})
    return CorpusModel("ctc", path, "variable_width", 13, max_length=256, min_length=9, longest=1024,
                       pad_safe_expected=None,
                       notes="CTC recognizer: odd convs and pools, any width >= 9; batch-first [N, T, 20] with T "
                             "a nested floor of the width",
                       _make=_float_inputs("image", lambda b, w: (b, 1, 32, w)))


def _upsample(path: Path) -> CorpusModel:
    import torch
    from torch import nn

    class Segmenter(nn.Module):
        """An encoder-decoder over [N, 3, 32, W]: two stride-2 convs (ceil(W/2), then ceil of that
        halved), decoded by `nn.Upsample(scale_factor=2)` twice, exported as `Resize` by scales:
        the output width is 4 * ceil(ceil(W/2)/2)."""

        def __init__(self, classes: int = 4):
            super().__init__()
            self.enc = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), nn.ReLU(), nn.Conv2d(8, 16, 3, 2, 1), nn.ReLU())
            self.dec = nn.Sequential(nn.Upsample(scale_factor=2.0, mode="nearest"), nn.Conv2d(16, 8, 3, 1, 1),
                                     nn.ReLU(), nn.Upsample(scale_factor=2.0, mode="nearest"),
                                     nn.Conv2d(8, classes, 1))

        def forward(self, image):
            return self.dec(self.enc(image))

    torch.manual_seed(SEED)
    model = Segmenter().eval()
    _export(model, (torch.randn(2, 3, 32, 40),), path, 13, ["image"], ["masks"],
            {"image": {0: "batch", 3: "width"}, "masks": {0: "batch", 3: "out_width"}})
    return CorpusModel("upsample", path, "variable_width", 13, max_length=256, min_length=1, longest=1024,
                       pad_safe_expected=None,
                       notes="segmenter decoded by Resize with scales (nn.Upsample x2, twice); output "
                             "[N, 4, 32, 4*ceil(ceil(W/2)/2)]",
                       _make=_float_inputs("image", lambda b, w: (b, 3, 32, w)))


def _ctc_fp16(path: Path) -> CorpusModel:
    from onnxconverter_common.float16 import convert_float_to_float16

    source = path.with_name(f"{path.stem}_fp32.onnx")
    fp32 = _ctc(source)
    half = convert_float_to_float16(onnx.load(str(source)), keep_io_types=False)
    onnx.save(half, str(path))

    def make(rng: np.random.Generator, batch: int, width: int) -> dict[str, np.ndarray]:
        return {"image": rng.standard_normal((batch, 1, 32, width)).astype(np.float16)}

    return replace(fp32, name="ctc_fp16", path=path, _make=make,
                   notes="the CTC recognizer converted with onnxconverter-common's convert_float_to_float16 "
                         "(float16 inputs, weights and outputs), as `--fp16` export scripts do")



def _ctc_external(path: Path) -> CorpusModel:
    """The CTC recognizer saved with its weights in an external data file, as every model over 2 GB
    must be (and many exporters do for smaller ones)."""
    source = path.with_name(f"{path.stem}_inline.onnx")
    inline = _ctc(source)
    onnx.save_model(onnx.load(str(source)), str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=f"{path.stem}.weights", size_threshold=256)
    return replace(inline, name="ctc_external", path=path,
                   notes="the CTC recognizer with its weights in an external data file")

BUILDERS: dict[str, Callable[[Path], CorpusModel]] = {
    "bert": _bert,
    "gpt2": _gpt2,
    "vit": _vit,
    "resnet18": _resnet,
    "crnn": _crnn,
    "yolo": _yolo,
    "conv_mean": _conv_mean,
    "yolov8": _yolov8,
    "ctc": _ctc,
    "upsample": _upsample,
    "ctc_fp16": _ctc_fp16,
    "ctc_external": _ctc_external,
}
NAMES = tuple(BUILDERS)

_cache: dict[Path, dict[str, CorpusModel]] = {}
_lock = threading.Lock()


def build_corpus(out_dir: Path, names: Sequence[str] | None = None) -> dict[str, CorpusModel]:
    """Export the named models (default: all) into `out_dir` as `<name>.onnx`; each file is built
    once per out_dir in this process (later calls return the same CorpusModel objects)."""
    out_dir = Path(out_dir).resolve()
    wanted = list(NAMES if names is None else names)
    unknown = [n for n in wanted if n not in BUILDERS]
    if unknown:
        raise KeyError(f"no corpus model {unknown}; known: {list(NAMES)}")
    with _lock:
        built = _cache.setdefault(out_dir, {})
        for name in wanted:
            if name not in built:
                out_dir.mkdir(parents=True, exist_ok=True)
                path = out_dir / f"{name}.onnx"
                m = BUILDERS[name](path)
                loaded = onnx.load(str(path))
                onnx.checker.check_model(loaded)
                m.inputs = {vi.name: _shape(vi) for vi in loaded.graph.input}
                m.outputs = {vi.name: _shape(vi) for vi in loaded.graph.output}
                built[name] = m
        return {n: built[n] for n in wanted}


# ---------------------------------------------------------------------------------------------
# checks


def session(m: CorpusModel):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(str(m.path), opts, providers=["CPUExecutionProvider"])


def check_lengths(m: CorpusModel) -> list[int]:
    """Two valid lengths (the smallest valid one above the minimum, and a larger one); [0] for fixed shapes."""
    lengths = m.valid_lengths()
    if not lengths:
        return [0]
    return [lengths[min(1, len(lengths) - 1)], lengths[len(lengths) // 2]]


def check_model(m: CorpusModel, batches: Sequence[int] = (1, 3), lengths: Sequence[int] | None = None,
                seed: int = 0) -> dict[tuple[int, int], dict[str, tuple[int, ...]]]:
    """Run the model in onnxruntime (CPU) at each batch size x length; (batch, length) -> output shapes."""
    sess = session(m)
    rng = np.random.default_rng(seed)
    names = [o.name for o in sess.get_outputs()]
    shapes = {}
    for batch in batches:
        for length in (lengths if lengths is not None else check_lengths(m)):
            outs = sess.run(None, m.make_inputs(rng, batch, length))
            for o in outs:
                if not np.all(np.isfinite(o)):
                    raise AssertionError(f"{m.name}: non-finite output at batch {batch}, length {length}")
            shapes[(batch, length)] = {n: tuple(o.shape) for n, o in zip(names, outs)}
    return shapes


def pad_difference(m: CorpusModel, length: int, padded: int, batch: int = 2, seed: int = 0) -> float:
    """Largest |difference| between the outputs at `length` and at `padded` (the same rows padded:
    a masked tail of id 0 for text models, zeros for the others), compared over the valid part
    (output axes whose size changes with the length are cut back to their size at `length`)."""
    sess = session(m)
    feeds = m.make_inputs(np.random.default_rng(seed), batch, length)
    if "attention_mask" in feeds:
        long = m.make_inputs(np.random.default_rng(seed), batch, padded, valid=[length] * batch)
        long["input_ids"][:, :length] = feeds["input_ids"]
    else:
        (name, x), = feeds.items()
        axis = next(i for i, d in enumerate(m.inputs[name]) if not isinstance(d, int) and i > 0)
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, padded - length)
        long = {name: np.pad(x, pad)}
    worst = 0.0
    for a, b in zip(sess.run(None, feeds), sess.run(None, long)):
        cut = tuple(slice(0, sa) for sa in a.shape)
        worst = max(worst, float(np.max(np.abs(a - b[cut]))) if a.size else 0.0)
    return worst


def dim_names(m: CorpusModel) -> dict[str, tuple]:
    """Input and output name -> shape as exported (dim_param string, dim_value int, or None)."""
    return {**m.inputs, **m.outputs}


if __name__ == "__main__":  # quick look: python -m tests.slicer.corpus [out_dir]
    import sys
    import tempfile
    import time

    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="corpus."))
    for name in NAMES:
        t = time.perf_counter()
        m = build_corpus(out, [name])[name]
        built = time.perf_counter() - t
        nodes = len(onnx.load(str(m.path)).graph.node)
        print(f"{name}: opset {m.opset}, {nodes} nodes, built in {built:.1f} s; {dim_names(m)}")
        print(f"   {check_model(m)}")
        if m.pad_safe_expected is not None:
            ls = m.valid_lengths()
            print(f"   pad difference {pad_difference(m, ls[1], ls[2]):.2e} (expected safe: {m.pad_safe_expected})")
