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

from dvabatch_backend.runtime.length_expr import is_length, parse_length
from dvabatch_backend.runtime.manifest import BATCH, SEQ

from .cut import OUTPUT_BATCH_AXES_KEY, input_specs
from .preflight import full_session
from .profiler import random_inputs

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


def batch_first_outputs(model: onnx.ModelProto, length: int) -> dict[str, int]:
    """Make every output batch-first in place (a `Transpose` after an output whose batch axis is
    not the first, e.g. an RNN's time-major [T, N, C]); return {output: its own batch axis}.

    The batch axis is the one that follows the batch size when the model runs at two of them.
    """
    session = _session(model)
    names = [o.name for o in model.graph.output]
    runs = [session.run(names, _feeds(model, batch, length)) for batch in (2, 3)]
    moved: dict[str, int] = {}
    for name, a2, a3 in zip(names, *runs):
        axes = [i for i, (d2, d3) in enumerate(zip(np.shape(a2), np.shape(a3))) if (d2, d3) == (2, 3)]
        if axes == [0]:
            continue
        if len(axes) != 1:
            raise AxisError(f"output {name!r} has no single batch axis (shapes {np.shape(a2)} at batch 2, "
                            f"{np.shape(a3)} at batch 3): every output must carry one row per query")
        axis = axes[0]
        rank = np.ndim(a2)
        inner = f"{name}__model_layout"
        for node in model.graph.node:
            node.output[:] = [inner if o == name else o for o in node.output]
            node.input[:] = [inner if i == name else i for i in node.input]
        perm = [axis] + [i for i in range(rank) if i != axis]
        model.graph.node.append(helper.make_node("Transpose", [inner], [name], perm=perm, name=f"{name}__batch_first"))
        moved[name] = axis
    for out in model.graph.output:
        if out.name in moved:
            out.type.tensor_type.ClearField("shape")
    if moved:
        helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props},
                                       OUTPUT_BATCH_AXES_KEY: ",".join(f"{k}={v}" for k, v in moved.items())})
    return moved


DENSE_RULE_LENGTHS = 64  # every length up to this is tried (a period up to 64 shows in full)
SPREAD_RULE_LENGTHS = 12  # and this many points above it, each with its neighbour and the next prime


@dataclass(frozen=True)
class LengthRule:
    """The lengths a model takes, as its own runs showed: multiples of `multiple`, at least
    `min_length`; `why` is the evidence ("" when every length tried ran)."""

    min_length: int = 1
    multiple: int = 1
    why: str = ""
    tried: int = 0

    def allows(self, length: int) -> bool:
        return length >= self.min_length and length % self.multiple == 0


def rule_lengths(max_length: int) -> list[int]:
    """The lengths `length_rule` runs the model at: every one up to DENSE_RULE_LENGTHS, then a
    spread to `max_length` with odd neighbours and primes (non-multiples of any stride)."""
    dense = set(range(1, min(max_length, DENSE_RULE_LENGTHS) + 1))
    if max_length > DENSE_RULE_LENGTHS:
        for point in np.geomspace(DENSE_RULE_LENGTHS + 1, max_length, SPREAD_RULE_LENGTHS):
            n = int(round(point))
            dense.update({n, n + 1, _next_prime(n)})
    return sorted(n for n in dense if n <= max_length)


def _next_prime(n: int) -> int:
    while n < 2 or any(n % d == 0 for d in range(2, int(n ** 0.5) + 1)):
        n += 1
    return n


def length_rule(model: onnx.ModelProto, max_length: int, strides: Sequence[int] = (),
                expected: Mapping[str, Sequence[object]] | None = None) -> LengthRule:
    """What lengths the canonical model takes, from running it (batch 1) at each of `rule_lengths`.

    A length is refused only where the model itself fails, answers with an empty output, or answers
    with a length dim other than its graph gives there (`expected`: output -> dims from symbolic
    inference; onnxruntime pads a pool that its input is too short for, say). Among
    the rules (a minimum, and a multiple from 1, `strides` and powers of two up to 64) that every
    length tried agrees with (each allowed length ran), the one allowing the most of the lengths
    that ran wins; the fewer refusals, the smaller multiple on a tie."""
    lengths = rule_lengths(max_length)
    session = _session(model)
    failed: dict[int, str] = {}
    for n in lengths:
        problem = _run_problem(session, model, 1, n, expected or {})
        if problem is not None:
            failed[n] = problem
    if not failed:
        return LengthRule(tried=len(lengths))
    ran = [n for n in lengths if n not in failed]
    if not ran:
        raise AxisError(f"the model runs at none of the lengths 1..{max_length} "
                        f"(at {lengths[-1]}: {failed[lengths[-1]]}); pass --max-length or --fixed")
    best: tuple[int, int, int] | None = None  # (allowed, -multiple, min_length)
    for multiple in sorted({1, *(int(k) for k in strides if 1 < k <= 64), *(2 ** j for j in range(1, 7))}):
        refused_multiples = [n for n in failed if n % multiple == 0]
        minimum = max(refused_multiples, default=0) + 1
        allowed = sum(1 for n in ran if n >= minimum and n % multiple == 0)
        if allowed >= 2 and (best is None or (allowed, -multiple) > best[:2]):
            best = (allowed, -multiple, minimum)
    if best is None:
        raise AxisError(f"the model runs at only {ran} of the lengths tried up to {max_length}; "
                        "pass --max-length or --fixed")
    _, neg_multiple, minimum = best
    multiple = -neg_multiple
    shown = sorted(failed)
    listed = ", ".join(map(str, shown[:8])) + (f" and {len(shown) - 8} more" if len(shown) > 8 else "")
    below = [n for n in shown if n < minimum]
    first = shown[-1] if multiple > 1 or not below else below[-1]
    why = (f"the model fails, or answers empty or off its graph's shape, at lengths {listed} of the {len(lengths)} "
           f"tried (at {first}: {failed[first]})")
    return LengthRule(minimum, multiple, why, len(lengths))


def probe_lengths(model: onnx.ModelProto, max_length: int, rule: LengthRule | None = None,
                  count: int = 5) -> list[int]:
    """Up to `count` lengths (at most `max_length`) the canonical model runs at, batch 2, that
    `rule` allows: the three smallest and two spread above them (the probes that confirm each
    length dim's expression, or fit one where inference has none)."""
    session = _session(model)
    rule = rule or LengthRule()
    steps = {rule.multiple * j for j in range(1, 4)} if rule.multiple > 1 else set()
    trials = [t for t in sorted({*(t for t in _LENGTH_TRIALS if t <= max_length), max_length, *steps})
              if t <= max_length and rule.allows(t)]
    runnable = [n for n in trials if _runs(session, model, 2, n)]
    if len(runnable) < 2:
        raise AxisError(
            f"the model runs at {len(runnable)} of the lengths {trials} (up to --max-length {max_length}): "
            f"it needs two; pass --max-length, or --fixed for the variable axis")
    picked = runnable[:3] + runnable[3:][len(runnable[3:]) // 2: len(runnable[3:]) // 2 + 1] + runnable[-1:]
    return sorted(set(picked))[:count]


def runnable_lengths(model: onnx.ModelProto, lengths: Sequence[int], multiple: int = 1) -> list[int]:
    """Those of `lengths` the canonical model runs at, rounded up to a multiple of `multiple`
    (within the largest); at least one."""
    top = max(lengths)
    wanted = sorted({min(-(-n // multiple) * multiple, top - top % multiple) for n in lengths} - {0})
    if not any(vi.type.tensor_type.shape.dim and any(d.dim_param == SEQ for d in vi.type.tensor_type.shape.dim)
               for vi in _model_inputs(model)):
        return list(lengths)
    session = _session(model)
    ok = [n for n in wanted if _runs(session, model, 2, n)]
    if not ok:
        raise AxisError(f"the model runs at none of the lengths {wanted}; pass --max-length or --fixed")
    return ok


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    return full_session(model)


def _feeds(model: onnx.ModelProto, batch: int, length: int) -> dict[str, np.ndarray]:
    return random_inputs(list(input_specs(model).values()), batch, length, np.random.default_rng(0))


def _runs(session: ort.InferenceSession, model: onnx.ModelProto, batch: int, length: int) -> bool:
    """The model takes this length: it runs, and no output comes back empty (a detector's grid of
    width // 32 cells at a width under 32)."""
    return _run_problem(session, model, batch, length) is None


def _run_problem(session: ort.InferenceSession, model: onnx.ModelProto, batch: int, length: int,
                 expected: Mapping[str, Sequence[object]] = {}) -> str | None:
    """Why the model does not take this length (its error's first line, an empty output, or an
    output length other than its graph's `expected` dims give), or None."""
    try:
        outputs = session.run(None, _feeds(model, batch, length))
    except Exception as exc:  # onnxruntime's errors for shapes a model cannot take
        text = str(exc).strip().splitlines()
        return (text[0] if text else type(exc).__name__)[:200]
    for meta, value in zip(session.get_outputs(), outputs):
        if 0 in np.shape(value):
            return f"output {meta.name!r} is empty"
        for axis, (got, dim) in enumerate(zip(np.shape(value), expected.get(meta.name, ()))):
            if is_length(dim) and got != (want := parse_length(str(dim))(length)):
                return f"output {meta.name!r} dim {axis} is {got} where its graph gives {dim} = {want}"
    return None


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
