"""What passes between the scheduler and whoever runs the stages: one execution (`Work`), what it
gave (`WorkResult`), the sub-batches that leave early (`EarlyExit`), each stage's executor state
(paper Figure 11), the `WorkListener` told when there may be work, the `Progress` that
wakes whoever waits for the runtime to move, and the `Step`, the right to launch an engine.
"""
from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

from .batch_table import BatchItem
from .buffers import PairUse
from .query import Query


class ExecutorState(enum.Enum):
    """A stage executor's state (paper Figure 11), kept by the scheduler for each stage."""

    ACTIVE = "active"  # holds a legitimate pair, waits for an item
    CHECKING = "checking"  # has an item whose pair is not legitimate yet
    WORKING = "working"
    INACTIVE = "inactive"  # holds no pair it may use
    STOPPED = "stopped"


@dataclass
class Work:
    """One execution of one batch item by one stage, prepared under the lock.

    `inputs` and `outputs` are views of the buffer pair's rows; stage 0 first gathers the
    queries' tensors into `inputs` (`gather`), the last stage scatters `outputs` into one
    answer per query (`scatter`). `whole`: the batch takes the one-stage route, the unsliced
    model run at stage 0 into the model's outputs (`Scheduler.runs_whole`), and leaves answered.
    """

    stage: int
    item: BatchItem
    use: PairUse
    inputs: dict[str, np.ndarray]
    outputs: dict[str, np.ndarray]
    queries: list[Query]
    started: float
    gather: bool
    scatter: bool
    whole: bool = False


@dataclass(frozen=True)
class WorkResult:
    """What running a `Work` gave: the engine's error for the whole item, or the errors of some of
    its rows (by index in `Work.queries`; the other rows ran), and (last stage) one output dict per
    query."""

    error: BaseException | None = None
    answers: list[dict[str, np.ndarray]] | None = None
    row_errors: Mapping[int, BaseException] = field(default_factory=dict)


@dataclass(frozen=True)
class EarlyExit:
    """Sub-batches that leave after a stage, answered from that stage's output tensors."""

    leaving: list[BatchItem]
    sources: dict[str, str]  # model output name -> the stage's output tensor it is taken from


class WorkListener:
    """Told (under the scheduler's lock) when there may be work; it must only signal, never block."""

    def stage_ready(self, stage: int) -> None:
        """`stage` may now have an item with a legitimate pair."""

    def window_moved(self) -> None:
        """The policy's batch window (`Scheduler.wake_at`) changed."""

    def stopping(self) -> None:
        """The scheduler stopped: `next_work` returns None from now on."""


class Progress:
    """Wakes whoever waits for the runtime to move (`Scheduler.wait_until`: tests, shutdown). Its
    condition is over the scheduler's lock: `notify` and `wait_until` are called holding it."""

    def __init__(self, lock: threading.Lock) -> None:
        self._moved = threading.Condition(lock)
        self._waiters = 0

    @property
    def waiters(self) -> int:
        """How many wait now."""
        return self._waiters

    def notify(self) -> None:
        if self._waiters:
            self._moved.notify_all()

    def wait_until(self, holds: Callable[[], bool], timeout: float, stopping: Callable[[], bool]) -> bool:
        """Wait until `holds()` after some progress (or the timeout, or a stop); return `holds()`."""
        deadline = time.monotonic() + timeout
        self._waiters += 1
        try:
            while not holds():
                remaining = deadline - time.monotonic()
                if remaining <= 0 or stopping():
                    return holds()
                self._moved.wait(remaining)
            return True
        finally:
            self._waiters -= 1


@dataclass(frozen=True)
class Launch:
    """A launch being run on this thread: the stage, the step that made it, whether it runs on the
    thread that holds that step, and the batch-table row and queries it runs."""

    stage: int
    step: int
    on_step_thread: bool
    batch: int | None = None
    queries: tuple[int, ...] = ()

    def __enter__(self) -> None:  # `with launching(launch):` (a class, not a generator: it runs every launch)
        _current.launch = self

    def __exit__(self, *exc: object) -> None:
        _current.launch = None


_current = threading.local()


def current_launch() -> Launch | None:
    """The launch this thread runs now, or None (a launch outside a step)."""
    return getattr(_current, "launch", None)


def launching(launch: Launch) -> Launch:
    """`with launching(launch):` this thread runs `launch` (`current_launch`) until the block ends."""
    return launch


class Step:
    """The right to launch an engine (engine_loop.py): held by one thread at a time, the engine
    loop's or a caller's that runs the loop's steps while the loop is idle (`EngineLoop.serve_here`).
    `count` numbers the steps; `holder` is the thread holding one, or None. Taken before the
    scheduler's lock, never under it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.holder: int | None = None
        self.count = 0

    def acquire(self) -> int:
        self._lock.acquire()
        return self._taken()

    def try_acquire(self) -> int | None:
        """The step, if no thread holds it now; else None at once."""
        return self._taken() if self._lock.acquire(blocking=False) else None

    def _taken(self) -> int:
        self.holder = threading.get_ident()
        self.count += 1
        return self.count

    def release(self) -> None:
        self.holder = None
        self._lock.release()

    def __enter__(self) -> int:  # `with step_lock as step:` (a class, not a generator: it runs every query)
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def is_mine(self) -> bool:
        return self.holder == threading.get_ident()
