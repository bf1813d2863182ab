"""Property: under random arrivals and random legal meta operations, every query is answered
exactly once, with the unsliced model's result, and the buffer-pair checks never fire."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dvabatch_backend.runtime.work import Launch, Step, launching
from policies import RandomLegalPolicy

from ..conftest import (Collector, GatedEngine, LaunchLedger, SlicedModel, SlowEngine, assert_all_answered_correctly,
                        assert_matches_reference, make_scheduler)

CUT_POINTS = ("h1", "h2", "h3", "h4", "h5")


@st.composite
def scenarios(draw: st.DrawFn) -> dict:
    kind = draw(st.sampled_from(["token", "dense"]))
    cuts = tuple(sorted(draw(st.sets(st.sampled_from(CUT_POINTS), max_size=5))))
    groups = draw(st.lists(st.integers(1, 6), min_size=1, max_size=12))  # queries per arrival
    return {
        "kind": kind,
        "cuts": cuts,
        "pairs": draw(st.integers(1, 3)),
        "bs_max": draw(st.integers(1, 8)),
        "groups": groups,
        "gaps": draw(st.lists(st.sampled_from([0.0, 0.0005, 0.001]), min_size=len(groups), max_size=len(groups))),
        "delay": draw(st.sampled_from([0.0, 0.0005, 0.002])),  # keep batches in flight when queries arrive
        "seed": draw(st.integers(0, 2**16)),
        "p_stretch": draw(st.sampled_from([0.0, 0.5, 0.9])),
        "p_split": draw(st.sampled_from([0.0, 0.3, 0.7])),
        "p_hold": draw(st.sampled_from([0.0, 0.2])),
    }


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(scenario=scenarios())
def test_random_schedules_answer_every_query_once_and_correctly(zoo, scenario: dict) -> None:
    model = zoo.get(scenario["kind"], scenario["cuts"])
    run_scenario(model, model.engines(), scenario)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(scenario=scenarios())
def test_random_schedules_on_the_torch_engine(zoo, scenario: dict) -> None:
    """The same property with every stage on the torch engine (CPU, eager): its answers equal the
    unsliced model in onnxruntime."""
    torch_engine = pytest.importorskip("dvabatch_backend.runtime.torch_engine")
    model = zoo.get(scenario["kind"], scenario["cuts"])
    engines = [torch_engine.TorchStageEngine(model.dir / s.file) for s in model.manifest.stages]
    run_scenario(model, engines, scenario)


def run_scenario(model: SlicedModel, engines: list, scenario: dict) -> None:
    """Queries arrive in the scenario's groups and gaps under a random legal policy: each is answered
    once, equal to the unsliced model, no buffer-rule violation, every launch inside a step of the
    engine loop (the loop's or the fast path's), one step at a time, no engine launched while it
    still runs, every thread gone after."""
    if scenario["delay"]:
        engines = [SlowEngine(e, scenario["delay"]) for e in engines]
    ledger = LaunchLedger()
    scheduler = ledger.watch(make_scheduler(model, scenario_policy(scenario), ledger.wrap(engines),
                                            num_buffer_pairs=scenario["pairs"], bs_max=scenario["bs_max"]))
    drive_scenario(model, scheduler, scenario)
    assert ledger.launches > 0 and ledger.violations == []


def scenario_policy(scenario: dict) -> RandomLegalPolicy:
    return RandomLegalPolicy(seed=scenario["seed"], stretch=scenario["p_stretch"], split=scenario["p_split"],
                             hold=scenario["p_hold"])


def drive_scenario(model: SlicedModel, pipeline, scenario: dict) -> None:
    """Send the scenario's groups with their gaps through `pipeline` (not started): every query
    answered once, as the unsliced model, no buffer-rule violation, every thread gone after."""
    rng = np.random.default_rng(scenario["seed"])
    collector = Collector()
    sent: dict[int, dict[str, np.ndarray]] = {}
    with pipeline:
        for size, gap in zip(scenario["groups"], scenario["gaps"]):
            batch = [model.query(rng) for _ in range(size)]
            sent.update(zip(pipeline.submit_many([(q, collector) for q in batch]), batch))
            time.sleep(gap)
        assert_all_answered_correctly(model, pipeline, collector, sent)
    assert not any(t.is_alive() for t in pipeline.threads)


def test_long_random_run_with_every_meta_operation(zoo) -> None:
    """One longer run per pair count, heavy on stretch and split, for the rarer interleavings. The
    last stage is held for the first half of the arrivals, so batches are surely in the table when
    queries arrive (stretch is possible whatever the timing); then everything runs freely."""
    model = zoo.stages("token", 4)
    rng = np.random.default_rng(7)
    for pairs in (1, 2, 3):
        engines = [SlowEngine(e, 0.0003) for e in model.engines()[:-1]]
        last = GatedEngine(model.engines()[-1])
        policy = RandomLegalPolicy(seed=pairs, stretch=0.9, split=0.6, hold=0.1)
        ledger = LaunchLedger()
        scheduler = ledger.watch(make_scheduler(model, policy, ledger.wrap([*engines, last]), num_buffer_pairs=pairs))
        collector = Collector()
        sent: dict[int, dict[str, np.ndarray]] = {}
        with scheduler:
            for i in range(120):
                if i == 60:
                    last.open()
                batch = [model.query(rng) for _ in range(int(rng.integers(1, 4)))]
                sent.update(zip(scheduler.submit_many([(q, collector) for q in batch]), batch))
                time.sleep(float(rng.choice([0.0, 0.0003, 0.001])))  # pacing only
            assert collector.wait_for(set(sent), timeout=60)
        for qid, inputs in sent.items():
            assert_matches_reference(model, inputs, collector.one(qid))
        assert ledger.violations == []
        stats = scheduler.stats
        assert stats.stretch > 0 and stats.split > 0, stats
        assert scheduler.buffer_violations == []


class HeldOnce:
    """An engine whose first run waits until the test lets it go; later runs return at once."""

    def __init__(self) -> None:
        self.entered, self.leave, self.calls = threading.Event(), threading.Event(), 0

    def run(self, inputs, outputs) -> None:
        self.calls += 1
        if self.calls == 1:
            self.entered.set()
            assert self.leave.wait(10)


def _on_worker(engine, step: int = 1):
    """Run `engine` as a launch a step handed to a worker."""
    with launching(Launch(0, step, on_step_thread=False)):
        engine.run({}, {})


def test_the_launch_ledger_names_a_second_run_of_a_running_engine() -> None:
    """The check above bites: an engine launched from a second thread while the first is held in it."""
    ledger = LaunchLedger()
    inner = HeldOnce()
    (engine,) = ledger.wrap([inner])
    first = threading.Thread(target=_on_worker, args=(engine,), name="first")
    first.start()
    assert inner.entered.wait(10)
    _on_worker(engine)  # while `first` is still inside
    inner.leave.set()
    first.join(10)
    assert ledger.launches == 2
    assert ledger.violations == ["engine 0: launched on MainThread while first runs it"]


def test_the_launch_ledger_names_a_launch_outside_a_step() -> None:
    ledger = LaunchLedger()
    (engine,) = ledger.wrap([HeldOnce()])
    engine.inner.calls = 1  # returns at once
    engine.run({}, {})
    _on_worker(engine)
    assert ledger.violations == ["engine 0: launched on MainThread outside a step"]


def test_the_launch_ledger_names_two_steps_at_once() -> None:
    """A thread launches as the holder of a step while another thread holds the loop's step."""
    ledger = LaunchLedger()
    ledger.step = Step()
    (engine,) = ledger.wrap([HeldOnce()])
    engine.inner.calls = 1
    held, leave = threading.Event(), threading.Event()

    def hold_the_step() -> None:
        with ledger.step:
            held.set()
            assert leave.wait(10)

    holder = threading.Thread(target=hold_the_step, name="holder")
    holder.start()
    assert held.wait(10)
    with launching(Launch(0, ledger.step.count, on_step_thread=True)):
        engine.run({}, {})  # claims the step's thread, but "holder" holds the step
    leave.set()
    holder.join(10)
    with ledger.step as step, launching(Launch(0, step, on_step_thread=True)):
        engine.run({}, {})  # held by this thread: no violation
    assert ledger.violations == ["engine 0: launched on MainThread in a step another thread holds"]
