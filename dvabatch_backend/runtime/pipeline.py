"""The pipeline: a `Scheduler` and the `EngineLoop` that owns its engines.

This is what serves: `start` starts the loop, `submit` hands queries to the scheduler,
`serve_here` lets a caller run the loop's steps on its own thread while the loop is idle (a
Triton `execute` call answering its own requests), `stop` answers what is left ("shutting down")
and joins the loop. The scheduler owns the state; the loop owns the engines and is the
scheduler's `WorkListener`.
"""
from __future__ import annotations

import enum
import logging
import threading
import time
from typing import Callable, Mapping, Sequence

import numpy as np

from .decisions import Policy, PolicyContext
from .engine import StageEngine
from .engine_loop import EngineLoop, hands_over
from .manifest import Manifest
from .query import Reply
from .admission import Admission
from .batch_table import TableSnapshot
from .buffers import BufferState, MemoryFactory
from .fences import FenceFactory
from .errors import BufferStateError, EngineLoopDiedError
from .query import QueryState
from .scheduler import Clock, Scheduler
from .settings import RuntimeSettings
from .work import ExecutorState
from .stats import RuntimeStats, TraceEvent

log = logging.getLogger(__name__)


class CallRoute(enum.Enum):
    """What becomes of a caller's call (`Pipeline.route_call`)."""

    HERE = "here"  # submitted; the caller runs the loop's steps that answer it, if the loop is idle
    LOOP = "loop"  # submitted; the caller returns at once and the loop answers it
    REFUSED = "refused"  # refused whole: its oldest waited in the caller's queue past the bound


class Pipeline:
    """A `Scheduler` and its `EngineLoop`. `Pipeline.create(manifest, engines, policy, settings)`
    makes the scheduler too."""

    def __init__(self, scheduler: Scheduler, engines: Sequence[StageEngine],
                 whole_model: StageEngine | None = None) -> None:
        """`whole_model`: the unsliced model's engine, which a batch that meets nobody then runs,
        the one-stage route (`Scheduler.serve_whole_model`), where the policy allows it."""
        if len(engines) != scheduler.num_stages:
            raise ValueError(f"{len(engines)} engines for {scheduler.num_stages} stages")
        self.scheduler = scheduler
        self._engines = list(engines)
        self._whole_model = whole_model if scheduler.settings.fast_path and type(scheduler.policy).allows_inline() else None
        if self._whole_model is not None:
            scheduler.serve_whole_model()
        self.loop = EngineLoop(scheduler, engines, self._whole_model)
        self.loop.on_death = self._loop_died
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
        """Every buffer's fence and memory, before it starts (`device_memory.place_on_streams`:
        stages on CUDA streams). The one-stage route's outputs stay the host's: the unsliced
        model's engine returns when it has written them."""
        with self._state_lock:
            if self._started:
                raise RuntimeError("buffers can only be installed before the pipeline starts")
        with self.scheduler.lock:
            self.scheduler.board.buffers.install_fences(fence_factory, memory_factory)

    def wait_at_entry(self, wait: Callable[[], None]) -> None:
        """Before it starts: the loop calls `wait` after it ran a batch at stage 0, before it takes
        more work (`loading.wait_at_entry`: until the batch has finished on the device)."""
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
        if not started or threading.current_thread() in self.threads or self.scheduler.step.is_mine():
            return  # a reply during a step: the loop waits for this thread's step, and ends after it
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
        """What runs a batch that meets nobody: "model" (the one-stage route) or "stages"."""
        return "model" if self._whole_model is not None else "stages"

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

    def submit_call(self, requests: Sequence[Sequence[tuple[Mapping[str, np.ndarray], Reply]]],
                    timeouts_us: Sequence[int | None] | None = None, borrowed: bool = False) -> list[list[int]]:
        return self.scheduler.submit_call(requests, timeouts_us, borrowed)

    def serve_here(self, submit: Callable[[bool], None], answered: Callable[[], bool],
                   between: Callable[[], None] | None = None) -> bool:
        """`submit(claimed)` (the caller submits its queries, lending its memory where `claimed`:
        `Scheduler.submit_call`) and, while the engine loop is idle, run its
        steps on this thread until `answered()` (`EngineLoop.serve_here`); whether it holds. Off
        (`submit` alone) where the setting `fast_path` is: every step is then the loop's. `between()`
        before each step after the first."""
        if not self.scheduler.settings.fast_path:
            submit(False)
            return answered()
        return self.loop.serve_here(submit, answered, between)

    def route_call(self, requests: int, rows: int, hand_off: bool = False, waited: float | None = None) -> CallRoute:
        """A caller's call of `requests` requests (`rows` rows), whose oldest request has `waited`
        through that many calls in the caller's own queue (`caller_queue.CallerQueue`; None: not
        measured): refused
        whole where that is longer than the caller's bound (`Admission.caller_bound`), the call
        holding the caller's oldest; with `hand_off` (the engines run beside the host), left to
        the loop where `hands_over` says so; else served here."""
        bound = self.scheduler.admission.caller_bound()
        if bound is not None and waited is not None and waited > bound:
            return CallRoute.REFUSED
        if hand_off and self.hands_over(requests, rows):
            return CallRoute.LOOP
        return CallRoute.HERE

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
        """The scheduler's stats and queue lengths, each stage's device time (and the unsliced
        model's) added from its engine's events where it runs on a device."""
        stats, queues = self.scheduler.observe()
        stats.loop_steps, stats.loop_step_seconds = self.loop.steps, self.loop.step_seconds
        for stage, engine in zip(stats.stages, self._engines):
            timer = getattr(engine, "device_timer", None)
            if timer is not None:
                stage.device_seconds = timer.seconds()
        whole = getattr(self._whole_model, "device_timer", None)
        if whole is not None:
            stats.whole_device_seconds = whole.seconds()
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
