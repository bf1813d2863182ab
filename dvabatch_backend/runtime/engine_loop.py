"""The engine loop: the one owner of the engines. Every launch is made inside a step.

A step (one `Step` held by one thread at a time) reads what completed and hands it to the
scheduler (`Scheduler.finish_work`: answers, the policy's `Schedule()`, hand-on), calls the policy
again when its batch window passed (`Scheduler.on_window`), and launches, for each stage that runs
nothing, the item the scheduler has for it (`Scheduler.next_work`): the paper's executors (§6.2)
are the step's per-stage launches, not threads. Arrivals need no step: `submit` batches them under
the scheduler's lock and wakes the loop.

Who holds the step (`work.Step`): the loop's thread, or a caller's while the loop is idle, that
is, runs no step, its thread asleep or not (`serve_here`: a Triton `execute` call runs the steps
that answer its own requests on its thread, saving the wake-up of the loop's; arrivals meanwhile
only mark the loop woken, and it steps once the caller lets go). The steps are the same either
way; so is the batch table they serve.

Where a launch runs: on the thread that holds the step, where nothing could run beside it (one
buffer pair: a stage waits for the stage after it to free the pair, so stages run one at a time,
and a quiet pipeline runs a query through every stage without a wake-up); on a worker where
another stage could run meanwhile (two or more pairs), so that batches in different stages overlap
and the step stays free to launch them. Either way a stage has one launch in flight at a time.

Lock order: the step, then the scheduler's lock; never the step under the scheduler's lock.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

from .device_timing import device_timers
from .engine import StageEngine
from .executor import run_work
from .scheduler import Scheduler
from .work import Launch, Work, WorkListener, WorkResult, launching

log = logging.getLogger(__name__)


class HandOverCost:
    """What handing work to the loop costs, measured: from the wake-up that work sends an idle loop
    to the loop's step (a thread's wake), as a moving average; None until one is measured."""

    WEIGHT = 0.2  # of the newest wake in the average

    def __init__(self) -> None:
        self.seconds: float | None = None
        self._since: float | None = None

    def woken(self, now: float) -> None:
        """An idle loop was sent a wake-up (the first one counts)."""
        if self._since is None:
            self._since = now

    def stepped(self, now: float) -> None:
        """The woken loop took its step."""
        if self._since is None:
            return
        sample, self._since = now - self._since, None
        self.seconds = sample if self.seconds is None else self.seconds + self.WEIGHT * (sample - self.seconds)


def hands_over(idle: bool, requests: int, service_s: float, handover_s: float | None) -> bool:
    """Where the engines run beside the host (a device): whether a caller hands its call to the loop
    and returns, rather than running the step itself. Work in flight: the loop takes it (as the
    paper's stretch or a new batch), where waiting for it would idle the host. An idle loop: a lone
    request met nobody and runs on its caller's thread, which saves the hand-over; several met each
    other (they queued while the last call ran), and returning lets the host read the next call
    while the device runs these, which pays where their batch's expected service is longer than a
    hand-over costs (unmeasured: hand over, which measures it)."""
    if not idle:
        return True
    if requests <= 1:
        return False
    return handover_s is None or service_s > handover_s


class EngineLoop(WorkListener):
    """The loop's thread and, with two or more buffer pairs, its launch workers (module docstring).
    Its state (`_woken`, `_completed`) is guarded by `_signal`; `_in_flight` is the step's."""

    def __init__(self, scheduler: Scheduler, engines: Sequence[StageEngine],
                 whole_model: StageEngine | None = None) -> None:
        """`whole_model`: the unsliced model's engine, for the batches that take the one-stage
        route (`Scheduler.serve_whole_model`)."""
        self._scheduler = scheduler
        self._engines = list(engines)
        self._whole_model = whole_model
        self.step = scheduler.step
        self._signal = threading.Condition()
        self._woken = False
        self._completed: list[tuple[Work, WorkResult | BaseException]] = []
        self._in_flight: set[int] = set()  # stages with a launch on a worker
        overlap = scheduler.settings.num_buffer_pairs > 1 and scheduler.num_stages > 1
        self._workers = (ThreadPoolExecutor(scheduler.num_stages, thread_name_prefix="dvabatch-launch")
                         if overlap else None)
        self.entry_wait: Callable[[], None] | None = None  # `Pipeline.wait_at_entry`; set before start
        # each engine's device timer, where it runs on a device: read by the step, published for the metrics
        self._timers = device_timers([*engines, *([whole_model] if whole_model is not None else [])])
        self.wakeups = 0  # how often the loop waited for a signal and woke (its thread only)
        self.steps = 0  # the loop's steps, and the host seconds they took (its thread writes, any reads)
        self.step_seconds = 0.0
        self.handover = HandOverCost()  # under `_signal`
        self._idle = False  # the loop waits for a signal (under `_signal`)
        self._driven = False  # a caller runs the steps (`serve_here`): wake-ups only mark `_woken`
        self.died: BaseException | None = None  # what ended the loop, if not a stop
        self.on_death: Callable[[BaseException], None] = lambda exc: None
        self.thread = threading.Thread(target=self._run, name="dvabatch-engine-loop", daemon=True)

    # -- WorkListener: under the scheduler's lock, so only signal --------------------------

    def stage_ready(self, stage: int) -> None:
        self.wake()

    def window_moved(self) -> None:
        self.wake()

    def stopping(self) -> None:
        self.wake()

    def wake(self) -> None:
        with self._signal:
            self._woken = True
            if self._driven:
                return  # the caller's steps see the work; the loop is told when it lets go
            if self._idle:
                self.handover.woken(self._scheduler.clock())
            self._signal.notify()

    # -- a caller's steps -------------------------------------------------------------------

    def serve_here(self, submit: Callable[[bool], None], answered: Callable[[], bool],
                   between: Callable[[], None] | None = None) -> bool:
        """Call `submit(claimed)` (the caller's arrivals; `claimed`: it may lend its memory, see
        `Scheduler.submit_call`) and, while the loop runs no step, run its steps on this
        thread until `answered()` or a step launches nothing (the policy holds queries back for its
        window, or they wait for a pair); whether `answered()`. The step is claimed before `submit`,
        so that the arrivals do not wake the loop. Not claimed (`submit` alone) while the loop
        steps, has work in flight or completed, or another caller runs its steps. The loop need not
        be asleep: awake between steps (a window's time came), it waits for the step while the
        caller holds it; were it required asleep, calls that follow each other closely would find it
        awake and go to it one after another, each answered through a response sender. Every launch
        here runs on this thread, in stage order; so with two or more buffer pairs, where the loop's
        workers overlap batches in different stages, only a call whose queries make one batch is
        run here. `between()`: before each step after the first (where answers given so far should
        leave, not wait for the rest)."""
        with self._signal:  # the step is taken without waiting: never held while this waits
            step = None if (self._driven or self._completed or self._in_flight) else self.step.try_acquire()
            self._driven = self._driven or step is not None
        if step is None:
            submit(False)
            return answered()
        try:
            try:
                submit(True)
                self._steps_until(step, answered, between)
            finally:
                self._scheduler.own_borrowed()  # before any launch of the loop's can gather them
        finally:
            self.step.release()
            with self._signal:
                self._driven = False  # from here on a wake-up reaches the loop
                woken = self._woken
            if woken and not self._scheduler.holds_nothing_now():
                self.wake()  # work came meanwhile that these steps left (a window, a queue): the loop's
        return answered()

    def _steps_until(self, step: int, answered: Callable[[], bool], between: Callable[[], None] | None) -> None:
        """`serve_here`'s steps, on the caller's thread holding `step`."""
        first = True
        while not answered():
            if self._workers is not None and self._scheduler.batches() > 1:
                return  # batches that could overlap on the loop's workers: the loop's
            if between is not None and not first:
                between()
            first = False
            began = self._scheduler.clock()
            launched, _ = self._step(step, [], here=True)
            self._step_done(began)
            if not launched:
                return

    def _step_done(self, began: float) -> None:
        """A step ended (its holder's thread, the step still held): the device timers read, and counted."""
        for timer in self._timers:
            timer.collect()
        self.step_seconds += self._scheduler.clock() - began
        self.steps += 1

    # -- the loop ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - a bug in the loop: fail loudly, never hang a caller
            log.exception("the engine loop died")
            self.died = exc
            self.on_death(exc)
        finally:
            if self._workers is not None:
                self._workers.shutdown(wait=True)

    def _serve(self) -> None:
        scheduler = self._scheduler
        wake_at: float | None = None
        launched = True
        while True:
            with self._signal:
                ended = scheduler.stopping and not self._in_flight
                if not (launched or ended or self._woken or self._completed):
                    timeout = None if wake_at is None else max(0.0, wake_at - scheduler.clock())
                    self._idle = True
                    self._signal.wait(timeout)
                    self._idle = False
                    self.handover.stepped(scheduler.clock())
                    self.wakeups += 1
                self._woken = False
                completed, self._completed = self._completed, []
            if scheduler.stopping and not self._in_flight and not completed:
                return
            with self.step as step:  # waits while a caller runs the steps (`serve_here`)
                began = scheduler.clock()
                launched, wake_at = self._step(step, completed)
                self._step_done(began)

    def _step(self, step: int, completed: list[tuple[Work, WorkResult | BaseException]],
              here: bool = False) -> tuple[bool, float | None]:
        """One step: the completions, the batch window, one launch per idle stage. Whether it
        launched anything, and when the batch window next passes. Launches on workers go last
        stage first, so a pair is freed downstream before upstream asks for it; launches on this
        thread (one pair, or `here`: a caller's step) go in stage order, each finished before the
        next stage is asked, so a batch crosses every stage in one step."""
        scheduler = self._scheduler
        for done, result in completed:
            self._in_flight.discard(done.stage)
            self._finish(done, result)
        wake_at = scheduler.on_window()
        launched = False
        here = here or self._workers is None
        stages = range(scheduler.num_stages)
        for stage in (stages if here else reversed(stages)):
            if stage in self._in_flight or (stage and not scheduler.has_items(stage)):
                continue
            work = scheduler.next_work(stage)
            if work is None:
                continue
            launched = True
            queries = tuple(q.id for q in work.queries)
            if here:
                self._finish(work, self._launch(work, Launch(stage, step, True, work.item.batch_id, queries)))
            else:
                self._in_flight.add(stage)
                self._workers.submit(self._on_worker, work, Launch(stage, step, False, work.item.batch_id, queries))
        return launched, wake_at

    def _launch(self, work: Work, launch: Launch) -> WorkResult | BaseException:
        """Run `work` on its stage's engine; a failure of the entry's wait is the result."""
        engine = self._whole_model if work.whole else self._engines[work.stage]
        with launching(launch):
            result = run_work(work, engine, self._scheduler)  # type: ignore[arg-type]
        try:  # the unsliced model writes host outputs: its run has ended on the device
            if work.stage == 0 and not work.whole and self.entry_wait is not None:
                self.entry_wait()
        except Exception as exc:  # noqa: BLE001 - a device fault: this batch's queries get the error
            return exc
        return result

    def _on_worker(self, work: Work, launch: Launch) -> None:
        result = self._launch(work, launch)
        with self._signal:
            self._completed.append((work, result))
            self._signal.notify()

    def _finish(self, work: Work, result: WorkResult | BaseException) -> None:
        scheduler = self._scheduler
        if isinstance(result, BaseException):  # the entry's wait for the device failed: this batch alone
            log.warning("stage %d: waiting for the device failed after %s: %s", work.stage, work.item, result)
            scheduler.fail_work(work, result)
            return
        try:
            scheduler.finish_work(work, result)
        except Exception as exc:  # a fault after the run: its queries get an error, the loop serves on
            log.exception("stage %d: bookkeeping failed after %s", work.stage, work.item)
            scheduler.fail_work(work, exc)

