"""Integer inputs that index a table are checked before batching: a value outside [0, bound) is
the query's own BadInputError, never a failed batch."""
from __future__ import annotations

import numpy as np
import pytest

from dvabatch_backend.runtime.errors import BadInputError, ManifestError
from dvabatch_backend.runtime.manifest import Manifest
from dvabatch_backend.runtime.query import validate_inputs

IDS = {"name": "input_ids", "dtype": "int64", "dims": ["batch", "seq"]}
OUT = {"name": "h", "dtype": "float32", "dims": ["batch", "seq", 4]}


def _manifest(**extra: object) -> Manifest:
    doc = {"schema_version": 1, "name": "m", "max_batch_size": 4, "max_length": 16, "inputs": [IDS],
           "outputs": [OUT], "stages": [{"file": "stage0.onnx", "inputs": [IDS], "outputs": [OUT]}], **extra}
    return Manifest.from_json(doc)


def test_ids_inside_the_table_pass_and_outside_fail_by_name() -> None:
    manifest = _manifest(input_bounds={"input_ids": 100})
    arrays, length = validate_inputs(1, {"input_ids": np.array([0, 5, 99], np.int64)}, manifest)
    assert length == 3
    for bad in (100, -1, 10_000):
        with pytest.raises(BadInputError, match=r"holds -?\d+, outside \[0, 100\)"):
            validate_inputs(2, {"input_ids": np.array([1, bad, 2], np.int64)}, manifest)


def test_bounds_round_trip_and_are_checked_at_load() -> None:
    manifest = _manifest(input_bounds={"input_ids": 30})
    assert Manifest.from_json(manifest.to_json()).input_bounds == {"input_ids": 30}
    assert _manifest().input_bounds == {}  # manifests written before: no bound
    with pytest.raises(ManifestError, match="input_bounds"):
        _manifest(input_bounds={"nope": 3})
