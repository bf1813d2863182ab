"""Queries: one inference request's tensors, its arrival time, its length, how to answer it, and
where it is in its life (`QueryState`); and the copies between queries and buffer rows.
"""
from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np

from .errors import BadInputError, QueryError
from .length_expr import parse_length
from .manifest import SEQ, Manifest, TensorSpec, is_length_dim


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


class QueryState(enum.IntEnum):
    """A query's life, in order (a query only moves forward, `QueryTable` moves it): admitted and
    waiting for the policy, in a batch not yet started, taken by stage 0, answered (its result or
    an error; a query refused at arrival goes straight here). "Queued" (the queue bound's gauge)
    is the first two."""

    WAITING = 1
    BATCHED = 2
    RUNNING = 3
    ANSWERED = 4

    @property
    def is_queued(self) -> bool:
        return self <= QueryState.BATCHED

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
    # the client cancelled it: a mark, not a state, as the query may be running (it then finishes,
    # and its answer goes to a request nobody awaits)
    cancelled: bool = False
    request: int = -1  # the id of its request's first row: a request's rows are refused together
    work: float = 0.0  # its share of a backlog batch's profiled seconds at its length, while queued (admission.py)


    def __post_init__(self) -> None:
        self.info = QueryInfo(self.id, self.length, self.arrival)


@dataclass(frozen=True)
class _InputRule:
    """What checking one input needs, worked out once per spec (a property like `np_dtype` or
    `has_seq` costs a dtype lookup or a regex per call, and this runs for every query)."""

    np_dtype: np.dtype
    rank: int  # of one query's tensor: no batch dim
    seq_axis: int | None  # the query tensor's length axis, if it has one


@functools.lru_cache(maxsize=256)
def _input_rule(spec: TensorSpec) -> _InputRule:
    return _InputRule(spec.np_dtype, len(spec.dims) - 1, spec.dims.index(SEQ) - 1 if spec.has_seq else None)


@functools.lru_cache(maxsize=64)
def _specs_by_name(specs: tuple[TensorSpec, ...]) -> dict[str, TensorSpec]:
    return {t.name: t for t in specs}


def request_rows(requests: Sequence[Mapping[str, np.ndarray]]) -> list[int]:
    """The rows of each request (its first input's batch axis; 1 for a request without inputs): the
    Triton adapter's count of a call's size."""
    return [next(iter(r.values())).shape[0] if r else 1 for r in requests]


def read_query(query_id: int, inputs: Mapping[str, np.ndarray], manifest: Manifest, arrival: float,
               reply: Reply) -> Query | BadInputError:
    """One arrived query, or why its inputs are bad (inputs that are not even tensors included: still
    this query's answer, not the caller's crash)."""
    try:
        arrays, length = validate_inputs(query_id, inputs, manifest)
    except BadInputError as exc:
        return exc
    except Exception as exc:
        return BadInputError(query_id, f"malformed input: {exc}")
    return Query(query_id, arrays, length, arrival, reply)


def validate_inputs(
    query_id: int, inputs: Mapping[str, np.ndarray], manifest: Manifest
) -> tuple[dict[str, np.ndarray], int]:
    """Check one query's tensors against the model inputs; return them (as arrays) and the length.

    NaN and infinities are data, not errors: they pass through.
    """
    if type(inputs) is not dict and not isinstance(inputs, Mapping):  # the ABC check is slow: dicts first
        raise BadInputError(query_id, f"inputs must map input names to tensors, got {type(inputs).__name__}")
    specs = _specs_by_name(manifest.inputs)
    if len(inputs) != len(specs) or not all(name in inputs for name in specs):
        _check_names(query_id, inputs, specs)
    arrays: dict[str, np.ndarray] = {}
    lengths: set[int] = set()
    for name, spec in specs.items():
        arr = np.asarray(inputs[name])
        rule = _input_rule(spec)
        problem = _tensor_problem(arr, spec, rule, manifest, batched=False)
        if problem is not None:
            raise BadInputError(query_id, problem)
        if rule.seq_axis is not None:
            lengths.add(arr.shape[rule.seq_axis])
        arrays[name] = arr
    if len(lengths) > 1:
        raise BadInputError(query_id, f"inputs disagree on the sequence length: {sorted(lengths)}")
    return arrays, (lengths.pop() if lengths else 0)


def _check_names(query_id: int, inputs: Mapping[str, np.ndarray], specs: Mapping[str, TensorSpec]) -> None:
    """Raise for missing or unknown input names (only reached when the names differ)."""
    missing = sorted(set(specs) - set(inputs))
    unknown = sorted(set(inputs) - set(specs))
    if missing:
        raise BadInputError(query_id, f"missing input(s) {missing}; the model expects {sorted(specs)}")
    if unknown:
        raise BadInputError(query_id, f"unknown input(s) {unknown}; the model expects {sorted(specs)}")


def _within(arr: np.ndarray, bound: int) -> bool:
    """Whether every value of an integer tensor lies in [0, bound), in one pass: read as unsigned, a
    negative value is larger than any bound."""
    if arr.dtype.kind == "i":
        return int(arr.view(np.dtype(f"u{arr.dtype.itemsize}")).max()) < bound
    return arr.dtype.kind == "u" and int(arr.max()) < bound


def _tensor_problem(arr: np.ndarray, spec: TensorSpec, rule: _InputRule, manifest: Manifest,
                    batched: bool) -> str | None:
    """What is wrong with one input tensor, or None: one query's (no batch axis), or a batch's
    (`batched`: rows first). The message is the client's to read."""
    lead = 1 if batched else 0
    if arr.dtype != rule.np_dtype:
        return f"input {spec.name!r} has dtype {arr.dtype}, expected {spec.dtype}"
    if arr.ndim != rule.rank + lead:
        return (f"input {spec.name!r} has rank {arr.ndim} (shape {list(arr.shape)}), expected rank "
                f"{rule.rank + lead} for {'a batch' if batched else 'one query'} of dims {list(spec.dims[1:])}")
    if arr.size == 0:
        return f"input {spec.name!r} is empty (shape {list(arr.shape)})"
    for axis, (got, want) in enumerate(zip(arr.shape[lead:], spec.dims[1:])):
        if want == SEQ:
            if got > manifest.max_length:
                return f"input {spec.name!r} has length {got}, longer than the largest profiled {manifest.max_length}"
        elif got != want:
            return f"input {spec.name!r} dim {axis} is {got}, expected {want}"
    bound = manifest.input_bounds.get(spec.name)
    if bound is not None and not _within(arr, bound):
        low, high = int(arr.min()), int(arr.max())
        if low < 0 or high >= bound:
            bad = low if low < 0 else high
            return f"input {spec.name!r} holds {bad}, outside [0, {bound}): it indexes a table of {bound} rows"
    if rule.seq_axis is not None:
        length = arr.shape[rule.seq_axis + lead]
        if not manifest.takes_length(length) and length <= manifest.max_length:
            wanted = (f"a multiple of {manifest.length_multiple} " if manifest.length_multiple > 1 else "") + (
                f"at least {manifest.min_length}" if manifest.min_length > 1 else "")
            return (f"input {spec.name!r} has length {length}; the model takes lengths {wanted.strip()}"
                    + (f" ({manifest.length_rule})" if manifest.length_rule else ""))
    return None


def gather_inputs(queries: list[Query], rows: dict[str, np.ndarray], specs: tuple[TensorSpec, ...]) -> None:
    """Copy each query's tensors into its buffer row, zero-padded to the batch's length."""
    gather_rows([q.inputs for q in queries], rows, specs)


def gather_rows(sources: Sequence[Mapping[str, np.ndarray]], rows: Mapping[str, np.ndarray],
                specs: Sequence[TensorSpec]) -> None:
    """Copy each row's tensors (one query's, no batch axis) into buffer row r, zero-padded to the
    batch's length."""
    for spec in specs:
        dest = rows[spec.name]
        for r, source in enumerate(sources):
            src = source[spec.name]
            row = dest[r]
            if src.shape == row.shape:  # nothing to pad: the copy overwrites the whole row
                row[...] = src
            else:
                row.fill(0)
                row[tuple(slice(0, n) for n in src.shape)] = src


LengthOf = Callable[[int], int]


@functools.lru_cache(maxsize=256)
def _length_dims(spec: TensorSpec) -> tuple[LengthOf | None, ...] | None:
    """Per non-batch dim of an output, the function giving its size at a length when it is a
    length dim; None for an output without one (worked out once per spec: parsing is not free)."""
    if not spec.has_seq:
        return None
    return tuple(parse_length(d) if is_length_dim(d) else None for d in spec.dims[1:])


def output_cuts(specs: Sequence[TensorSpec]) -> list[tuple[str, tuple[LengthOf | None, ...] | None]]:
    """Each output's name and its length dims (`cut_to` takes them; None: nothing to cut), worked
    out once for a caller that cuts many rows."""
    return [(spec.name, _length_dims(spec)) for spec in specs]


def cut_to(row: np.ndarray, length_dims: tuple[LengthOf | None, ...] | None, length: int) -> np.ndarray:
    """One row of an output (no batch axis; or several rows, with None first in `length_dims`) of a
    batch padded past `length`, cut back to `length` on every length dim (`seq` and the lengths
    derived from it), given the output's length dims from `output_cuts`: a view."""
    if length_dims is None:
        return row
    return row[tuple(slice(None) if size_at is None else slice(0, size_at(length)) for size_at in length_dims)]


def scatter_outputs(
    queries: list[Query], rows: dict[str, np.ndarray], specs: tuple[TensorSpec, ...]
) -> list[dict[str, np.ndarray]]:
    """Copy each query's results out of its output row, cut back to its own length on every
    length dim (`seq` and the lengths derived from it)."""
    cuts = [(name, rows[name], length_dims) for name, length_dims in output_cuts(specs)]  # once per batch, not per row
    return [{name: np.array(cut_to(batch[r], length_dims, query.length), copy=True) for name, batch, length_dims in cuts}
            for r, query in enumerate(queries)]
