"""A buggy policy cannot lose queries: bad decisions are answered with errors, stalls are broken."""
from __future__ import annotations

import threading
from typing import Sequence

import numpy as np
import pytest

from dvabatch_backend import ArrivalPlan, New, Policy
from dvabatch_backend.runtime.decisions import BatchTableView, QueryInfo
from dvabatch_backend.runtime.errors import PolicyError

from ..conftest import Collector, GatedEngine, assert_matches_reference, make_scheduler


class PadTooShort(Policy):
    name = "pad-too-short"

    def on_arrival(self, waiting: Sequence[QueryInfo], table: BatchTableView, now: float) -> ArrivalPlan:
        return ArrivalPlan(tuple(New((q.id,), pad_length=1 if q.length > 1 else None) for q in waiting))


class NeverDecides(Policy):
    name = "never"

    def on_arrival(self, waiting: Sequence[QueryInfo], table: BatchTableView, now: float) -> ArrivalPlan:
        return ArrivalPlan()


def test_an_impossible_decision_answers_only_its_queries_with_a_policy_error(zoo) -> None:
    model = zoo.stages("token", 2)
    rng = np.random.default_rng(5)
    short, long = model.query(rng, 1), model.query(rng, 6)
    collector = Collector()
    with make_scheduler(model, PadTooShort()) as scheduler:
        ids = scheduler.submit_many([(short, collector), (long, collector)])
        assert collector.wait_for(ids)
    assert_matches_reference(model, short, collector.one(ids[0]))
    error = collector.one(ids[1]).error
    assert isinstance(error, PolicyError) and "pad-too-short" in str(error) and "pad length" in str(error)
    assert scheduler.stats.policy_errors == 1


def test_a_policy_that_never_decides_does_not_strand_queries(zoo) -> None:
    model = zoo.stages("dense", 2)
    rng = np.random.default_rng(6)
    queries = [model.query(rng) for _ in range(3)]
    collector = Collector()
    with make_scheduler(model, NeverDecides()) as scheduler:
        ids = scheduler.submit_many([(q, collector) for q in queries])
        assert collector.wait_for(ids)
    for qid, inputs in zip(ids, queries):
        assert_matches_reference(model, inputs, collector.one(qid))
    assert scheduler.stats.policy_errors >= 1


class Raises(Policy):
    name = "raises"

    def on_arrival(self, waiting: Sequence[QueryInfo], table: BatchTableView, now: float) -> ArrivalPlan:
        if len(waiting) > 1:
            raise RuntimeError("policy bug")
        return ArrivalPlan((New(tuple(q.id for q in waiting)),))

    def on_stage_done(self, stage, batch, table, now):
        raise RuntimeError("policy bug")


def test_a_policy_that_raises_loses_no_query_and_no_thread(zoo) -> None:
    model = zoo.stages("token", 3)
    rng = np.random.default_rng(7)
    queries = [model.query(rng) for _ in range(4)]
    collector = Collector()
    with make_scheduler(model, Raises()) as scheduler:
        ids = [scheduler.submit(queries[0], collector)]
        ids += scheduler.submit_many([(q, collector) for q in queries[1:]])
        assert collector.wait_for(ids)
        assert all(t.is_alive() for t in scheduler.threads)
    for qid, inputs in zip(ids, queries):
        assert_matches_reference(model, inputs, collector.one(qid))
    assert scheduler.stats.policy_errors >= 2


class HoldsIntoThePast(Policy):
    """A batch window whose deadline passes while the pipeline is busy."""

    name = "window-in-the-past"

    def __init__(self) -> None:
        self.called_past_deadline = threading.Event()

    def on_arrival(self, waiting: Sequence[QueryInfo], table: BatchTableView, now: float) -> ArrivalPlan:
        if len(table) == 0:
            return ArrivalPlan((New(tuple(q.id for q in waiting[: self.context.bs_max])),))
        deadline = min(q.arrival for q in waiting) + 0.001
        if now >= deadline:
            self.called_past_deadline.set()  # woken at its deadline, busy still: asks again, in the past
        return ArrivalPlan((), wake_at=deadline)


def test_a_wake_up_in_the_past_does_not_starve_the_pipeline(zoo) -> None:
    model = zoo.stages("token", 2)
    rng = np.random.default_rng(8)
    queries = [model.query(rng) for _ in range(3)]
    collector = Collector()
    gates = [GatedEngine(e) for e in model.engines()]
    policy = HoldsIntoThePast()
    with make_scheduler(model, policy, gates) as scheduler:
        ids = [scheduler.submit(queries[0], collector)]
        gates[0].wait_started()  # the pipeline is busy with the first query
        ids += [scheduler.submit(q, collector) for q in queries[1:]]
        # the window's deadline passes while the first query is held: the policy is asked again
        # and answers with a wake-up in the past
        assert policy.called_past_deadline.wait(10)
        for gate in gates:
            gate.open()
        assert collector.wait_for(ids, timeout=10)
    for qid, inputs in zip(ids, queries):
        assert_matches_reference(model, inputs, collector.one(qid))


class IllTyped(Policy):
    """Mistakes a policy author makes: a bare id, a bare decision, float pad and split sizes."""

    name = "ill-typed"

    def __init__(self, mistake: str) -> None:
        self.mistake = mistake

    def on_arrival(self, waiting: Sequence[QueryInfo], table: BatchTableView, now: float) -> ArrivalPlan:
        ids = tuple(q.id for q in waiting)
        if self.mistake == "bare id":
            return ArrivalPlan(tuple(New(q) for q in ids))  # type: ignore[arg-type]
        if self.mistake == "bare decision":
            return ArrivalPlan(New(ids))  # type: ignore[arg-type]
        if self.mistake == "float pad":
            return ArrivalPlan((New(ids, pad_length=12.0),))  # type: ignore[arg-type]
        return ArrivalPlan((New(ids),))

    def on_stage_done(self, stage, batch, table, now):
        from dvabatch_backend import Split

        return Split((batch.bs / 2, batch.bs / 2)) if self.mistake == "float split" and batch.bs % 2 == 0 else None


@pytest.mark.parametrize("mistake", ["bare id", "bare decision", "float pad", "float split"])
def test_ill_typed_decisions_are_policy_errors_not_crashes(zoo, mistake: str) -> None:
    model = zoo.stages("token", 3)
    rng = np.random.default_rng(9)
    queries = [model.query(rng) for _ in range(4)]
    collector = Collector()
    with make_scheduler(model, IllTyped(mistake)) as scheduler:
        ids = scheduler.submit_many([(q, collector) for q in queries])
        assert collector.wait_for(ids)
        assert all(t.is_alive() for t in scheduler.threads)
    for qid, inputs in zip(ids, queries):
        assert_matches_reference(model, inputs, collector.one(qid))
    assert scheduler.stats.policy_errors >= 1
