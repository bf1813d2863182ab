"""The scheduler: the runtime's entry point and the owner of all its mutable state.

`submit`/`submit_many` take arrived queries and return at once; the policy batches them with
`new`/`stretch`, the stage executors run the batches as a pipeline, the policy may `split`
them as stages finish, and each query is answered through its `reply` exactly once: with its
outputs when its rows leave the last stage, or with an error (bad input, a failed stage,
shutting down).

Lock discipline: one lock, `Scheduler.lock`, guards every piece of mutable runtime state:
waiting and pending queries, the batch table, the batch queues, the buffer pool, executor
states, stats and trace. Engines run, and replies are delivered, outside it. Each executor
waits on its own condition over that lock; the batch-window timer and `wait_until` on two more.
"""
from __future__ import annotations

import copy
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

from .batch_table import BatchItem, BatchQueue, BatchTable, TableSnapshot
from .buffers import BufferPool, BufferState, PairUse
from .decisions import ArrivalPlan, BatchTableView, New, Policy, PolicyContext, QueryInfo, Split, Stretch
from .engine import OrtStageEngine, StageEngine
from .errors import BadInputError, PolicyError, ShuttingDownError, StageFailedError
from .executor import ExecutorState, StageExecutor, Work, scatter_outputs
from .manifest import Manifest
from .query import Answer, Query, Reply, validate_inputs
from .stats import RuntimeStats, StageStats, TraceEvent

log = logging.getLogger(__name__)

Clock = Callable[[], float]
MIN_WAKE_DELAY = 1e-4  # seconds
_Delivery = tuple[Reply, Answer]
_Exits = tuple[list[BatchItem], dict[str, str]]  # sub-batches leaving early, model output -> stage tensor


@dataclass(frozen=True)
class RuntimeSettings:
    num_buffer_pairs: int = 2
    bs_max: int | None = None  # None: the manifest's max_batch_size
    threads_per_stage: int = 1
    record_trace: bool = False


class Scheduler:
    def __init__(
        self,
        manifest: Manifest,
        engines: Sequence[StageEngine],
        policy: Policy,
        settings: RuntimeSettings = RuntimeSettings(),
        clock: Clock = time.perf_counter,
    ) -> None:
        if len(engines) != manifest.num_stages:
            raise ValueError(f"{len(engines)} engines for {manifest.num_stages} stages")
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
        self._clock = clock
        self._ids = itertools.count()
        self._policy = policy
        self._table = BatchTable(self.num_stages, bs_max)
        self._view = BatchTableView(self._table)
        self._queues = [BatchQueue() for _ in range(self.num_stages)]
        self._buffers = BufferPool(manifest, settings.num_buffer_pairs, bs_max)
        self._pending: dict[int, Query] = {}  # submitted, not yet answered
        self._waiting: dict[int, Query] = {}  # pending and not yet in a batch
        self._infos: dict[int, QueryInfo] = {}
        self._wake_at: float | None = None
        self._stopping = False
        self._started = False
        self._stopped = threading.Event()
        self.stats = RuntimeStats(stages=[StageStats() for _ in range(self.num_stages)])
        self.trace: list[TraceEvent] = []
        self._timer_wakeup = threading.Condition(self.lock)
        self._progress = threading.Condition(self.lock)
        self._progress_waiters = 0
        self._policy_splits = type(policy).on_stage_done is not Policy.on_stage_done
        self._executors = [StageExecutor(i, e, self) for i, e in enumerate(engines)]
        self._timer = threading.Thread(target=self._timer_loop, name="dvabatch-batch-window", daemon=True)
        policy.bind(PolicyContext(
            num_stages=self.num_stages, bs_max=bs_max, max_length=manifest.max_length,
            num_buffer_pairs=settings.num_buffer_pairs, stage_times=_stage_times(manifest),
            stage_times_by_length=_stage_times_by_length(manifest),
            output_names=tuple(t.name for t in manifest.outputs),
        ))

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> "Scheduler":
        with self.lock:
            if self._started:
                return self
            self._started = True
        for ex in self._executors:
            ex.thread.start()
        self._timer.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Answer every pending query with "shutting down" and join every thread."""
        with self.lock:
            already = self._stopping
            self._stopping = True
            deliveries = [(q.reply, Answer(q.id, None, ShuttingDownError(q.id))) for q in self._pending.values()]
            self.stats.answered_error += len(deliveries)
            self._pending.clear()
            self._waiting.clear()
            self._table.clear()
            for queue in self._queues:
                queue.clear()
            for ex in self._executors:
                ex.wakeup.notify_all()
            self._timer_wakeup.notify_all()
            self._notify_progress()
        _deliver(deliveries)
        ours = threading.current_thread() in self.threads  # stop() called from a reply callback
        if already:
            if not ours:
                self._stopped.wait(timeout)
            return
        if self._started:
            for thread in self.threads:
                if thread is not threading.current_thread():
                    thread.join(timeout)
                    if thread.is_alive():
                        log.error("thread %s did not stop within %.1fs", thread.name, timeout)
        self._stopped.set()

    def __enter__(self) -> "Scheduler":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def threads(self) -> list[threading.Thread]:
        return [ex.thread for ex in self._executors] + [self._timer]

    # -- arrivals -----------------------------------------------------------------------

    def submit(self, inputs: Mapping[str, np.ndarray], reply: Reply) -> int:
        return self.submit_many([(inputs, reply)])[0]

    def submit_many(self, requests: Sequence[tuple[Mapping[str, np.ndarray], Reply]]) -> list[int]:
        """Take arrived queries; return their ids at once. Bad ones are answered here and now."""
        now = self._clock()
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
            for q in accepted:
                if self._stopping:
                    deliveries.append((q.reply, Answer(q.id, None, ShuttingDownError(q.id))))
                    self.stats.answered_error += 1
                    continue
                self._pending[q.id] = self._waiting[q.id] = q
                self._infos[q.id] = QueryInfo(q.id, q.length, q.arrival)
            deliveries += self._dispatch(now)
        _deliver(deliveries)
        return ids

    def _dispatch(self, now: float) -> list[_Delivery]:
        """Ask the policy what to do with the waiting queries, and do it. Under the lock."""
        if not self._waiting or self._stopping:
            return []
        try:
            plan = self._policy.on_arrival([self._infos[q] for q in self._waiting], self._view, now)
            _check_plan(plan)
        except Exception:  # a broken policy must not lose queries: treat it as "no decision"
            log.exception("policy %s failed in on_arrival", self._policy.name)
            self.stats.policy_errors += 1
            plan = ArrivalPlan()
        deliveries: list[_Delivery] = []
        for decision in plan.decisions:
            deliveries += self._apply(decision, now)
        # a wake-up in the past would have the timer call the policy again without ever
        # releasing the lock: the earliest wake-up is a little after now
        self._wake_at = None if plan.wake_at is None else max(float(plan.wake_at), now + MIN_WAKE_DELAY)
        if self._wake_at is not None:
            self._timer_wakeup.notify()
        elif self._waiting and len(self._table) == 0:
            # Nothing in flight and no wake-up asked: the waiting queries would wait forever.
            log.error("policy %s left %d queries waiting with nothing in flight", self._policy.name, len(self._waiting))
            self.stats.policy_errors += 1
            waiting = list(self._waiting)
            for i in range(0, len(waiting), self.bs_max):
                deliveries += self._apply(New(tuple(waiting[i:i + self.bs_max])), now)
        return deliveries

    def _apply(self, decision: New | Stretch, now: float) -> list[_Delivery]:
        """Carry out one arrival decision, checked whole before anything changes."""
        ids = decision.query_ids
        refusal = self._arrival_refusal(decision)
        if refusal is not None:
            return self._policy_error(refusal, [q for q in ids if q in self._waiting])
        queries = [self._waiting.pop(q) for q in ids]
        for q in ids:
            del self._infos[q]
        if isinstance(decision, Stretch):
            why = self._table.stretch_refusal(decision.batch_id, [q.length for q in queries])
            if why is None:
                item = self._table.stretch(decision.batch_id, queries)
                self.stats.stretch += 1
                self._record("stretch", now, None, item)
                self._push(0, item, now)
                return []
            self.stats.stretch_refused += 1
            log.debug("stretch refused, new batch instead: %s", why)
            decision = New(ids)
        pad = max(q.length for q in queries) if decision.pad_length is None else decision.pad_length
        item = self._table.new(queries, pad, pair=-1, now=now, no_stretch=decision.no_stretch)
        self.stats.new += 1
        self._record("new", now, None, item, f"pad={pad}")
        self._push(0, item, now)
        return []

    def _arrival_refusal(self, decision: New | Stretch) -> str | None:
        ids = decision.query_ids
        if not ids or len(set(ids)) != len(ids) or any(q not in self._waiting for q in ids):
            return f"{decision} names queries that are not all distinct and waiting"
        if len(ids) > self.bs_max:
            return f"{decision} has more than bs_max={self.bs_max} queries"
        if isinstance(decision, New) and decision.pad_length is not None:
            longest = max(self._waiting[q].length for q in ids)
            if not longest <= decision.pad_length <= self.manifest.max_length:
                return f"{decision}: pad length outside [{longest}, {self.manifest.max_length}]"
        return None

    def _policy_error(self, why: str, query_ids: Sequence[int]) -> list[_Delivery]:
        log.error("policy %s: %s", self._policy.name, why)
        self.stats.policy_errors += 1
        deliveries = []
        for qid in query_ids:
            self._waiting.pop(qid, None)
            self._infos.pop(qid, None)
            q = self._pending.pop(qid)
            deliveries.append((q.reply, Answer(qid, None, PolicyError(qid, f"policy {self._policy.name}: {why}"))))
        self.stats.answered_error += len(deliveries)
        return deliveries

    def _timer_loop(self) -> None:
        with self.lock:
            while not self._stopping:
                if self._wake_at is None:
                    self._timer_wakeup.wait()
                    continue
                delay = self._wake_at - self._clock()
                if delay > 0:
                    self._timer_wakeup.wait(delay)
                    continue
                self._wake_at = None
                deliveries = self._dispatch(self._clock())
                if deliveries:
                    self.lock.release()
                    try:
                        _deliver(deliveries)
                    finally:
                        self.lock.acquire()

    # -- executors ----------------------------------------------------------------------

    def next_work(self, ex: StageExecutor) -> Work | None:
        """Block until executor `ex` has an item with a legitimate pair; None when stopping."""
        stage = ex.stage
        with self.lock:
            while True:
                if self._stopping:
                    ex.state = ExecutorState.STOPPED
                    return None
                item = self._queues[stage].head()
                pair = None if item is None else self._pair_for(stage, item)
                if pair is not None and self._buffers.is_legitimate(stage, pair):
                    break
                if not self._buffers.is_active(stage):
                    ex.state = ExecutorState.INACTIVE
                else:
                    ex.state = ExecutorState.ACTIVE if item is None else ExecutorState.CHECKING
                self._notify_progress()
                ex.wakeup.wait()
            item = self._queues[stage].pop_coalesced()
            row = self._table.get(item.batch_id)
            row.pair = pair
            row.started = True
            use = PairUse(stage, pair, row.rows(item), group=row.group)
            self._buffers.begin(use)
            ex.state = ExecutorState.WORKING
            length = row.pad_length
            inp, out = self._buffers.pair(stage, pair)
            return Work(
                stage, item, use, inp.rows(length, use.rows), out.rows(length, use.rows),
                row.queries[item.start:item.start + item.num], self._clock(),
            )

    def _pair_for(self, stage: int, item: BatchItem) -> int | None:
        """The item's buffer pair; a new batch takes the first legitimate one at stage 0."""
        row = self._table.get(item.batch_id)
        if row.pair >= 0:
            return row.pair
        return self._buffers.first_legitimate(stage)

    def finish_work(
        self, ex: StageExecutor, work: Work, error: BaseException | None, results: list[dict[str, np.ndarray]] | None
    ) -> None:
        """Executor `ex` ran `work`: answer exits, carry out `Schedule()`, hand on, legitimate."""
        now = self._clock()
        deliveries: list[_Delivery] = []
        try:
            with self.lock:
                if not self._stopping:
                    self._finish_locked(work, error, results, now, deliveries)
        finally:  # answers already taken from `pending` are delivered whatever happens
            _deliver(deliveries)

    def _finish_locked(
        self, work: Work, error: BaseException | None, results: list[dict[str, np.ndarray]] | None,
        now: float, deliveries: list[_Delivery],
    ) -> None:
        stage, item = work.stage, work.item
        stats = self.stats.stages[stage]
        stats.batches += 1
        stats.rows += item.num
        stats.busy_seconds += now - work.started
        self._record("run", work.started, stage, item, t1=now)
        if error is not None:
            deliveries += self._answer_errors(work, error)
        elif results is not None:
            deliveries += self._answer_results(work.queries, results)
        handed_on, exiting = self._hand_on(stage, item, now)
        self._buffers.finish(work.use, handed_on=bool(handed_on))
        for out_item in handed_on:
            self._push(stage + 1, out_item, now)
        if exiting is not None:
            deliveries += self._exit_early(stage, work.use.pair, *exiting, now)
        if stage == self.num_stages - 1 and self._table.retire_if_done(item.batch_id):
            self._record("exit", now, stage, BatchItem(item.batch_id, 0, 0))
        for upstream in self._buffers.legitimate_upstream(stage):
            self._legitimated(upstream)
        if stage == self.num_stages - 1 or exiting is not None:
            deliveries += self._dispatch(now)
        self._notify_progress()

    def _hand_on(self, stage: int, item: BatchItem, now: float) -> tuple[list[BatchItem], _Exits | None]:
        """After `stage` ran `item`: the items for the next stage, and the sub-batches that exit
        early with the outputs to answer from. This is the policy's `Schedule()`."""
        nxt = self._table.complete(item, stage)
        if nxt is None:
            return [], None
        row = self._table.get(nxt.batch_id)
        if not self._policy_splits or nxt.start != 0 or nxt.num != row.bs:
            return [nxt], None
        out = self._buffers.pair(stage, row.pair)[1]
        self._view._show_stage_outputs(out.rows(row.pad_length, row.rows(nxt)))
        try:
            decision = self._policy.on_stage_done(stage, self._table.info(row), self._view, now)
        except Exception:  # the batch goes on whole
            log.exception("policy %s failed in on_stage_done", self._policy.name)
            self.stats.policy_errors += 1
            return [nxt], None
        finally:
            self._view._show_stage_outputs({})
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
        return going, ((leaving, dict(decision.exit_outputs)) if leaving else None)

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

    def _exit_early(self, stage: int, pair: int, leaving: list[BatchItem], sources: dict[str, str],
                    now: float) -> list[_Delivery]:
        """Answer the sub-batches that leave after `stage` from its output, and free their rows."""
        out = self._buffers.pair(stage, pair)[1]
        deliveries = []
        for child in leaving:
            row = self._table.get(child.batch_id)
            rows = row.rows(child)
            views = out.rows(row.pad_length, rows)
            results = scatter_outputs(row.queries, {name: views[src] for name, src in sources.items()},
                                      self.output_specs)
            deliveries += self._answer_results(row.queries, results)
            self._buffers.discard(stage + 1, pair, rows)
            self._table.drop(child.batch_id)
            self.stats.early_exits += child.num
            self._record("exit", now, stage, child, "early")
        return deliveries

    def _legitimated(self, stage: int) -> None:
        """Executor `stage` got a pair back: wake it only if it has an item to run."""
        ex = self._executors[stage]
        if len(self._queues[stage]):
            ex.wakeup.notify()
        elif ex.state is ExecutorState.INACTIVE and self._buffers.is_active(stage):
            ex.state = ExecutorState.ACTIVE  # waits for an item either way: no need to wake it

    def _notify_progress(self) -> None:
        if self._progress_waiters:
            self._progress.notify_all()

    def _push(self, stage: int, item: BatchItem, now: float) -> None:
        self._queues[stage].push(item)
        self.stats.handoffs += 1
        self._record("push", now, stage, item)
        self._executors[stage].wakeup.notify()

    def _answer_results(self, queries: list[Query], results: list[dict[str, np.ndarray]]) -> list[_Delivery]:
        deliveries = []
        for q, outputs in zip(queries, results, strict=True):
            if self._pending.pop(q.id, None) is not None:
                deliveries.append((q.reply, Answer(q.id, outputs, None)))
                self.stats.answered_ok += 1
        return deliveries

    def _answer_errors(self, work: Work, error: BaseException) -> list[_Delivery]:
        deliveries = []
        for q in work.queries:
            if self._pending.pop(q.id, None) is not None:
                exc = StageFailedError(q.id, f"{type(error).__name__}: {error}", work.stage)
                deliveries.append((q.reply, Answer(q.id, None, exc)))
                self.stats.answered_error += 1
        return deliveries

    def _record(self, kind: str, t0: float, stage: int | None, item: BatchItem, detail: str = "", t1: float | None = None) -> None:
        if self.settings.record_trace:
            self.trace.append(TraceEvent(kind, t0, t0 if t1 is None else t1, stage, item.batch_id, item.start, item.num, detail))

    # -- observation --------------------------------------------------------------------

    @property
    def buffer_violations(self) -> list[str]:
        return list(self._buffers.violations)

    def observe(self) -> tuple[RuntimeStats, list[int]]:
        """A consistent copy of the stats and the current length of each batch queue."""
        with self.lock:
            return copy.deepcopy(self.stats), [len(q) for q in self._queues]

    def executor_states(self) -> list[ExecutorState]:
        """Each executor's state; read without the lock (usable inside `wait_until` predicates)."""
        return [ex.state for ex in self._executors]

    def buffer_states(self) -> list[list[BufferState]]:
        with self.lock:
            return [[b.state for b in boundary] for boundary in self._buffers.buffers]

    def snapshot(self) -> TableSnapshot:
        with self.lock:
            return self.snapshot_unlocked()

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

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    def snapshot_unlocked(self) -> TableSnapshot:
        """Batch rows and queue items, for callers that hold the lock (`wait_until` predicates)."""
        return TableSnapshot([self._table.info(r) for r in self._table], [list(q) for q in self._queues])


def load_scheduler(model_dir: str | Path, policy: Policy, settings: RuntimeSettings = RuntimeSettings(),
                   manifest_file: str = "manifest.json") -> Scheduler:
    """A scheduler over a sliced model directory, one onnxruntime engine per stage.

    `model_dir` holds the manifest, or is a Triton model folder whose version folder `1/` does.
    """
    model_dir = Path(model_dir)
    if not (model_dir / manifest_file).exists() and (model_dir / "1" / manifest_file).exists():
        model_dir = model_dir / "1"
    manifest = Manifest.load(model_dir / manifest_file)
    engines = [OrtStageEngine(model_dir / s.file, settings.threads_per_stage) for s in manifest.stages]
    return Scheduler(manifest, engines, policy, settings)


def _stage_times(manifest: Manifest) -> tuple[dict[int, float], ...]:
    profile = manifest.extra.get("stage_times")
    if not isinstance(profile, list) or len(profile) != manifest.num_stages:
        return ()
    return tuple({int(bs): float(t) for bs, t in stage.items()} for stage in profile)


def _stage_times_by_length(manifest: Manifest) -> dict[int, tuple[dict[int, float], ...]]:
    by_length = manifest.extra.get("stage_times_by_length")
    if not isinstance(by_length, dict):
        return {}
    out = {}
    for length, stages in by_length.items():
        if isinstance(stages, list) and len(stages) == manifest.num_stages:
            out[int(length)] = tuple({int(bs): float(t) for bs, t in stage.items()} for stage in stages)
    return out


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
