"""Admission: what the runtime accepts, and what it drops before it runs.

Five rules, each refusing with Triton's code and wording where Triton has one, and a cap:
  - the queue bound (Triton's `max_queue_size`): queries admitted but not yet run by stage 0 are
    "queued"; where a request would take them past the bound, the oldest queued requests that no
    stage has started are refused "Exceeds maximum queue size", whole, to make room for it (the
    request itself when they are too few), those still waiting before batched ones queued less
    than `STANDING_WAIT` (a batch about to run, hollowed, would run the backlog a row or two at a
    time; batched rows kept whatever their age could sit whole behind a deep stage-0 queue, so
    the age bounds them). The oldest, not the newest: under overload a queue drained at the head
    and pushed at the tail is crossed at the arrival rate, not the service rate, so what is
    answered waits a fraction of the bound (the service rate over the arrival rate); a burst
    within the bound refuses nothing either way. The default bound is about `QUEUE_SECONDS` of
    work at the pipeline's peak (bs_max rows through the slowest stage, or through every stage in
    a row with one buffer pair), and at least `QUEUE_BATCHES` full batches (`derived_queue_bound`);
  - the standing queue (with the derived bound and no timeout configured): a queue that has held
    more than a batch (bs_max rows) for `STANDING_SECONDS` is overload, not a burst (within the
    bound, a burst falls back to a batch well within that time: arrivals outpaced the stages all
    along); while it stands, a query queued longer than `STANDING_WAIT` is refused "Request
    timeout expired" before it runs. Bursts and a load the stages carry, whose queue keeps falling
    back, are served whole; overload is answered within about STANDING_WAIT plus a batch's
    passage, also as it stops (the queue then drains at the service rate, no newer request pushing
    it on). "Has not emptied" is not the test: a load near the peak keeps a few queued for long
    and would be refused. CoDel's least wait over an interval is not used: by it, the queue left
    as overload stops is a burst like any other;
  - the door (with the standing-queue rule): once a queue has stood, an arrival that would wait
    longer than `STANDING_WAIT` behind what is queued (at the rate the stages carry a backlog, the
    measured correction applied: `backlog_rate`) is refused "Exceeds maximum queue size" before it
    is read, until an arrival finds the pipeline holding nothing; meanwhile batches stay at the
    backlog's size (below). Under overload most arrivals end here, where each pushed-out one
    would cost a copy of its rows, an admission and a send of its own, on the stub's cores the
    stages share; the answered then wait up to STANDING_WAIT, where pushed out they waited the
    bound crossed at the arrival rate;
  - the backlog's batches (not a refusal): with one buffer pair (batches through the stages one at
    a time), while more than a batch is queued, batches are made no larger than `backlog_batch`,
    the smallest profiled size whose time per row is within `BACKLOG_BATCH_TOLERANCE` of the
    least, where a bs_max batch's passage through the stages takes more than `CAPPED_PASSAGE`
    (`ServiceModel.efficient_batch`; the scheduler carries a policy's larger `New` out as several,
    and refuses a `Stretch` past it). A backlog gains no throughput from a larger batch on such a
    device (a CPU, typically), while every row of it waits for all of them: capping the batch cuts
    the answered tail under overload at the same answered rate;
  - the timeout (Triton's `default_timeout_microseconds`, a request's own `timeout` where
    `allow_timeout_override`): a query still queued at its deadline is answered "Request timeout
    expired" and never runs (with `timeout_action` "delay" it runs anyway);
  - the latency target (`slo_ms`, NeuStream's admission): the target is split into per-stage
    budgets in proportion to the profiled stage times; a query whose remaining budget is smaller
    than what the stages still need (predicted from the profile, corrected by the times the
    stages actually take) is answered "overloaded: cannot meet N ms" at once -- at arrival, and
    again when stage 0 is about to take it -- rather than served late (`action` "serve_late" keeps it).

`ServiceModel` is the prediction; `Admission` applies the rules. Both are owned by the
scheduler and used under its lock. docs/queues-and-overload.md has the whole picture.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

from .cost import StageCost
from .errors import CancelledError, OverloadedError, QueryError, StandingQueueError, TimeoutExpiredError
from .query import Query, QueryState
from .settings import MIN_WAKE_DELAY, QueuePolicy, SloPolicy

QUEUE_SECONDS = 1.0  # the default queue bound holds about this much work at the pipeline's peak
QUEUE_BATCHES = 2  # ... and at least this many bs_max batches
BACKLOG_BATCH_TOLERANCE = 0.05  # a backlog's batches stop where a row costs within this of the least
STANDING_SECONDS = 2 * QUEUE_SECONDS  # a queue over a batch for this long stands: overload
STANDING_WAIT = QUEUE_SECONDS / 2  # while it stands, a query queued longer than this is refused
CAPPED_PASSAGE = STANDING_WAIT / 10  # a backlog's batches are capped where a bs_max batch takes longer
UNPROFILED_STAGE_SECONDS = 1e-3  # per row, for a manifest without stage times
_EWMA = 0.05  # weight of one observation in the measured/profiled correction


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

    def peak_rate(self, bs_max: int) -> float:
        """Queries per second through the slowest stage at bs_max."""
        return bs_max / max(self.stage_time(k, bs_max) for k in range(self.num_stages))

    def efficient_batch(self, bs_max: int, tolerance: float, every_length: bool = False) -> int:
        """The smallest profiled batch size (up to bs_max) whose seconds per row through every stage
        are within `tolerance` of the fewest at any profiled size up to bs_max: past it, a larger
        batch buys next to no throughput and makes each of its rows wait for all of them. With
        `every_length`, the largest such size over the profiled lengths (a short length's rows gain
        from a batch where a long one's are at their least). bs_max without a profile."""
        if not self.cost.available:
            return bs_max
        sizes = sorted(b for b in self.cost.profiled(0) if b <= bs_max)
        if not sizes:
            return bs_max
        lengths: list[int | None] = list(self.cost.lengths) if every_length and self._lengths else [None]
        return max(self._efficient_at(sizes, length, tolerance) for length in lengths)

    def _efficient_at(self, sizes: list[int], length: int | None, tolerance: float) -> int:
        per_row = {b: sum(self.profiled(k, b, length) for k in range(self.num_stages)) / b for b in sizes}
        best = min(per_row.values())
        return next(b for b in sizes if per_row[b] <= best * (1 + tolerance))

    def observe(self, stage: int, bs: int, seconds: float, length: int | None = None) -> None:
        predicted = self.profiled(stage, bs, length)
        if predicted > 0 and seconds > 0:
            self.correction += _EWMA * (seconds / predicted - self.correction)


def derived_queue_bound(service: ServiceModel, bs_max: int, overlapping: bool = True) -> int:
    """About `QUEUE_SECONDS` of work at the pipeline's peak, and at least `QUEUE_BATCHES` batches of
    bs_max. The peak: bs_max rows through the slowest profiled stage where stages overlap (two or
    more buffer pairs), through every stage in a row where they cannot (one pair: one batch at a time)."""
    times = [service.profiled(k, bs_max) for k in range(service.num_stages)]
    peak = bs_max / (max(times) if overlapping else sum(times))
    return max(QUEUE_BATCHES * bs_max, math.ceil(peak * QUEUE_SECONDS))


class Admission:
    def __init__(self, queue: QueuePolicy, slo: SloPolicy, service: ServiceModel, bs_max: int,
                 overlapping: bool = True) -> None:
        """`overlapping`: whether the stages run batches at once (two or more buffer pairs); the
        derived queue bound counts on it."""
        self.queue = queue
        self.slo = slo
        self.service = service
        self.bs_max = bs_max
        self.slo_seconds = None if slo.slo_ms is None else slo.slo_ms / 1000.0
        self._derived_bound = derived_queue_bound(service, bs_max, overlapping)
        # a bs_max batch's passage through the stages matters beside the wait a standing queue allows
        # (and the pipeline's own hand-offs cost little beside it: `CallerQueue.caller_backlog`)
        self.long_passage = service.pipeline_time(bs_max) > CAPPED_PASSAGE
        # with one buffer pair, where that passage is each waiting row's wait; at any length, as a
        # call's (the batch-size profile alone is taken at one length, and a shorter length's rows
        # may still gain from a larger batch)
        self.backlog_batch = (service.efficient_batch(bs_max, BACKLOG_BATCH_TOLERANCE, every_length=True)
                              if self.long_passage and not overlapping else bs_max)
        # any batch but a backlog's: no larger than buys throughput at any length, so that a call's
        # requests are answered as their batch is done rather than with its largest batch
        self.call_batch = (service.efficient_batch(bs_max, BACKLOG_BATCH_TOLERANCE, every_length=True)
                           if self.long_passage else bs_max)
        self.overlapping = overlapping
        # the standing-queue rule (and the door) go with the derived bound: a configured bound or
        # timeout is the user's
        self.refuses_standing = queue.max_queue_size is None and not queue.default_timeout_us
        self.door_since: float | None = None  # since when the door refuses (the door rule), None while open
        self.door_shut_at: float | None = None  # when the door last shut: overload known (`CallerQueue`)

    @property
    def max_queue_size(self) -> int:
        """The bound in effect (0: none). Derived: the pipeline's peak at bs_max and the longest
        length from the profile, times `QUEUE_SECONDS`; fixed at load, not following the measured
        correction: under contention, or with a slow engine, that would shrink the bound to a few
        batches and refuse load the pipeline would carry."""
        if self.queue.max_queue_size is not None:
            return self.queue.max_queue_size
        return self._derived_bound

    def stage_budgets(self) -> list[float]:
        """The latency target split over the stages in proportion to their profiled times at bs_max (s)."""
        if self.slo_seconds is None:
            return []
        times = [self.service.profiled(k, self.bs_max) for k in range(self.service.num_stages)]
        return [self.slo_seconds * t / sum(times) for t in times]

    def queue_refusal(self, queued: int, rows: int) -> str | None:
        bound = self.max_queue_size
        if bound and queued + rows > bound:
            return f"Exceeds maximum queue size ({queued} queued, max_queue_size {bound})"
        return None

    def backlog_rate(self) -> float:
        """Rows a second the stages carry through a backlog: its batches (`backlog_batch`) through
        the slowest stage where stages overlap, through every stage in a row where they cannot,
        at the times the stages take now (the profile and the measured correction)."""
        b = self.backlog_batch
        times = [self.service.stage_time(k, b) for k in range(self.service.num_stages)]
        return b / (max(times) if self.overlapping else sum(times))

    def door_refusal(self, now: float, queued: int, queue_since: float | None, idle: bool) -> str | None:
        """Why an arrival is refused before it is read (the door rule), or None. `queued`: the rows
        queued now; `queue_since`: since when the queue has held more than a batch (None: no more);
        `idle`: the pipeline holds nothing, which opens the door (an empty queue does not: stage 0
        may just have taken all of it)."""
        if not self.refuses_standing:
            return None
        if self.door_since is None:
            if queue_since is None or now - queue_since <= STANDING_SECONDS:
                return None
            self.door_since = self.door_shut_at = now
        elif idle:
            self.door_since = None
            return None
        wait = queued / self.backlog_rate()
        if wait <= STANDING_WAIT:
            return None
        return (f"Exceeds maximum queue size: overloaded, {queued} queued would make a request wait about "
                f"{wait * 1000:.0f} ms")

    def deadline(self, arrival: float, request_timeout_us: int | None) -> float | None:
        """When a query stops being worth running: its request's timeout if it may override, else the default."""
        timeout_us = self.queue.default_timeout_us
        if request_timeout_us and self.queue.allow_timeout_override:
            timeout_us = request_timeout_us
        return arrival + timeout_us / 1e6 if timeout_us else None

    def slo_deadline(self, arrival: float) -> float | None:
        return None if self.slo_seconds is None else arrival + self.slo_seconds

    def predicted_finish(self, now: float, queued_ahead: int) -> float:
        """When a query arriving now behind `queued_ahead` others would leave: the queue drained at
        the peak rate, then one pass through the pipeline in a batch of what is queued."""
        bs = max(1, min(self.bs_max, queued_ahead + 1))
        return now + queued_ahead / self.service.peak_rate(self.bs_max) + self.service.pipeline_time(bs)

    def slo_refusal(self, finish: float, slo_deadline: float | None) -> str | None:
        """Why a query predicted to finish at `finish` is refused under its target, or None."""
        if slo_deadline is None or self.slo.action != "reject" or finish <= slo_deadline:
            return None
        return f"overloaded: cannot meet {self.slo.slo_ms:g} ms"

    def arrival_refusal(self, now: float, queued: int) -> str | None:
        """Why a query arriving now, behind `queued` others, cannot meet its latency target, or None.
        No target, no prediction: it walks every stage's profile."""
        deadline = self.slo_deadline(now)
        return None if deadline is None else self.slo_refusal(self.predicted_finish(now, queued), deadline)

    def drop_error(self, q: Query, now: float, bs: int, queue_since: float | None = None) -> QueryError | None:
        """Why a queued query (to run in a batch of `bs`) should not run any more, or None.
        `queue_since`: since when the queue has held more than a batch (None: it holds no more)."""
        if q.cancelled:
            return CancelledError(q.id)
        if self.timed_out(now, q.deadline):
            return TimeoutExpiredError(q.id)
        if (self.refuses_standing and queue_since is not None and now - queue_since > STANDING_SECONDS
                and now - q.arrival > STANDING_WAIT):
            return StandingQueueError(q.id, now - queue_since, now - q.arrival)
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
