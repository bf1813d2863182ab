"""Stage executors (paper §6.2, Figures 11 and 12): one thread per stage, and the batch window.

An executor loops: ask the scheduler for work of the stage it plays (`Scheduler.next_work_for`,
which answers at once) -> run it on buffer views, outside the scheduler's lock (`run_work`) -> hand
the result back (`Scheduler.finish_work`), where the policy's `Schedule()` runs, items go to the
next queue and pairs are legitimated upstream; on a quiet pipeline it runs on with the item at the
next stage (the scheduler swaps the two executors' stages). With nothing to run it waits for the scheduler's signal
(`StageExecutor.wake`, through the `Pipeline`, the scheduler's `WorkListener`). Executors own
their threads and nothing else: the runtime's state, each stage's `ExecutorState` included, is
the scheduler's.

`run_work` and `run_until_idle` let one thread play every executor (tests, benchmarks).
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, Sequence

from .engine import StageEngine
from .query import gather_inputs, scatter_outputs
from .scheduler import Scheduler
from .work import Work, WorkResult

log = logging.getLogger(__name__)


def run_work(work: Work, engine: StageEngine, scheduler: Scheduler) -> WorkResult:
    """Run one `Work` on its stage's engine: gather at stage 0, scatter at the last stage.

    An engine's failure is the result (the queries' answer), never raised. When a batch of
    several rows fails, each row is run alone, so that only the rows that fail by themselves (one
    client's bad input) fail and the others get their answers.
    """
    try:
        if work.gather:
            gather_inputs(work.queries, work.inputs, scheduler.input_specs)
        engine.run(work.inputs, work.outputs)
        row_errors: dict[int, BaseException] = {}
    except Exception as exc:
        log.warning("stage %d failed on %s: %s", work.stage, work.item, exc)
        if len(work.queries) == 1:
            return WorkResult(error=exc)
        row_errors = _rows_alone(work, engine)
        if len(row_errors) == len(work.queries):
            return WorkResult(error=exc)
    try:
        answers = scatter_outputs(work.queries, work.outputs, scheduler.output_specs) if work.scatter else None
    except Exception as exc:
        return WorkResult(error=exc)
    return WorkResult(answers=answers, row_errors=row_errors)


def _rows_alone(work: Work, engine: StageEngine) -> dict[int, BaseException]:
    """Run each row of a failed item by itself (views of the same buffer rows); the rows that fail."""
    errors: dict[int, BaseException] = {}
    for row in range(len(work.queries)):
        try:
            engine.run({k: v[row:row + 1] for k, v in work.inputs.items()},
                       {k: v[row:row + 1] for k, v in work.outputs.items()})
        except Exception as exc:
            errors[row] = exc
    return errors


def run_until_idle(scheduler: Scheduler, engines: Sequence[StageEngine]) -> int:
    """Play every stage's executor from this thread until no stage has work; return the works run.

    Stages are visited last first, so a buffer pair is freed downstream before upstream asks for it.
    """
    done = 0
    while True:
        progressed = False
        for stage in reversed(range(scheduler.num_stages)):
            work = scheduler.next_work(stage)
            if work is not None:
                scheduler.finish_work(work, run_work(work, engines[stage], scheduler))
                done += 1
                progressed = True
        if not progressed:
            return done


class StageExecutor:
    """One executor thread: runs the work of the stage it plays whenever the scheduler has some.

    Executor i starts playing stage i; after running an item it may run on with that item at the
    next stage, swapping stages with that stage's idle executor (`Scheduler.finish_work`), so it
    holds every stage's engine and runs the one of each work's stage.
    """

    def __init__(self, index: int, engines: Sequence[StageEngine], scheduler: Scheduler) -> None:
        self.index = index
        self._engines = list(engines)
        self._scheduler = scheduler
        self._ready = threading.Event()
        self.wakeups = 0  # how often the thread waited for a signal and woke (written by the thread only)
        # called after running a batch at stage 0, before taking more work (`Pipeline.wait_at_entry`);
        # set before the thread starts
        self.entry_wait: Callable[[], None] | None = None
        self.thread = threading.Thread(target=self._loop, name=f"dvabatch-stage-{index}", daemon=True)

    @property
    def stage(self) -> int:
        """The stage this executor plays now."""
        return self._scheduler.board.stage_of(self.index)

    def wake(self) -> None:
        """The stage it plays may have work (or the scheduler stopped): look again."""
        self._ready.set()

    def _loop(self) -> None:
        scheduler = self._scheduler
        while True:
            self._ready.clear()  # before asking: a signal from now on is not lost
            work = scheduler.next_work_for(self.index)
            if work is None:
                if scheduler.stopping:
                    return
                self._ready.wait()
                self.wakeups += 1
                continue
            while work is not None:
                result = run_work(work, self._engines[work.stage], scheduler)
                try:
                    if work.stage == 0 and self.entry_wait is not None:
                        self.entry_wait()  # a device fault here fails this item's queries (below)
                    work = scheduler.finish_work(work, result, executor=self.index)
                except Exception as exc:  # a runtime bug: its queries get an error, the pipeline serves on
                    log.exception("stage %d: bookkeeping failed after %s", work.stage, work.item)
                    scheduler.fail_work(work, exc)
                    work = None


class BatchWindow:
    """The thread that calls the policy again when its batch window (`Scheduler.wake_at`) passes."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
        self._changed = threading.Condition()
        self._moved = False
        self._closed = False
        self.thread = threading.Thread(target=self._loop, name="dvabatch-batch-window", daemon=True)

    def moved(self) -> None:
        with self._changed:
            self._moved = True
            self._changed.notify()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify()

    def _loop(self) -> None:
        wake_at: float | None = None
        while True:
            with self._changed:
                if not (self._moved or self._closed):
                    timeout = None if wake_at is None else max(0.0, wake_at - self._scheduler.clock())
                    self._changed.wait(timeout)
                if self._closed:
                    return
                self._moved = False
            wake_at = self._scheduler.on_window()
