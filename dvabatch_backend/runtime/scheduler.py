"""The scheduler: the owner of all the runtime's mutable state, and of no thread.

`submit`/`submit_many` take arrived queries and return at once; the policy batches them with
`new`/`stretch` (dispatch); whoever runs the stages (the `EngineLoop`'s step, or a test from one
thread) asks `next_work(stage)` for an item whose buffer pair is legitimate -- it answers
at once, with the `Work` or None -- runs it outside the lock, and hands the result back with
`finish_work`, where the policy may `split` the batch, items go to the next queue and pairs are
legitimated upstream (hand-off). Each query is answered exactly once: with its outputs when its
rows leave the last stage (or exit early), or with an error (bad input, a failed stage, a policy
error, shutting down).

The parts it owns, one concern each: the `QueryTable` (each query's `QueryState`, its answer, the
counters that follow), the `BatchTable`, the `StageBoard` (batch queues, buffer pairs, executor
states, wake-ups), `Admission` (refusals and drops, and
the predicted cost), the `SplitStep` (the policy's splits after a stage, early exits), the stats
and the `Trace`. A policy's plans
are checked (`plan_checks`) before anything is carried out.

Lock discipline: one lock, `Scheduler.lock`, guards all of it. Every public method takes it;
engines run, and replies are delivered, outside it. Policies and the listener are called under it.
`wait_until` waits on a condition over the same lock.
"""
from __future__ import annotations

import copy
import itertools
import logging
import threading
import time
from typing import Callable, Mapping, Sequence

import numpy as np

from .admission import Admission, ServiceModel
from .batch_table import BatchItem, BatchTable, TableSnapshot
from .buffers import BufferPool, BufferState, PairUse, StageBuffer
from .decisions import ArrivalPlan, BatchTableView, New, Policy, PolicyContext, Stretch
from .errors import (BadInputError, BufferStateError, CancelledError, OverloadedError, PolicyError, QueryError,
                     QueueFullError, ShuttingDownError, TimeoutExpiredError)
from .fences import FenceFactory, host_fences
from .manifest import Manifest
from .plan_checks import arrival_refusal, by_length, check_plan, pad_unsafe_stretch
from .query import Answer, Query, QueryState, Reply, read_query
from .query_table import Delivery, QueryTable
from .settings import MIN_WAKE_DELAY, RuntimeSettings, graph_length, replays_graphs
from .split_step import SplitStep
from .stage_board import StageBoard
from .stats import RuntimeStats, StageStats, Trace
from .work import ExecutorState, Progress, Step, Work, WorkResult

log = logging.getLogger(__name__)

Clock = Callable[[], float]


class Scheduler:
    def __init__(self, manifest: Manifest, policy: Policy, settings: RuntimeSettings = RuntimeSettings(),
                 context: PolicyContext | None = None, clock: Clock = time.perf_counter,
                 fence_factory: FenceFactory = host_fences) -> None:
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
        self.stats = RuntimeStats(stages=[StageStats() for _ in range(self.num_stages)])
        self.recorder = Trace(settings.record_trace)
        self.trace = self.recorder.events
        service = ServiceModel(manifest.stage_times(), self.num_stages, manifest.stage_times_by_length())
        self.admission = Admission(settings.queue, settings.slo, service, bs_max, settings.num_buffer_pairs > 1)
        self.queries = QueryTable(self.stats, self.admission, clock)
        self._table = BatchTable(self.num_stages, bs_max)
        self._view = BatchTableView(self._table)
        buffers = BufferPool(manifest, settings.num_buffer_pairs, bs_max, fence_factory)
        self.board = StageBoard(self.num_stages, self._table, buffers, self.stats, self.recorder)
        self.progress = Progress(self.lock)
        self.step = Step()  # the right to launch: the engine loop's, lent to a caller while it is idle (engine_loop.py)
        self._ids = itertools.count()
        self._policy = policy
        self._splits = SplitStep(policy, manifest, self._table, buffers, self.queries, self.stats, self.recorder)
        self._wake_at: float | None = None
        self._stopping = False
        self._stop_error: Callable[[int], QueryError] = ShuttingDownError
        # where the stages replay CUDA graphs of bucket lengths, a batch of a pad-safe model is
        # padded to a bucket before stage 0 (`graph_length`): every stage's inputs then match a graph
        self._pads_to_graphs = replays_graphs(settings) and manifest.pad_safe and manifest.has_seq
        self._whole_outputs: StageBuffer | None = None  # the one-stage route's outputs (`runs_whole`)
        self._borrowed: list[Query] = []  # queries whose inputs are a caller's memory (`submit_call`)
        policy.bind(context or PolicyContext.for_model(manifest, bs_max, settings.num_buffer_pairs,
                                                       self.admission.wait_bound()))

    def serve_whole_model(self) -> None:
        """Before any query: a batch may take the one-stage route, the unsliced model at stage 0
        (`Pipeline` has its engine, which the slicer measured faster than the stages in a row). The
        rule, at stage 0's launch of a batch not yet begun: no other batch could run in its stages
        beside it (one buffer pair, whose stages run batches one at a time, or the batch is the
        table's only row); it is marked no-stretch then, so no query joins it past a boundary it no
        longer has. The policy allows it (`Policy.allows_inline`: its splits never change an answer)."""
        m = self.manifest
        with self.lock:
            self._whole_outputs = StageBuffer(m.num_stages, -1, m.boundary(m.num_stages), self.bs_max, m.max_length)

    @property
    def policy(self) -> Policy:
        return self._policy

    @property
    def runs_whole(self) -> bool:
        """Whether a batch may take the one-stage route (`serve_whole_model`)."""
        return self._whole_outputs is not None

    def padded_length(self, length: int) -> int:
        """The length a batch whose longest query (or the policy's padding) is `length` runs at: a
        CUDA-graph bucket's where the stages replay graphs (`graph_length`), else `length`."""
        return graph_length(length, self.manifest.max_length) if self._pads_to_graphs else length

    # -- lifecycle ----------------------------------------------------------------------

    @property
    def stopping(self) -> bool:
        return self._stopping

    def stop(self, error: Callable[[int], QueryError] = ShuttingDownError) -> None:
        """Answer every query not yet answered, and every one submitted from now on, with `error`
        ("shutting down"); `next_work` returns None from now on."""
        with self.lock:
            if self._stopping:
                return
            self._stopping = True
            self._stop_error = error
            deliveries = self.queries.fail_all(error)
            self._table.clear()
            self.board.stop()
            self.progress.notify()
        _deliver(deliveries)

    # -- arrivals (dispatch) ------------------------------------------------------------

    def submit(self, inputs: Mapping[str, np.ndarray], reply: Reply) -> int:
        return self.submit_many([(inputs, reply)])[0]

    def submit_many(self, requests: Sequence[tuple[Mapping[str, np.ndarray], Reply]],
                    timeout_us: int | None = None) -> list[int]:
        """Take arrived queries (one request's rows: admitted or refused together); return their ids
        at once. Bad ones, and ones over the queue bound or the latency target, are answered here
        and now. `timeout_us` is the request's own timeout (admission.py)."""
        return self.submit_call([requests], [timeout_us])[0]

    def submit_call(self, requests: Sequence[Sequence[tuple[Mapping[str, np.ndarray], Reply]]],
                    timeouts_us: Sequence[int | None] | None = None, borrowed: bool = False) -> list[list[int]]:
        """`submit_many` for each of several requests that arrived together (a caller's call), with
        one batching decision for all of them; each request's query ids. `borrowed`: the inputs are
        the caller's memory, valid until it lets go of the loop's step (`EngineLoop.serve_here`),
        when those of the queries still queued are copied (`own_borrowed`)."""
        now = self.clock()
        timeouts = list(timeouts_us) if timeouts_us is not None else [None] * len(requests)
        arrived = [[read_query(next(self._ids), inputs, self.manifest, now, reply) for inputs, reply in rows]
                   for rows in requests]
        deliveries: list[Delivery] = []
        with self.lock:
            # as Triton's bound leaves out the batch it hands `execute`: at an idle entry the call's
            # first batch starts at once, and its rows wait behind nobody
            starts = self.bs_max if self.holds_nothing() else 0
            for rows, queries, timeout_us in zip(requests, arrived, timeouts):
                accepted = [q for q in queries if isinstance(q, Query)]
                for q in accepted:
                    q.request = accepted[0].id
                bad = [(reply, Answer(q.query_id, None, q)) for q, (_, reply) in zip(queries, rows)
                       if isinstance(q, BadInputError)]
                self.stats.submitted += len(rows)
                self.stats.answered_error += len(bad)
                deliveries += bad
                if accepted:
                    deliveries += self._admit(accepted, now, timeout_us, starts)
                    if borrowed:
                        self._borrowed += accepted
            deliveries += self._dispatch(now)
        _deliver(deliveries)
        return [[q.id if isinstance(q, Query) else q.query_id for q in queries] for queries in arrived]

    def refuse_caller_backlog(self, requests: int, waited: float) -> list[QueryError]:
        """One refusal for each of `requests`, a call of the caller's oldest, the first of which
        has waited through `waited` calls in the caller's queue, past the bound (`Pipeline.route_call`)."""
        with self.lock:
            self.stats.queue_full += requests
            self.stats.caller_drains += requests
            why = (f"Exceeds maximum queue size: overloaded, waited through about {waited:.0f} calls before the "
                   f"model, past the bound of {self.admission.caller_bound():g}")
            self.stats.submitted += requests
            self.stats.answered_error += requests
            return [QueueFullError(next(self._ids), why) for _ in range(requests)]


    def _admit(self, queries: list[Query], now: float, timeout_us: int | None, starts: int = 0) -> list[Delivery]:
        """Queue the queries, or refuse them all: stopping, the bound or their deadline (the wait
        ahead), the latency target (admission.py). `starts`: the queued rows that start at once,
        which wait behind nobody."""
        admission, refuse = self.admission, self.queries.refuse
        if self._stopping:
            return [refuse(q, self._stop_error(q.id)) for q in queries]
        for q in queries:
            q.work = admission.row_work(q.length if self.manifest.has_seq else None)
        # the rows queued with these, less those that start at once (they wait behind nobody), and
        # their work (the share of it those rows are)
        rows = self.stats.queued + len(queries)
        waiting = max(rows - starts, 0)
        work = (self.queries.queued_work + sum(q.work for q in queries)) * waiting / rows
        why = admission.queue_refusal(waiting, work)
        if why is not None:
            self.stats.queue_full += len(queries)
            return [refuse(q, QueueFullError(q.id, why)) for q in queries]
        why = admission.timeout_refusal(work, timeout_us)
        if why is not None:
            self.stats.timed_out += len(queries)
            return [refuse(q, TimeoutExpiredError(q.id, why)) for q in queries]
        why = admission.arrival_refusal(now, self.stats.queued, self.queries.queued_work)
        if why is not None:
            self.stats.slo_rejected += len(queries)
            return [refuse(q, OverloadedError(q.id, why)) for q in queries]
        deadline, slo_deadline = admission.deadline(now, timeout_us), admission.slo_deadline(now)
        for q in queries:
            q.deadline, q.slo_deadline = deadline, slo_deadline
        self.queries.admit(queries)
        return []

    def cancel(self, query_ids: Sequence[int]) -> None:
        """The client cancelled these queries: drop those not yet batched (answered "cancelled"); the
        others finish, and their answers go to a request nobody awaits."""
        deliveries: list[Delivery] = []
        with self.lock:
            for qid in query_ids:
                q = self.queries.get(qid)
                if q is None or q.cancelled:
                    continue
                q.cancelled = True
                if q.state is QueryState.WAITING:
                    deliveries += self.queries.drop(q, CancelledError(qid))
                elif q.state is QueryState.RUNNING:
                    self.stats.cancelled_in_flight += 1
                # batched, not yet run: dropped when stage 0 reaches its batch (`_prune_queued_head`)
        _deliver(deliveries)

    @property
    def wake_at(self) -> float | None:
        """When the policy asked to be called again (its batch window), or None."""
        return self._wake_at

    def on_window(self) -> float | None:
        """Call the policy again if its batch window has passed; return the next wake-up time."""
        if self._wake_at is None:  # read unlocked: a window set later wakes the loop (`window_moved`)
            return None
        with self.lock:
            now = self.clock()
            if self._wake_at is None or self._wake_at > now:
                return self._wake_at
            self._wake_at = None
            deliveries = self._dispatch(now)
            wake_at = self._wake_at
        _deliver(deliveries)
        return wake_at

    def _dispatch(self, now: float) -> list[Delivery]:
        """Drop the waiting queries past their deadline; ask the policy what to do with the others,
        and do it. Under the lock."""
        if self._stopping:
            return []
        waiting, deliveries = self.queries.drop_waiting(now)
        if not waiting:
            return deliveries
        try:
            plan = self._policy.on_arrival([q.info for q in waiting], self._view, now)
            check_plan(plan)
        except Exception:  # a broken policy must not lose queries: treat it as "no decision"
            log.exception("policy %s failed in on_arrival", self._policy.name)
            self.stats.policy_errors += 1
            plan = ArrivalPlan()
        for decision in plan.decisions:
            deliveries += self._apply(decision, now)
        # a wake-up in the past would have the window call the policy again at once, forever
        policy_wake = None if plan.wake_at is None else max(float(plan.wake_at), now + MIN_WAKE_DELAY)
        drop_wake = self.admission.next_drop_time(waiting, now)  # no query becomes waiting during a dispatch
        self._wake_at = min((t for t in (policy_wake, drop_wake) if t is not None), default=None)
        if self._wake_at is not None:
            self.board.listener.window_moved()
        if policy_wake is None and len(self._table) == 0 and (left := self.queries.waiting()):
            # Nothing in flight and no wake-up asked: the waiting queries would wait forever.
            log.error("policy %s left %d queries waiting with nothing in flight", self._policy.name, len(left))
            self.stats.policy_errors += 1
            for i in range(0, len(left), self.bs_max):
                deliveries += self._apply(New(tuple(q.id for q in left[i:i + self.bs_max])), now)
        return deliveries

    def _apply(self, decision: New | Stretch, now: float) -> list[Delivery]:
        """Carry out one arrival decision, checked whole before anything changes."""
        ids, pad_safe = tuple(dict.fromkeys(decision.query_ids)), self.manifest.pad_safe
        why = arrival_refusal(decision, self.queries, self.bs_max, self.manifest.max_length)
        if why is not None:  # its queries still waiting are answered: a policy's bug is loud
            log.error("policy %s: %s", self._policy.name, why)
            self.stats.policy_errors += 1
            named = [q for q in map(self.queries.get, ids) if q is not None and q.state is QueryState.WAITING]
            return self.queries.fail(named, lambda qid: PolicyError(qid, f"policy {self._policy.name}: {why}"))
        queries = [q for q in map(self.queries.get, ids) if q is not None]
        self.queries.batch(queries)
        if isinstance(decision, Stretch):
            why = self._table.stretch_refusal(decision.batch_id, [q.length for q in queries])
            if why is None and not pad_safe:
                why = pad_unsafe_stretch(decision.batch_id, self._table.get(decision.batch_id).pad_length, queries)
                self.stats.pad_unsafe_splits += why is not None
            if why is None:
                item = self._table.stretch(decision.batch_id, queries)
                self.stats.stretch += 1
                self.recorder.record("stretch", now, None, item)
                self.board.push(0, item, now)
                return []
            self.stats.stretch_refused += 1
            log.debug("stretch refused, new batch instead: %s", why)
            decision = New(ids)
        groups, reshaped = by_length(decision, queries) if not pad_safe else ([queries], False)
        if reshaped:
            self.stats.pad_unsafe_splits += 1
            log.debug("model not pad-safe: %s carried out as batches of lengths %s", decision, [g[0].length for g in groups])
        for group in groups:
            pad = group[0].length if not pad_safe else self.padded_length(
                max(q.length for q in group) if decision.pad_length is None else decision.pad_length)
            item = self._table.new(group, pad, pair=-1, now=now, no_stretch=decision.no_stretch)
            self.stats.new += 1
            self.recorder.record("new", now, None, item, f"pad={pad}")
            self.board.push(0, item, now)
        return []

    # -- stages (hand-off) --------------------------------------------------------------

    def has_items(self, stage: int) -> bool:
        """Whether `stage`'s batch queue holds an item; read unlocked, so only a step may trust it
        for a stage past the first (whose items only `finish_work`, in a step, pushes)."""
        return bool(len(self.board.queues[stage]))

    def next_work(self, stage: int) -> Work | None:
        """The item `stage` may run now (its buffer pair legitimate), taken off its queue; or None.

        Never blocks. None also when stopping (see `stopping`) or while the stage already runs an
        item. Stage 0 first drops the queued queries that timed out, were cancelled or can no
        longer meet the latency target.
        """
        deliveries: list[Delivery] = []
        try:
            with self.lock:
                if self._stopping:
                    return None
                if stage == 0:
                    deliveries = self._prune_queued_head(self.clock())
                return self._take_work(stage)
        finally:
            _deliver(deliveries)

    def _prune_queued_head(self, now: float) -> list[Delivery]:
        """Drop the dead queries of the batches at the head of stage 0's queue that no stage has
        started (their rows are not in any buffer yet): the batch shrinks, or goes if none is left."""
        queue, deliveries = self.board.queues[0], []
        while (item := queue.head()) is not None:
            row = self._table.get(item.batch_id)
            if row.started:
                break
            dead = [(q, e) for q in row.queries if (e := self._queued_drop(q, now, row.bs)) is not False]
            if not dead:
                break
            gone = {q.id for q, _ in dead}
            row.queries = [q for q in row.queries if q.id not in gone]
            queue.remove_batch(row.id)
            for q, error in dead:
                if error is not None:
                    deliveries += self.queries.drop(q, error)
            if row.queries:
                queue.push_front(BatchItem(row.id, 0, row.bs))
                break
            self._table.drop(row.id)
        return deliveries

    def _queued_drop(self, q: Query, now: float, bs: int) -> QueryError | None | bool:
        """Why a query batched for stage 0 leaves its batch: the error to drop it with, None where it
        was answered already, False where it stays."""
        if self.queries.get(q.id) is None:
            return None
        error = self.admission.drop_error(q, now, bs)
        return False if error is None else error

    def _take_work(self, stage: int) -> Work | None:
        """`next_work` under the lock."""
        board = self.board
        if board.states[stage] is ExecutorState.WORKING:
            return None
        pair = board.ready_pair(stage)
        if pair is None:
            board.settle(stage)
            self.progress.notify()
            return None
        item = board.queues[stage].pop_coalesced()
        row = self._table.get(item.batch_id)
        if stage == 0 and not row.started and self._whole_outputs is not None and (
                not self.admission.overlapping or len(self._table) == 1):
            row.whole = row.no_stretch = True  # the one-stage route (`serve_whole_model`)
        row.pair = pair
        row.started = True
        use = PairUse(stage, pair, row.rows(item), group=row.group)
        board.buffers.begin(use)
        board.states[stage] = ExecutorState.WORKING
        inp, out = board.buffers.pair(stage, pair)
        if row.whole:
            out = self._whole_outputs  # type: ignore[assignment]
        queries = row.queries[item.start:item.start + item.num]
        if stage == 0:
            self.queries.run(queries)
        return Work(stage, item, use, inp.rows(row.pad_length, use.rows), out.rows(row.pad_length, use.rows),
                    queries, self.clock(), gather=stage == 0, scatter=row.whole or stage == self.num_stages - 1,
                    whole=row.whole)

    def finish_work(self, work: Work, result: WorkResult) -> None:
        """`work` ran: answer exits, carry out `Schedule()`, hand on, legitimate."""
        now = self.clock()
        deliveries: list[Delivery] = []
        try:
            with self.lock:
                if not self._stopping:
                    self._finish_locked(work, result, now, deliveries)
        finally:  # answers already taken from the query table are delivered whatever happens
            _deliver(deliveries)

    def _count_run(self, work: Work, now: float) -> None:
        """A run's counts: its stage's, and the service model's measure of the stage; a run of the
        unsliced model (the one-stage route) is counted apart, as no stage's. Under the lock."""
        seconds, rows = now - work.started, work.item.num
        row = self._table.get(work.item.batch_id) if work.item.batch_id in self._table else None
        length = row.pad_length if row else None
        if work.whole:
            self.stats.whole_runs += 1
            self.stats.whole_rows += rows
            self.stats.whole_seconds += seconds
            self.admission.service.observe_passage(rows, seconds, length)  # what a batch takes now
            return
        stats = self.stats.stages[work.stage]
        stats.batches += 1
        stats.rows += rows
        stats.busy_seconds += seconds
        self.admission.service.observe(work.stage, rows, seconds, length)

    def fail_work(self, work: Work, error: BaseException) -> None:
        """`finish_work` raised (a runtime bug, or a subclass that breaks it): answer the queries of
        the work's batch with an error naming the stage and the cause, and free what the batch held
        (its buffer rows, its queue items, its table row) so the pipeline serves on."""
        deliveries: list[Delivery] = []
        try:
            with self.lock:
                board = self.board
                cause = f"the runtime failed after the stage ran: {type(error).__name__}: {error}"
                row = self._table.get(work.item.batch_id) if work.item.batch_id in self._table else None
                queries = {id(q): q for q in [*work.queries, *(row.queries if row else [])]}.values()
                deliveries = self.queries.errors(queries, cause, work.stage)
                inp, out = board.buffers.pair(work.stage, work.use.pair)
                if inp.state is BufferState.INREADING and out.state is BufferState.INWRITING:
                    board.buffers.finish(work.use, handed_on=False)
                if row is not None:
                    board.free_batch(row.id, work.use.pair, range(row.row_start, row.row_start + row.bs))
                    self._table.drop(row.id)
                self.recorder.record("exit", self.clock(), work.stage, work.item, f"failed: {cause}")
                board.recover(work.stage)
                deliveries += self._dispatch(self.clock())
                self.progress.notify()
        finally:
            _deliver(deliveries)

    def _finish_locked(self, work: Work, result: WorkResult, now: float, deliveries: list[Delivery]) -> None:
        """`finish_work` under the lock; the answers go into `deliveries` as they are made (the caller
        delivers them even if this raises midway: they have left the query table)."""
        stage, item, board = work.stage, work.item, self.board
        self._count_run(work, now)
        self.recorder.record("run", work.started, stage, item, "whole model" if work.whole else "", t1=now)
        if result.error is not None:
            deliveries += self.queries.errors(work.queries, result.error, stage)
        for i, error in result.row_errors.items():  # those rows' queries alone fail; the rest go on
            deliveries += self.queries.errors([work.queries[i]], error, stage)
        if result.error is None and result.answers is not None:
            answered = self.queries.results(work.queries, result.answers)
            self.stats.table_answered += len(answered)
            deliveries += answered
        nxt = self._table.complete(item, stage)  # then the policy's `Schedule()`: a split, an early exit
        handed_on, exiting = ([], None) if nxt is None else self._splits.after(stage, nxt, now)
        board.buffers.finish(work.use, handed_on=bool(handed_on))
        if work.whole:  # its rows passed every stage: boundary 1 holds nothing for stage 1
            board.buffers.discard(1, work.use.pair, work.use.rows)
        for out_item in handed_on:
            board.push(stage + 1, out_item, now)
        if exiting is not None:
            deliveries += self._splits.exit_early(stage, work.use.pair, exiting, now)
        leaves = stage == self.num_stages - 1 or work.whole
        if leaves and self._table.retire_if_done(item.batch_id):
            self.recorder.record("exit", now, stage, BatchItem(item.batch_id, 0, 0))
        board.pairs_returned(stage)
        if leaves or exiting is not None:
            deliveries += self._dispatch(now)
        board.settle(stage)
        self.progress.notify()

    # -- observation --------------------------------------------------------------------

    def holds_nothing(self) -> bool:
        """No query unanswered, no batch, no stage working, not stopping. Under the lock."""
        return (not self._stopping and not len(self.queries) and not len(self._table)
                and ExecutorState.WORKING not in self.board.states)

    def own_borrowed(self) -> None:
        """The caller that lent its memory (`submit_call`) lets go of the step: the queries not yet
        gathered into a batch (queued) get copies of their inputs. Called holding the step, so no
        launch gathers meanwhile."""
        with self.lock:
            for q in self._borrowed:
                if q.state.is_queued and self.queries.get(q.id) is q:
                    q.inputs = {name: np.array(value) for name, value in q.inputs.items()}
            self._borrowed.clear()

    def batches(self) -> int:
        """Rows of the batch table now."""
        with self.lock:
            return len(self._table)

    def holds_nothing_now(self) -> bool:
        """`holds_nothing`, taking the lock."""
        with self.lock:
            return self.holds_nothing()

    @property
    def buffer_violations(self) -> list[BufferStateError]:
        return list(self.board.buffers.violations)

    def observe(self) -> tuple[RuntimeStats, list[int]]:
        """A consistent copy of the stats and the current length of each batch queue."""
        with self.lock:
            return copy.deepcopy(self.stats), [len(q) for q in self.board.queues]

    def executor_states(self) -> list[ExecutorState]:
        """Each stage's executor state; read without the lock (usable inside `wait_until` predicates)."""
        return list(self.board.states)

    def snapshot(self) -> TableSnapshot:
        with self.lock:
            return self.snapshot_unlocked()

    def snapshot_unlocked(self) -> TableSnapshot:
        """Batch rows and queue items, for callers that hold the lock (`wait_until` predicates)."""
        return TableSnapshot([self._table.info(r) for r in self._table], [list(q) for q in self.board.queues])

    def query_states(self) -> dict[int, QueryState]:
        """The state of every query not yet answered."""
        with self.lock:
            return self.queries.states()

    @property
    def pending_count(self) -> int:
        return len(self.queries)

    def wait_until(self, predicate: Callable[["Scheduler"], bool], timeout: float) -> bool:
        """Wait until `predicate(self)` holds after some progress; it is evaluated under the lock."""
        with self.lock:
            return self.progress.wait_until(lambda: predicate(self), timeout, lambda: self._stopping)


def _deliver(deliveries: list[Delivery]) -> None:
    for reply, answer in deliveries:
        try:
            reply(answer)
        except Exception:  # a failing reply callback must not take the runtime down
            log.exception("reply callback for query %d raised", answer.query_id)
