"""Admission: what the runtime accepts, and what it drops before it runs.

One rule, at arrival: a request is refused when the work queued ahead of it, in seconds of the
stages' own service, would keep it past the model's bound, its deadline or its latency target.
The wait is predicted as the work of the rows queued ahead of it and of its own: each row's share
of a full batch (bs_max rows at its length) through the slowest stage where stages overlap,
through every stage in a row where they cannot (one buffer pair), at the profiled times
(`row_work`), times the correction learnt from the times the stages take (`ServiceModel`), so a
queue of short queries holds more rows than one of long ones. Each refusal answers with Triton's
code and wording:

  - the bound: by default a request may wait no longer than `QUEUE_BATCHES` bs_max batches at the
    longest length take to enter the pipeline (`wait_bound`: a number of batches, so seconds of
    this device's own service, on a CPU or a GPU alike), refused "Exceeds maximum queue size". A
    burst within it is carried whole; under overload what is answered waits at most about the bound, the rest is
    refused at once. A configured `max_queue_size` (Triton's, in rows: refused past it, as Triton
    refuses) or timeout is the user's queue policy and replaces the derived bound; `max_queue_size`
    0 with no timeout is unbounded;
  - the deadline (Triton's `default_timeout_microseconds`, a request's own `timeout` where
    `allow_timeout_override`): a request predicted to start past it is answered "Request timeout
    expired" at arrival; one still queued at it is answered so and never runs (with
    `timeout_action` "delay" it runs anyway);
  - the latency target (`slo_ms`, NeuStream's admission): a query predicted to finish past it is
    answered "overloaded: cannot meet N ms" at once -- at arrival, and again when stage 0 is about
    to take it -- rather than served late (`action` "serve_late" keeps it).

In Triton's queue, before `execute`, the same bound is counted in calls served (`caller_bound`): a
call whose oldest request waited through more is refused (`Pipeline.route_call`). Under overload the policy's batches are full, and the answered rate is
the rate the stages sustain.

`ServiceModel` is the prediction; `Admission` applies the rule. Both are owned by the scheduler
and used under its lock. docs/queues-and-overload.md has the whole picture.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from .cost import StageCost
from .errors import CancelledError, OverloadedError, QueryError, TimeoutExpiredError
from .query import Query, QueryState
from .settings import MIN_WAKE_DELAY, QueuePolicy, SloPolicy

# the derived bound: a request may wait as long as this many bs_max batches take to enter the
# pipeline. A count of batches, so the bound follows the device's measured service; five carry a
# burst of five full batches at once, and keep an answered request's wait under overload to about
# five batch times beside a lone query's own (a second, for batches of a fifth of a second)
QUEUE_BATCHES = 5
UNPROFILED_STAGE_SECONDS = 1e-3  # per row, for a manifest without stage times, until the correction learns
_EWMA = 0.05  # weight of one observation in the measured/profiled correction
# an observation counts at most this factor from the correction: a run held or preempted (a
# collection, a neighbour) is an outlier, while a real change of speed is still followed, at the weight `_EWMA` a run
_OUTLIER = 2.0
_ROUNDING = 1e-9  # relative: a sum of rows' work drifts from the bound's product by rounding alone


class ServiceModel:
    """Predicted seconds for a stage to run a batch: the profile (`cost.StageCost`, the rule the
    policies read it by), times a correction learnt from what the stages actually take (threads,
    load and the machine differ from the slicer's measurement)."""

    def __init__(self, stage_times: Sequence[dict[int, float]], num_stages: int,
                 by_length: Mapping[int, Sequence[dict[int, float]]] | None = None) -> None:
        if not stage_times:
            stage_times = [{1: UNPROFILED_STAGE_SECONDS} for _ in range(num_stages)]
        self.cost = StageCost(stage_times, len(stage_times), by_length if by_length else None)
        self._lengths = bool(by_length)
        self.correction = 1.0

    @property
    def num_stages(self) -> int:
        return self.cost.num_stages

    def profiled(self, stage: int, bs: int, length: int | None = None) -> float:
        """Profiled seconds at batch size `bs` (at `length` where the profile has lengths; without
        one, the batch-size profile, taken at the longest length)."""
        return self.cost.time(stage, bs, length if self._lengths else None)

    def stage_time(self, stage: int, bs: int) -> float:
        return self.profiled(stage, bs) * self.correction

    def pipeline_time(self, bs: int, from_stage: int = 0) -> float:
        return sum(self.stage_time(k, bs) for k in range(from_stage, self.num_stages))

    def observe(self, stage: int, bs: int, seconds: float, length: int | None = None) -> None:
        self._learn(seconds, self.profiled(stage, bs, length))

    def observe_passage(self, bs: int, seconds: float, length: int | None = None) -> None:
        """A batch passed every stage in one run (the unsliced model): against the stages' sum."""
        self._learn(seconds, sum(self.profiled(k, bs, length) for k in range(self.num_stages)))

    def _learn(self, seconds: float, predicted: float) -> None:
        if predicted > 0 and seconds > 0:
            c = self.correction
            self.correction += _EWMA * (min(max(seconds / predicted, c / _OUTLIER), c * _OUTLIER) - c)


class Admission:
    def __init__(self, queue: QueuePolicy, slo: SloPolicy, service: ServiceModel, bs_max: int,
                 overlapping: bool = True) -> None:
        """`overlapping`: whether the stages run batches at once (two or more buffer pairs): a
        backlog then drains through the slowest stage, else through every stage in a row."""
        self.queue = queue
        self.slo = slo
        self.service = service
        self.bs_max = bs_max
        self.overlapping = overlapping
        self.slo_seconds = None if slo.slo_ms is None else slo.slo_ms / 1000.0
        # the derived bound unless the config sets a queue policy (a bound or a timeout): the user's
        self.derived_bound = queue.max_queue_size is None and not queue.default_timeout_us
        self._row_work: dict[int, float] = {}  # by length: `row_work`, worked out once each

    def row_work(self, length: int | None = None) -> float:
        """A row's profiled seconds in a backlog at `length` (None: the longest profiled): its share
        of a bs_max batch through the slowest stage where stages overlap, through every stage in a
        row where they cannot. Times the correction, the seconds it takes the stages now."""
        key = -1 if length is None else length
        work = self._row_work.get(key)
        if work is None:
            b, service = self.bs_max, self.service
            times = [service.profiled(k, b, length) for k in range(service.num_stages)]
            work = self._row_work[key] = (max(times) if self.overlapping else sum(times)) / b
        return work

    def drain_rate(self) -> float:
        """Rows a second, at the longest length, the stages carry through a backlog now."""
        return 1.0 / (self.row_work() * self.service.correction)

    def batch_seconds(self) -> float:
        """Seconds a bs_max batch takes to enter the pipeline at the drain rate: the unit of the
        bound (the scheduler's lock not needed: it reads one float of the correction)."""
        return self.bs_max / self.drain_rate()

    def wait_bound(self) -> float | None:
        """The derived bound (s): `QUEUE_BATCHES` batch times; None where the config sets a queue policy."""
        return QUEUE_BATCHES * self.batch_seconds() if self.derived_bound else None

    def caller_bound(self) -> float | None:
        """Calls served that a request may wait through before `execute` (`Pipeline.route_call`):
        the derived bound's `QUEUE_BATCHES` (a call that comes full is a bs_max batch, at the pace
        the server really serves calls, its own round for each included); else a configured
        timeout's worth of batches, else a configured `max_queue_size`'s; None: unbounded."""
        timeout, size = self._timeout_s(None), self.queue.max_queue_size
        if self.derived_bound:
            return float(QUEUE_BATCHES)
        return timeout / self.batch_seconds() if timeout else size / self.bs_max if size else None

    def stage_budgets(self) -> list[float]:
        """The latency target split over the stages in proportion to their profiled times at bs_max (s)."""
        if self.slo_seconds is None:
            return []
        times = [self.service.profiled(k, self.bs_max) for k in range(self.service.num_stages)]
        return [self.slo_seconds * t / sum(times) for t in times]

    def queue_refusal(self, rows: int, work: float) -> str | None:
        """Why a request is refused by the bound (module docstring), or None. `rows`: the rows that
        would be queued with it, its own included (those that start at once left out); `work`:
        their profiled seconds (`row_work`)."""
        if self.queue.max_queue_size and rows > self.queue.max_queue_size:
            return f"Exceeds maximum queue size ({rows} queued, max_queue_size {self.queue.max_queue_size})"
        bound = self.wait_bound()
        wait = max(work, 0.0) * self.service.correction
        if bound is not None and wait > bound * (1 + _ROUNDING):
            return (f"Exceeds maximum queue size: overloaded, {rows} queued would make a request wait about "
                    f"{wait * 1000:.0f} ms (the bound: {QUEUE_BATCHES} batches, {bound * 1000:.0f} ms)")
        return None

    def timeout_refusal(self, work: float, timeout_us: int | None = None) -> str | None:
        """Why a request behind `work` profiled seconds of rows (its own included) would time out
        before a stage could take it, or None (module docstring)."""
        timeout = self._timeout_s(timeout_us)
        wait = max(work, 0.0) * self.service.correction
        if timeout is None or wait <= timeout:
            return None
        return f"it would wait about {wait * 1000:.0f} ms, past its timeout of {timeout * 1000:g} ms"

    def _timeout_s(self, request_timeout_us: int | None) -> float | None:
        """The timeout (s) a request's queries are refused past, or None (none, or "delay")."""
        if self.queue.timeout_action != "reject":
            return None
        timeout_us = self.queue.default_timeout_us
        if request_timeout_us and self.queue.allow_timeout_override:
            timeout_us = request_timeout_us
        return timeout_us / 1e6 if timeout_us else None

    def deadline(self, arrival: float, request_timeout_us: int | None) -> float | None:
        """When a query stops being worth running: its request's timeout if it may override, else the default."""
        timeout_us = self.queue.default_timeout_us
        if request_timeout_us and self.queue.allow_timeout_override:
            timeout_us = request_timeout_us
        return arrival + timeout_us / 1e6 if timeout_us else None

    def slo_deadline(self, arrival: float) -> float | None:
        return None if self.slo_seconds is None else arrival + self.slo_seconds

    def predicted_finish(self, now: float, queued_ahead: int, work: float) -> float:
        """When a query arriving now behind `queued_ahead` rows of `work` profiled seconds would
        leave: that work drained as the stages run now, then one pass through the pipeline in a
        batch of what is queued."""
        bs = max(1, min(self.bs_max, queued_ahead + 1))
        return now + work * self.service.correction + self.service.pipeline_time(bs)

    def slo_refusal(self, finish: float, slo_deadline: float | None) -> str | None:
        """Why a query predicted to finish at `finish` is refused under its target, or None."""
        if slo_deadline is None or self.slo.action != "reject" or finish <= slo_deadline:
            return None
        return f"overloaded: cannot meet {self.slo.slo_ms:g} ms"

    def arrival_refusal(self, now: float, queued: int, work: float) -> str | None:
        """Why a query arriving now, behind `queued` rows of `work` profiled seconds, cannot meet its
        latency target, or None. No target, no prediction: it walks every stage's profile."""
        deadline = self.slo_deadline(now)
        return None if deadline is None else self.slo_refusal(self.predicted_finish(now, queued, work), deadline)

    def drop_error(self, q: Query, now: float, bs: int) -> QueryError | None:
        """Why a queued query (to run in a batch of `bs`) should not run any more, or None."""
        if q.cancelled:
            return CancelledError(q.id)
        if self.timed_out(now, q.deadline):
            return TimeoutExpiredError(q.id)
        if q.slo_deadline is None:  # no target: skip the prediction, which walks every stage's profile
            return None
        why = self.slo_refusal(now + self.service.pipeline_time(bs), q.slo_deadline)
        return None if why is None else OverloadedError(q.id, why)

    @staticmethod
    def next_drop_time(waiting: Sequence[Query], now: float) -> float | None:
        """When one of `waiting` still waiting next reaches a deadline (the batch window wakes then to drop it)."""
        times = [t for q in waiting if q.state is QueryState.WAITING
                 for t in (q.deadline, q.slo_deadline) if t is not None]
        return max(min(times), now + MIN_WAKE_DELAY) if times else None

    def timed_out(self, now: float, deadline: float | None) -> bool:
        return deadline is not None and now > deadline and self.queue.timeout_action == "reject"

    def within_slo(self, latency: float) -> bool:
        return self.slo_seconds is None or latency <= self.slo_seconds
