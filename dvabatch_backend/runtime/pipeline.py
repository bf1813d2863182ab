"""The pipeline: a `Scheduler` and the `EngineLoop` that owns its engines.

This is what serves: `start` starts the loop, `submit` hands queries to the scheduler,
`run_inline` runs a batch that meets nobody on the caller's thread (the fast path, holding the
loop's step), `stop` answers what is left ("shutting down") and joins the loop. The scheduler owns
the state; the loop owns the engines and is the scheduler's `WorkListener`.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Mapping, Sequence

import numpy as np

from .decisions import Policy, PolicyContext
from .engine import StageEngine
from .engine_loop import EngineLoop, hands_over
from .fast_path import FastPath
from .manifest import Manifest
from .query import Reply, request_rows
from .admission import Admission
from .batch_table import TableSnapshot
from .buffers import BufferState, MemoryFactory
from .fences import FenceFactory
from .errors import BufferStateError, EngineLoopDiedError, QueryError
from .query import QueryState
from .scheduler import Clock, Scheduler
from .settings import RuntimeSettings
from .work import ExecutorState
from .stats import RuntimeStats, TraceEvent

log = logging.getLogger(__name__)


class Pipeline:
    """A `Scheduler` and its `EngineLoop` (and the fast path, which borrows the loop's step).

    `Pipeline.create(manifest, engines, policy, settings)` makes the scheduler too.
    """

    def __init__(self, scheduler: Scheduler, engines: Sequence[StageEngine],
                 whole_model: StageEngine | None = None) -> None:
        """`whole_model`: the unsliced model's engine, which then runs the fast path instead of the
        stages in a row."""
        if len(engines) != scheduler.num_stages:
            raise ValueError(f"{len(engines)} engines for {scheduler.num_stages} stages")
        self.scheduler = scheduler
        self._engines = list(engines)
        self.loop = EngineLoop(scheduler, engines)
        self.loop.on_death = self._loop_died
        self._fast_path = FastPath(scheduler, engines, whole_model) if scheduler.inline.allowed else None
        self._state_lock = threading.Lock()  # guards _started and _stop_called
        self._started = False
        self._stop_called = False
        scheduler.board.listener = self.loop

    @classmethod
    def create(
        cls,
        manifest: Manifest,
        engines: Sequence[StageEngine],
        policy: Policy,
        settings: RuntimeSettings = RuntimeSettings(),
        context: PolicyContext | None = None,
        clock: Clock = time.perf_counter,
        whole_model: StageEngine | None = None,
    ) -> "Pipeline":
        return cls(Scheduler(manifest, policy, settings, context, clock), engines, whole_model)

    # -- lifecycle ----------------------------------------------------------------------

    def install_buffers(self, fence_factory: FenceFactory, memory_factory: MemoryFactory) -> None:
        """Every buffer's fence and memory, the pipeline's and the fast path's, before it starts
        (`device_memory.place_on_streams`: stages on CUDA streams)."""
        with self._state_lock:
            if self._started:
                raise RuntimeError("buffers can only be installed before the pipeline starts")
        with self.scheduler.lock:
            self.scheduler.board.buffers.install_fences(fence_factory, memory_factory)
        if self._fast_path is not None:
            self._fast_path.install_buffers(fence_factory, memory_factory)

    def wait_at_entry(self, wait: Callable[[], None]) -> None:
        """Before it starts: the loop calls `wait` after it ran a batch at stage 0, before it takes
        more work (`loading.wait_at_entry`: until the batch has finished on the device). The fast
        path does not: it runs the stages in a row and waits once, for the answers."""
        with self._state_lock:
            if self._started:
                raise RuntimeError("the entry's wait can only be set before the pipeline starts")
        self.loop.entry_wait = wait

    def start(self) -> "Pipeline":
        with self._state_lock:
            if self._started or self._stop_called:
                return self
            self._started = True
        for thread in self.threads:
            thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Answer every query not yet answered with "shutting down" and join every thread.

        Safe to call more than once and from several threads: each caller outside the pipeline
        joins the threads. From a reply callback (a pipeline thread) it cannot join itself and
        returns at once; the threads end on their own.
        """
        with self._state_lock:
            self._stop_called = True
            started = self._started
        self.scheduler.stop()
        if not started or threading.current_thread() in self.threads:
            return
        for thread in self.threads:
            thread.join(timeout)
            if thread.is_alive():
                log.error("thread %s did not stop within %.1fs", thread.name, timeout)

    def __enter__(self) -> "Pipeline":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def fast_path_engine(self) -> str:
        """What runs the fast path: "model" (the unsliced model), "stages" (in a row) or "off"."""
        return "off" if self._fast_path is None else self._fast_path.engine

    @property
    def threads(self) -> list[threading.Thread]:
        return [self.loop.thread]

    def _loop_died(self, cause: BaseException) -> None:
        """The loop ended on a fault of its own: every query not answered, and every one submitted
        from now on, is answered with an error naming it (INTERNAL), none left waiting."""
        self.scheduler.stop(lambda qid: EngineLoopDiedError(qid, f"the engine loop died: {type(cause).__name__}: {cause}"))

    # -- the scheduler's entry points and observations ----------------------------------

    def submit(self, inputs: Mapping[str, np.ndarray], reply: Reply) -> int:
        return self.scheduler.submit(inputs, reply)

    def submit_many(self, requests: Sequence[tuple[Mapping[str, np.ndarray], Reply]],
                    timeout_us: int | None = None) -> list[int]:
        return self.scheduler.submit_many(requests, timeout_us)

    def refuse_at_door(self, requests: int) -> list[QueryError]:
        return self.scheduler.refuse_at_door(requests)

    def run_inline(self, inputs: Mapping[str, np.ndarray], wait: bool = True) -> dict[str, np.ndarray] | None:
        """The fast path (runtime/fast_path.py): the model's outputs for a batch of rows in the model's
        layout, run at once on this thread while the pipeline holds nothing; None when the rows must
        be submitted instead (the fast path is off, the pipeline busy, the rows not one batch, or the
        run failed). `wait`: with one buffer pair, wait for a busy pipeline to empty first
        (`InlineHold.reserve`); not for rows whose deadline the pipeline keeps."""
        return None if self._fast_path is None else self._fast_path.run(inputs, wait)

    def run_inline_requests(self, requests: Sequence[Mapping[str, np.ndarray]],
                            answer: Callable[[int, dict[str, np.ndarray]], None],
                            cancelled: Callable[[int], bool] | None = None,
                            between_batches: Callable[[], None] | None = None) -> list[int] | None:
        """Several requests' rows on the fast path, batched as the policy batches them at an empty
        pipeline (`FastPath.run_requests`): `answer(i, outputs)` as each request is done, `cancelled(i)`
        before a batch a request waited for, `between_batches()` before each batch after the first;
        None when not taken, else the requests left (for `submit_many`, bar the cancelled)."""
        return None if self._fast_path is None else self._fast_path.run_requests(requests, answer, cancelled,
                                                                                  between_batches)

    def run_inline_group(self, requests: Sequence[Mapping[str, np.ndarray]],
                         answer: Callable[[int, dict[str, np.ndarray]], None], several: bool = True,
                         cancelled: Callable[[int], bool] | None = None, full: bool = False,
                         refuse: Callable[[int, QueryError], None] | None = None,
                         between_batches: Callable[[], None] | None = None) -> list[int]:
        """The requests one call hands over together (a Triton `execute` call: what queued while the
        last one ran) on the fast path where it takes them: a lone request by `run_inline`, several
        by `run_inline_requests` when `several`. `answer(i, outputs)` for each request answered here;
        returns the others' indices, in order (all of them where it took none): those `cancelled`
        said were, and the rest for `submit_many`. `full`: the call came full (its caller had a
        batch waiting); full calls for too long have the calls handed to the pipeline or refused,
        `refuse(i, error)` for each request (`InlineHold.caller_backlog`).
        `between_batches()`: before each batch of several requests after the first."""
        hold = self.scheduler.inline
        if self._fast_path is None or hold.caller_backlog(full, sum(request_rows(requests))):
            return list(range(len(requests)))
        if hold.refusing and refuse is not None:
            for i, error in enumerate(self.scheduler.refuse_caller_backlog(len(requests))):
                refuse(i, error)
            return []
        if len(requests) == 1:
            outputs = self.run_inline(requests[0], wait=several)  # not several: a deadline, the pipeline's
            if outputs is None:
                return [0]
            answer(0, outputs)
            return []
        left = self.run_inline_requests(requests, answer, cancelled, between_batches) if several else None
        return list(range(len(requests))) if left is None else left

    def hands_over(self, requests: int, rows: int) -> bool:
        """Where the engines run beside the host: whether a call of `requests` requests (`rows` rows)
        goes to the loop, its caller returning at once, rather than running on the caller's thread
        (`engine_loop.hands_over`: what is in flight, the batch's expected service, a hand-over's cost)."""
        s = self.scheduler
        with s.lock:
            service = s.admission.service.pipeline_time(min(max(rows, 1), s.bs_max))
            handed = hands_over(s.holds_nothing(), requests, service, self.loop.handover.seconds)
            s.stats.calls_handed_over += handed
            s.stats.calls_run_here += not handed
        return handed

    def cancel(self, query_ids: Sequence[int]) -> None:
        self.scheduler.cancel(query_ids)

    # Observations are the scheduler's: `pipeline.stats` is `pipeline.scheduler.stats`, and so on.
    @property
    def manifest(self) -> Manifest:
        return self.scheduler.manifest

    @property
    def num_stages(self) -> int:
        return self.scheduler.num_stages

    @property
    def bs_max(self) -> int:
        return self.scheduler.bs_max

    @property
    def settings(self) -> RuntimeSettings:
        return self.scheduler.settings

    @property
    def stats(self) -> RuntimeStats:
        return self.scheduler.stats

    @property
    def trace(self) -> list[TraceEvent]:
        return self.scheduler.trace

    @property
    def admission(self) -> Admission:
        return self.scheduler.admission

    @property
    def buffer_violations(self) -> list[BufferStateError]:
        return self.scheduler.buffer_violations

    @property
    def pending_count(self) -> int:
        return self.scheduler.pending_count

    def observe(self) -> tuple[RuntimeStats, list[int]]:
        """The scheduler's stats and queue lengths, each stage's device time (and the fast path's
        unsliced model's) added from its engine's events where it runs on a device."""
        stats, queues = self.scheduler.observe()
        stats.loop_steps, stats.loop_step_seconds = self.loop.steps, self.loop.step_seconds
        for stage, engine in zip(stats.stages, self._engines):
            timer = getattr(engine, "device_timer", None)
            if timer is not None:
                stage.device_seconds = timer.seconds()
        whole = self._fast_path.model_timer if self._fast_path is not None else None
        if whole is not None:
            stats.inline_device_seconds = whole.seconds()
        return stats, queues

    def executor_states(self) -> list[ExecutorState]:
        return self.scheduler.executor_states()

    def buffer_states(self) -> list[list[BufferState]]:
        with self.scheduler.lock:
            return self.scheduler.board.buffer_states()

    def query_states(self) -> dict[int, QueryState]:
        return self.scheduler.query_states()

    def snapshot(self) -> TableSnapshot:
        return self.scheduler.snapshot()

    def wait_until(self, predicate: Callable[[Scheduler], bool], timeout: float) -> bool:
        return self.scheduler.wait_until(predicate, timeout)

    def any_queued(self, query_ids: Sequence[int]) -> bool:
        return self.scheduler.queries.any_queued(query_ids)
