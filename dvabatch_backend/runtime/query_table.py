"""The query table: every query submitted and not yet answered, and the one place a query's
`QueryState` changes.

A query moves forward only: WAITING (admitted) -> BATCHED (a policy put it in a batch) -> RUNNING
(stage 0 took it) -> ANSWERED; a refused one is answered without ever entering. The counters that
follow from those moves live here too, so no other part adjusts them by hand: the queued gauge
(`RuntimeStats.queued`: WAITING and BATCHED) and its work (`queued_work`), the answers (ok, error, within the latency target)
and why a queued query was dropped (cancelled, timed out, the latency target).

Every answer is made here (`answer`, `results`, `errors`, `drop`, `refuse`): a query leaves the
table when it is answered, so a second answer finds it gone and is not made (exactly one answer).
Owned by the scheduler; used under its lock, except `any_queued`, which reads without it.
"""
from __future__ import annotations

from typing import Callable, Iterable, Sequence

import numpy as np

from .admission import Admission
from .errors import CancelledError, QueryError, StageFailedError, TimeoutExpiredError
from .query import Answer, Query, QueryState, Reply
from .stats import RuntimeStats

Delivery = tuple[Reply, Answer]  # an answer to deliver, outside the lock


class QueryTable:
    def __init__(self, stats: RuntimeStats, admission: Admission, clock: Callable[[], float]) -> None:
        self._stats = stats
        self._admission = admission
        self._clock = clock
        self._queries: dict[int, Query] = {}  # in arrival order
        # the WAITING ones, in arrival order: a dispatch looks at these, not at every query in flight
        self._waiting: dict[int, Query] = {}
        # the queued queries' `work` (admission.py: the wait ahead of an arrival, in profiled seconds)
        self.queued_work = 0.0

    def __len__(self) -> int:
        return len(self._queries)

    def get(self, query_id: int) -> Query | None:
        return self._queries.get(query_id)

    def waiting(self) -> list[Query]:
        return list(self._waiting.values())

    def is_waiting(self, query_id: int) -> bool:
        return query_id in self._waiting

    def states(self) -> dict[int, QueryState]:
        return {qid: q.state for qid, q in self._queries.items()}

    def any_queued(self, query_ids: Sequence[int]) -> bool:
        """Whether one of these queries is admitted and not yet taken by stage 0 (read without the lock)."""
        queries = self._queries
        return any((q := queries.get(qid)) is not None and q.state.is_queued for qid in query_ids)

    # -- moving forward -------------------------------------------------------------------

    def admit(self, queries: Iterable[Query]) -> None:
        for q in queries:
            q.state = QueryState.WAITING
            self._queries[q.id] = q
            self._waiting[q.id] = q
            self._stats.queued += 1
            self.queued_work += q.work

    def _unqueue(self, q: Query) -> None:
        self._stats.queued -= 1
        self.queued_work = self.queued_work - q.work if self._stats.queued else 0.0  # no drift kept

    def batch(self, queries: Iterable[Query]) -> None:
        for q in queries:
            q.state = QueryState.BATCHED
            del self._waiting[q.id]

    def run(self, queries: Iterable[Query]) -> None:
        """Stage 0 took these (a stretch's rows may already run: they are left as they are)."""
        for q in queries:
            if q.state.is_queued:
                q.state = QueryState.RUNNING
                self._unqueue(q)

    # -- answers ---------------------------------------------------------------------------

    def answer(self, q: Query, answer: Answer) -> list[Delivery]:
        """Answer `q` if it is still in the table (it then leaves it); [] if it was answered already."""
        if self._queries.pop(q.id, None) is None:
            return []
        self._waiting.pop(q.id, None)
        if q.state.is_queued:
            self._unqueue(q)
        q.state = QueryState.ANSWERED
        if answer.error is None:
            self._stats.answered_ok += 1
            admission = self._admission  # no target: every answer is within it, no clock read
            if admission.slo_seconds is None or admission.within_slo(self._clock() - q.arrival):
                self._stats.within_slo += 1
        else:
            self._stats.answered_error += 1
        return [(q.reply, answer)]

    def results(self, queries: Sequence[Query], outputs: Sequence[dict[str, np.ndarray]]) -> list[Delivery]:
        return [d for q, out in zip(queries, outputs, strict=True) for d in self.answer(q, Answer(q.id, out, None))]

    def errors(self, queries: Iterable[Query], error: BaseException | str, stage: int) -> list[Delivery]:
        """These queries failed at `stage`: the engine's error, or (a string) the runtime's cause."""
        cause = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        return [d for q in queries for d in self.answer(q, Answer(q.id, None, StageFailedError(q.id, cause, stage)))]

    def fail(self, queries: Iterable[Query], error: Callable[[int], QueryError]) -> list[Delivery]:
        """Answer these with `error(query id)` (shutting down, a policy's error)."""
        return [d for q in queries for d in self.answer(q, Answer(q.id, None, error(q.id)))]

    def drop(self, q: Query, error: QueryError) -> list[Delivery]:
        """A queued query that will not run: cancelled, timed out, or past its latency target."""
        if isinstance(error, CancelledError):
            self._stats.cancelled += 1
        elif isinstance(error, TimeoutExpiredError):
            self._stats.timed_out += 1
        else:
            self._stats.slo_rejected += 1
        return self.answer(q, Answer(q.id, None, error))

    def drop_waiting(self, now: float) -> tuple[list[Query], list[Delivery]]:
        """The waiting queries still worth running (arrival order), and the answers of the others."""
        waiting, deliveries = [], []
        for q in list(self._waiting.values()):
            error = self._admission.drop_error(q, now, 1)
            if error is None:
                waiting.append(q)
            else:
                deliveries += self.drop(q, error)
        return waiting, deliveries

    def refuse(self, q: Query, error: QueryError) -> Delivery:
        """Answer a query that was never admitted."""
        q.state = QueryState.ANSWERED
        self._stats.answered_error += 1
        return q.reply, Answer(q.id, None, error)

    def fail_all(self, error: Callable[[int], QueryError]) -> list[Delivery]:
        """Answer every query in the table with `error(query id)` (shutting down)."""
        return self.fail(list(self._queries.values()), error)
