"""The per-query copies between queries and buffer rows, on their fast paths: a row the query fills
whole is overwritten without zeroing first, a padded row is zeroed past the query, and answers are
cut back on `seq` and on lengths derived from it (rules worked out once per spec)."""
from __future__ import annotations

import numpy as np

from dvabatch_backend.runtime.manifest import TensorSpec, dim_size
from dvabatch_backend.runtime.query import Query, gather_inputs, scatter_outputs


def _query(qid: int, length: int, x: np.ndarray) -> Query:
    return Query(qid, {"x": x}, length, 0.0, lambda answer: None)


def test_gather_overwrites_a_full_row_and_zero_pads_a_short_one() -> None:
    spec = TensorSpec("x", "float32", ("batch", "seq", 3))
    rows = {"x": np.full((2, 4, 3), 7.0, np.float32)}  # stale data from an earlier batch
    full, short = np.arange(12, dtype=np.float32).reshape(4, 3), np.ones((2, 3), np.float32)
    gather_inputs([_query(0, 4, full), _query(1, 2, short)], rows, (spec,))
    np.testing.assert_array_equal(rows["x"][0], full)
    np.testing.assert_array_equal(rows["x"][1, :2], short)
    assert not rows["x"][1, 2:].any()


def test_scatter_cuts_seq_and_derived_lengths_and_copies() -> None:
    specs = (TensorSpec("a", "float32", ("batch", "seq", 2)), TensorSpec("b", "float32", ("batch", "(seq+3)//4")),
             TensorSpec("c", "float32", ("batch", 5)))
    pad = 9
    rows = {s.name: np.random.default_rng(0).standard_normal(s.shape(2, pad)).astype(np.float32) for s in specs}
    queries = [_query(0, 9, np.zeros(1)), _query(1, 5, np.zeros(1))]
    answers = scatter_outputs(queries, rows, specs)
    for r, q in enumerate(queries):
        np.testing.assert_array_equal(answers[r]["a"], rows["a"][r, :q.length])
        np.testing.assert_array_equal(answers[r]["b"], rows["b"][r, :dim_size("(seq+3)//4", q.length)])
        np.testing.assert_array_equal(answers[r]["c"], rows["c"][r])
        for name in ("a", "b", "c"):
            assert not np.shares_memory(answers[r][name], rows[name])  # the buffers are reused
