"""A stage engine on torch: each stage's ONNX graph becomes a torch module at load.

`OnnxTorchModule` holds the stage's initializers as buffers and interprets its nodes in their
(topological) order through one dispatch table, `OPS` (op type -> function of the node and its
input tensors). It runs eagerly on the CPU, and on CUDA the same module runs on the engine's own
stream and can be captured as one CUDA graph per input shape (batch size, length bucket).

Shape arithmetic (`Shape`, `Gather` on shapes, `Concat`, `Range`, ...) is computed on small int64
tensors kept on the host: an op whose inputs are all on the host runs there, and a host tensor
that meets a device tensor is copied to the device. Shape parameters (`Reshape`'s shape,
`Slice`'s starts, reduction axes, ...) are read on the host with `.tolist()`, so no device value
is ever read back while the module runs: what a CUDA graph needs.

This module imports torch; the runtime imports it only when a stage engine on torch is asked for
(`loading.make_engines` with `RuntimeSettings.engine == "torch"`), so the runtime runs without torch.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from .device_timing import cuda_timer
from .manifest import BATCH, dim_size, is_length_dim

Tensor = torch.Tensor
OpFunction = Callable[..., Any]  # (node, *inputs) -> a tensor or a tuple of tensors

# initializers of at most this many elements, of an integer or bool type, stay on the host: they
# are shape arithmetic (axes, shape pieces, indices into shapes); so do scalars of any type (a
# float scalar may be shape arithmetic too: a head size's square root, a length's ratio)
HOST_CONSTANT_MAX_ELEMENTS = 64


class UnsupportedOpError(NotImplementedError):
    """The torch engine cannot run a node of the graph (an unknown op, or an attribute value it
    does not implement); raised when the model is loaded."""


@dataclass
class Node:
    """One ONNX node, prepared for the interpreter: attributes as Python values."""

    index: int
    op_type: str
    name: str
    inputs: tuple[str, ...]  # "" for an omitted optional input
    outputs: tuple[str, ...]
    attrs: dict[str, Any]
    opset: int
    fn: OpFunction = field(repr=False, default=None)  # type: ignore[assignment]

    def where(self) -> str:
        return f"node {self.name or '#' + str(self.index)!r} ({self.op_type})"


# --------------------------------------------------------------------------------------------
# helpers shared by the op functions


def _ints(t: Tensor | None) -> list[int] | None:
    """A host tensor of shape parameters as a list of ints (None stays None)."""
    return None if t is None else [int(v) for v in t.reshape(-1).tolist()]


def _axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


_ONNX_TO_TORCH_DTYPE = {1: "float32", 2: "uint8", 3: "int8", 5: "int16", 6: "int32", 7: "int64", 9: "bool",
                        10: "float16", 11: "float64", 16: "bfloat16"}


def torch_dtype(onnx_type: int) -> torch.dtype:
    name = _ONNX_TO_TORCH_DTYPE.get(onnx_type)
    if name is None:
        raise UnsupportedOpError(f"ONNX element type {onnx_type} has no torch dtype here")
    return getattr(torch, name)


def _is_integer(t: Tensor) -> bool:
    return not t.dtype.is_floating_point and not t.dtype.is_complex and t.dtype != torch.bool


# --------------------------------------------------------------------------------------------
# elementwise


def _unary(name: str) -> OpFunction:
    def run(node: Node, x: Tensor) -> Tensor:
        return getattr(torch, name)(x)
    return run


def _binary(name: str) -> OpFunction:
    def run(node: Node, a: Tensor, b: Tensor) -> Tensor:
        return getattr(torch, name)(a, b)
    return run


def _div(node: Node, a: Tensor, b: Tensor) -> Tensor:
    if _is_integer(a) and _is_integer(b):  # ONNX integer division truncates toward zero
        return torch.div(a, b, rounding_mode="trunc")
    return a / b


def _pow(node: Node, a: Tensor, b: Tensor) -> Tensor:
    return torch.pow(a, b).to(a.dtype)  # the result has the base's type


def _variadic(name: str) -> OpFunction:
    def run(node: Node, *xs: Tensor) -> Tensor:
        return functools.reduce(getattr(torch, name), xs)
    return run


def _where(node: Node, cond: Tensor, a: Tensor, b: Tensor) -> Tensor:
    return torch.where(cond.to(torch.bool), a, b)


def _is_inf(node: Node, x: Tensor) -> Tensor:
    pos, neg = node.attrs.get("detect_positive", 1), node.attrs.get("detect_negative", 1)
    return (torch.isposinf(x) & bool(pos)) | (torch.isneginf(x) & bool(neg))


def _cast(node: Node, x: Tensor) -> Tensor:
    return x.to(torch_dtype(node.attrs["to"]))


def _cast_like(node: Node, x: Tensor, like: Tensor) -> Tensor:
    return x.to(like.dtype)


def _clip(node: Node, x: Tensor, lo: Tensor | None = None, hi: Tensor | None = None) -> Tensor:
    lo_v = lo.item() if lo is not None else node.attrs.get("min")
    hi_v = hi.item() if hi is not None else node.attrs.get("max")
    return torch.clamp(x, lo_v, hi_v)


def _identity(node: Node, x: Tensor, *rest: Tensor) -> Tensor | tuple[Tensor, ...]:
    if len(node.outputs) > 1:  # Dropout's mask: nothing dropped at inference
        return x, torch.ones_like(x, dtype=torch.bool)
    return x


# --------------------------------------------------------------------------------------------
# shapes and indexing


def _shape(node: Node, x: Tensor) -> Tensor:
    rank = x.dim()
    start = _axis(node.attrs.get("start", 0), rank)
    end = _axis(node.attrs.get("end", rank), rank)
    return torch.tensor(list(x.shape)[max(start, 0):min(end, rank)], dtype=torch.int64)


def _size(node: Node, x: Tensor) -> Tensor:
    return torch.tensor(x.numel(), dtype=torch.int64)


def _constant_of_shape(node: Node, shape: Tensor) -> Tensor:
    value = node.attrs.get("value")
    fill = np.zeros(1, np.float32) if value is None else value
    dtype = getattr(torch, str(fill.dtype))
    return torch.full(_ints(shape), fill.reshape(-1)[0].item(), dtype=dtype)


def _reshape(node: Node, x: Tensor, shape: Tensor) -> Tensor:
    dims = _ints(shape)
    if not node.attrs.get("allowzero", 0):  # 0 copies the input's dim
        dims = [x.shape[i] if d == 0 else d for i, d in enumerate(dims)]
    return x.reshape(dims)


def _flatten(node: Node, x: Tensor) -> Tensor:
    axis = _axis(node.attrs.get("axis", 1), x.dim())
    return x.reshape(math.prod(x.shape[:axis]), math.prod(x.shape[axis:]))


def _transpose(node: Node, x: Tensor) -> Tensor:
    perm = node.attrs.get("perm") or list(reversed(range(x.dim())))
    return x.permute(*perm)


def _axes(node: Node, axes: Tensor | None) -> list[int] | None:
    """Axes from the input (newer opsets) or the attribute (older ones)."""
    return _ints(axes) if axes is not None else node.attrs.get("axes")


def _squeeze(node: Node, x: Tensor, axes: Tensor | None = None) -> Tensor:
    dims = _axes(node, axes)
    if dims is None:
        return x.squeeze()
    return x.squeeze(tuple(_axis(a, x.dim()) for a in dims))


def _unsqueeze(node: Node, x: Tensor, axes: Tensor | None = None) -> Tensor:
    dims = _axes(node, axes) or []
    rank = x.dim() + len(dims)
    for a in sorted(_axis(a, rank) for a in dims):
        x = x.unsqueeze(a)
    return x


def _concat(node: Node, *xs: Tensor) -> Tensor:
    return torch.cat([x for x in xs if x is not None], dim=node.attrs["axis"])


def _expand(node: Node, x: Tensor, shape: Tensor) -> Tensor:
    # ONNX broadcasts both ways: a 1 in `shape` keeps the input's dim
    return x.expand(torch.broadcast_shapes(tuple(x.shape), tuple(_ints(shape))))


def _tile(node: Node, x: Tensor, repeats: Tensor) -> Tensor:
    return x.repeat(*_ints(repeats))


def _gather(node: Node, data: Tensor, indices: Tensor) -> Tensor:
    axis = _axis(node.attrs.get("axis", 0), data.dim())
    size = data.shape[axis]
    idx = torch.where(indices < 0, indices + size, indices).to(torch.int64)
    picked = torch.index_select(data, axis, idx.reshape(-1))
    return picked.reshape((*data.shape[:axis], *indices.shape, *data.shape[axis + 1:]))


def _gather_elements(node: Node, data: Tensor, indices: Tensor) -> Tensor:
    axis = _axis(node.attrs.get("axis", 0), data.dim())
    idx = torch.where(indices < 0, indices + data.shape[axis], indices).to(torch.int64)
    return torch.gather(data, axis, idx)


def _slice(node: Node, x: Tensor, starts: Tensor | None = None, ends: Tensor | None = None,
           axes: Tensor | None = None, steps: Tensor | None = None) -> Tensor:
    if starts is None:  # opset < 10: attributes
        first, last, dims, strides = node.attrs["starts"], node.attrs["ends"], node.attrs.get("axes"), None
    else:
        first, last, dims, strides = _ints(starts), _ints(ends), _ints(axes), _ints(steps)
    dims = dims if dims is not None else list(range(len(first)))
    strides = strides if strides is not None else [1] * len(first)
    for start, end, axis, step in zip(first, last, dims, strides):
        axis = _axis(axis, x.dim())
        begin, stop, step = slice(start, end, step).indices(x.shape[axis])  # ONNX clamps as Python does
        if step > 0:
            x = x[(slice(None),) * axis + (slice(begin, stop, step),)]
        else:  # torch slicing has no negative step: pick the indices (made on x's device)
            x = torch.index_select(x, axis, torch.arange(begin, stop, step, device=x.device))
    return x


def _split(node: Node, x: Tensor, sizes: Tensor | None = None) -> tuple[Tensor, ...]:
    axis = _axis(node.attrs.get("axis", 0), x.dim())
    parts = _ints(sizes) if sizes is not None else node.attrs.get("split")
    if parts is None:
        count = node.attrs.get("num_outputs", len(node.outputs))
        parts = -(-x.shape[axis] // count)  # equal parts, the last one smaller
    return tuple(torch.split(x, parts, dim=axis))


def _range(node: Node, start: Tensor, limit: Tensor, delta: Tensor) -> Tensor:
    return torch.arange(start.item(), limit.item(), delta.item(), dtype=start.dtype)


# --------------------------------------------------------------------------------------------
# reductions and normalization


def _reduce(kind: str) -> OpFunction:
    def run(node: Node, x: Tensor, axes: Tensor | None = None) -> Tensor:
        dims = _axes(node, axes)
        keep = bool(node.attrs.get("keepdims", 1))
        if not dims:
            if node.attrs.get("noop_with_empty_axes", 0):
                return x
            dims = list(range(x.dim()))
        dims = [_axis(a, x.dim()) for a in dims]
        if kind == "sum":
            return torch.sum(x, dim=dims, keepdim=keep)
        if kind == "mean":
            return torch.mean(x, dim=dims, keepdim=keep)
        if kind == "l2":
            return torch.sqrt(torch.sum(x * x, dim=dims, keepdim=keep))
        if kind == "prod":
            for d in sorted(dims, reverse=True):
                x = torch.prod(x, dim=d, keepdim=keep)
            return x
        return torch.amax(x, dim=dims, keepdim=keep) if kind == "max" else torch.amin(x, dim=dims, keepdim=keep)
    return run


def _softmax(log: bool) -> OpFunction:
    def run(node: Node, x: Tensor) -> Tensor:
        fn = torch.log_softmax if log else torch.softmax
        if node.opset >= 13:
            return fn(x, dim=node.attrs.get("axis", -1))
        axis = _axis(node.attrs.get("axis", 1), x.dim())  # older opsets: over all dims from `axis` on
        return fn(x.reshape(math.prod(x.shape[:axis]), -1), dim=1).reshape(x.shape)
    return run


def _layer_norm(node: Node, x: Tensor, scale: Tensor, bias: Tensor | None = None) -> Tensor:
    axis = _axis(node.attrs.get("axis", -1), x.dim())
    shape = tuple(x.shape[axis:])
    eps = node.attrs.get("epsilon", 1e-5)
    if tuple(scale.shape) == shape and (bias is None or tuple(bias.shape) == shape):
        return torch.nn.functional.layer_norm(x, shape, scale, bias, eps)
    y = torch.nn.functional.layer_norm(x, shape, None, None, eps) * scale  # broadcast scale/bias
    return y if bias is None else y + bias


def _batch_norm(node: Node, x: Tensor, scale: Tensor, bias: Tensor, mean: Tensor, var: Tensor) -> Tensor:
    return torch.nn.functional.batch_norm(x, mean, var, scale, bias, False, 0.0, node.attrs.get("epsilon", 1e-5))


# --------------------------------------------------------------------------------------------
# matrix products, convolution, pooling


def _gemm(node: Node, a: Tensor, b: Tensor, c: Tensor | None = None) -> Tensor:
    a = a.t() if node.attrs.get("transA", 0) else a
    b = b.t() if node.attrs.get("transB", 0) else b
    y = a @ b
    alpha, beta = node.attrs.get("alpha", 1.0), node.attrs.get("beta", 1.0)
    y = y if alpha == 1.0 else y * alpha
    return y if c is None else y + (c if beta == 1.0 else c * beta)


def _spatial_pads(node: Node, spatial: Sequence[int], kernel: Sequence[int], strides: Sequence[int],
                  dilations: Sequence[int]) -> tuple[list[int], list[int]]:
    """(begins, ends) padding of each spatial dim, from `pads` or `auto_pad`."""
    n = len(spatial)
    auto = node.attrs.get("auto_pad", "NOTSET")
    if auto in ("NOTSET", "VALID"):
        pads = (node.attrs.get("pads") if auto == "NOTSET" else None) or [0] * (2 * n)
        return list(pads[:n]), list(pads[n:])
    begins, ends = [], []
    for size, k, s, d in zip(spatial, kernel, strides, dilations):  # SAME_UPPER / SAME_LOWER
        total = max((-(-size // s) - 1) * s + (k - 1) * d + 1 - size, 0)
        small, large = total // 2, total - total // 2
        begins.append(large if auto == "SAME_LOWER" else small)
        ends.append(small if auto == "SAME_LOWER" else large)
    return begins, ends


def _torch_pad(begins: Sequence[int], ends: Sequence[int]) -> list[int]:
    """ONNX (begins, ends) per spatial dim -> F.pad's list (last dim first)."""
    out: list[int] = []
    for b, e in zip(reversed(begins), reversed(ends)):
        out += [b, e]
    return out


def _window(node: Node, x: Tensor, kernel: Sequence[int]) -> tuple[list[int], list[int], list[int], list[int]]:
    n = len(kernel)
    strides = node.attrs.get("strides") or [1] * n
    dilations = node.attrs.get("dilations") or [1] * n
    begins, ends = _spatial_pads(node, x.shape[2:], kernel, strides, dilations)
    return strides, dilations, begins, ends


def _conv(node: Node, x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
    F = torch.nn.functional
    kernel = node.attrs.get("kernel_shape") or list(w.shape[2:])
    strides, dilations, begins, ends = _window(node, x, kernel)
    conv = (F.conv1d, F.conv2d, F.conv3d)[len(kernel) - 1]
    if begins != ends:  # asymmetric: pad first
        x, padding = F.pad(x, _torch_pad(begins, ends)), [0] * len(kernel)
    else:
        padding = begins
    return conv(x, w, b, strides, padding, dilations, node.attrs.get("group", 1))


def _conv_transpose(node: Node, x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
    F = torch.nn.functional
    kernel = node.attrs.get("kernel_shape") or list(w.shape[2:])
    n = len(kernel)
    strides = node.attrs.get("strides") or [1] * n
    dilations = node.attrs.get("dilations") or [1] * n
    pads = node.attrs.get("pads") or [0] * (2 * n)
    extra = node.attrs.get("output_padding") or [0] * n
    conv = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[n - 1]
    y = conv(x, w, b, strides, 0, extra, node.attrs.get("group", 1), dilations)
    # the full output, cropped by the pads (asymmetric pads included)
    crop = tuple(slice(pads[i], y.shape[2 + i] - pads[n + i]) for i in range(n))
    return y[(slice(None), slice(None)) + crop]


def _max_pool(node: Node, x: Tensor) -> Tensor:
    F = torch.nn.functional
    kernel = node.attrs["kernel_shape"]
    strides, dilations, begins, ends = _window(node, x, kernel)
    pool = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[len(kernel) - 1]
    ceil = bool(node.attrs.get("ceil_mode", 0))
    if begins == ends and all(p <= k // 2 for p, k in zip(begins, kernel)):
        return pool(x, kernel, strides, begins, dilations, ceil_mode=ceil)
    x = F.pad(x, _torch_pad(begins, ends), value=float("-inf"))
    return pool(x, kernel, strides, 0, dilations, ceil_mode=ceil)


def _average_pool(node: Node, x: Tensor) -> Tensor:
    F = torch.nn.functional
    kernel = node.attrs["kernel_shape"]
    strides, _, begins, ends = _window(node, x, kernel)
    if begins != ends:
        raise UnsupportedOpError(f"{node.where()}: asymmetric pads are not supported")
    pool = (F.avg_pool1d, F.avg_pool2d, F.avg_pool3d)[len(kernel) - 1]
    return pool(x, kernel, strides, begins, bool(node.attrs.get("ceil_mode", 0)),
                bool(node.attrs.get("count_include_pad", 0)))


def _global_pool(kind: str) -> OpFunction:
    def run(node: Node, x: Tensor) -> Tensor:
        dims = tuple(range(2, x.dim()))
        return x.mean(dim=dims, keepdim=True) if kind == "mean" else x.amax(dim=dims, keepdim=True)
    return run


# --------------------------------------------------------------------------------------------
# recurrent


_LSTM_GATES_TO_TORCH = [0, 2, 3, 1]  # ONNX gates i, o, f, c -> torch's i, f, g(c), o


def _lstm(node: Node, x: Tensor, w: Tensor, r: Tensor, b: Tensor | None = None, lengths: Tensor | None = None,
          h0: Tensor | None = None, c0: Tensor | None = None, peepholes: Tensor | None = None) -> tuple[Tensor, ...]:
    if lengths is not None and bool((lengths != x.shape[0 if not node.attrs.get("layout", 0) else 1]).any()):
        raise UnsupportedOpError(f"{node.where()}: sequence_lens shorter than the sequence are not supported")
    batch_first = bool(node.attrs.get("layout", 0))
    hidden = node.attrs["hidden_size"]
    directions = w.shape[0]

    def gates(m: Tensor) -> Tensor:  # [4H, ...] reordered to torch's gate order
        return torch.cat([m[g * hidden:(g + 1) * hidden] for g in _LSTM_GATES_TO_TORCH])

    params: list[Tensor] = []
    for d in range(directions):
        params += [gates(w[d]), gates(r[d])]
        if b is not None:
            params += [gates(b[d, :4 * hidden]), gates(b[d, 4 * hidden:])]
    rows = x.shape[0] if batch_first else x.shape[1]
    zeros = x.new_zeros(directions, rows, hidden)
    h = zeros if h0 is None else (h0.transpose(0, 1) if batch_first else h0)
    c = zeros if c0 is None else (c0.transpose(0, 1) if batch_first else c0)
    y, h_n, c_n = torch.lstm(x, (h.contiguous(), c.contiguous()), params, b is not None, 1, 0.0, False,
                             directions == 2, batch_first)
    # torch: [T, N, D*H] (or [N, T, D*H]); ONNX: [T, D, N, H] (layout 1: [N, T, D, H])
    if batch_first:
        y = y.reshape(y.shape[0], y.shape[1], directions, hidden)
        return y, h_n.transpose(0, 1), c_n.transpose(0, 1)
    y = y.reshape(y.shape[0], y.shape[1], directions, hidden).permute(0, 2, 1, 3)
    return y, h_n, c_n


def _check_lstm(node: Node) -> None:
    default = ["Sigmoid", "Tanh", "Tanh"]
    acts = node.attrs.get("activations")
    if acts and [a for a in acts] != default * (len(acts) // 3):
        raise UnsupportedOpError(f"{node.where()}: activations {acts} are not supported (only the default ones)")
    for name in ("clip", "input_forget"):
        if node.attrs.get(name):
            raise UnsupportedOpError(f"{node.where()}: attribute {name} is not supported")
    if len(node.inputs) > 7 and node.inputs[7]:
        raise UnsupportedOpError(f"{node.where()}: peephole weights (input P) are not supported")


def _check_outputs(count: int) -> Callable[[Node], None]:
    """Only the first `count` outputs may be used."""
    def check(node: Node) -> None:
        if any(node.outputs[count:]):
            raise UnsupportedOpError(f"{node.where()}: only its first {count} output(s) are supported")
    return check


def _check_conv_transpose(node: Node) -> None:
    if "output_shape" in node.attrs or node.attrs.get("auto_pad", "NOTSET") != "NOTSET":
        raise UnsupportedOpError(f"{node.where()}: output_shape / auto_pad are not supported")


# --------------------------------------------------------------------------------------------
# the dispatch table


OPS: dict[str, OpFunction] = {
    **{op: _unary(fn) for op, fn in {
        "Relu": "relu", "Sigmoid": "sigmoid", "Tanh": "tanh", "Erf": "erf", "Sqrt": "sqrt", "Exp": "exp",
        "Log": "log", "Abs": "abs", "Neg": "neg", "Reciprocal": "reciprocal", "Floor": "floor", "Ceil": "ceil",
        "Not": "logical_not", "IsNaN": "isnan",
    }.items()},
    **{op: _binary(fn) for op, fn in {
        "Add": "add", "Sub": "sub", "Mul": "mul", "MatMul": "matmul", "Equal": "eq", "Less": "lt",
        "LessOrEqual": "le", "Greater": "gt", "GreaterOrEqual": "ge", "And": "logical_and", "Or": "logical_or",
        "Xor": "logical_xor",
    }.items()},
    "Div": _div, "Pow": _pow, "Max": _variadic("maximum"), "Min": _variadic("minimum"), "Sum": _variadic("add"),
    "Where": _where, "IsInf": _is_inf, "Cast": _cast, "CastLike": _cast_like, "Clip": _clip,
    "Identity": _identity, "Dropout": _identity,
    "Shape": _shape, "Size": _size, "ConstantOfShape": _constant_of_shape, "Reshape": _reshape, "Flatten": _flatten,
    "Transpose": _transpose, "Squeeze": _squeeze, "Unsqueeze": _unsqueeze, "Concat": _concat, "Expand": _expand,
    "Tile": _tile, "Gather": _gather, "GatherElements": _gather_elements, "Slice": _slice, "Split": _split,
    "Range": _range,
    "ReduceSum": _reduce("sum"), "ReduceMean": _reduce("mean"), "ReduceL2": _reduce("l2"),
    "ReduceMax": _reduce("max"), "ReduceMin": _reduce("min"), "ReduceProd": _reduce("prod"),
    "Softmax": _softmax(log=False), "LogSoftmax": _softmax(log=True),
    "LayerNormalization": _layer_norm, "BatchNormalization": _batch_norm,
    "Gemm": _gemm, "Conv": _conv, "ConvTranspose": _conv_transpose, "MaxPool": _max_pool,
    "AveragePool": _average_pool, "GlobalAveragePool": _global_pool("mean"), "GlobalMaxPool": _global_pool("max"),
    "LSTM": _lstm,
}

# load-time checks of attribute values an op function does not implement
CHECKS: dict[str, Callable[[Node], None]] = {
    "LSTM": _check_lstm, "MaxPool": _check_outputs(1), "LayerNormalization": _check_outputs(1),
    "BatchNormalization": _check_outputs(1), "ConvTranspose": _check_conv_transpose,
}

# input positions read on the host as shape parameters (never moved to the device)
HOST_PARAMS: dict[str, frozenset[int]] = {
    "Reshape": frozenset({1}), "Expand": frozenset({1}), "Tile": frozenset({1}), "Squeeze": frozenset({1}),
    "Unsqueeze": frozenset({1}), "Slice": frozenset({1, 2, 3, 4}), "Split": frozenset({1}),
    "ConstantOfShape": frozenset({0}), "Range": frozenset({0, 1, 2}), "Clip": frozenset({1, 2}),
    **{op: frozenset({1}) for op in ("ReduceSum", "ReduceMean", "ReduceL2", "ReduceMax", "ReduceMin", "ReduceProd")},
}


# --------------------------------------------------------------------------------------------
# the module


def _attribute_value(attr: onnx.AttributeProto) -> Any:
    if attr.type == onnx.AttributeProto.TENSOR:
        return numpy_helper.to_array(attr.t)
    value = onnx.helper.get_attribute_value(attr)
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, list) and value and isinstance(value[0], bytes):
        return [v.decode() for v in value]
    return value


def _constant_value(node: Node) -> np.ndarray:
    for key, dtype in (("value", None), ("value_float", np.float32), ("value_floats", np.float32),
                       ("value_int", np.int64), ("value_ints", np.int64)):
        if key in node.attrs:
            return np.array(node.attrs[key], dtype=dtype)
    raise UnsupportedOpError(f"{node.where()}: only value / value_float(s) / value_int(s) constants are supported")


def _to_torch(array: np.ndarray) -> Tensor:
    array = np.array(array, copy=True)
    if array.dtype.name == "bfloat16":  # ml_dtypes' bfloat16 (onnx's arrays): torch reads its bits
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _stays_on_host(t: Tensor) -> bool:
    return t.dim() == 0 or (not t.dtype.is_floating_point and t.numel() <= HOST_CONSTANT_MAX_ELEMENTS)


class DeviceMemo:
    """Host tensors copied to the device, kept per (node, input position) so that a CUDA graph
    capture reuses the copies its warm-up made (a copy from host memory cannot be captured) and
    the copies live as long as the graph."""

    def __init__(self) -> None:
        self.copies: dict[tuple[int, int], Tensor] = {}
        self.frozen = False  # True while capturing: every copy must already be here

    def to_device(self, key: tuple[int, int], t: Tensor, device: torch.device) -> Tensor:
        if self.frozen:
            if key not in self.copies:
                raise RuntimeError(f"host tensor for node #{key[0]} input {key[1]} was not copied during warm-up")
            return self.copies[key]
        self.copies[key] = t.to(device)
        return self.copies[key]


def _onnx_model(model: onnx.ModelProto | str | Path) -> onnx.ModelProto:
    return onnx.load(str(model)) if isinstance(model, (str, Path)) else model


class OnnxTorchModule(torch.nn.Module):
    """An ONNX graph as a torch module: `forward(*inputs)` takes the graph's inputs in order and
    returns its outputs (a tuple, in the graph's order). Built from a ModelProto or a path."""

    def __init__(self, model: onnx.ModelProto | str | Path, source: str | None = None) -> None:
        super().__init__()
        proto = _onnx_model(model)
        self.source = source or (str(model) if isinstance(model, (str, Path)) else proto.graph.name)
        opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 1)
        graph = proto.graph
        self._slots: dict[str, str] = {}  # constant name -> buffer attribute
        self._host: dict[str, Tensor] = {}  # small integer constants: never moved to a device
        for tensor in graph.initializer:
            self._add_constant(tensor.name, _to_torch(numpy_helper.to_array(tensor)))
        constants = set(self._slots) | set(self._host)
        self.input_names = [i.name for i in graph.input if i.name not in constants]
        self.output_names = [o.name for o in graph.output]
        self.steps: list[Node] = []
        for index, proto_node in enumerate(graph.node):
            node = self._prepare(index, proto_node, opset)
            if node.op_type == "Constant":
                self._add_constant(node.outputs[0], _to_torch(_constant_value(node)))
            else:
                self.steps.append(node)
        self._drops = self._last_uses()
        self.memo: DeviceMemo | None = None
        self._constants_cache: dict[str, Tensor] | None = None
        self._host_on_device: dict[tuple[str, torch.device], Tensor] = {}  # host constants a device op reads

    def _add_constant(self, name: str, value: Tensor) -> None:
        if _stays_on_host(value):
            self._host[name] = value
        else:
            slot = f"onnx_constant_{len(self._slots)}"
            self.register_buffer(slot, value, persistent=False)
            self._slots[name] = slot

    def _prepare(self, index: int, proto_node: onnx.NodeProto, opset: int) -> Node:
        node = Node(index, proto_node.op_type, proto_node.name, tuple(proto_node.input), tuple(proto_node.output),
                    {a.name: _attribute_value(a) for a in proto_node.attribute}, opset)
        if proto_node.domain not in ("", "ai.onnx") or (node.op_type not in OPS and node.op_type != "Constant"):
            domain = f" of domain {proto_node.domain!r}" if proto_node.domain else ""
            raise UnsupportedOpError(f"{self.source}: op {node.op_type!r}{domain} ({node.where()}) is not supported "
                                     f"by the torch engine; it supports {sorted(OPS)}")
        if node.op_type in CHECKS:
            try:
                CHECKS[node.op_type](node)
            except UnsupportedOpError as exc:
                raise UnsupportedOpError(f"{self.source}: {exc}") from None
        node.fn = OPS.get(node.op_type)  # type: ignore[assignment]
        return node

    def _last_uses(self) -> list[list[str]]:
        """Per step, the values no later step reads (freed as the graph runs)."""
        keep = set(self.output_names)
        last: dict[str, int] = {}
        for i, node in enumerate(self.steps):
            for name in node.inputs:
                if name:
                    last[name] = i
        drops: list[list[str]] = [[] for _ in self.steps]
        for name, i in last.items():
            if name not in keep and name not in self.input_names:
                drops[i].append(name)
        return drops

    def _apply(self, fn, *args, **kwargs):  # .to(device) and friends: buffers change
        self._constants_cache = None
        return super()._apply(fn, *args, **kwargs)

    def _constants(self) -> dict[str, Tensor]:
        if self._constants_cache is None:
            self._constants_cache = {**self._host, **{n: getattr(self, s) for n, s in self._slots.items()}}
        return self._constants_cache

    def forward(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        if len(inputs) != len(self.input_names):
            raise TypeError(f"{self.source}: expected inputs {self.input_names}, got {len(inputs)} tensors")
        env = {**self._constants(), **dict(zip(self.input_names, inputs))}
        for node, drops in zip(self.steps, self._drops):
            args = self._arguments(node, env)
            try:
                result = node.fn(node, *args)
            except UnsupportedOpError:
                raise
            except Exception as exc:
                raise RuntimeError(f"{self.source}: {node.where()} failed: {exc}") from exc
            if isinstance(result, (tuple, list)):
                env.update((name, value) for name, value in zip(node.outputs, result) if name)
            else:
                env[node.outputs[0]] = result
            for name in drops:
                env.pop(name, None)
        return tuple(env[name] for name in self.output_names)

    def _arguments(self, node: Node, env: dict[str, Tensor]) -> list[Tensor | None]:
        args = [env[name] if name else None for name in node.inputs]
        while args and args[-1] is None:  # trailing omitted inputs take the functions' defaults
            args.pop()
        return self._placed(node, args)

    def _placed(self, node: Node, args: list[Tensor | None]) -> list[Tensor | None]:
        """Host tensors that meet a device tensor are copied to its device (shape parameters stay):
        a host constant once for good, a value computed on the host once per run (or, while a CUDA
        graph is captured, the copy its warm-up made)."""
        params = HOST_PARAMS.get(node.op_type, frozenset())
        device = next((a.device for i, a in enumerate(args)
                       if a is not None and i not in params and a.device.type != "cpu"), None)
        if device is None:
            return args
        placed = list(args)
        for i, a in enumerate(args):
            if a is None or i in params or a.device.type != "cpu":
                continue
            name = node.inputs[i]
            if name in self._host:
                if (name, device) not in self._host_on_device:
                    self._host_on_device[(name, device)] = a.to(device)
                placed[i] = self._host_on_device[(name, device)]
            elif self.memo is not None:
                placed[i] = self.memo.to_device((node.index, i), a, device)
            else:
                placed[i] = a.to(device)
        return placed


# --------------------------------------------------------------------------------------------
# the engine


@dataclass
class CapturedGraph:
    """One CUDA graph of a stage at one set of input shapes: its static input and output tensors
    on the device, and the host-to-device copies it reads."""

    graph: Any  # torch.cuda.CUDAGraph
    inputs: dict[str, Tensor]
    outputs: dict[str, Tensor]
    memo: DeviceMemo


ShapeKey = tuple[tuple[int, ...], ...]  # the stage's input shapes, in input order


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """Python's garbage collector off inside (as it was before, after)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class TorchStageEngine:
    """A stage engine on torch (`run(inputs, outputs)`, as `OrtStageEngine`).

    `TorchStageEngine(path, device="cpu", threads=1)`: the stage ONNX at `path` converted to an
    `OnnxTorchModule` (an op it does not know fails here, naming the op and the node).
    `threads` sets torch's intra-op threads (`torch.set_num_threads`, a process-wide setting).

    - device "cpu": `run` reads the numpy input views without copying (`torch.from_numpy`), runs
      the module eagerly under `torch.inference_mode()` and copies the results into the output views.
    - device "cuda" (needs `torch.cuda.is_available()`): `run` copies the inputs to the GPU (a
      view that is a tensor in device memory already, `device_memory.TorchMemory`, is read where
      it is), runs the module on the engine's own `torch.cuda.Stream` (`self.stream`) and copies
      the results into the output views. Where an output view is host memory it synchronizes that
      stream before returning: the outputs are complete when `run` returns. Where every output is
      in device memory it returns with the work queued; the caller's fence orders the reader, and
      `wait_for_device()` waits for it (the pipeline's entry: `Pipeline.wait_at_entry`).
      `capture(batch_size, length)` records one CUDA graph for those input
      shapes; afterwards `run` on inputs of exactly those shapes replays the graph (copy in,
      `replay()`, copy out) instead of running eagerly. `captured` lists the captured shape keys.
    """

    def __init__(self, path: str | Path, device: str = "cpu", threads: int = 1) -> None:
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        if device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("device 'cuda' was asked for, but torch sees no CUDA device")
        torch.set_num_threads(threads)
        self.path = Path(path)
        self.device = torch.device(device)
        proto = onnx.load(str(self.path))
        self.module = OnnxTorchModule(proto, source=self.path.name).eval().to(self.device)
        if self.device.type == "cuda":  # the weights' copies (default stream) are done before any run
            torch.cuda.synchronize(self.device)
        self.input_names: list[str] = list(self.module.input_names)
        self.output_names: list[str] = list(self.module.output_names)
        self.input_dims = {vi.name: _dims(vi) for vi in proto.graph.input if vi.name in self.input_names}
        self.input_dtypes = {vi.name: torch_dtype(vi.type.tensor_type.elem_type)
                             for vi in proto.graph.input if vi.name in self.input_names}
        self.stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None
        # each run's time on the device, from events around it (runtime/device_timing.py)
        self.device_timer = cuda_timer() if self.stream is not None else None
        self._graphs: dict[ShapeKey, CapturedGraph] = {}
        self._buckets: list[ShapeKey] = []  # capture_buckets' graphs, smallest first
        self._pad_length = False
        self.replays = 0  # runs that replayed a CUDA graph (the rest ran eagerly)
        self._pool: Any = None  # one memory pool shared by this engine's graphs (they never run at once)

    # -- running ------------------------------------------------------------------------

    def run(self, inputs: Mapping[str, Any], outputs: Mapping[str, Any]) -> None:
        host = [_tensor(inputs[name]) for name in self.input_names]
        if self.stream is None:
            with torch.inference_mode():
                self._write(self.module(*host), outputs)
            return
        with torch.cuda.stream(self.stream), torch.inference_mode():
            began = self.device_timer.start(self.stream)  # type: ignore[union-attr]
            key = tuple(tuple(t.shape) for t in host)
            captured = self._graphs.get(key) or self._bucket_for(key)
            if captured is not None:
                for name, t in zip(self.input_names, host):
                    static = captured.inputs[name]
                    if tuple(static.shape) != tuple(t.shape):  # a bucket's graph: zeros past the batch's rows and length
                        static.zero_()
                        static = static[_leading(t.shape)]
                    static.copy_(t, non_blocking=True)  # from the host: queued (page-locked) or staged
                captured.graph.replay()
                self.replays += 1
                results: Sequence[Tensor] = [captured.outputs[name] for name in self.output_names]
            else:
                results = self.module(*[t.to(self.device, non_blocking=True) for t in host])
            self._write(results, outputs, padded=captured is not None)
            self.device_timer.stop(began, self.stream)  # type: ignore[union-attr]
        if any(not isinstance(out, Tensor) for out in outputs.values()):
            self.stream.synchronize()  # host outputs: complete when `run` returns
        # outputs all in device memory: the work stays queued on the stream, and the buffer's
        # fence (recorded on this stream after `run`) orders its reader after it

    def wait_for_device(self) -> None:
        """Return once the work `run` queued has finished on the device."""
        if self.stream is not None:
            self.stream.synchronize()

    def _write(self, results: Sequence[Tensor], outputs: Mapping[str, Any], padded: bool = False) -> None:
        by_name = dict(zip(self.output_names, results))
        for name, out in outputs.items():
            result = by_name[name]
            shape = tuple(out.shape)
            if tuple(result.shape) != shape:
                if not (padded and result.dim() == len(shape) and all(a >= b for a, b in zip(result.shape, shape))):
                    raise ValueError(f"{self.path.name}: output {name} has shape {tuple(result.shape)}, "
                                     f"its buffer {shape}")
                result = result[_leading(shape)]  # the bucket's padding cut off
            # to the host: `run` synchronizes the stream before it returns
            (out if isinstance(out, Tensor) else torch.from_numpy(out)).copy_(result, non_blocking=True)

    # -- CUDA graphs ----------------------------------------------------------------------

    def input_shapes(self, batch_size: int, length: int = 0) -> dict[str, tuple[int, ...]]:
        """Each input's shape at `batch_size` rows padded to `length` (the stage ONNX's dims are the
        manifest's: "batch", "seq", derived lengths such as "seq//4", or fixed sizes)."""
        shapes = {}
        for name in self.input_names:
            dims = []
            for d in self.input_dims[name]:
                if d == BATCH:
                    dims.append(batch_size)
                elif isinstance(d, str) and is_length_dim(d):
                    dims.append(dim_size(d, length))
                elif isinstance(d, int):
                    dims.append(d)
                else:
                    raise ValueError(f"{self.path.name}: input {name} has dim {d!r}, neither batch, a length nor a size")
            shapes[name] = tuple(dims)
        return shapes

    @property
    def captured(self) -> list[ShapeKey]:
        return list(self._graphs)

    def capture(self, batch_size: int, length: int = 0, warmup: int = 2) -> ShapeKey:
        """Record one CUDA graph of the stage at these input shapes (inputs of zeros: only the
        shapes matter to the ops that compute on the host); returns its key, the input shapes.
        Later `run` calls on inputs of exactly these shapes replay it."""
        if self.stream is None:
            raise RuntimeError("capture needs device 'cuda'")
        shapes = self.input_shapes(batch_size, length)
        key: ShapeKey = tuple(shapes[name] for name in self.input_names)
        static = {name: torch.zeros(shapes[name], dtype=self.input_dtypes[name], device=self.device)
                  for name in self.input_names}
        memo = DeviceMemo()
        self.module.memo = memo
        try:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream), torch.inference_mode():
                for _ in range(warmup):  # also makes the host-to-device copies the graph will read
                    self.module(*static.values())
            self.stream.synchronize()
            memo.frozen = True
            graph = torch.cuda.CUDAGraph()
            # thread_local: the other stages' executor threads may keep using CUDA meanwhile. No
            # garbage collection during the capture: freeing another engine's graph there (its
            # `reset`) is a CUDA call the capture forbids, and it invalidates the capture (as when
            # engines are built after others were dropped)
            with _no_gc(), torch.inference_mode(), torch.cuda.graph(graph, pool=self._pool, stream=self.stream,
                                                                    capture_error_mode="thread_local"):
                results = self.module(*static.values())
        finally:
            self.module.memo = None
        self._pool = graph.pool()
        self._graphs[key] = CapturedGraph(graph, static, dict(zip(self.output_names, results)), memo)
        return key

    def capture_buckets(self, batch_sizes: Sequence[int], lengths: Sequence[int], pad_length: bool) -> int:
        """One CUDA graph per (batch size, length) bucket; afterwards `run` replays, for a batch of
        any shape, the smallest bucket's graph that holds it: its rows and length zero-padded up to
        the bucket's, the outputs cut back. Rows are independent (every batch the runtime runs
        relies on it); a length is padded only with `pad_length` (the manifest's `pad_safe`),
        else only a bucket of exactly the batch's length is used. Returns the graphs captured."""
        for bs in batch_sizes:
            for length in lengths:
                self.capture(bs, length)
        self._pad_length = pad_length
        self._buckets = sorted(self._graphs, key=_elements)
        return len(self._buckets)

    def _bucket_for(self, key: ShapeKey) -> CapturedGraph | None:
        """The smallest bucket graph whose input shapes hold `key`'s (None: run eagerly)."""
        for bucket in self._buckets:
            if all(len(b) == len(k) and all(x >= y for x, y in zip(b, k))
                   and (self._pad_length or b[1:] == k[1:]) for b, k in zip(bucket, key)):
                return self._graphs[bucket]
        return None

    def release_graphs(self) -> None:
        """Drop every captured graph (`run` goes back to eager for those shapes)."""
        self._graphs.clear()
        self._buckets = []


def _tensor(value: Any) -> Tensor:
    """A stage input as a tensor: a buffer view in device memory as it is, a numpy one shared."""
    if isinstance(value, Tensor):
        return value
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a read-only view: torch only reads it
        return torch.from_numpy(np.asarray(value))


def _leading(shape: Sequence[int]) -> tuple[slice, ...]:
    return tuple(slice(0, n) for n in shape)


def _elements(key: ShapeKey) -> int:
    return sum(math.prod(shape) for shape in key)


def _dims(vi: onnx.ValueInfoProto) -> tuple[int | str | None, ...]:
    out: list[int | str | None] = []
    for d in vi.type.tensor_type.shape.dim:
        out.append(d.dim_param if d.HasField("dim_param") else d.dim_value if d.HasField("dim_value") else None)
    return tuple(out)
