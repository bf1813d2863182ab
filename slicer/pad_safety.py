"""Is the model pad-safe? Measured: zero-padding a query to a longer batch length must not change its answer.

A few queries are run alone (the unsliced model, batch 1 at their own length) and padded beside a
longer query (batch 2 at the longer length) exactly as the runtime pads them -- zeros, so an
attention mask is zero past the query's length (`gather_inputs`) -- and their outputs cut back to
their own length (`scatter_outputs`). The answers must agree within the slicer's atol (relative
1e-3 for large-magnitude outputs). A model without a sequence axis is never padded: pad-safe.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import onnxruntime as ort

from dvabatch_backend.runtime.manifest import TensorSpec
from dvabatch_backend.runtime.query import Query, gather_inputs, scatter_outputs

from .profiler import random_inputs

RTOL = 1e-3


@dataclass(frozen=True)
class PadSafety:
    safe: bool
    detail: str  # what was checked, or the first difference found

    def to_json(self) -> dict[str, object]:
        return {"safe": self.safe, "detail": self.detail}


def short_lengths(max_length: int) -> list[int]:
    """The lengths of the queries padded to `max_length`: the shortest, a third, half, one short."""
    return sorted({n for n in (1, max_length // 3, max_length // 2, max_length - 1) if 1 <= n < max_length})


def check_pad_safety(session: ort.InferenceSession, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec],
                     max_length: int, atol: float, int_high: Mapping[str, int] | None = None,
                     rtol: float = RTOL, seed: int = 4) -> PadSafety:
    """Run short queries alone and padded to `max_length` beside a query of that length; compare."""
    if not any(t.has_seq for t in inputs):
        return PadSafety(True, "no sequence axis: queries are never padded")
    lengths = short_lengths(max_length)
    if not lengths:
        return PadSafety(True, f"max length {max_length}: queries are never padded")
    rng = np.random.default_rng(seed)
    names = [o.name for o in session.get_outputs()]
    specs = [t for t in outputs if t.name in names]

    def alone(query: Query) -> dict[str, np.ndarray] | None:
        try:
            got = session.run(names, {k: v[None] for k, v in query.inputs.items()})
        except Exception:  # a length the model does not run at (a multiple of some step): not compared
            return None
        return {name: value[0] for name, value in zip(names, got)}

    def one_query(qid: int, length: int) -> Query:
        feeds = random_inputs(inputs, 1, length, rng, int_high)  # batch 1: a mask is all ones
        return Query(qid, {k: v[0] for k, v in feeds.items()}, length, 0.0, lambda answer: None)

    long = one_query(0, max_length)
    compared = []
    for i, length in enumerate(lengths):
        short = one_query(i + 1, length)
        expected = alone(short)
        if expected is None:
            continue
        compared.append(length)
        batch = [short, long] if i % 2 == 0 else [long, short]
        rows = {t.name: np.zeros(t.shape(2, max_length), t.np_dtype) for t in inputs}
        gather_inputs(batch, rows, tuple(inputs))
        ran = dict(zip(names, session.run(names, rows)))
        padded = scatter_outputs(batch, ran, tuple(specs))[batch.index(short)]
        for spec in specs:
            got, ref = padded[spec.name], expected[spec.name]
            if got.shape != ref.shape:
                return PadSafety(False, f"output {spec.name!r} of a length-{length} query padded to {max_length} "
                                        f"has shape {list(got.shape)}, alone {list(ref.shape)}")
            if not _close(got, ref, atol, rtol):
                diff = float(np.max(np.abs(got.astype(np.float64) - ref.astype(np.float64))))
                return PadSafety(False, f"output {spec.name!r} of a length-{length} query padded to {max_length} "
                                        f"differs from the query alone by {diff:.3g}")
    if not compared:
        return PadSafety(True, f"not measured: the model runs none of the lengths {lengths} alone")
    return PadSafety(True, f"queries of lengths {compared} padded to {max_length} answer as alone")


HALF_ATOL = 5e-2  # float16 outputs: a stage-split or padded run rounds differently in half precision


def output_atol(dtype: np.dtype, atol: float) -> float:
    """The absolute tolerance for an output of this dtype: `atol`, or HALF_ATOL for float16."""
    return max(atol, HALF_ATOL) if np.dtype(dtype) == np.float16 else atol


def _close(got: np.ndarray, ref: np.ndarray, atol: float, rtol: float) -> bool:
    if got.size == 0:
        return True
    if not np.issubdtype(ref.dtype, np.number) or np.issubdtype(ref.dtype, np.integer):
        return bool(np.array_equal(got, ref))
    return bool(np.allclose(got.astype(np.float64), ref.astype(np.float64), rtol=rtol,
                            atol=output_atol(ref.dtype, atol), equal_nan=True))
