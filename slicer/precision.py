"""Half precision: a model's float weights and arithmetic in fp16 or bf16 (`dvabatch slice --precision`).

`convert(model, precision)` rewrites an fp32 graph: onnxruntime's own float16 converter
(`onnxruntime.transformers.float16`) turns its float tensors, initializers and `Cast`s to fp16,
keeps the graph's inputs and outputs in their types (a cast after each input and before each
output) and leaves in fp32 the ops its block list names (those without half kernels: TopK, Range,
Resize's relatives, ...). bf16 is that graph retyped: every fp16 type, `Cast` and tensor becomes
bf16, the initializers re-encoded from their fp32 values (bf16 has fp32's range, so nothing is
clamped to fp16's 65504; only finite values past bf16's largest are clamped to it). The nodes
come back in topological order (the converter appends its casts at the end; the torch engine runs
nodes in order).

The slicer converts each stage and the unsliced model so, each with its own inputs and outputs in
their types: the boundaries between stages stay fp32 (two small casts per stage; the runtime's
buffers, copies and manifest are the same in every precision).

A converted model is checked against the fp32 one on the same inputs (`check_outputs`): each output
within `Precision.tolerance` of the fp32 output's largest magnitude. The tolerance is a rule: the
format's unit roundoff (2^-11 for fp16, 2^-8 for bf16) times `ROUNDOFF_BUDGET`, the rounding error a
deep network's forward pass may accumulate (each layer's error is a few roundoffs of its output,
and normalization keeps the errors from compounding; docs/slicing.md gives what models show).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from .errors import SliceError, one_line

ROUNDOFF_BUDGET = 64  # unit roundoffs of an output's scale: the error a converted model may show


@dataclass(frozen=True)
class Precision:
    name: str  # "fp32", "fp16", "bf16"
    onnx_type: int  # TensorProto's element type of its floats
    unit_roundoff: float  # half the distance from 1 to the next number: 2^-(mantissa bits + 1)

    @property
    def tolerance(self) -> float:
        """The largest |converted - fp32| an output may show, over the fp32 output's largest magnitude."""
        return ROUNDOFF_BUDGET * self.unit_roundoff

    @property
    def is_half(self) -> bool:
        return self.name != "fp32"


PRECISIONS: dict[str, Precision] = {
    "fp32": Precision("fp32", TensorProto.FLOAT, 2.0**-24),
    "fp16": Precision("fp16", TensorProto.FLOAT16, 2.0**-11),
    "bf16": Precision("bf16", TensorProto.BFLOAT16, 2.0**-8),
}


FP32 = PRECISIONS["fp32"]


def precision(name: str) -> Precision:
    try:
        return PRECISIONS[name]
    except KeyError:
        raise SliceError(f"precision {name!r} is not one of {', '.join(PRECISIONS)}") from None


def convert(model: onnx.ModelProto, to: Precision) -> onnx.ModelProto:
    """`model` (fp32) in precision `to`, its inputs and outputs in their types; fp32 is a copy."""
    if not to.is_half:
        out = onnx.ModelProto()
        out.CopyFrom(model)
        return out
    from onnxruntime.transformers.float16 import convert_float_to_float16
    from onnxruntime.transformers.onnx_model import OnnxModel

    try:
        half = convert_float_to_float16(model, keep_io_types=True, disable_shape_infer=False)
    except Exception as exc:  # the converter's shape inference or an attribute it cannot convert
        raise SliceError(f"the model cannot be converted to {to.name}: {one_line(exc)}") from exc
    if to.onnx_type == TensorProto.BFLOAT16:
        _retype_graph(half.graph, {t.name: t for t in model.graph.initializer})
    OnnxModel(half).topological_sort()
    return half


def _retype_graph(graph: onnx.GraphProto, fp32: Mapping[str, TensorProto]) -> None:
    """fp16 -> bf16 everywhere in `graph` and its subgraphs; initializers from their fp32 values."""
    for tensor in graph.initializer:
        _retype_tensor(tensor, fp32.get(tensor.name))
    for info in [*graph.input, *graph.output, *graph.value_info]:
        if info.type.tensor_type.elem_type == TensorProto.FLOAT16:
            info.type.tensor_type.elem_type = TensorProto.BFLOAT16
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                _retype_tensor(attr.t, None)
            elif attr.type == onnx.AttributeProto.GRAPH:
                _retype_graph(attr.g, fp32)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for sub in attr.graphs:
                    _retype_graph(sub, fp32)
            elif attr.name in ("to", "dtype") and attr.type == onnx.AttributeProto.INT \
                    and attr.i == TensorProto.FLOAT16:
                attr.i = TensorProto.BFLOAT16


def _retype_tensor(tensor: TensorProto, fp32: TensorProto | None) -> None:
    if tensor.data_type != TensorProto.FLOAT16:
        return
    values = numpy_helper.to_array(fp32) if fp32 is not None and fp32.data_type == TensorProto.FLOAT \
        else numpy_helper.to_array(tensor).astype(np.float32)
    # a finite value past bf16's largest (fp32's own min, a common mask fill) would round to inf
    largest = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
    values = np.where(np.isfinite(values), np.clip(values, -largest, largest), values)
    tensor.CopyFrom(numpy_helper.from_array(values.astype(ml_dtypes.bfloat16), tensor.name))


def output_error(got: np.ndarray, ref: np.ndarray) -> float:
    """|got - ref| at its largest, over ref's largest magnitude (at least 1e-30); 0 for empty or
    non-float outputs, inf where one is not finite and the other is."""
    if ref.size == 0 or not np.issubdtype(ref.dtype, np.floating):
        return 0.0 if np.array_equal(got, ref) else float("inf")
    got64, ref64 = got.astype(np.float64), ref.astype(np.float64)
    if not np.array_equal(np.isfinite(got64), np.isfinite(ref64)):
        return float("inf")
    finite = np.isfinite(ref64)
    if not finite.any():
        return 0.0
    scale = max(float(np.max(np.abs(ref64[finite]))), 1e-30)
    return float(np.max(np.abs(got64[finite] - ref64[finite]))) / scale


def check_outputs(got: Mapping[str, np.ndarray], ref: Mapping[str, np.ndarray], to: Precision, what: str) -> float:
    """The largest `output_error` over the outputs, or a SliceError naming the output past the tolerance."""
    worst = 0.0
    for name, expected in ref.items():
        error = output_error(np.asarray(got[name]), expected)
        if not error <= to.tolerance:
            raise SliceError(f"{what} in {to.name}: output {name!r} differs from the fp32 model by {error:.3g} of "
                             f"its largest magnitude (> {to.tolerance:.3g}, {ROUNDOFF_BUDGET} unit roundoffs)")
        worst = max(worst, error)
    return worst


def convert_stages(folder: Path, stage_files: Sequence[str], full_file: str, whole: onnx.ModelProto,
                   to: Precision) -> None:
    """A sliced model's version folder in precision `to`: each stage file converted in place, its own
    inputs and outputs (the boundaries) kept in their types, and the unsliced model replaced by
    `whole` (the model converted once)."""
    for file in stage_files:
        path = folder / file
        onnx.save(convert(onnx.load(str(path)), to), str(path))
    onnx.save(whole, str(folder / full_file))
