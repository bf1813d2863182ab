"""A stage executor's run (paper §6.2, Figures 11 and 12): one `Work` on its stage's engine.

The executors are the engine loop's per-stage launches (engine_loop.py): take the stage's work from
the scheduler (`Scheduler.next_work`), run it on buffer views outside the scheduler's lock
(`run_work`), hand the result back (`Scheduler.finish_work`), where the policy's `Schedule()`
runs, items go to the next queue and pairs are legitimated upstream. The runtime's state, each
stage's `ExecutorState` included, is the scheduler's.

`run_until_idle` plays every executor from one thread (tests, benchmarks).
"""
from __future__ import annotations

import logging
from typing import Sequence

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
