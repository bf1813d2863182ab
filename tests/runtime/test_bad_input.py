"""Bad input gets a clear error, harms no other query, and nothing hangs."""
from __future__ import annotations

import numpy as np
import pytest

from dvabatch_backend import BadInputError, StageFailedError
from policies import PipelinedPolicy

from ..conftest import MAX_LENGTH, Collector, assert_matches_reference, make_scheduler


def _good(rng: np.random.Generator, length: int = 4) -> dict[str, np.ndarray]:
    return {"x": rng.standard_normal((length, 8)).astype(np.float32), "mask": np.ones(length, np.float32)}


BAD_INPUTS = {
    "wrong dtype": (lambda g: {**g, "x": g["x"].astype(np.float64)}, "dtype float64, expected float32"),
    "wrong rank": (lambda g: {**g, "x": g["x"][None]}, "has rank 3"),
    "too long": (
        lambda g: {"x": np.zeros((MAX_LENGTH + 1, 8), np.float32), "mask": np.ones(MAX_LENGTH + 1, np.float32)},
        f"longer than the largest profiled {MAX_LENGTH}",
    ),
    "empty": (lambda g: {"x": np.zeros((0, 8), np.float32), "mask": np.ones(0, np.float32)}, "is empty"),
    "missing input": (lambda g: {"x": g["x"]}, "missing input(s) ['mask']"),
    "unknown input": (lambda g: {**g, "y": g["x"]}, "unknown input(s) ['y']"),
    "wrong fixed dim": (lambda g: {**g, "x": np.zeros((4, 9), np.float32)}, "dim 1 is 9, expected 8"),
    "lengths disagree": (lambda g: {**g, "mask": np.ones(3, np.float32)}, "disagree on the sequence length"),
    "ragged nested list": (lambda g: {**g, "x": [[1.0, 2.0], [3.0]]}, "malformed input"),
    "not a mapping": (lambda g: None, "inputs must map input names to tensors"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_answered_with_a_clear_error_and_neighbours_are_served(zoo, case: str) -> None:
    model = zoo.stages("token", 3)
    scheduler = make_scheduler(model, PipelinedPolicy())
    rng = np.random.default_rng(0)
    make_bad, message = BAD_INPUTS[case]
    before, after = [_good(rng, n) for n in (3, 7)], [_good(rng, n) for n in (1, 12)]
    collector = Collector()
    with scheduler:
        ids = scheduler.submit_many([(q, collector) for q in [*before, make_bad(_good(rng)), *after]])
        assert collector.wait_for(ids, timeout=10)
    bad = collector.one(ids[2])
    assert isinstance(bad.error, BadInputError) and bad.outputs is None
    assert message in str(bad.error) and f"query {ids[2]}" in str(bad.error)
    for qid, inputs in zip(ids[:2] + ids[3:], before + after):
        assert_matches_reference(model, inputs, collector.one(qid))


def test_nan_passes_through_as_data(zoo) -> None:
    model = zoo.stages("token", 3)
    scheduler = make_scheduler(model, PipelinedPolicy())
    rng = np.random.default_rng(1)
    nan_query = _good(rng, 5)
    nan_query["x"][2, 3] = np.nan
    neighbour = _good(rng, 5)
    collector = Collector()
    with scheduler:
        ids = scheduler.submit_many([(nan_query, collector), (neighbour, collector)])  # one batch
        assert collector.wait_for(ids)
    answer = collector.one(ids[0])
    assert answer.ok and np.isnan(answer.outputs["pooled"]).any()
    for name, ref in model.reference(nan_query).items():
        np.testing.assert_allclose(answer.outputs[name], ref, atol=1e-4, equal_nan=True)
    assert_matches_reference(model, neighbour, collector.one(ids[1]))


class FailOnMarker:
    """A real engine that raises when it sees a marker value, as a broken stage would."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def run(self, inputs, outputs) -> None:
        if any((arr == 1234.0).any() for arr in inputs.values()):
            raise RuntimeError("stage kernel failed")
        self.inner.run(inputs, outputs)


def test_a_failing_stage_answers_its_queries_with_an_error_naming_the_stage(zoo) -> None:
    model = zoo.stages("token", 3)
    engines = model.engines()
    engines[0] = FailOnMarker(engines[0])
    scheduler = make_scheduler(model, PipelinedPolicy(), engines)
    rng = np.random.default_rng(2)
    poisoned = _good(rng, 4)
    poisoned["x"][0, 0] = 1234.0
    good = [_good(rng, 6) for _ in range(3)]
    collector = Collector()
    with scheduler:
        bad_id = scheduler.submit(poisoned, collector)
        ids = [scheduler.submit(q, collector) for q in good]
        assert collector.wait_for([bad_id, *ids])
    error = collector.one(bad_id).error
    assert isinstance(error, StageFailedError) and error.stage == 0
    assert "stage kernel failed" in str(error) and f"query {bad_id} at stage 0" in str(error)
    for qid, inputs in zip(ids, good):
        assert_matches_reference(model, inputs, collector.one(qid))
