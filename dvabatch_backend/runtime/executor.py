"""Stage executors (paper §6.2, Figures 11 and 12): one thread per stage.

Each loops: take an item from its batch queue once the item's buffer pair is legitimate
(`Scheduler.next_work`, under the scheduler's lock) -> execute it on buffer views (outside the
lock) -> hand the result back (`Scheduler.finish_work`), where the policy's `Schedule()` runs,
items go to the next queue and pairs are legitimated upstream. The executor holds no runtime
state of its own besides its `state`, which the scheduler sets under its lock.
"""
from __future__ import annotations

import enum
import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .batch_table import BatchItem
from .buffers import PairUse
from .engine import StageEngine
from .manifest import SEQ, TensorSpec
from .query import Query

if TYPE_CHECKING:
    from .scheduler import Scheduler

log = logging.getLogger(__name__)


class ExecutorState(enum.Enum):
    ACTIVE = "active"  # holds a legitimate pair, waits for an item
    CHECKING = "checking"  # has an item whose pair is not legitimate yet
    WORKING = "working"
    INACTIVE = "inactive"  # holds no pair it may use
    STOPPED = "stopped"


@dataclass
class Work:
    """One execution of one batch item by one stage, prepared under the lock."""

    stage: int
    item: BatchItem
    use: PairUse
    inputs: dict[str, np.ndarray]
    outputs: dict[str, np.ndarray]
    queries: list[Query]
    started: float


class StageExecutor:
    def __init__(self, stage: int, engine: StageEngine, scheduler: "Scheduler") -> None:
        self.stage = stage
        self.engine = engine
        self.state = ExecutorState.INACTIVE
        self._scheduler = scheduler
        self.wakeup = threading.Condition(scheduler.lock)
        self.thread = threading.Thread(target=self._loop, name=f"dvabatch-stage-{stage}", daemon=True)

    def _loop(self) -> None:
        is_first = self.stage == 0
        is_last = self.stage == self._scheduler.num_stages - 1
        while (work := self._scheduler.next_work(self)) is not None:
            error: BaseException | None = None
            results: list[dict[str, np.ndarray]] | None = None
            try:
                if is_first:
                    gather_inputs(work.queries, work.inputs, self._scheduler.input_specs)
                self.engine.run(work.inputs, work.outputs)
                if is_last:
                    results = scatter_outputs(work.queries, work.outputs, self._scheduler.output_specs)
            except Exception as exc:  # the engine's failure is the queries' answer, not the thread's end
                log.warning("stage %d failed on %s: %s", self.stage, work.item, exc)
                error = exc
            try:
                self._scheduler.finish_work(self, work, error, results)
            except Exception:  # a runtime bug: keep serving, the rest of the pipeline still needs us
                log.exception("stage %d: bookkeeping failed after %s", self.stage, work.item)


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
    """Copy each query's results out of its output row, cut back to its own length."""
    results = []
    for r, query in enumerate(queries):
        out = {}
        for spec in specs:
            row = rows[spec.name][r]
            if spec.has_seq:
                axis = spec.dims.index(SEQ) - 1
                row = row[(slice(None),) * axis + (slice(0, query.length),)]
            out[spec.name] = np.array(row, copy=True)
        results.append(out)
    return results
