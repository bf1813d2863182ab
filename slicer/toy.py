"""Small ONNX models built from seeded numpy weights, for tests and demos.

Every model uses IR version 10 and the default-domain opset 17: onnx 1.23 writes IR 14 by
default, which onnxruntime 1.31 refuses to load.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

IR_VERSION = 10
OPSET = 17


def _model(graph: onnx.GraphProto) -> onnx.ModelProto:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="slicer.toy")
    model.ir_version = IR_VERSION
    return model


def _linear(
    rng: np.random.Generator, k: int, src: str, dst: str, size: int, inits: list[onnx.TensorProto]
) -> list[onnx.NodeProto]:
    """Nodes for dst = MatMul(src, W_k) + b_k, weights scaled to keep values O(1)."""
    w = (rng.standard_normal((size, size)) / np.sqrt(size)).astype(np.float32)
    b = (0.1 * rng.standard_normal(size)).astype(np.float32)
    inits += [numpy_helper.from_array(w, f"W{k}"), numpy_helper.from_array(b, f"b{k}")]
    return [
        helper.make_node("MatMul", [src, f"W{k}"], [f"mm{k}"], name=f"matmul{k}"),
        helper.make_node("Add", [f"mm{k}", f"b{k}"], [dst], name=f"add{k}"),
    ]


def _relu_layers(rng: np.random.Generator, ks: range, src: str, size: int,
                 inits: list[onnx.TensorProto]) -> tuple[list[onnx.NodeProto], str]:
    """Nodes for h{k} = Relu(h{k-1} @ W_k + b_k), k in `ks`, from `src`; and the last tensor's name."""
    nodes: list[onnx.NodeProto] = []
    prev = src
    for k in ks:
        nodes += _linear(rng, k, prev, f"lin{k}", size, inits)
        nodes.append(helper.make_node("Relu", [f"lin{k}"], [f"h{k}"], name=f"relu{k}"))
        prev = f"h{k}"
    return nodes, prev


def token_mlp(hidden: int = 8, layers: int = 4, seed: int = 0) -> onnx.ModelProto:
    """A per-token MLP with a masked mean pool.

    Inputs ``x`` float32 [batch, seq, hidden] and ``mask`` float32 [batch, seq]; layer k
    computes ``h{k} = Relu(h{k-1} @ W_k + b_k)``. Outputs ``tokens = h{layers} * mask[..., None]``
    [batch, seq, hidden] and ``pooled = sum_seq(tokens) / max(sum_seq(mask), 1e-6)``
    [batch, hidden]. Rows are independent and zero-padding does not change a row's results.
    """
    if hidden < 1 or layers < 1:
        raise ValueError(f"hidden and layers must be >= 1, got hidden={hidden}, layers={layers}")
    rng = np.random.default_rng(seed)
    inits: list[onnx.TensorProto] = []
    nodes, prev = _relu_layers(rng, range(1, layers + 1), "x", hidden, inits)
    inits += [
        numpy_helper.from_array(np.array([-1], dtype=np.int64), "axis_last"),
        numpy_helper.from_array(np.array([1], dtype=np.int64), "axis_seq"),
        numpy_helper.from_array(np.array(1e-6, dtype=np.float32), "eps"),
    ]
    nodes += [
        helper.make_node("Unsqueeze", ["mask", "axis_last"], ["mask3"], name="unsqueeze_mask"),
        helper.make_node("Mul", [prev, "mask3"], ["tokens"], name="apply_mask"),
        helper.make_node("ReduceSum", ["tokens", "axis_seq"], ["token_sum"], keepdims=0, name="sum_tokens"),
        helper.make_node("ReduceSum", ["mask", "axis_seq"], ["count"], keepdims=1, name="count_tokens"),
        helper.make_node("Max", ["count", "eps"], ["count_safe"], name="clamp_count"),
        helper.make_node("Div", ["token_sum", "count_safe"], ["pooled"], name="mean_pool"),
    ]
    graph = helper.make_graph(
        nodes,
        "token_mlp",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", hidden]),
            helper.make_tensor_value_info("mask", TensorProto.FLOAT, ["batch", "seq"]),
        ],
        [
            helper.make_tensor_value_info("tokens", TensorProto.FLOAT, ["batch", "seq", hidden]),
            helper.make_tensor_value_info("pooled", TensorProto.FLOAT, ["batch", hidden]),
        ],
        initializer=inits,
    )
    return _model(graph)


def dense_mlp(features: int = 16, layers: int = 4, seed: int = 0) -> onnx.ModelProto:
    """A plain MLP: ``x`` float32 [batch, features] -> ``y`` float32 [batch, features].

    Hidden layers ``h{k} = Relu(h{k-1} @ W_k + b_k)`` for k = 1..layers-1; the last layer
    ``y = h{layers-1} @ W + b`` has no Relu.
    """
    if features < 1 or layers < 1:
        raise ValueError(f"features and layers must be >= 1, got features={features}, layers={layers}")
    rng = np.random.default_rng(seed)
    inits: list[onnx.TensorProto] = []
    nodes, prev = _relu_layers(rng, range(1, layers), "x", features, inits)
    nodes += _linear(rng, layers, prev, "y", features, inits)
    return _x_to_y(nodes, "dense_mlp", features, inits)


def _x_to_y(nodes: list[onnx.NodeProto], name: str, width: int, inits: list[onnx.TensorProto]) -> onnx.ModelProto:
    """A model of `nodes`: ``x`` float32 [batch, width] -> ``y`` float32 [batch, width]."""
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", width])],
        initializer=inits,
    )
    return _model(graph)


def residual_mlp(width: int = 512, blocks: int = 16, seed: int = 0) -> onnx.ModelProto:
    """A ranking-style deep MLP: ``x`` float32 [batch, width] -> ``y`` float32 [batch, width].

    Block k: ``r{k} = r{k-1} + (Relu(r{k-1} @ A_k + a_k) @ B_k + b_k) * 0.5``, r0 = x. Each query
    reads every weight (32 MiB at width 512, 16 blocks), so a query alone is memory-bound and a
    batch costs little more than one query: the fixed-shape model where batching pays most.
    """
    if width < 1 or blocks < 1:
        raise ValueError(f"width and blocks must be >= 1, got width={width}, blocks={blocks}")
    rng = np.random.default_rng(seed)
    inits: list[onnx.TensorProto] = [numpy_helper.from_array(np.array(0.5, np.float32), "half")]
    nodes: list[onnx.NodeProto] = []
    prev = "x"
    for k in range(1, blocks + 1):
        nodes += _linear(rng, 2 * k - 1, prev, f"in{k}", width, inits)
        nodes.append(helper.make_node("Relu", [f"in{k}"], [f"act{k}"], name=f"relu{k}"))
        nodes += _linear(rng, 2 * k, f"act{k}", f"out{k}", width, inits)
        nodes.append(helper.make_node("Mul", [f"out{k}", "half"], [f"scaled{k}"], name=f"scale{k}"))
        out = "y" if k == blocks else f"r{k}"
        nodes.append(helper.make_node("Add", [prev, f"scaled{k}"], [out], name=f"residual{k}"))
        prev = out
    return _x_to_y(nodes, "residual_mlp", width, inits)


def save(model: onnx.ModelProto, path: str | Path) -> Path:
    """Check `model` with onnx.checker and save it to `path` (parent folders created)."""
    onnx.checker.check_model(model)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def cascade_mlp(features: int = 16, classes: int = 4, layers: int = 4, seed: int = 0) -> onnx.ModelProto:
    """An MLP with an early-exit head: ``x`` [batch, features] -> ``early_logits`` and ``logits`` [batch, classes].

    ``h1 = Relu(x @ W1 + b1)`` feeds both the exit head (``early_logits = h1 @ We + be``) and the
    rest of the network (hidden ``h2..h{layers}``, then ``logits``). Cut after ``early_logits``
    and a policy can answer confident queries from the head without running the rest.
    """
    if features < 1 or classes < 1 or layers < 2:
        raise ValueError(f"need features, classes >= 1 and layers >= 2, got {features}, {classes}, {layers}")
    rng = np.random.default_rng(seed)
    inits: list[onnx.TensorProto] = []
    nodes, _ = _relu_layers(rng, range(1, 2), "x", features, inits)
    head_w = (rng.standard_normal((features, classes)) * 2 / np.sqrt(features)).astype(np.float32)
    inits += [numpy_helper.from_array(head_w, "We"), numpy_helper.from_array(np.zeros(classes, np.float32), "be")]
    nodes += [
        helper.make_node("MatMul", ["h1", "We"], ["early_mm"], name="exit_matmul"),
        helper.make_node("Add", ["early_mm", "be"], ["early_logits"], name="exit_add"),
    ]
    rest, prev = _relu_layers(rng, range(2, layers + 1), "h1", features, inits)
    nodes += rest
    inits += [numpy_helper.from_array(head_w[::-1].copy(), "Wc"), numpy_helper.from_array(np.zeros(classes, np.float32), "bc")]
    nodes += [
        helper.make_node("MatMul", [prev, "Wc"], ["final_mm"], name="final_matmul"),
        helper.make_node("Add", ["final_mm", "bc"], ["logits"], name="final_add"),
    ]
    graph = helper.make_graph(
        nodes, "cascade_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", features])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", classes]),
         helper.make_tensor_value_info("early_logits", TensorProto.FLOAT, ["batch", classes])],
        initializer=inits,
    )
    return _model(graph)


def conv_pool(hidden: int = 8, layers: int = 2, kernel: int = 3, seed: int = 0) -> onnx.ModelProto:
    """A model that zero-padding changes: per-token layers, a 1-D conv over the sequence, a plain mean.

    Input ``x`` float32 [batch, seq, hidden], no mask. Layer k computes ``h{k} = Relu(h{k-1} @ W_k + b_k)``
    (cut points), then ``conv = Conv1d(h{layers})`` over the sequence (``kernel`` taps, 'same' padding,
    a bias) and ``pooled = mean_seq(conv)`` [batch, hidden]. Padded positions hold the conv's bias
    and the last tokens' taps, and the mean divides by the padded length: a query padded to a longer
    length gets another answer, so it must only be batched with queries of its own length.
    """
    if hidden < 1 or layers < 1 or kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"need hidden, layers >= 1 and an odd kernel, got {hidden}, {layers}, {kernel}")
    rng = np.random.default_rng(seed)
    inits: list[onnx.TensorProto] = []
    nodes, prev = _relu_layers(rng, range(1, layers + 1), "x", hidden, inits)
    w = (rng.standard_normal((hidden, hidden, kernel)) / np.sqrt(hidden * kernel)).astype(np.float32)
    b = (0.5 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
    inits += [numpy_helper.from_array(w, "Wconv"), numpy_helper.from_array(b, "bconv")]
    nodes += [
        helper.make_node("Transpose", [prev], ["channels"], perm=[0, 2, 1], name="to_channels"),
        helper.make_node("Conv", ["channels", "Wconv", "bconv"], ["conv"], kernel_shape=[kernel],
                         pads=[kernel // 2, kernel // 2], name="conv_seq"),
        helper.make_node("ReduceMean", ["conv"], ["pooled"], axes=[2], keepdims=0, name="mean_seq"),
    ]
    graph = helper.make_graph(
        nodes,
        "conv_pool",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", hidden])],
        [helper.make_tensor_value_info("pooled", TensorProto.FLOAT, ["batch", hidden])],
        initializer=inits,
    )
    return _model(graph)
