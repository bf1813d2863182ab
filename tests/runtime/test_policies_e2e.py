"""The built-in diversity policies (paper §7.2), end to end: each policy in a real Scheduler over a
sliced toy model (the policies' decisions alone are unit-tested in tests/unit/test_policies.py).
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable, Mapping, Sequence

import numpy as np
import pytest

from dvabatch_backend.runtime.decisions import ArrivalPlan, BatchTableView, New, Policy, QueryInfo
from policies.hybrid import HybridPolicy
from policies.input_diversity import InputDiversityPolicy
from policies.load_diversity import LoadDiversityPolicy
from policies.operator_diversity import OperatorDiversityPolicy

from ..conftest import Collector, GatedEngine, SlicedModel, SlowEngine, assert_all_answered_correctly, make_scheduler

MS = 1e-3
# Saturates at bs 2: T(1) = T(2), then per-query time is flat (T linear in bs). Splitting pays
# down to 2: T(8) = 2 T(4), T(4) = 2 T(2), but T(2) < 2 T(1).
SPLITS = {1: 1 * MS, 2: 1 * MS, 4: 2 * MS, 8: 4 * MS}
# A large fixed cost per batch: T(bs) < 2 T(bs/2) everywhere, never worth splitting.
NO_SPLIT = {1: 1 * MS, 2: 1.1 * MS, 4: 1.3 * MS, 8: 1.7 * MS}


def news(plan: ArrivalPlan) -> list[New]:
    return [d for d in plan.decisions if isinstance(d, New)]


def covered(plan: ArrivalPlan) -> list[int]:
    return sorted(q for d in plan.decisions for q in d.query_ids)


class CheckedInput(InputDiversityPolicy):
    """Input diversity that records whether each plan kept Policy I's promises."""

    def __init__(self, **params: float) -> None:
        super().__init__(**params)
        self.broken: list[str] = []

    def on_arrival(self, waiting: Sequence[QueryInfo], table: BatchTableView, now: float) -> ArrivalPlan:
        plan = super().on_arrival(waiting, table, now)
        length = {q.id: q.length for q in waiting}
        active = table.queries_in_flight() + len(covered(plan))
        if active > self.context.bs_max:
            self.broken.append(f"{active} queries active")
        if plan.wake_at is not None and plan.wake_at <= now:
            self.broken.append(f"wake_at {plan.wake_at} <= now {now}")
        for d in news(plan):
            lengths = [length[q] for q in d.query_ids]
            if d.pad_length is None or d.pad_length > (1 + self.pad_tolerance) * min(lengths):
                self.broken.append(f"{d} pads lengths {lengths}")
        return plan


def with_profile(model: SlicedModel, stage_times: Sequence[Mapping[int, float]]) -> SlicedModel:
    """The model with a stage-time profile in its manifest, shaped as manifest.json holds it."""
    profile = [{str(bs): t for bs, t in stage.items()} for stage in stage_times]
    manifest = dataclasses.replace(model.manifest, extra={**model.manifest.extra, "stage_times": profile})
    return dataclasses.replace(model, manifest=manifest)


def run_queries(model: SlicedModel, policy: Policy, rounds: Sequence[Sequence[int]], delay: float,
                submitters: int = 1, gap: Callable[[np.random.Generator], float] = lambda r: 0.0, **settings: object):
    """Submit rounds of queries of these lengths (from `submitters` threads); check every answer."""
    engines = [SlowEngine(e, delay) for e in model.engines()]
    scheduler = make_scheduler(model, policy, engines, **settings)
    collector = Collector()
    sent: dict[int, dict[str, np.ndarray]] = {}
    lock = threading.Lock()
    errors: list[Exception] = []

    def submit(worker: int) -> None:
        rng = np.random.default_rng(worker)
        try:
            for lengths in rounds[worker::submitters]:
                batch = [model.query(rng, n) for n in lengths]
                ids = scheduler.submit_many([(q, collector) for q in batch])
                with lock:
                    sent.update(zip(ids, batch))
                time.sleep(gap(rng))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    with scheduler:
        threads = [threading.Thread(target=submit, args=(w,)) for w in range(submitters)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert_all_answered_correctly(model, scheduler, collector, sent)
    return scheduler


def run_gated(model: SlicedModel, policy: Policy, rounds: Sequence[Sequence[int]], hold: int,
              clock: Callable[[], float] | None = None, **settings: object):
    """Submit the first round, hold its batch in stage `hold` (gated engines), submit the other
    rounds one after another (each is dispatched before submit returns), then let everything run;
    check every answer. No timing: what the policy sees is fixed by the gates (and `clock`)."""
    gates = [GatedEngine(e) for e in model.engines()]
    scheduler = make_scheduler(model, policy, gates, clock=clock, **settings)
    collector = Collector()
    rng = np.random.default_rng(0)
    sent: dict[int, dict[str, np.ndarray]] = {}

    def submit(lengths: Sequence[int]) -> None:
        batch = [model.query(rng, n) for n in lengths]
        sent.update(zip(scheduler.submit_many([(q, collector) for q in batch]), batch))

    with scheduler:
        submit(rounds[0])
        for stage in range(hold):
            gates[stage].wait_started()
            gates[stage].release()
        gates[hold].wait_started()  # the first batch is running stage `hold`, and held there
        for lengths in rounds[1:]:
            submit(lengths)
        for gate in gates:
            gate.open()
        assert_all_answered_correctly(model, scheduler, collector, sent)
    return scheduler


def frozen_clock() -> float:
    """A clock that never moves: a batch's age is always 0, whatever the machine's speed."""
    return 0.0


POLICIES: dict[str, Callable[[], Policy]] = {
    "input": lambda: CheckedInput(),
    "operator": lambda: OperatorDiversityPolicy(),
    "load": lambda: LoadDiversityPolicy(),
    "hybrid": lambda: HybridPolicy(),
}


@pytest.mark.parametrize("profiled", [False, True], ids=["no-profile", "profile"])
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_policy_answers_concurrent_mixed_lengths_like_the_unsliced_model(zoo, name: str, profiled: bool) -> None:
    model = zoo.stages("token", 4)
    if profiled:
        model = with_profile(model, [SPLITS] * 4)
    rng = np.random.default_rng(11)
    rounds = [[int(n) for n in rng.integers(1, 13, size=int(rng.integers(1, 5)))] for _ in range(24)]
    policy = POLICIES[name]()
    scheduler = run_queries(model, policy, rounds, delay=0.0005, submitters=4,
                            gap=lambda r: float(r.choice([0.0, 0.0005, 0.002])), num_buffer_pairs=2)
    assert scheduler.stats.new > 0
    if isinstance(policy, CheckedInput):
        assert policy.broken == []


def test_operator_policy_splits_with_a_profile_that_pays(zoo) -> None:
    model = with_profile(zoo.stages("token", 4), [SPLITS] * 4)
    scheduler = run_queries(model, OperatorDiversityPolicy(), [[12, 3, 5, 7, 1, 9, 2, 11]], delay=0.001)
    assert scheduler.stats.split > 0 and scheduler.stats.split_refused == 0
    splits = [e.detail for e in scheduler.trace if e.kind == "split"]
    assert splits and splits[0].startswith("into [2, 2, 2, 2]")
    quiet = run_queries(with_profile(zoo.stages("token", 4), [NO_SPLIT] * 4), OperatorDiversityPolicy(),
                        [[12, 3, 5, 7, 1, 9, 2, 11]], delay=0.001)
    assert quiet.stats.split == 0


def test_load_policy_stretches_a_batch_in_flight(zoo) -> None:
    # T_comp_wait defaults to stage 0's profiled time at bs 1 (half a second here); the clock is
    # frozen, so the batch held in stage 1 is always younger than that
    model = with_profile(zoo.stages("token", 4), [{1: 0.5, 8: 0.6}] * 4)
    scheduler = run_gated(model, LoadDiversityPolicy(), [[12, 4], [5, 6, 7], [2]], hold=1, clock=frozen_clock)
    assert scheduler.stats.stretch == 2 and scheduler.stats.stretch_refused == 0
    assert scheduler.stats.new == 1  # every later query joined the first batch


def test_load_policy_grows_the_batch_that_waits_for_a_busy_stage_0(zoo) -> None:
    # T_comp_wait 0: a started batch never takes more; the queries arriving one by one while stage 0
    # runs the first batch join the second, queued one, which stage 0 then runs as ONE item
    model = zoo.stages("token", 4)
    scheduler = run_gated(model, LoadDiversityPolicy(t_comp_wait=0.0), [[12], [7], [5], [6], [4], [2]], hold=0)
    assert scheduler.stats.new == 2 and scheduler.stats.stretch == 4
    assert scheduler.stats.stages[0].batches == 2 and scheduler.stats.stages[0].rows == 6
    assert [e.detail for e in scheduler.trace if e.kind == "stretch"]


class DeviceStage:
    """A real engine whose batch, once `run` returns, "runs on a device" until the test lets it
    finish: `wait_for_device` (what a torch engine on CUDA offers) waits for a permit."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.waiting = threading.Semaphore(0)
        self._finished = threading.Semaphore(0)

    def run(self, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
        self.inner.run(inputs, outputs)  # type: ignore[attr-defined]

    def wait_for_device(self) -> None:
        self.waiting.release()
        if not self._finished.acquire(timeout=20):
            raise TimeoutError("the test never let the device finish")

    def finish_all(self) -> None:
        self._finished.release(1_000_000)


@pytest.mark.parametrize("waits", [True, False], ids=["entry-waits", "entry-runs-ahead"])
def test_queries_arriving_while_stage_0_batch_is_on_the_device_join_the_next_batch(zoo, waits: bool) -> None:
    # stage 0's engine returns at once (its work queued on a device); with `entry_waits_for_device`
    # its executor waits for the device before taking more, so the five queries that arrive one by
    # one meanwhile join the batch that waits for stage 0 (load policy, T_comp_wait 0): 2 batches
    from dvabatch_backend.runtime.loading import wait_at_entry
    from dvabatch_backend.runtime.settings import RuntimeSettings

    model = zoo.stages("token", 4)
    engines = model.engines()
    device = DeviceStage(engines[0])
    engines[0] = device  # type: ignore[call-overload]
    scheduler = make_scheduler(model, LoadDiversityPolicy(t_comp_wait=0.0), engines, num_buffer_pairs=2)
    assert wait_at_entry(scheduler, engines, RuntimeSettings(entry_waits_for_device=waits)) is waits
    collector = Collector()
    rng = np.random.default_rng(0)
    sent: dict[int, dict[str, np.ndarray]] = {}

    def submit(length: int) -> None:
        query = model.query(rng, length)
        sent.update(zip(scheduler.submit_many([(query, collector)]), [query]))

    with scheduler:
        if waits:
            submit(12)
            assert device.waiting.acquire(timeout=10)  # the first batch is on the "device"
            for length in (7, 5, 6, 4, 2):
                submit(length)
            device.finish_all()
            assert_all_answered_correctly(model, scheduler, collector, sent)
            assert scheduler.stats.stages[0].batches == 2 and scheduler.stats.stages[0].rows == 6
            assert scheduler.stats.new == 2 and scheduler.stats.stretch == 4
        else:
            for length in (12, 7):
                submit(length)
                assert collector.wait_for(set(sent))  # each alone: stage 0 never waits for the device
            assert device.waiting.acquire(timeout=0) is False
            assert scheduler.stats.stages[0].batches == 2
            assert_all_answered_correctly(model, scheduler, collector, sent)


def test_hybrid_policy_stretches_then_splits(zoo) -> None:
    model = with_profile(zoo.stages("token", 4), [SPLITS] * 4)
    scheduler = run_gated(model, HybridPolicy(t_comp_wait=1.0), [[12, 3], [4, 5, 6, 7]], hold=0, clock=frozen_clock)
    assert scheduler.stats.stretch == 1 and scheduler.stats.new == 1
    assert scheduler.stats.split > 0  # the stretched batch of 6 splits into 3 + 3
    assert [e.detail.split(" ->")[0] for e in scheduler.trace if e.kind == "split"] == ["into [3, 3]"]
