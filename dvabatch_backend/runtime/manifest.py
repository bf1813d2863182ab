"""The model manifest: what a sliced model directory holds, as a versioned JSON document.

`Manifest.load` validates everything the runtime relies on and refuses a bad document
with a `ManifestError` naming the field; `Manifest.dump` writes what `load` reads back.

Tensor dimensions are ints or symbols: ``"batch"`` (always the first dimension), ``"seq"``
(the input length, at most ``max_length``), and lengths derived from it: any expression of
``seq`` in `length_expr`'s grammar, such as ``"(seq+1)//2"`` or ``"floor(floor(seq/2 - 1/2)/2) + 1"``
(a convolution's output width; a detector head's sum of three). Every stage's inputs are exactly
the previous stage's outputs (same names, dtypes and dims), so buffers between stages are
shared by name.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .errors import ManifestError
from .length_expr import is_length, parse_length

SCHEMA_VERSION = 1
BATCH = "batch"
SEQ = "seq"
SUPPORTED_DTYPES = ("float32", "float16", "float64", "int64", "int32", "int8", "uint8", "bool")

Dim = int | str
_DERIVED = re.compile(r"^(?:seq|\(seq\+(\d+)\))//(\d+)$")


def derived_dim(add: int, divisor: int) -> str:
    """The dim ``floor((seq + add) / divisor)``; plain ``seq`` for (0, 1)."""
    if divisor == 1 and add == 0:
        return SEQ
    return f"seq//{divisor}" if add == 0 else f"(seq+{add})//{divisor}"


def is_length_dim(dim: Dim) -> bool:
    """`seq` or a length derived from it."""
    return dim == SEQ or is_length(dim)


def length_dim_terms(dim: Dim) -> tuple[int, int]:
    """(A, K) of a length dim of the simple form ``floor((seq + A) / K)``; `seq` is (0, 1).
    Raises ValueError for any other expression."""
    if dim == SEQ:
        return 0, 1
    match = _DERIVED.match(dim) if isinstance(dim, str) else None
    if match is None:
        raise ValueError(f"{dim!r} is not a length dim")
    return int(match.group(1) or 0), int(match.group(2))


def dim_size(dim: Dim, length: int) -> int:
    """The size of a non-batch dim for queries padded to `length`."""
    if isinstance(dim, str):
        return parse_length(dim)(length)
    return int(dim)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    dims: tuple[Dim, ...]

    def __hash__(self) -> int:  # kept: every query's checks look specs up in caches keyed by them
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.name, self.dtype, self.dims))
            object.__setattr__(self, "_hash", cached)
        return cached

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)

    @property
    def has_seq(self) -> bool:
        """Some dim is the length or derived from it."""
        return any(is_length_dim(d) for d in self.dims)

    def shape(self, batch: int, length: int) -> tuple[int, ...]:
        """The concrete shape for `batch` rows padded to `length`."""
        return tuple(batch if d == BATCH else dim_size(d, length) for d in self.dims)

    def sample_shape(self, length: int) -> tuple[int, ...]:
        """The shape of one query's tensor (no batch dimension)."""
        return self.shape(1, length)[1:]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "dims": list(self.dims)}


@dataclass(frozen=True)
class StageSpec:
    file: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "inputs": [t.to_json() for t in self.inputs],
            "outputs": [t.to_json() for t in self.outputs],
        }


@dataclass(frozen=True)
class Manifest:
    name: str
    max_batch_size: int
    max_length: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    stages: tuple[StageSpec, ...]
    full_model: str | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    # zero-padding a query to a longer batch length leaves its answer unchanged (measured by the
    # slicer); when False the runtime batches only queries of the same length and never pads them
    pad_safe: bool = True
    # outputs whose batch axis in the model's own layout is not the first (time-major [T, N, C]):
    # the runtime keeps them batch-first; a response stacks its rows along this axis
    output_batch_axes: dict[str, int] = field(default_factory=dict, compare=False)
    # the lengths the model itself takes (the slicer ran it at each length of a sweep): a multiple
    # of `length_multiple`, at least `min_length`; `length_rule` says why ("" when every length runs)
    length_multiple: int = 1
    # integer inputs that index a table (token ids into an embedding): valid values are [0, bound)
    input_bounds: dict[str, int] = field(default_factory=dict, compare=False)
    min_length: int = 1
    length_rule: str = ""

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def has_seq(self) -> bool:
        return any(t.has_seq for t in self.inputs)

    def takes_length(self, length: int) -> bool:
        """The model takes queries of this length (the slicer's `length_rule`, at most max_length)."""
        return self.min_length <= length <= self.max_length and length % self.length_multiple == 0

    def valid_lengths(self) -> list[int]:
        """Every length the model takes, in order; [0] for a model without one."""
        if not self.has_seq:
            return [0]
        return [n for n in range(self.min_length, self.max_length + 1) if self.takes_length(n)]

    @property
    def fast_path_engine(self) -> str:
        """What runs a batch that meets nobody (`Scheduler.serve_whole_model`): "model", the unsliced model
        (`full_model`), when the slicer measured it faster than the stages in a row; else "stages"."""
        choice = self.extra.get("fast_path")
        engine = choice.get("engine") if isinstance(choice, dict) else None
        return "model" if engine == "model" and self.full_model else "stages"

    def stage_times(self) -> tuple[dict[int, float], ...]:
        """Profiled seconds per stage keyed by batch size (the slicer's `stage_times`); () without a profile."""
        return _per_stage_times(self.extra.get("stage_times"), self.num_stages) or ()

    def stage_times_by_length(self) -> dict[int, tuple[dict[int, float], ...]]:
        """The same per profiled sequence length: {length: per stage {bs: seconds}}; {} without one."""
        by_length = self.extra.get("stage_times_by_length")
        if not isinstance(by_length, dict):
            return {}
        out = {}
        for length, stages in by_length.items():
            times = _per_stage_times(stages, self.num_stages)
            if times is not None:
                out[int(length)] = times
        return out

    def boundary(self, k: int) -> tuple[TensorSpec, ...]:
        """Tensors at boundary k: 0 is the model input, `num_stages` the model output."""
        return self.stages[k].inputs if k < self.num_stages else self.stages[-1].outputs

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "name": self.name,
            "max_batch_size": self.max_batch_size,
            "max_length": self.max_length,
            "inputs": [t.to_json() for t in self.inputs],
            "outputs": [t.to_json() for t in self.outputs],
            "stages": [s.to_json() for s in self.stages],
            "full_model": self.full_model,
            "pad_safe": self.pad_safe,
            "output_batch_axes": dict(self.output_batch_axes),
            "length_multiple": self.length_multiple,
            "input_bounds": dict(self.input_bounds),
            "min_length": self.min_length,
            "length_rule": self.length_rule,
        }
        doc.update(self.extra)
        return doc

    def dump(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Manifest":
        path = Path(path)
        if not path.is_file():
            raise ManifestError(str(path), "manifest file not found")
        try:
            doc = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ManifestError(str(path), f"not a readable JSON document ({exc})") from exc
        manifest = cls.from_json(doc)
        for i, stage in enumerate(manifest.stages):
            if not (path.parent / stage.file).is_file():
                raise ManifestError(f"stages[{i}].file", f"{stage.file!r} not found beside the manifest")
        return manifest

    @classmethod
    def from_json(cls, doc: Any) -> "Manifest":
        if not isinstance(doc, dict):
            raise ManifestError("manifest", "must be a JSON object")
        version = _field(doc, "schema_version", int, "manifest")
        if version != SCHEMA_VERSION:
            raise ManifestError("schema_version", f"{version} is not supported (expected {SCHEMA_VERSION})")
        name = _field(doc, "name", str, "manifest")
        max_bs = _field(doc, "max_batch_size", int, "manifest")
        if max_bs < 1:
            raise ManifestError("max_batch_size", f"must be >= 1, got {max_bs}")
        max_len = _field(doc, "max_length", int, "manifest")
        if max_len < 0:
            raise ManifestError("max_length", f"must be >= 0, got {max_len}")
        inputs = _tensors(_field(doc, "inputs", list, "manifest"), "inputs")
        outputs = _tensors(_field(doc, "outputs", list, "manifest"), "outputs")
        raw_stages = _field(doc, "stages", list, "manifest")
        if not raw_stages:
            raise ManifestError("stages", "must list at least one stage")
        stages = tuple(_stage(s, f"stages[{i}]") for i, s in enumerate(raw_stages))
        full = doc.get("full_model")
        if full is not None and not isinstance(full, str):
            raise ManifestError("full_model", "must be a string or null")
        pad_safe = doc.get("pad_safe", True)  # manifests written before it was measured: True
        if not isinstance(pad_safe, bool):
            raise ManifestError("pad_safe", f"must be true or false, got {pad_safe!r}")
        known = {"schema_version", "name", "max_batch_size", "max_length", "inputs", "outputs", "stages", "full_model",
                 "pad_safe", "output_batch_axes", "length_multiple", "input_bounds", "min_length", "length_rule"}
        extra = {k: v for k, v in doc.items() if k not in known}
        axes = doc.get("output_batch_axes", {})
        if not isinstance(axes, dict) or not all(
                k in {t.name for t in outputs} and isinstance(v, int) and not isinstance(v, bool) and v >= 1
                for k, v in axes.items()):
            raise ManifestError("output_batch_axes", f"must map model outputs to an axis >= 1, got {axes!r}")
        multiple = doc.get("length_multiple", 1)
        if not isinstance(multiple, int) or isinstance(multiple, bool) or multiple < 1:
            raise ManifestError("length_multiple", f"must be an int >= 1, got {multiple!r}")
        bounds = doc.get("input_bounds", {})
        if not isinstance(bounds, dict) or not all(
                k in {t.name for t in inputs} and isinstance(v, int) and not isinstance(v, bool) and v >= 1
                for k, v in bounds.items()):
            raise ManifestError("input_bounds", f"must map model inputs to a bound >= 1, got {bounds!r}")
        min_length = doc.get("min_length", 1)
        if not isinstance(min_length, int) or isinstance(min_length, bool) or not 1 <= min_length <= max(1, max_len):
            raise ManifestError("min_length", f"must be an int from 1 to max_length, got {min_length!r}")
        rule = doc.get("length_rule", "")
        if not isinstance(rule, str):
            raise ManifestError("length_rule", f"must be a string, got {rule!r}")
        manifest = cls(name, max_bs, max_len, inputs, outputs, stages, full, extra, pad_safe, axes, multiple, bounds,
                       min_length, rule)
        _check_chain(manifest)
        return manifest


def _field(doc: dict[str, Any], key: str, kind: type, where: str) -> Any:
    if key not in doc:
        raise ManifestError(key if where == "manifest" else f"{where}.{key}", "missing")
    value = doc[key]
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        label = key if where == "manifest" else f"{where}.{key}"
        raise ManifestError(label, f"must be {kind.__name__}, got {type(value).__name__}")
    return value


def _tensors(raw: Sequence[Any], where: str) -> tuple[TensorSpec, ...]:
    if not raw:
        raise ManifestError(where, "must list at least one tensor")
    specs = tuple(_tensor(t, f"{where}[{i}]") for i, t in enumerate(raw))
    names = [t.name for t in specs]
    if len(set(names)) != len(names):
        raise ManifestError(where, f"duplicate tensor names in {names}")
    return specs


def _tensor(raw: Any, where: str) -> TensorSpec:
    if not isinstance(raw, dict):
        raise ManifestError(where, "must be an object")
    name = _field(raw, "name", str, where)
    dtype = _field(raw, "dtype", str, where)
    if dtype not in SUPPORTED_DTYPES:
        raise ManifestError(f"{where}.dtype", f"{dtype!r} is not one of {SUPPORTED_DTYPES}")
    dims = _field(raw, "dims", list, where)
    if not dims or dims[0] != BATCH:
        raise ManifestError(f"{where}.dims", f"must start with {BATCH!r}, got {dims}")
    for d in dims[1:]:
        if is_length_dim(d) or (isinstance(d, int) and not isinstance(d, bool) and d > 0):
            continue
        raise ManifestError(f"{where}.dims", f"{d!r} is neither a positive int, {SEQ!r} nor a length expression "
                                             f"of it such as 'floor(seq/2) + 1'")
    return TensorSpec(name, dtype, tuple(dims))


def _stage(raw: Any, where: str) -> StageSpec:
    if not isinstance(raw, dict):
        raise ManifestError(where, "must be an object")
    file = _field(raw, "file", str, where)
    return StageSpec(
        file,
        _tensors(_field(raw, "inputs", list, where), f"{where}.inputs"),
        _tensors(_field(raw, "outputs", list, where), f"{where}.outputs"),
    )


def _check_chain(m: Manifest) -> None:
    if set(m.stages[0].inputs) != set(m.inputs):
        raise ManifestError("stages[0].inputs", "must equal the model inputs")
    for i in range(1, m.num_stages):
        if set(m.stages[i].inputs) != set(m.stages[i - 1].outputs):
            raise ManifestError(f"stages[{i}].inputs", f"must equal stages[{i - 1}].outputs")
    if set(m.stages[-1].outputs) != set(m.outputs):
        raise ManifestError(f"stages[{m.num_stages - 1}].outputs", "must equal the model outputs")
    if m.has_seq and m.max_length < 1:
        raise ManifestError("max_length", "must be >= 1 for a model with a 'seq' dimension")
    seq_everywhere = [t for s in m.stages for t in s.inputs + s.outputs if t.has_seq]
    if seq_everywhere and not m.has_seq:
        raise ManifestError("inputs", "no input has a 'seq' dimension but a stage tensor does")


def _per_stage_times(raw: Any, num_stages: int) -> tuple[dict[int, float], ...] | None:
    if not isinstance(raw, list) or len(raw) != num_stages:
        return None
    return tuple({int(bs): float(t) for bs, t in stage.items()} for stage in raw)
