"""Axis discovery: which dim of each model input is the batch, and which is the variable length.

Exporters name dims as they like (`batch_size`, `sequence_length`, `N`, `unk__214`,
`p2o.DynamicDimension.0`) or leave them unnamed (`-1`, no value). The runtime's manifest knows
two symbols, ``"batch"`` (first dim) and ``"seq"`` (one variable length shared by every input
that has it). `discover_axes` reads the graph, applies the user's overrides, and confirms the
result by running the model at two batch sizes and two lengths; `canonical_model` rewrites the
inputs' dims to the two symbols so that the rest of the slicer reads them. Probe lengths are the
model's own: the smallest lengths it runs at (a minimum size, a multiple of 32) are learned by
trying, not fixed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from dvabatch_backend.runtime.manifest import BATCH, SEQ

# lengths tried, in order, to find the ones the model accepts (small first: probing is cheap)
_LENGTH_TRIALS = (5, 7, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)


class AxisError(ValueError):
    """The model's axes cannot be served as they are; the message says what to pass or change."""


@dataclass(frozen=True)
class AxisOverrides:
    """The user's word on axes: `--batch-axis INPUT:AXIS`, `--variable-axis INPUT:AXIS`, `--fixed DIM=VALUE`.

    `fixed` keys are a dim name (`sequence_length`) or `INPUT:AXIS` for an unnamed dim.
    """

    batch_axis: Mapping[str, int] = field(default_factory=dict)
    variable_axis: Mapping[str, int] = field(default_factory=dict)
    fixed: Mapping[str, int] = field(default_factory=dict)

    @staticmethod
    def parse(batch_axis: Sequence[str] = (), variable_axis: Sequence[str] = (),
              fixed: Sequence[str] = ()) -> "AxisOverrides":
        return AxisOverrides(_pairs(batch_axis, ":", "--batch-axis INPUT:AXIS"),
                             _pairs(variable_axis, ":", "--variable-axis INPUT:AXIS"),
                             _pairs(fixed, "=", "--fixed DIM=VALUE"))


@dataclass(frozen=True)
class Axes:
    """Per model input: its variable axis (or None) and the names its dims had; the batch axis is 0."""

    variable: Mapping[str, int | None]
    original_dims: Mapping[str, tuple[str | int, ...]]
    fixed: Mapping[str, int]  # "INPUT:AXIS" -> value the user fixed

    @property
    def has_length(self) -> bool:
        return any(v is not None for v in self.variable.values())

    def describe(self) -> str:
        parts = []
        for name, dims in self.original_dims.items():
            axis = self.variable[name]
            var = f", variable axis {axis} ({dims[axis]!s})" if axis is not None else ""
            parts.append(f"{name}: batch axis 0 ({dims[0]!s}){var}")
        return "; ".join(parts)


def discover_axes(model: onnx.ModelProto, overrides: AxisOverrides = AxisOverrides()) -> Axes:
    """Find each input's batch axis (0) and variable axis from its declared dims and the overrides."""
    inputs = _model_inputs(model)
    unknown = sorted(set(overrides.batch_axis) | set(overrides.variable_axis) - {vi.name for vi in inputs})
    unknown = [n for n in unknown if n not in {vi.name for vi in inputs}]
    if unknown:
        raise AxisError(f"no model input named {unknown}; the inputs are {[vi.name for vi in inputs]}")
    variable: dict[str, int | None] = {}
    original: dict[str, tuple[str | int, ...]] = {}
    fixed: dict[str, int] = {}
    for vi in inputs:
        dims = _declared_dims(vi)
        original[vi.name] = tuple("?" if d is None else d for d in dims)
        batch = overrides.batch_axis.get(vi.name, 0)
        if batch != 0:
            raise AxisError(
                f"input {vi.name!r}: batch axis {batch} is not supported, the batch must be the first axis of "
                f"every input; re-export with the batch first")
        if not dims:
            raise AxisError(f"input {vi.name!r} is a scalar: it has no batch axis; re-export it with one")
        if isinstance(dims[0], int):
            raise AxisError(
                f"input {vi.name!r} has a fixed batch dim of {dims[0]} (dims {list(original[vi.name])}): the model "
                f"cannot run a batch of queries; re-export it with a dynamic batch axis, e.g. "
                f"torch.onnx.export(..., dynamic_axes={{{vi.name!r}: {{0: 'batch'}}}})")
        dynamic = []
        for axis, d in enumerate(dims[1:], start=1):
            value = overrides.fixed.get(f"{vi.name}:{axis}")
            if value is None and isinstance(d, str):
                value = overrides.fixed.get(d)
            if value is not None:
                fixed[f"{vi.name}:{axis}"] = int(value)
            elif not isinstance(d, int):
                dynamic.append(axis)
        chosen = overrides.variable_axis.get(vi.name)
        if chosen is not None:
            if chosen not in dynamic:
                raise AxisError(f"--variable-axis {vi.name}:{chosen}: axis {chosen} of {vi.name!r} is not dynamic "
                                f"(dims {list(original[vi.name])})")
            dynamic = [chosen] + [a for a in dynamic if a != chosen]
        if len(dynamic) > 1:
            names = [f"{a} ({original[vi.name][a]})" for a in dynamic]
            raise AxisError(
                f"input {vi.name!r} has {len(dynamic)} variable axes {names}: dvabatch batches along one; "
                f"pass --variable-axis {vi.name}:AXIS and --fixed NAME=VALUE (or --fixed {vi.name}:AXIS=VALUE) "
                f"for the others")
        variable[vi.name] = dynamic[0] if dynamic else None
    _check_shared_length(variable, original)
    return Axes(variable, original, fixed)


def _check_shared_length(variable: Mapping[str, int | None], original: Mapping[str, tuple[str | int, ...]]) -> None:
    """Every variable axis is the one length: named ones must share their name (unnamed ones are
    confirmed by running the model with one length for all)."""
    names = {str(original[n][a]) for n, a in variable.items() if a is not None and original[n][a] != "?"}
    if len(names) > 1:
        raise AxisError(
            f"the inputs' variable axes have different names {sorted(names)}: dvabatch serves one variable length "
            f"shared by every input; fix the others with --fixed NAME=VALUE")


def canonical_model(model: onnx.ModelProto, axes: Axes) -> onnx.ModelProto:
    """A copy of `model` whose inputs' dims are ``batch``, ``seq`` and the fixed values, and whose
    other declared shapes no longer name the old symbols (they are inferred again where needed)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    old_symbols: set[str] = set()
    for vi in _model_inputs(out):
        for axis, dim in enumerate(vi.type.tensor_type.shape.dim):
            if dim.HasField("dim_param"):
                old_symbols.add(dim.dim_param)
            fixed = axes.fixed.get(f"{vi.name}:{axis}")
            dim.Clear()
            if axis == 0:
                dim.dim_param = BATCH
            elif axes.variable[vi.name] == axis:
                dim.dim_param = SEQ
            elif fixed is not None:
                dim.dim_value = fixed
            else:
                dim.dim_value = int(axes.original_dims[vi.name][axis])
    # declared shapes elsewhere may still use the old names (or clash with ours): drop the names
    for vi in list(out.graph.output) + list(out.graph.value_info):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape"):
            for dim in vi.type.tensor_type.shape.dim:
                if dim.HasField("dim_param"):
                    dim.Clear()
    del out.graph.value_info[:]
    return out


def probe_lengths(model: onnx.ModelProto, max_length: int, count: int = 2) -> list[int]:
    """The `count` smallest lengths (at most `max_length`) the canonical model runs at, batch 2.

    A model that needs a minimum size or a multiple of some step (a detector's 32) shows it here.
    """
    session = _session(model)
    found: list[int] = []
    for length in sorted({*(t for t in _LENGTH_TRIALS if t <= max_length), max_length}):
        if _runs(session, model, 2, length):
            found.append(length)
            if len(found) == count:
                return found
    raise AxisError(
        f"the model runs at none of the lengths {sorted(set(t for t in _LENGTH_TRIALS if t <= max_length))} "
        f"(up to --max-length {max_length}); pass --max-length, or --fixed for the variable axis")


def runnable_lengths(model: onnx.ModelProto, lengths: Sequence[int]) -> list[int]:
    """Those of `lengths` the canonical model runs at (all of them for most models); at least one."""
    if not any(vi.type.tensor_type.shape.dim and any(d.dim_param == SEQ for d in vi.type.tensor_type.shape.dim)
               for vi in _model_inputs(model)):
        return list(lengths)
    session = _session(model)
    ok = [n for n in lengths if _runs(session, model, 2, n)]
    if not ok:
        ok = probe_lengths(model, max(lengths), count=1)
    return ok


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 4
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _runs(session: ort.InferenceSession, model: onnx.ModelProto, batch: int, length: int) -> bool:
    rng = np.random.default_rng(0)
    feeds = {}
    for vi in _model_inputs(model):
        tt = vi.type.tensor_type
        shape = [batch if d.dim_param == BATCH else length if d.dim_param == SEQ else d.dim_value for d in tt.shape.dim]
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type))
        feeds[vi.name] = (rng.standard_normal(shape).astype(dtype) if np.issubdtype(dtype, np.floating)
                          else np.ones(shape, dtype))
    try:
        session.run(None, feeds)
    except Exception:  # onnxruntime's errors for shapes a model cannot take
        return False
    return True


def _model_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    inits = {t.name for t in model.graph.initializer} | {t.values.name for t in model.graph.sparse_initializer}
    return [vi for vi in model.graph.input if vi.name not in inits]


def _declared_dims(vi: onnx.ValueInfoProto) -> list[str | int | None]:
    """Each dim of a declared input: its size, its name, or None (unnamed, -1 or unknown)."""
    if not vi.type.HasField("tensor_type") or not vi.type.tensor_type.HasField("shape"):
        raise AxisError(f"model input {vi.name!r} has no declared shape; re-export it with one")
    dims: list[str | int | None] = []
    for d in vi.type.tensor_type.shape.dim:
        if d.HasField("dim_value") and d.dim_value > 0:
            dims.append(int(d.dim_value))
        elif d.HasField("dim_param") and d.dim_param:
            dims.append(d.dim_param)
        else:
            dims.append(None)
    return dims


def _pairs(items: Sequence[str], sep: str, usage: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        key, found, value = item.rpartition(sep)
        try:
            out[key] = int(value)
        except ValueError:
            found = ""
        if not found or not key:
            raise AxisError(f"{item!r}: expected {usage}")
    return out
