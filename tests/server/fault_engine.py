"""An engine wrapper for tests against the real server: stage 1 raises for the rows of marked queries.

The test copies this file into the model's version folder and names it in config.pbtxt's
`engine_wrapper` parameter as `fault_engine.py:per_row_fault` or `fault_engine.py:batch_fault`.

A query is marked when its first token id is `MARKER`. Stage 1 does not see the token ids, so
stage 0 remembers a fingerprint of each marked row's output (the first values of its widest float
output, which stage 1 reads as they were written), and stage 1 knows a marked row by it:
  - per_row_fault: stage 1 raises for any run that holds a marked row, alone or in a batch; after
    the runtime reruns a failed batch row by row, exactly the marked queries fail.
  - batch_fault: stage 1 raises only for a run of more than one row that holds a marked row; the
    row-by-row rerun then answers every query, the marked ones included.
Every raise is one line in `faults-<kind>.log` next to this file, for the test to count.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Mapping

import numpy as np

MARKER = 4242  # a token id: the first token of a marked query
FAULT_STAGE = 1
FINGERPRINT_VALUES = 32

_marked: set[tuple[str, bytes]] = set()  # (tensor name, fingerprint) of marked rows, in this stub process
_lock = threading.Lock()


def _fingerprint(row: np.ndarray) -> bytes:
    return np.ascontiguousarray(row).reshape(-1)[:FINGERPRINT_VALUES].tobytes()


def _widest_float(arrays: Mapping[str, np.ndarray]) -> str:
    floats = {name: arr for name, arr in arrays.items() if arr.dtype.kind == "f" and arr.ndim >= 2}
    return max(floats, key=lambda name: floats[name][0].size)


class MarkingEngine:
    """Stage 0: runs, then remembers the fingerprints of the marked rows' widest output."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def run(self, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
        self.inner.run(inputs, outputs)
        rows = np.flatnonzero(inputs["input_ids"][:, 0] == MARKER)
        if rows.size:
            name = _widest_float(outputs)
            with _lock:
                _marked.update((name, _fingerprint(outputs[name][row])) for row in rows)


class FaultingEngine:
    """Stage 1: raises for a run holding a marked row (`kind` "batch": only a run of several rows)."""

    def __init__(self, inner: Any, kind: str) -> None:
        self.inner, self.kind = inner, kind
        self.log = Path(__file__).with_name(f"faults-{kind}.log")

    def marked_rows(self, inputs: Mapping[str, np.ndarray]) -> list[int]:
        rows = next(iter(inputs.values())).shape[0]
        with _lock:
            marked = set(_marked)
        return [row for row in range(rows)
                if any((name, _fingerprint(arr[row])) in marked for name, arr in inputs.items())]

    def run(self, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
        rows = next(iter(inputs.values())).shape[0]
        marked = self.marked_rows(inputs)
        if marked and (self.kind == "row" or rows > 1):
            with _lock, open(self.log, "a") as log:
                log.write(f"{rows} {marked}\n")
            raise RuntimeError(f"injected {self.kind} fault: marked row(s) {marked} in a run of {rows}")
        self.inner.run(inputs, outputs)


def _wrap(stage: int, engine: Any, kind: str) -> Any:
    if stage == 0:
        return MarkingEngine(engine)
    if stage == FAULT_STAGE:
        return FaultingEngine(engine, kind)
    return engine


def per_row_fault(stage: int, engine: Any) -> Any:
    return _wrap(stage, engine, "row")


def batch_fault(stage: int, engine: Any) -> Any:
    return _wrap(stage, engine, "batch")
