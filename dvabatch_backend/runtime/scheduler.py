"""The scheduler: the owner of all the runtime's mutable state, and of no thread.

`submit`/`submit_many` take arrived queries and return at once; the policy batches them with
`new`/`stretch`; whoever runs the stages (the `Pipeline`'s executor threads, or a test from one
thread) asks `next_work(stage)` for an item whose buffer pair is legitimate -- it answers at once,
with the `Work` or None -- runs it outside the lock, and hands the result back with
`finish_work`, where the policy may `split` the batch, items go to the next queue and pairs are
legitimated upstream. Each query is answered through its `reply` exactly once: with its outputs
when its rows leave the last stage (or exit early), or with an error (bad input, a failed stage,
a policy error, shutting down). When a stage may have new work, or the policy's batch window
moves, the scheduler tells its `WorkListener` (under the lock; the listener must only signal).

State: one table of queries (`_queries`, each with its `QueryState`), the batch table, the batch
queues, the buffer pool, each stage's `ExecutorState`, stats and trace.

Executors and stages: executor i starts playing stage i (`next_work_for(i)`). When an executor
finishes an item at stage k, stage k has nothing it can run and the executor of stage k+1 is idle,
`finish_work` hands it the item at k+1 and the two executors swap stages (`RuntimeSettings.run_on`):
a quiet pipeline runs a query through every stage on one thread, without a wake-up per hand-off,
and a busy one keeps one executor per stage. Each stage still runs one item at a time.

Lock discipline: one lock, `Scheduler.lock`, guards all of it. Every public method takes it;
engines run, and replies are delivered, outside it. Policies and the listener are called under
it. `wait_until` waits on a condition over the same lock.
"""
from __future__ import annotations

import copy
import enum
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence, TypeVar

import numpy as np

from .batch_table import BatchItem, BatchQueue, BatchTable, TableSnapshot
from .buffers import BufferPool, BufferState, PairUse
from .fences import FenceFactory, host_fences
from .decisions import ArrivalPlan, BatchTableView, New, Policy, PolicyContext, Split, Stretch
from .admission import Admission, ServiceModel
from .errors import (BadInputError, CancelledError, OverloadedError, PolicyError, QueryError, QueueFullError,
                     ShuttingDownError, StageFailedError, TimeoutExpiredError)
from .manifest import Manifest
from .settings import QueuePolicy, RuntimeSettings, SloPolicy  # noqa: F401 - their home before settings.py
from .query import Answer, Query, QueryInfo, QueryState, Reply, scatter_outputs, validate_inputs
from .stats import RuntimeStats, StageStats, TraceEvent

log = logging.getLogger(__name__)

Clock = Callable[[], float]
MIN_WAKE_DELAY = 1e-4  # seconds
_Delivery = tuple[Reply, Answer]
_Row = TypeVar("_Row", Query, QueryInfo)  # a query, or what a policy sees of one (the fast path plans those)


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
    answer per query (`scatter`).
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


class Scheduler:
    def __init__(
        self,
        manifest: Manifest,
        policy: Policy,
        settings: RuntimeSettings = RuntimeSettings(),
        context: PolicyContext | None = None,
        clock: Clock = time.perf_counter,
        fence_factory: FenceFactory = host_fences,
    ) -> None:
        bs_max = settings.bs_max or manifest.max_batch_size
        if not 1 <= bs_max <= manifest.max_batch_size:
            raise ValueError(f"bs_max must be in [1, {manifest.max_batch_size}], got {bs_max}")
        self.manifest = manifest
        self.num_stages = manifest.num_stages
        self.bs_max = bs_max
        self.input_specs = manifest.inputs
        self.output_specs = manifest.outputs
        self.settings = settings
        self.lock = threading.Lock()
        self.clock = clock
        self.listener = WorkListener()
        self._ids = itertools.count()
        self._policy = policy
        self._table = BatchTable(self.num_stages, bs_max)
        self._view = BatchTableView(self._table)
        self._queues = [BatchQueue() for _ in range(self.num_stages)]
        self._buffers = BufferPool(manifest, settings.num_buffer_pairs, bs_max, fence_factory)
        self._queries: dict[int, Query] = {}  # submitted and not yet answered, in arrival order
        # the WAITING ones among them, in arrival order: a dispatch looks at these, not at every query
        # in flight (a query leaves only in `_apply`, batched, or in `_answer`)
        self._waiting_queries: dict[int, Query] = {}
        self.admission = Admission(settings.queue, settings.slo,
                                   ServiceModel(manifest.stage_times(), self.num_stages,
                                                manifest.stage_times_by_length()), bs_max)
        self._stage_states = [ExecutorState.INACTIVE] * self.num_stages
        self._plays = list(range(self.num_stages))  # executor -> the stage it plays (a run-on swaps two)
        self._held_signals: list[int] | None = None  # stage_ready signals held while finish_work decides a run-on
        self._wake_at: float | None = None
        self._stopping = False
        self._inline = False  # a fast-path run holds the pipeline (`reserve_inline`): no stage starts work
        self.stats = RuntimeStats(stages=[StageStats() for _ in range(self.num_stages)])
        self.trace: list[TraceEvent] = []
        self._progress = threading.Condition(self.lock)
        self._progress_waiters = 0
        self._policy_splits = type(policy).on_stage_done is not Policy.on_stage_done
        policy.bind(context or PolicyContext(
            num_stages=self.num_stages, bs_max=bs_max, max_length=manifest.max_length,
            num_buffer_pairs=settings.num_buffer_pairs, stage_times=manifest.stage_times(),
            stage_times_by_length=manifest.stage_times_by_length(),
            output_names=tuple(t.name for t in manifest.outputs), pad_safe=manifest.pad_safe,
        ))

    # -- lifecycle ----------------------------------------------------------------------

    @property
    def stopping(self) -> bool:
        return self._stopping

    def stop(self) -> None:
        """Answer every query not yet answered with "shutting down"; `next_work` returns None from now on."""
        with self.lock:
            if self._stopping:
                return
            self._stopping = True
            queries = list(self._queries.values())
            self._queries.clear()
            self._waiting_queries.clear()
            deliveries = [self._answer(q, Answer(q.id, None, ShuttingDownError(q.id))) for q in queries]
            self.stats.queued = 0
            self._table.clear()
            for queue in self._queues:
                queue.clear()
            self._stage_states = [ExecutorState.STOPPED] * self.num_stages
            self.listener.stopping()
            self._notify_progress()
        _deliver(deliveries)

    # -- arrivals -----------------------------------------------------------------------

    def submit(self, inputs: Mapping[str, np.ndarray], reply: Reply) -> int:
        return self.submit_many([(inputs, reply)])[0]

    def submit_many(self, requests: Sequence[tuple[Mapping[str, np.ndarray], Reply]],
                    timeout_us: int | None = None) -> list[int]:
        """Take arrived queries (one request's rows: admitted or refused together); return their ids
        at once. Bad ones, and ones over the queue bound or the latency target, are answered here
        and now. `timeout_us` is the request's own timeout (admission.py)."""
        now = self.clock()
        deliveries: list[_Delivery] = []
        accepted: list[Query] = []
        ids = []
        for inputs, reply in requests:
            qid = next(self._ids)
            ids.append(qid)
            try:
                arrays, length = validate_inputs(qid, inputs, self.manifest)
            except BadInputError as exc:
                deliveries.append((reply, Answer(qid, None, exc)))
                continue
            except Exception as exc:  # not even tensors: still this query's answer, not the caller's crash
                deliveries.append((reply, Answer(qid, None, BadInputError(qid, f"malformed input: {exc}"))))
                continue
            accepted.append(Query(qid, arrays, length, now, reply))
        with self.lock:
            self.stats.submitted += len(requests)
            self.stats.answered_error += len(deliveries)
            if accepted:
                deliveries += self._admit(accepted, now, timeout_us)
            deliveries += self._dispatch(now)
        _deliver(deliveries)
        return ids

    def _admit(self, queries: list[Query], now: float, timeout_us: int | None) -> list[_Delivery]:
        """Queue the queries, or refuse them all: stopping, the queue bound, the latency target."""
        if self._stopping:
            return [self._refuse(q, ShuttingDownError(q.id)) for q in queries]
        admission = self.admission
        why = admission.queue_refusal(self.stats.queued, len(queries))
        if why is not None:
            self.stats.queue_full += len(queries)
            return [self._refuse(q, QueueFullError(q.id, why)) for q in queries]
        slo_deadline = admission.slo_deadline(now)
        why = self._slo_refusal(now, slo_deadline, self.stats.queued)
        if why is not None:
            self.stats.slo_rejected += len(queries)
            return [self._refuse(q, OverloadedError(q.id, why)) for q in queries]
        deadline = admission.deadline(now, timeout_us)
        for q in queries:
            q.deadline, q.slo_deadline = deadline, slo_deadline
            self._queries[q.id] = q
            self._waiting_queries[q.id] = q
        self.stats.queued += len(queries)
        return []

    def cancel(self, query_ids: Sequence[int]) -> None:
        """The client cancelled these queries: drop those not yet taken by stage 0 (answered
        "cancelled"); the others finish, and their answers go to a request nobody awaits."""
        deliveries: list[_Delivery] = []
        with self.lock:
            for qid in query_ids:
                q = self._queries.get(qid)
                if q is None or q.cancelled:
                    continue
                q.cancelled = True
                if q.state is QueryState.WAITING:
                    del self._queries[qid]
                    deliveries.append(self._drop(q, CancelledError(qid)))
                elif q.entered:
                    self.stats.cancelled_in_flight += 1
                # batched, not yet run: dropped when stage 0 reaches its batch (`_prune_queued_head`)
        _deliver(deliveries)

    def any_queued(self, query_ids: Sequence[int]) -> bool:
        """Whether one of these queries is admitted and not yet taken by stage 0 (read without the lock)."""
        queries = self._queries
        return any((q := queries.get(qid)) is not None and not q.entered for qid in query_ids)

    @property
    def wake_at(self) -> float | None:
        """When the policy asked to be called again (its batch window), or None."""
        return self._wake_at

    def on_window(self) -> float | None:
        """Call the policy again if its batch window has passed; return the next wake-up time."""
        with self.lock:
            now = self.clock()
            if self._wake_at is None or self._wake_at > now:
                return self._wake_at
            self._wake_at = None
            deliveries = self._dispatch(now)
            wake_at = self._wake_at
        _deliver(deliveries)
        return wake_at

    def _waiting(self) -> list[Query]:
        return list(self._waiting_queries.values())

    # -- the fast path (runtime/fast_path.py) ------------------------------------------

    @property
    def inline_allowed(self) -> bool:
        """Whether the fast path serves: the setting, and a policy that allows it."""
        return self.settings.fast_path and type(self._policy).allows_inline()

    def reserve_inline(self, rows: int) -> bool:
        """Hold the pipeline for one fast-path run of `rows` rows on the caller's thread, if it holds
        nothing: no query unanswered, no batch in the table, no stage working. While held, queries
        submitted are admitted and batched as usual but no stage starts work, so none overtakes the
        run; `release_inline` lets them go."""
        with self.lock:
            if (self._stopping or self._inline or self._queries or len(self._table) or rows < 1
                    or ExecutorState.WORKING in self._stage_states or self._misses_target()):
                return False
            self._inline = True
            return True

    def _misses_target(self) -> bool:
        """A latency target no query can meet now: the usual way refuses it, or serves it late."""
        now = self.clock()
        return self._slo_refusal(now, self.admission.slo_deadline(now), queued=0) is not None

    def _slo_refusal(self, now: float, deadline: float | None, queued: int) -> str | None:
        """Why a query arriving now, behind `queued` others, cannot meet `deadline` (its latency
        target), or None. No target, no prediction: it walks every stage's profile."""
        if deadline is None:
            return None
        return self.admission.slo_refusal(self.admission.predicted_finish(now, queued), deadline)

    def plan_inline(self, lengths: Sequence[int], now: float) -> list[tuple[list[int], int]]:
        """While the pipeline is held for the fast path: the batches the policy makes of rows of
        these lengths arriving now at an empty pipeline, as (row indices, pad length), in the order
        to run them. Rows the policy leaves waiting are offered again; rows it never takes (or a
        policy that fails) go in arrival order, bs_max at a time. A model that is not pad-safe gets
        one batch per length, as `_apply` carries out a `New`."""
        ids = {next(self._ids): i for i in range(len(lengths))}
        waiting = [QueryInfo(qid, lengths[i], now) for qid, i in ids.items()]
        batches: list[tuple[list[int], int]] = []
        with self.lock:
            while waiting:
                try:
                    plan = self._policy.on_arrival(list(waiting), self._view, now)
                    _check_plan(plan)
                    decisions = [d for d in plan.decisions if isinstance(d, New)]
                except Exception:  # a broken policy must not lose rows: arrival order instead
                    log.exception("policy %s failed in on_arrival (fast path)", self._policy.name)
                    self.stats.policy_errors += 1
                    decisions = []
                left = {q.id: q for q in waiting}
                taken = []
                for d in decisions:
                    rows = [left.pop(qid) for qid in dict.fromkeys(d.query_ids) if qid in left][:self.bs_max]
                    if rows:
                        taken.append((rows, d.pad_length))
                if not taken:  # nothing decided: arrival order
                    chunk = list(left.values())[:self.bs_max]
                    taken = [(chunk, None)]
                    for q in chunk:
                        del left[q.id]
                for rows, pad in taken:
                    groups = [rows] if self.manifest.pad_safe else self._by_length(New(tuple(q.id for q in rows), pad), rows)
                    for group in groups:
                        longest = max(q.length for q in group)
                        length = longest if pad is None or not self.manifest.pad_safe else max(longest, min(pad, self.manifest.max_length))
                        batches.append(([ids[q.id] for q in group], length))
                waiting = list(left.values())
        return batches

    def release_inline(self, rows: int, seconds: float | None, runs: int = 1, fell_back: bool = False) -> None:
        """The fast-path run ended: `rows` rows answered in `runs` batches, the last `seconds` after
        they arrived (None: none answered); `fell_back`: some rows were not answered (a batch
        failed) and the caller sends them the usual way. Stages with work waiting are signalled."""
        with self.lock:
            self._inline = False
            if fell_back:
                self.stats.inline_fallbacks += 1
            if seconds is not None and rows:
                self.stats.inline_runs += runs
                self.stats.inline_queries += rows
                self.stats.submitted += rows
                self.stats.answered_ok += rows
                if self.admission.slo_seconds is None or self.admission.within_slo(seconds):
                    self.stats.within_slo += rows
            for stage in range(self.num_stages):
                if self._ready_pair(stage) is not None:
                    self._signal(stage)
            self._notify_progress()

    # -- admission: queries dropped before they run ------------------------------------

    def _drop_error(self, q: Query, now: float, bs: int) -> QueryError | None:
        """Why a queued query (to run in a batch of `bs`) should not run any more, or None."""
        if q.cancelled:
            return CancelledError(q.id)
        if self.admission.timed_out(now, q.deadline):
            return TimeoutExpiredError(q.id)
        if q.slo_deadline is None:  # no target: skip the prediction, which walks every stage's profile
            return None
        why = self.admission.slo_refusal(now + self.admission.service.pipeline_time(bs), q.slo_deadline)
        return None if why is None else OverloadedError(q.id, why)

    def _drop(self, q: Query, error: QueryError) -> _Delivery:
        """Answer a queued query that will not run (taken off the query table by the caller)."""
        if isinstance(error, CancelledError):
            self.stats.cancelled += 1
        elif isinstance(error, TimeoutExpiredError):
            self.stats.timed_out += 1
        else:
            self.stats.slo_rejected += 1
        return self._answer(q, Answer(q.id, None, error))

    def _refuse(self, q: Query, error: QueryError) -> _Delivery:
        """Answer a query that was never admitted."""
        q.entered = True  # never counted as queued
        return self._answer(q, Answer(q.id, None, error))

    def _drop_waiting(self, now: float) -> tuple[list[Query], list[_Delivery]]:
        """The waiting queries still worth running, in arrival order, and the answers of the others."""
        waiting, deliveries = [], []
        for q in self._waiting():
            error = self._drop_error(q, now, 1)
            if error is None:
                waiting.append(q)
            else:
                del self._queries[q.id]
                deliveries.append(self._drop(q, error))
        return waiting, deliveries

    @staticmethod
    def _next_drop_time(waiting: list[Query], now: float) -> float | None:
        """When one of `waiting` still waiting next reaches a deadline: the batch window wakes then to drop it."""
        times = [t for q in waiting if q.state is QueryState.WAITING
                 for t in (q.deadline, q.slo_deadline) if t is not None]
        return max(min(times), now + MIN_WAKE_DELAY) if times else None

    def _prune_queued_head(self, now: float) -> list[_Delivery]:
        """Drop the dead queries of the batches at the head of stage 0's queue that no stage has
        started (their rows are not in any buffer yet): the batch shrinks, or goes if none is left."""
        queue, deliveries = self._queues[0], []
        while (item := queue.head()) is not None:
            row = self._table.get(item.batch_id)
            if row.started:
                break
            dead = [(q, e) for q in row.queries if (e := self._drop_error(q, now, row.bs)) is not None]
            if not dead:
                break
            gone = {q.id for q, _ in dead}
            row.queries = [q for q in row.queries if q.id not in gone]
            queue.remove_batch(row.id)
            for q, error in dead:
                del self._queries[q.id]
                deliveries.append(self._drop(q, error))
            if row.queries:
                queue.push_front(BatchItem(row.id, 0, row.bs))
                break
            self._table.drop(row.id)
        return deliveries

    def _dispatch(self, now: float) -> list[_Delivery]:
        """Drop the waiting queries past their deadline; ask the policy what to do with the others,
        and do it. Under the lock."""
        if self._stopping:
            return []
        waiting, deliveries = self._drop_waiting(now)  # one pass over the query table, not three
        if not waiting:
            return deliveries
        try:
            plan = self._policy.on_arrival([q.info for q in waiting], self._view, now)
            _check_plan(plan)
        except Exception:  # a broken policy must not lose queries: treat it as "no decision"
            log.exception("policy %s failed in on_arrival", self._policy.name)
            self.stats.policy_errors += 1
            plan = ArrivalPlan()
        for decision in plan.decisions:
            deliveries += self._apply(decision, now)
        # a wake-up in the past would have the window call the policy again at once, forever:
        # the earliest wake-up is a little after now
        policy_wake = None if plan.wake_at is None else max(float(plan.wake_at), now + MIN_WAKE_DELAY)
        drop_wake = self._next_drop_time(waiting, now)  # no query becomes waiting during a dispatch
        self._wake_at = min((t for t in (policy_wake, drop_wake) if t is not None), default=None)
        if self._wake_at is not None:
            self.listener.window_moved()
        if policy_wake is None and len(self._table) == 0 and (left := self._waiting()):
            # Nothing in flight and no wake-up asked: the waiting queries would wait forever.
            log.error("policy %s left %d queries waiting with nothing in flight", self._policy.name, len(left))
            self.stats.policy_errors += 1
            for i in range(0, len(left), self.bs_max):
                deliveries += self._apply(New(tuple(q.id for q in left[i:i + self.bs_max])), now)
        return deliveries

    def _apply(self, decision: New | Stretch, now: float) -> list[_Delivery]:
        """Carry out one arrival decision, checked whole before anything changes."""
        ids = decision.query_ids
        refusal = self._arrival_refusal(decision)
        if refusal is not None:
            return self._policy_error(refusal, [q for q in ids if self._is_waiting(q)])
        queries = [self._queries[q] for q in ids]
        for q in queries:
            q.state = QueryState.BATCHED
            self._waiting_queries.pop(q.id, None)
        if isinstance(decision, Stretch):
            why = self._table.stretch_refusal(decision.batch_id, [q.length for q in queries])
            if why is None and not self.manifest.pad_safe:
                why = self._pad_unsafe_stretch(decision.batch_id, queries)
            if why is None:
                item = self._table.stretch(decision.batch_id, queries)
                self.stats.stretch += 1
                self._record("stretch", now, None, item)
                self._push(0, item, now)
                return []
            self.stats.stretch_refused += 1
            log.debug("stretch refused, new batch instead: %s", why)
            decision = New(ids)
        if not self.manifest.pad_safe:
            for group in self._by_length(decision, queries):
                self._new(group, group[0].length, decision.no_stretch, now)
            return []
        pad = max(q.length for q in queries) if decision.pad_length is None else decision.pad_length
        self._new(queries, pad, decision.no_stretch, now)
        return []

    def _new(self, queries: list[Query], pad: int, no_stretch: bool, now: float) -> None:
        item = self._table.new(queries, pad, pair=-1, now=now, no_stretch=no_stretch)
        self.stats.new += 1
        self._record("new", now, None, item, f"pad={pad}")
        self._push(0, item, now)

    def _by_length(self, decision: New, queries: list[_Row]) -> list[list[_Row]]:
        """A model that is not pad-safe: the `New`'s queries as one batch per length (in order of first
        appearance), each at its own length, whatever pad length the policy asked for."""
        groups: dict[int, list[_Row]] = {}
        for q in queries:
            groups.setdefault(q.length, []).append(q)
        if len(groups) > 1 or (decision.pad_length is not None and decision.pad_length != queries[0].length):
            self.stats.pad_unsafe_splits += 1
            log.debug("model not pad-safe: %s carried out as batches of lengths %s", decision, list(groups))
        return list(groups.values())

    def _pad_unsafe_stretch(self, batch_id: int, queries: list[Query]) -> str | None:
        """A model that is not pad-safe: why these queries may not join the batch (a length other than
        the batch's pad length), or None."""
        pad = self._table.get(batch_id).pad_length
        other = sorted({q.length for q in queries if q.length != pad})
        if not other:
            return None
        self.stats.pad_unsafe_splits += 1
        return f"the model is not pad-safe: queries of lengths {other} cannot join batch {batch_id} of length {pad}"

    def _is_waiting(self, query_id: int) -> bool:
        q = self._queries.get(query_id)
        return q is not None and q.state is QueryState.WAITING

    def _arrival_refusal(self, decision: New | Stretch) -> str | None:
        ids = decision.query_ids
        if not ids or len(set(ids)) != len(ids) or not all(self._is_waiting(q) for q in ids):
            return f"{decision} names queries that are not all distinct and waiting"
        if len(ids) > self.bs_max:
            return f"{decision} has more than bs_max={self.bs_max} queries"
        if isinstance(decision, New) and decision.pad_length is not None:
            longest = max(self._queries[q].length for q in ids)
            if not longest <= decision.pad_length <= self.manifest.max_length:
                return f"{decision}: pad length outside [{longest}, {self.manifest.max_length}]"
        return None

    def _policy_error(self, why: str, query_ids: Sequence[int]) -> list[_Delivery]:
        log.error("policy %s: %s", self._policy.name, why)
        self.stats.policy_errors += 1
        return [
            self._answer(q, Answer(q.id, None, PolicyError(q.id, f"policy {self._policy.name}: {why}")))
            for q in (self._queries.pop(qid) for qid in query_ids)
        ]

    # -- stages -------------------------------------------------------------------------

    def next_work(self, stage: int) -> Work | None:
        """The item `stage` may run now (its buffer pair legitimate), taken off its queue; or None.

        Never blocks. None also when stopping (see `stopping`) or while the stage already runs an
        item. Stage 0 first drops the queued queries that timed out, were cancelled or can no
        longer meet the latency target.
        """
        return self._next_work(lambda: stage)

    def next_work_for(self, executor: int) -> Work | None:
        """`next_work` of the stage that `executor` plays now (executor threads ask this way)."""
        return self._next_work(lambda: self._plays[executor])

    def stage_played_by(self, executor: int) -> int:
        return self._plays[executor]

    def executor_playing(self, stage: int) -> int:
        """The executor that plays `stage` (the listener asks, under the lock, whom to wake)."""
        return self._plays.index(stage)

    def _next_work(self, stage_now: Callable[[], int]) -> Work | None:
        deliveries: list[_Delivery] = []
        try:
            with self.lock:
                if self._stopping:
                    return None
                stage = stage_now()
                if stage == 0:
                    deliveries = self._prune_queued_head(self.clock())
                return self._take_work(stage)
        finally:
            _deliver(deliveries)

    def _ready_pair(self, stage: int) -> int | None:
        """The buffer pair of `stage`'s next item when that pair is legitimate (the stage can run
        it now), else None. Under the lock."""
        item = self._queues[stage].head()
        pair = None if item is None else self._pair_for(stage, item)
        return pair if pair is not None and self._buffers.is_legitimate(stage, pair) else None

    def _take_work(self, stage: int) -> Work | None:
        """`next_work` under the lock."""
        if self._inline or self._stage_states[stage] is ExecutorState.WORKING:
            return None
        pair = self._ready_pair(stage)
        if pair is None:
            self._stage_states[stage] = self._idle_state(stage)
            self._notify_progress()
            return None
        item = self._queues[stage].pop_coalesced()
        row = self._table.get(item.batch_id)
        row.pair = pair
        row.started = True
        use = PairUse(stage, pair, row.rows(item), group=row.group)
        self._buffers.begin(use)
        self._stage_states[stage] = ExecutorState.WORKING
        length = row.pad_length
        inp, out = self._buffers.pair(stage, pair)
        queries = row.queries[item.start:item.start + item.num]
        if stage == 0:
            for q in queries:
                if not q.entered:
                    q.entered = True
                    self.stats.queued -= 1
        return Work(
            stage, item, use, inp.rows(length, use.rows), out.rows(length, use.rows),
            queries, self.clock(), gather=stage == 0, scatter=stage == self.num_stages - 1,
        )

    def _idle_state(self, stage: int) -> ExecutorState:
        """The state of `stage` while it runs nothing: it holds no usable pair, or waits for an item,
        or has an item whose pair is not legitimate yet."""
        if not self._buffers.is_active(stage):
            return ExecutorState.INACTIVE
        if self._queues[stage].head() is None or self._ready_pair(stage) is not None:
            return ExecutorState.ACTIVE
        return ExecutorState.CHECKING

    def _pair_for(self, stage: int, item: BatchItem) -> int | None:
        """The item's buffer pair; a new batch takes the first legitimate one at stage 0."""
        row = self._table.get(item.batch_id)
        if row.pair >= 0:
            return row.pair
        return self._buffers.first_legitimate(stage)

    def finish_work(self, work: Work, result: WorkResult, executor: int | None = None) -> Work | None:
        """`work` ran: answer exits, carry out `Schedule()`, hand on, legitimate.

        From an executor thread (`executor` given, playing `work.stage`), returns the item that
        executor runs next at the following stage, if it runs on (see the module docstring);
        otherwise None, and the executor asks `next_work_for` again.
        """
        now = self.clock()
        deliveries: list[_Delivery] = []
        run_on: Work | None = None
        try:
            with self.lock:
                if self._stopping:
                    return None
                may_run_on = (executor is not None and self.settings.run_on
                              and work.stage + 1 < self.num_stages and self._plays[executor] == work.stage)
                if not may_run_on:
                    self._finish_locked(work, result, now, deliveries)
                    return None
                self._held_signals = []
                try:
                    self._finish_locked(work, result, now, deliveries)
                    run_on = self._run_on(executor, work.stage)  # type: ignore[arg-type]
                finally:
                    held, self._held_signals = self._held_signals, None
                    for stage in dict.fromkeys(held):  # the executor now playing it runs it: no wake-up
                        if run_on is None or stage != run_on.stage:
                            self.listener.stage_ready(stage)
        finally:  # answers already taken from the query table are delivered whatever happens
            _deliver(deliveries)
        return run_on

    def fail_work(self, work: Work, error: BaseException) -> None:
        """`finish_work` raised (a runtime bug, or a subclass that breaks it): answer the queries of
        the work's batch with an error naming the stage and the cause, and free what the batch held
        (its buffer rows, its queue items, its table row) so the pipeline serves on."""
        deliveries: list[_Delivery] = []
        try:
            with self.lock:
                cause = f"the runtime failed after the stage ran: {type(error).__name__}: {error}"
                row = self._table.get(work.item.batch_id) if work.item.batch_id in self._table else None
                queries = {id(q): q for q in [*work.queries, *(row.queries if row else [])]}.values()
                deliveries = [self._answer(q, Answer(q.id, None, StageFailedError(q.id, cause, work.stage)))
                              for q in queries if self._queries.pop(q.id, None) is not None]
                inp, out = self._buffers.pair(work.stage, work.use.pair)
                if inp.state is BufferState.INREADING and out.state is BufferState.INWRITING:
                    self._buffers.finish(work.use, handed_on=False)
                if row is not None:
                    for queue in self._queues:
                        queue.remove_batch(row.id)
                    for boundary in range(1, self.num_stages):
                        self._buffers.discard(boundary, work.use.pair, range(row.row_start, row.row_start + row.bs))
                    self._table.drop(row.id)
                self._record("exit", self.clock(), work.stage, work.item, f"failed: {cause}")
                for stage in range(self.num_stages):
                    for upstream in self._buffers.legitimate_upstream(stage):
                        self._legitimated(upstream)
                    if self._stage_states[stage] is not ExecutorState.WORKING or stage == work.stage:
                        self._stage_states[stage] = self._idle_state(stage)
                    if self._ready_pair(stage) is not None:
                        self._signal(stage)
                deliveries += self._dispatch(self.clock())
                self._notify_progress()
        finally:
            _deliver(deliveries)

    def _run_on(self, executor: int, stage: int) -> Work | None:
        """After `executor` finished an item at `stage`: the item at stage + 1 it runs itself, or None.

        Only while `stage` has nothing to run and stage + 1's executor is idle; the two executors
        then swap stages, so each stage keeps one executor and runs one item at a time."""
        following = stage + 1
        if (self._ready_pair(stage) is not None or self._stage_states[following] is ExecutorState.WORKING
                or self._ready_pair(following) is None):
            return None
        other = self._plays.index(following)
        self._plays[executor], self._plays[other] = following, stage
        self.stats.run_ons += 1
        return self._take_work(following)

    def _finish_locked(self, work: Work, result: WorkResult, now: float, deliveries: list[_Delivery]) -> None:
        stage, item = work.stage, work.item
        stats = self.stats.stages[stage]
        stats.batches += 1
        stats.rows += item.num
        stats.busy_seconds += now - work.started
        row = self._table.get(item.batch_id) if item.batch_id in self._table else None
        self.admission.service.observe(stage, item.num, now - work.started, row.pad_length if row else None)
        self._record("run", work.started, stage, item, t1=now)
        if result.error is not None:
            deliveries += self._answer_errors(work, result.error, work.queries)
        for row, error in result.row_errors.items():  # those rows' queries alone fail; the rest go on
            deliveries += self._answer_errors(work, error, [work.queries[row]])
        if result.error is None and result.answers is not None:
            deliveries += self._answer_results(work.queries, result.answers)
        handed_on, exiting = self._hand_on(stage, item, now)
        self._buffers.finish(work.use, handed_on=bool(handed_on))
        for out_item in handed_on:
            self._push(stage + 1, out_item, now)
        if exiting is not None:
            deliveries += self._exit_early(stage, work.use.pair, exiting, now)
        if stage == self.num_stages - 1 and self._table.retire_if_done(item.batch_id):
            self._record("exit", now, stage, BatchItem(item.batch_id, 0, 0))
        for upstream in self._buffers.legitimate_upstream(stage):
            self._legitimated(upstream)
        if stage == self.num_stages - 1 or exiting is not None:
            deliveries += self._dispatch(now)
        self._stage_states[stage] = self._idle_state(stage)
        self._notify_progress()

    def _hand_on(self, stage: int, item: BatchItem, now: float) -> tuple[list[BatchItem], EarlyExit | None]:
        """After `stage` ran `item`: the items for the next stage, and the sub-batches that exit
        early. This is the policy's `Schedule()`."""
        nxt = self._table.complete(item, stage)
        if nxt is None:
            return [], None
        row = self._table.get(nxt.batch_id)
        if not self._policy_splits or nxt.start != 0 or nxt.num != row.bs:
            return [nxt], None
        out = self._buffers.pair(stage, row.pair)[1]
        view = BatchTableView(self._table, stage_outputs=out.rows(row.pad_length, row.rows(nxt)))
        try:
            decision = self._policy.on_stage_done(stage, self._table.info(row), view, now)
        except Exception:  # the batch goes on whole
            log.exception("policy %s failed in on_stage_done", self._policy.name)
            self.stats.policy_errors += 1
            return [nxt], None
        if not isinstance(decision, Split):
            return [nxt], None
        why = self._split_problem(decision, stage, nxt)
        if why is not None:
            self.stats.split_refused += 1
            log.log(logging.ERROR if why.startswith("policy") else logging.DEBUG, "split refused: %s", why)
            return [nxt], None
        children = self._table.split(nxt.batch_id, stage, [int(n) for n in decision.sizes])
        self.stats.split += 1
        self._record("split", now, stage, nxt, f"into {list(decision.sizes)} -> ids {[c.batch_id for c in children]}")
        flags = decision.exit or (False,) * len(children)
        going = [c for c, leaves in zip(children, flags) if not leaves]
        leaving = [c for c, leaves in zip(children, flags) if leaves]
        return going, (EarlyExit(leaving, dict(decision.exit_outputs)) if leaving else None)

    def _split_problem(self, decision: Split, stage: int, nxt: BatchItem) -> str | None:
        """Why a Split cannot be carried out, or None. Reasons that are a policy's bug start with "policy"."""
        sizes = decision.sizes
        if not isinstance(sizes, (tuple, list)) or not all(_is_int(n) for n in sizes):
            self.stats.policy_errors += 1
            return f"policy {self._policy.name}: {decision} has sizes that are not ints"
        if decision.exit:
            if len(decision.exit) != len(sizes):
                self.stats.policy_errors += 1
                return f"policy {self._policy.name}: {decision} has {len(decision.exit)} exit flags for {len(sizes)} parts"
            at_stage = {t.name: t for t in self.manifest.boundary(stage + 1)}
            for spec in self.output_specs:
                source = at_stage.get(decision.exit_outputs.get(spec.name, ""))
                if source is None or source.dtype != spec.dtype or source.dims != spec.dims:
                    self.stats.policy_errors += 1
                    return (f"policy {self._policy.name}: exit output {spec.name!r} must come from a tensor of stage "
                            f"{stage}'s output with dims {list(spec.dims)}; got {decision.exit_outputs.get(spec.name)!r}")
        whole_exit = len(sizes) == 1 and bool(decision.exit) and decision.exit[0]
        return self._table.split_refusal(nxt, stage, [int(n) for n in sizes], min_parts=1 if whole_exit else 2)

    def _exit_early(self, stage: int, pair: int, exiting: EarlyExit, now: float) -> list[_Delivery]:
        """Answer the sub-batches that leave after `stage` from its output, and free their rows."""
        out = self._buffers.pair(stage, pair)[1]
        deliveries = []
        for child in exiting.leaving:
            row = self._table.get(child.batch_id)
            rows = row.rows(child)
            views = out.rows(row.pad_length, rows)
            results = scatter_outputs(row.queries, {name: views[src] for name, src in exiting.sources.items()},
                                      self.output_specs)
            deliveries += self._answer_results(row.queries, results)
            self._buffers.discard(stage + 1, pair, rows)
            self._table.drop(child.batch_id)
            self.stats.early_exits += child.num
            self._record("exit", now, stage, child, "early")
        return deliveries

    def _legitimated(self, stage: int) -> None:
        """`stage` got a pair back: tell the listener only if it has an item to run."""
        if len(self._queues[stage]):
            self._signal(stage)
        elif self._stage_states[stage] is ExecutorState.INACTIVE and self._buffers.is_active(stage):
            self._stage_states[stage] = ExecutorState.ACTIVE  # waits for an item either way

    def _notify_progress(self) -> None:
        if self._progress_waiters:
            self._progress.notify_all()

    def _push(self, stage: int, item: BatchItem, now: float) -> None:
        self._queues[stage].push(item)
        self.stats.handoffs += 1
        self._record("push", now, stage, item)
        self._signal(stage)

    def _signal(self, stage: int) -> None:
        """`stage` may have work: tell the listener, or hold it until `finish_work` knows its run-on."""
        if self._held_signals is not None:
            self._held_signals.append(stage)
        else:
            self.listener.stage_ready(stage)

    # -- answers ------------------------------------------------------------------------

    def _answer(self, query: Query, answer: Answer) -> _Delivery:
        """Mark `query` answered and count it; the caller has taken it off the query table."""
        query.state = QueryState.ANSWERED
        self._waiting_queries.pop(query.id, None)
        if not query.entered:
            query.entered = True
            self.stats.queued -= 1
        if answer.error is None:
            self.stats.answered_ok += 1
            admission = self.admission  # no target: every answer is within it, no clock read
            if admission.slo_seconds is None or admission.within_slo(self.clock() - query.arrival):
                self.stats.within_slo += 1
        else:
            self.stats.answered_error += 1
        return query.reply, answer

    def _answer_results(self, queries: list[Query], results: list[dict[str, np.ndarray]]) -> list[_Delivery]:
        return [self._answer(q, Answer(q.id, outputs, None))
                for q, outputs in zip(queries, results, strict=True) if self._queries.pop(q.id, None) is not None]

    def _answer_errors(self, work: Work, error: BaseException, queries: Sequence[Query]) -> list[_Delivery]:
        cause = f"{type(error).__name__}: {error}"
        return [self._answer(q, Answer(q.id, None, StageFailedError(q.id, cause, work.stage)))
                for q in queries if self._queries.pop(q.id, None) is not None]

    def _record(self, kind: str, t0: float, stage: int | None, item: BatchItem, detail: str = "", t1: float | None = None) -> None:
        if self.settings.record_trace:
            self.trace.append(TraceEvent(kind, t0, t0 if t1 is None else t1, stage, item.batch_id, item.start, item.num, detail))

    def install_fences(self, fence_factory: FenceFactory) -> None:
        """Replace the buffers' fences (e.g. CUDA events once the stage streams exist); before any work."""
        with self.lock:
            self._buffers.install_fences(fence_factory)

    # -- observation --------------------------------------------------------------------

    @property
    def buffer_violations(self) -> list[str]:
        return list(self._buffers.violations)

    def observe(self) -> tuple[RuntimeStats, list[int]]:
        """A consistent copy of the stats and the current length of each batch queue."""
        with self.lock:
            return copy.deepcopy(self.stats), [len(q) for q in self._queues]

    def executor_states(self) -> list[ExecutorState]:
        """Each stage's executor state; read without the lock (usable inside `wait_until` predicates)."""
        return list(self._stage_states)

    def buffer_states(self) -> list[list[BufferState]]:
        with self.lock:
            return [[b.state for b in boundary] for boundary in self._buffers.buffers]

    def snapshot(self) -> TableSnapshot:
        with self.lock:
            return self.snapshot_unlocked()

    def snapshot_unlocked(self) -> TableSnapshot:
        """Batch rows and queue items, for callers that hold the lock (`wait_until` predicates)."""
        return TableSnapshot([self._table.info(r) for r in self._table], [list(q) for q in self._queues])

    def query_states(self) -> dict[int, QueryState]:
        """The state of every query not yet answered."""
        with self.lock:
            return {qid: q.state for qid, q in self._queries.items()}

    @property
    def pending_count(self) -> int:
        return len(self._queries)

    def wait_until(self, predicate: Callable[["Scheduler"], bool], timeout: float) -> bool:
        """Wait until `predicate(self)` holds after some progress; it is evaluated under the lock."""
        deadline = time.monotonic() + timeout
        with self.lock:
            self._progress_waiters += 1
            try:
                while not predicate(self):
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 or self._stopping:
                        return predicate(self)
                    self._progress.wait(remaining)
                return True
            finally:
                self._progress_waiters -= 1


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _check_plan(plan: object) -> None:
    """Raise TypeError unless `plan` is an ArrivalPlan of well-typed decisions."""
    if not isinstance(plan, ArrivalPlan):
        raise TypeError(f"on_arrival returned {type(plan).__name__}, not an ArrivalPlan")
    if not isinstance(plan.decisions, (tuple, list)):
        raise TypeError(f"ArrivalPlan.decisions must be a tuple of New/Stretch, got {type(plan.decisions).__name__}")
    if plan.wake_at is not None and not isinstance(plan.wake_at, (int, float)):
        raise TypeError(f"ArrivalPlan.wake_at must be a number or None, got {plan.wake_at!r}")
    for d in plan.decisions:
        if not isinstance(d, (New, Stretch)):
            raise TypeError(f"{d!r} is not a New or Stretch decision")
        if not isinstance(d.query_ids, (tuple, list)) or not all(_is_int(q) for q in d.query_ids):
            raise TypeError(f"{d}: query_ids must be a tuple of ints")
        if isinstance(d, New) and d.pad_length is not None and not _is_int(d.pad_length):
            raise TypeError(f"{d}: pad_length must be an int or None")
        if isinstance(d, Stretch) and not _is_int(d.batch_id):
            raise TypeError(f"{d}: batch_id must be an int")


def _deliver(deliveries: list[_Delivery]) -> None:
    for reply, answer in deliveries:
        try:
            reply(answer)
        except Exception:  # a failing reply callback must not take the runtime down
            log.exception("reply callback for query %d raised", answer.query_id)
