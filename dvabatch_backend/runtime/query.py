"""Queries: one inference request's tensors, its arrival time, its length, how to answer it, and
where it is in its life (`QueryState`); and the copies between queries and buffer rows.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

from .errors import BadInputError, QueryError
from .manifest import SEQ, Manifest, TensorSpec, dim_size, is_length_dim


@dataclass(frozen=True)
class Answer:
    """Exactly one per query: its outputs, or the error that replaces them."""

    query_id: int
    outputs: dict[str, np.ndarray] | None
    error: QueryError | None

    @property
    def ok(self) -> bool:
        return self.error is None


Reply = Callable[[Answer], None]


class QueryState(enum.Enum):
    """A query's life, in order: waiting to be batched, in a batch, answered (result or error)."""

    WAITING = 1
    BATCHED = 2
    ANSWERED = 3

    @property
    def is_finished(self) -> bool:
        return self is QueryState.ANSWERED


@dataclass(frozen=True)
class QueryInfo:
    """What a policy may know of a waiting query."""

    id: int
    length: int
    arrival: float


@dataclass
class Query:
    id: int
    inputs: dict[str, np.ndarray]  # one sample each: no batch dimension
    length: int  # actual input length along "seq"; 0 for models without one
    arrival: float
    reply: Reply
    state: QueryState = QueryState.WAITING
    info: QueryInfo = field(init=False)
    deadline: float | None = None  # its timeout: dropped if still queued after this
    slo_deadline: float | None = None  # arrival + the latency target
    cancelled: bool = False
    entered: bool = False  # stage 0 took it (or it was answered): no longer queued

    def __post_init__(self) -> None:
        self.info = QueryInfo(self.id, self.length, self.arrival)


def validate_inputs(
    query_id: int, inputs: Mapping[str, np.ndarray], manifest: Manifest
) -> tuple[dict[str, np.ndarray], int]:
    """Check one query's tensors against the model inputs; return them (as arrays) and the length.

    NaN and infinities are data, not errors: they pass through.
    """
    if not isinstance(inputs, Mapping):
        raise BadInputError(query_id, f"inputs must map input names to tensors, got {type(inputs).__name__}")
    specs = {t.name: t for t in manifest.inputs}
    missing = sorted(set(specs) - set(inputs))
    unknown = sorted(set(inputs) - set(specs))
    if missing:
        raise BadInputError(query_id, f"missing input(s) {missing}; the model expects {sorted(specs)}")
    if unknown:
        raise BadInputError(query_id, f"unknown input(s) {unknown}; the model expects {sorted(specs)}")
    arrays: dict[str, np.ndarray] = {}
    lengths: set[int] = set()
    for name, spec in specs.items():
        arr = np.asarray(inputs[name])
        _check_tensor(query_id, arr, spec, manifest.max_length)
        bound = manifest.input_bounds.get(name)
        if bound is not None and (int(arr.min()) < 0 or int(arr.max()) >= bound):
            bad = int(arr.min()) if int(arr.min()) < 0 else int(arr.max())
            raise BadInputError(query_id, f"input {name!r} holds {bad}, outside [0, {bound}): it indexes a table of "
                                          f"{bound} rows")
        if spec.has_seq:
            length = arr.shape[spec.dims.index(SEQ) - 1]
            if length % manifest.length_multiple:
                raise BadInputError(query_id, f"input {spec.name!r} has length {length}, not a multiple of "
                                              f"{manifest.length_multiple} (the model's outputs are the length "
                                              f"divided by it)")
            lengths.add(length)
        arrays[name] = arr
    if len(lengths) > 1:
        raise BadInputError(query_id, f"inputs disagree on the sequence length: {sorted(lengths)}")
    return arrays, (lengths.pop() if lengths else 0)


def _check_tensor(query_id: int, arr: np.ndarray, spec: TensorSpec, max_length: int) -> None:
    expected_rank = len(spec.dims) - 1
    if arr.dtype != spec.np_dtype:
        raise BadInputError(query_id, f"input {spec.name!r} has dtype {arr.dtype}, expected {spec.dtype}")
    if arr.ndim != expected_rank:
        raise BadInputError(
            query_id,
            f"input {spec.name!r} has rank {arr.ndim} (shape {list(arr.shape)}), expected rank "
            f"{expected_rank} for one query of dims {list(spec.dims[1:])}",
        )
    if arr.size == 0:
        raise BadInputError(query_id, f"input {spec.name!r} is empty (shape {list(arr.shape)})")
    for axis, (got, want) in enumerate(zip(arr.shape, spec.dims[1:])):
        if want == SEQ:
            if got > max_length:
                raise BadInputError(
                    query_id, f"input {spec.name!r} has length {got}, longer than the largest profiled {max_length}"
                )
        elif got != want:
            raise BadInputError(query_id, f"input {spec.name!r} dim {axis} is {got}, expected {want}")


def gather_inputs(queries: list[Query], rows: dict[str, np.ndarray], specs: tuple[TensorSpec, ...]) -> None:
    """Copy each query's tensors into its buffer row, zero-padded to the batch's length."""
    for spec in specs:
        dest = rows[spec.name]
        for r, query in enumerate(queries):
            src = query.inputs[spec.name]
            dest[r].fill(0)
            dest[r][tuple(slice(0, n) for n in src.shape)] = src


def scatter_outputs(
    queries: list[Query], rows: dict[str, np.ndarray], specs: tuple[TensorSpec, ...]
) -> list[dict[str, np.ndarray]]:
    """Copy each query's results out of its output row, cut back to its own length on every
    length dim (`seq` and the lengths derived from it)."""
    results = []
    for r, query in enumerate(queries):
        out = {}
        for spec in specs:
            row = rows[spec.name][r]
            if spec.has_seq:
                row = row[tuple(slice(0, dim_size(d, query.length)) if is_length_dim(d) else slice(None)
                                for d in spec.dims[1:])]
            out[spec.name] = np.array(row, copy=True)
        results.append(out)
    return results
