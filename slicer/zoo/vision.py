"""Convolutional vision models built from seeded weights: ResNet-152, VGG-19, U-Net, LinkNet.

Every model is in inference form, takes ``image`` float32 [batch, 3, size, size] (``size``
fixed per model instance, ``batch`` a dim_param) and scales with ``width``, its base channel
count (64 in the papers).

Weights: every Conv and ConvTranspose draws He-style weights (std ``sqrt(2 / fan_in)``) and
then has a BatchNorm folded into it, as exported inference models do. While the graph is
built, each layer runs (in onnxruntime) on a seeded calibration batch of standard-normal
images (``CALIBRATION_PIXELS`` pixels, 2 to 16 images), and its weights and bias are set so
that each output channel has mean ``beta`` (noise of std ``BIAS_STD``) and std ``gamma`` on
that batch. ``gamma`` is 1, except for the last conv of every residual branch
(``RESIDUAL_SCALE``), so 50 stacked bottlenecks neither explode nor vanish. A channel's
variance is pooled with the layer's (weight ``CALIBRATION_PRIOR`` samples) where it has few
samples (1x1 maps). FC layers (Gemm) have no BatchNorm, as in the papers: He-style weights
divided by the root mean square of their input on the calibration batch, bias noise of std
``BIAS_STD``. So activations stay O(1) at any depth, width and ``size``, and every Relu
channel is about half active: no dead channels and no input-independent outputs, even at
width 4. Building a model costs about one forward pass of the calibration batch; the
weights are a function of the seed, up to float rounding in onnxruntime's kernels.

Block outputs have fixed names, the natural cut points for ``slicer.cut.cut_positions_after``:
``block{k}`` (ResNet), ``conv{k}``/``fc{k}`` (VGG), ``enc{i}``/``bottleneck``/``dec{i}`` (U-Net)
and ``enc{i}``/``dec{i}`` (LinkNet); node and weight names start with their block's name
(``block7_conv2``, ``block7_add_relu``, ``block7_conv2_w``, ...).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from slicer.zoo.graph import IR_VERSION, OPSET, GraphBuilder

RESIDUAL_SCALE = 0.2
BIAS_STD = 0.05
CALIBRATION_PIXELS = 256 * 256  # the calibration batch holds about this many pixels ...
CALIBRATION_BATCH = (2, 16)  # ... in this many images at least and at most
CALIBRATION_PRIOR = 16.0
IMAGE = "image"


@dataclass(frozen=True)
class _Feat:
    """A feature map in the graph: tensor name, channels, spatial side (maps are square) and
    its value on the calibration batch."""

    name: str
    ch: int
    hw: int
    value: np.ndarray = field(repr=False, compare=False)


def _check_positive(**values: int) -> None:
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{key} must be a positive int, got {value!r}")


def _run_node(op: str, inputs: list[np.ndarray], **attrs: object) -> np.ndarray:
    """Run one ONNX node on numpy inputs in onnxruntime."""
    names = [f"in{i}" for i in range(len(inputs))]
    graph = helper.make_graph(
        [helper.make_node(op, names, ["out"], **attrs)], "calibrate",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, a.shape) for n, a in zip(names, inputs)],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR_VERSION
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, dict(zip(names, inputs)))[0]


class _Net:
    """GraphBuilder plus the layer vocabulary of the four models, calibrating as it goes."""

    def __init__(self, name: str, seed: int, size: int, **params: int) -> None:
        """`params` (the model's other arguments) go into the model's metadata, with `size` and `seed`."""
        self.b = GraphBuilder(name, seed)
        params = {**params, "size": size, "seed": seed}
        self.b.metadata.update({"zoo.model": name, **{f"zoo.{k}": str(v) for k, v in params.items()}})
        lo, hi = CALIBRATION_BATCH
        n_images = min(max(-(-CALIBRATION_PIXELS // (size * size)), lo), hi)
        calibration = np.random.default_rng([seed, 1]).standard_normal((n_images, 3, size, size))
        self.image = _Feat(self.b.input(IMAGE, TensorProto.FLOAT, ["batch", 3, size, size]), 3, size,
                           calibration.astype(np.float32))

    def _folded(self, op: str, x: _Feat, w_shape: list[int], hint: str, relu: bool, gamma: float,
                out: str | None, **attrs: object) -> _Feat:
        """`op`(x, W, b) (+ Relu): Conv/ConvTranspose with a BatchNorm(gamma, beta ~ N(0, BIAS_STD))
        folded into W and b; Gemm plain, W's std ``sqrt(gain / fan_in)`` over x's root mean square."""
        out_axis = 1 if op == "ConvTranspose" else 0
        ch = w_shape[out_axis]
        fan_in = int(np.prod(w_shape)) // ch
        beta = self.b.rng.standard_normal(ch) * BIAS_STD
        if op == "Gemm":
            rms = np.sqrt(max(float(np.mean(np.square(x.value, dtype=np.float64))), 1e-12))
            std = gamma * np.sqrt((2.0 if relu else 1.0) / fan_in) / rms
            w = self.b.rng.standard_normal(w_shape, dtype=np.float32) * np.float32(std)
            bias = beta.astype(np.float32)
            return self._emit(op, x, w, bias, x.value @ w.T + bias, hint, relu, out, **attrs)
        w = self.b.rng.standard_normal(w_shape, dtype=np.float32) * np.float32(np.sqrt(2.0 / fan_in))
        z = _run_node(op, [x.value, w], **attrs)
        stat_axes = tuple(i for i in range(z.ndim) if i != 1)
        n = z.size / ch
        mean, var = z.mean(axis=stat_axes, dtype=np.float64), z.var(axis=stat_axes, dtype=np.float64)
        var = (n * var + CALIBRATION_PRIOR * var.mean()) / (n + CALIBRATION_PRIOR) + 1e-6 * var.mean() + 1e-12
        g = gamma / np.sqrt(var)
        w = (w * g.reshape([-1 if i == out_axis else 1 for i in range(w.ndim)])).astype(np.float32)
        bias = (beta - mean * g).astype(np.float32)
        bshape = [-1 if i == 1 else 1 for i in range(z.ndim)]
        value = ((z - mean.reshape(bshape)) * g.reshape(bshape) + beta.reshape(bshape)).astype(np.float32)
        return self._emit(op, x, w, bias, value, hint, relu, out, **attrs)

    def _emit(self, op: str, x: _Feat, w: np.ndarray, bias: np.ndarray, value: np.ndarray, hint: str,
              relu: bool, out: str | None, **attrs: object) -> _Feat:
        """Add the node `op`(x, w, bias) (+ Relu) whose output on the calibration batch is `value`."""
        inputs = [x.name, self.b.const(w, f"{hint}_w"), self.b.const(bias, f"{hint}_b")]
        y = self.b.op(op, inputs, hint, out=None if relu else out, **attrs)
        if relu:
            y = self.b.op("Relu", [y], f"{hint}_relu", out=out)
            value = np.maximum(value, 0.0)
        return _Feat(y, value.shape[1], value.shape[-1] if value.ndim == 4 else 1, value)

    def conv(self, x: _Feat, ch: int, k: int, hint: str, stride: int = 1, pad: int | None = None,
             relu: bool = True, gamma: float = 1.0, out: str | None = None) -> _Feat:
        """Conv k x k (+ Relu); `out` names the last tensor of the two."""
        pad = k // 2 if pad is None else pad
        return self._folded("Conv", x, [ch, x.ch, k, k], hint, relu, gamma, out,
                            kernel_shape=[k, k], strides=[stride, stride], pads=[pad] * 4)

    def deconv(self, x: _Feat, ch: int, k: int, stride: int, hint: str, pad: int = 0, out_pad: int = 0,
               relu: bool = False, out: str | None = None) -> _Feat:
        """ConvTranspose k x k, stride `stride` (+ Relu)."""
        attrs: dict[str, object] = {"kernel_shape": [k, k], "strides": [stride, stride], "pads": [pad] * 4}
        if out_pad:
            attrs["output_padding"] = [out_pad, out_pad]
        return self._folded("ConvTranspose", x, [x.ch, ch, k, k], hint, relu, 1.0, out, **attrs)

    def gemm(self, x: _Feat, n_out: int, hint: str, relu: bool, out: str | None = None) -> _Feat:
        """Fully connected layer on a flat [batch, x.ch] tensor (+ Relu)."""
        return self._folded("Gemm", x, [n_out, x.ch], hint, relu, 1.0, out, transB=1)

    def maxpool(self, x: _Feat, k: int, stride: int, hint: str, pad: int = 0) -> _Feat:
        attrs: dict[str, object] = {"kernel_shape": [k, k], "strides": [stride, stride]}
        if pad:
            attrs["pads"] = [pad] * 4
        value = _run_node("MaxPool", [x.value], **attrs)
        return _Feat(self.b.op("MaxPool", [x.name], hint, **attrs), x.ch, value.shape[-1], value)

    def add(self, x: _Feat, y: _Feat, hint: str, relu: bool = False, out: str | None = None) -> _Feat:
        """x + y (+ Relu)."""
        if (x.ch, x.hw) != (y.ch, y.hw):
            raise AssertionError(f"{hint}: adding {x} to {y}")
        s = self.b.op("Add", [x.name, y.name], hint, out=None if relu else out)
        value = x.value + y.value
        if relu:
            s = self.b.op("Relu", [s], f"{hint}_relu", out=out)
            value = np.maximum(value, 0.0)
        return _Feat(s, x.ch, x.hw, value)

    def concat(self, xs: list[_Feat], hint: str) -> _Feat:
        if len({x.hw for x in xs}) != 1:
            raise AssertionError(f"{hint}: concatenating maps of different sizes {xs}")
        value = np.concatenate([x.value for x in xs], axis=1)
        return _Feat(self.b.op("Concat", [x.name for x in xs], hint, axis=1), value.shape[1], xs[0].hw, value)

    def global_avgpool(self, x: _Feat, hint: str) -> _Feat:
        """[batch, C, H, W] -> [batch, C, 1, 1]."""
        value = x.value.mean(axis=(2, 3), keepdims=True)
        return _Feat(self.b.op("GlobalAveragePool", [x.name], hint), x.ch, 1, value)

    def flatten(self, x: _Feat, hint: str) -> _Feat:
        """[batch, C, H, W] -> [batch, C*H*W]."""
        value = x.value.reshape(x.value.shape[0], -1)
        return _Feat(self.b.op("Flatten", [x.name], hint, axis=1), value.shape[1], 1, value)

    def finish(self, out_name: str, dims: list[int | str]) -> onnx.ModelProto:
        self.b.output(out_name, TensorProto.FLOAT, dims)
        return self.b.model()


# --- ResNet ------------------------------------------------------------------------------


def _resnet_bottleneck(net: _Net, x: _Feat, mid: int, stride: int, k: int) -> _Feat:
    """ResNet v1.5 bottleneck (stride on the 3x3), expansion 4; output tensor ``block{k}``."""
    p = f"block{k}"
    h = net.conv(x, mid, 1, f"{p}_conv1")
    h = net.conv(h, mid, 3, f"{p}_conv2", stride=stride)
    h = net.conv(h, 4 * mid, 1, f"{p}_conv3", relu=False, gamma=RESIDUAL_SCALE)
    if stride != 1 or x.ch != 4 * mid:
        x = net.conv(x, 4 * mid, 1, f"{p}_proj", stride=stride, relu=False)
    return net.add(h, x, f"{p}_add", relu=True, out=p)


def _resnet(name: str, stages: tuple[int, ...], width: int, size: int, classes: int, seed: int) -> onnx.ModelProto:
    _check_positive(width=width, size=size, classes=classes)
    net = _Net(name, seed, size, width=width, classes=classes)
    x = net.conv(net.image, width, 7, "stem_conv", stride=2, pad=3)
    x = net.maxpool(x, 3, 2, "stem_maxpool", pad=1)
    k = 0
    for s, n_blocks in enumerate(stages):
        for j in range(n_blocks):
            x = _resnet_bottleneck(net, x, width << s, 2 if (j == 0 and s > 0) else 1, k)
            k += 1
    pooled = net.global_avgpool(x, "head_avgpool")
    net.gemm(net.flatten(pooled, "head_flatten"), classes, "head_fc", relu=False, out="logits")
    return net.finish("logits", ["batch", classes])


def resnet152(width: int = 64, size: int = 224, classes: int = 1000, seed: int = 0) -> onnx.ModelProto:
    """ResNet-152 (v1.5): image [batch, 3, size, size] -> ``logits`` [batch, classes].

    Stem conv 7x7/2 + maxpool 3x3/2, bottleneck stages of [3, 8, 36, 3] blocks with mid
    channels width * [1, 2, 4, 8], expansion 4, projection shortcuts where the shape changes,
    global average pool, FC. Block k's output (k = 0..49, counting over all stages) is
    tensor ``block{k}``.
    """
    return _resnet("resnet152", (3, 8, 36, 3), width, size, classes, seed)


# --- VGG ---------------------------------------------------------------------------------

_VGG19 = ((1, 1), (2, 2), (4, 4, 4, 4), (8, 8, 8, 8), (8, 8, 8, 8))


def vgg19(width: int = 64, size: int = 224, classes: int = 1000, seed: int = 0) -> onnx.ModelProto:
    """VGG-19: image [batch, 3, size, size] -> ``logits`` [batch, classes]; size divisible by 32.

    16 convs 3x3 + Relu (channels width * 1,1 | 2,2 | 4x4 | 8x4 | 8x4), a 2x2 maxpool after each
    group, then FC(64 * width) Relu, FC(64 * width) Relu, FC(classes). Conv k's Relu output
    (k = 0..15) is tensor ``conv{k}``; the two hidden FC Relu outputs are ``fc0`` and ``fc1``.
    """
    _check_positive(width=width, size=size, classes=classes)
    if size % 32:
        raise ValueError(f"vgg19 needs size divisible by 32 (5 maxpools of stride 2), got size={size}")
    net = _Net("vgg19", seed, size, width=width, classes=classes)
    x, k = net.image, 0
    for g, group in enumerate(_VGG19):
        for mult in group:
            x = net.conv(x, mult * width, 3, f"conv{k}_conv", out=f"conv{k}")
            k += 1
        x = net.maxpool(x, 2, 2, f"pool{g}")
    fc = 64 * width
    h = net.gemm(net.flatten(x, "head_flatten"), fc, "fc0_gemm", relu=True, out="fc0")
    h = net.gemm(h, fc, "fc1_gemm", relu=True, out="fc1")
    net.gemm(h, classes, "fc2_gemm", relu=False, out="logits")
    return net.finish("logits", ["batch", classes])


# --- U-Net -------------------------------------------------------------------------------


def unet(width: int = 64, size: int = 256, classes: int = 2, depth: int = 4, seed: int = 0) -> onnx.ModelProto:
    """U-Net: image [batch, 3, size, size] -> ``mask`` [batch, classes, size, size].

    Encoder level i (i = 0..depth-1): double conv 3x3 + Relu to width * 2**i channels, output
    ``enc{i}``, then maxpool 2x2. ``bottleneck``: double conv to width * 2**depth channels.
    Decoder level i (i = depth-1 down to 0, so in graph order dec{depth-1} comes first):
    ConvTranspose 2x2/2 to width * 2**i channels, Concat with ``enc{i}``, double conv, output
    ``dec{i}`` (same resolution and channels as ``enc{i}``). Then a 1x1 conv to ``mask`` logits.
    size must be divisible by 2**depth.
    """
    _check_positive(width=width, size=size, classes=classes, depth=depth)
    if size % (2 ** depth):
        raise ValueError(f"unet with depth={depth} needs size divisible by 2**depth = {2 ** depth}, got size={size}")
    net = _Net("unet", seed, size, width=width, classes=classes, depth=depth)

    def double_conv(x: _Feat, ch: int, name: str) -> _Feat:
        x = net.conv(x, ch, 3, f"{name}_conv1")
        return net.conv(x, ch, 3, f"{name}_conv2", out=name)

    x, skips = net.image, []
    for i in range(depth):
        skips.append(double_conv(x, width << i, f"enc{i}"))
        x = net.maxpool(skips[-1], 2, 2, f"enc{i}_maxpool")
    x = double_conv(x, width << depth, "bottleneck")
    for i in reversed(range(depth)):
        up = net.deconv(x, width << i, 2, 2, f"dec{i}_up")
        x = double_conv(net.concat([up, skips[i]], f"dec{i}_concat"), width << i, f"dec{i}")
    net.conv(x, classes, 1, "head_conv", relu=False, out="mask")
    return net.finish("mask", ["batch", classes, size, size])


# --- LinkNet -----------------------------------------------------------------------------


def _basic_block(net: _Net, x: _Feat, ch: int, stride: int, name: str, out: str | None) -> _Feat:
    """ResNet basic block: conv 3x3 (stride) Relu, conv 3x3, + shortcut, Relu."""
    h = net.conv(x, ch, 3, f"{name}_conv1", stride=stride)
    h = net.conv(h, ch, 3, f"{name}_conv2", relu=False, gamma=RESIDUAL_SCALE)
    if stride != 1 or x.ch != ch:
        x = net.conv(x, ch, 1, f"{name}_proj", stride=stride, relu=False)
    return net.add(h, x, f"{name}_add", relu=True, out=out)


def _linknet_decoder(net: _Net, x: _Feat, ch: int, name: str, skip: _Feat | None) -> _Feat:
    """LinkNet decoder block: 1x1 conv to in/4, ConvTranspose 3x3/2, 1x1 conv to `ch` (+ skip)."""
    mid = max(1, x.ch // 4)
    h = net.conv(x, mid, 1, f"{name}_reduce")
    # pads 1 and output_padding 1: out = 2 * in exactly
    h = net.deconv(h, mid, 3, 2, f"{name}_up", pad=1, out_pad=1, relu=True)
    if skip is None:
        return net.conv(h, ch, 1, f"{name}_expand", out=name)
    h = net.conv(h, ch, 1, f"{name}_expand")
    return net.add(h, skip, f"{name}_skip", out=name)


def linknet(width: int = 64, size: int = 256, classes: int = 2, seed: int = 0) -> onnx.ModelProto:
    """LinkNet with a ResNet-18-like encoder: image [batch, 3, size, size] -> ``mask`` [batch, classes, size, size].

    Stem conv 7x7/2 + maxpool 3x3/2, then encoder stages i = 0..3 of 2 basic blocks each with
    width * 2**i channels (stage 0 stride 1, the others stride 2), outputs ``enc{i}`` at
    size / 2**(i + 2). Decoder block i (i = 3 down to 0, graph order dec3 first) mirrors
    stage i: 1x1 conv to in/4 channels, ConvTranspose 3x3/2, 1x1 conv to the channels of
    ``enc{i-1}``, plus ``enc{i-1}`` added (no skip for dec0, which keeps width channels);
    output ``dec{i}`` at size / 2**(i + 1). Head: ConvTranspose 3x3/2 to width/2 channels, conv
    3x3, conv 3x3 to ``mask`` logits. size must be divisible by 32.
    """
    _check_positive(width=width, size=size, classes=classes)
    if size % 32:
        raise ValueError(f"linknet needs size divisible by 32 (total stride of its encoder), got size={size}")
    net = _Net("linknet", seed, size, width=width, classes=classes)
    x = net.conv(net.image, width, 7, "stem_conv", stride=2, pad=3)
    x = net.maxpool(x, 3, 2, "stem_maxpool", pad=1)
    encs = []
    for i in range(4):
        x = _basic_block(net, x, width << i, 1 if i == 0 else 2, f"enc{i}_block0", out=None)
        x = _basic_block(net, x, width << i, 1, f"enc{i}_block1", out=f"enc{i}")
        encs.append(x)
    for i in reversed(range(4)):
        skip = encs[i - 1] if i > 0 else None
        x = _linknet_decoder(net, x, skip.ch if skip else width, f"dec{i}", skip)
    half = max(1, width // 2)
    x = net.deconv(x, half, 3, 2, "head_up", pad=1, out_pad=1, relu=True)
    x = net.conv(x, half, 3, "head_conv")
    net.conv(x, classes, 3, "head_out", relu=False, out="mask")
    return net.finish("mask", ["batch", classes, size, size])


VISION_MODELS: dict[str, Callable[..., onnx.ModelProto]] = {
    "resnet152": resnet152,
    "vgg19": vgg19,
    "unet": unet,
    "linknet": linknet,
}
