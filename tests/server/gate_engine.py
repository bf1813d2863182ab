"""An engine wrapper for tests against the real server: stage 0 holds its first run until the test
opens a gate, so a batch is surely in flight while the test sends more.

The test copies this file into the model's version folder and names it in config.pbtxt's
`engine_wrapper` parameter as `gate_engine.py:hold_first`. The first run of stage 0 writes `held`
beside this file (the rows it holds) and waits until `open` exists there (at most `HOLD_S`);
every later run goes through at once. `gate_engine.py:hold_each` holds every run of stage 0 in
turn: the k-th (from 1) writes `held-k` (its rows) and waits until `open-k` or `open` exists.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Mapping

import numpy as np

HERE = Path(__file__).resolve().parent
HOLD_S = 120.0  # a bound on a test that never opens the gate, not a timing


class HoldFirst:
    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self._first = threading.Lock()  # taken by the first run only
        self._held = False

    def run(self, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
        with self._first:
            first, self._held = not self._held, True
        if first:
            (HERE / "held").write_text(str(next(iter(inputs.values())).shape[0]))
            deadline = time.monotonic() + HOLD_S
            while not (HERE / "open").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        self.inner.run(inputs, outputs)


def hold_first(stage: int, engine: Any) -> Any:
    return HoldFirst(engine) if stage == 0 else engine


class HoldEach:
    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self._lock = threading.Lock()  # guards _runs
        self._runs = 0

    def run(self, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
        with self._lock:
            self._runs += 1
            k = self._runs
        (HERE / f"held-{k}").write_text(str(next(iter(inputs.values())).shape[0]))
        deadline = time.monotonic() + HOLD_S
        while not ((HERE / f"open-{k}").exists() or (HERE / "open").exists()) and time.monotonic() < deadline:
            time.sleep(0.01)
        self.inner.run(inputs, outputs)


def hold_each(stage: int, engine: Any) -> Any:
    return HoldEach(engine) if stage == 0 else engine
