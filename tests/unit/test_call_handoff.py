"""The hand-off of `execute` calls to a thread of their own (triton_adapter/handoff.py), ordered by
gates: each call runs exactly once, in order; calls that came while one ran are run together up to
the limit; `put` waits while a batch's rows already wait; `close` runs what was handed over first.
Calls that come alone are their caller's to run (`run_here`, on a clock of the test's own): after
`quiet_calls` in a row that met no other, until one meets another, and never beside a handed run; a
handed run whose requests are all answered meets no call, which waits for the run's last steps."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dvabatch_backend.runtime.settings import RuntimeSettings, runs_on_device
from dvabatch_backend.triton_adapter.handoff import CallHandoff, HandedCall


def call(name: str, rows: int = 1) -> HandedCall:
    return HandedCall([name], [{"x": np.zeros((rows, 2), np.float32)}], full=False)


class GatedRun:
    """The hand-off's `run`: records each group of calls, and waits at a gate before returning."""

    def __init__(self) -> None:
        self.groups: list[list[str]] = []
        self.entered = threading.Semaphore(0)
        self.gate = threading.Semaphore(0)

    def __call__(self, calls: list[HandedCall]) -> None:
        self.groups.append([c.requests[0] for c in calls])
        self.entered.release()
        assert self.gate.acquire(timeout=30)


def test_calls_that_came_while_one_ran_run_together_up_to_the_limit() -> None:
    run = GatedRun()
    handoff = CallHandoff(run, limit=4)
    assert handoff.put(call("a"))
    assert run.entered.acquire(timeout=30)  # "a" runs, held at the gate
    for name, rows in (("b", 1), ("c", 2), ("d", 2)):
        assert handoff.put(call(name, rows))
    run.gate.release()
    assert run.entered.acquire(timeout=30)
    run.gate.release()
    assert run.entered.acquire(timeout=30)
    run.gate.release()
    handoff.close()
    assert run.groups == [["a"], ["b", "c"], ["d"]]  # b and c fill 3 of 4 rows: d (2 rows) waits its turn


def test_put_waits_while_a_batchs_rows_wait_and_close_runs_what_was_handed_over() -> None:
    run = GatedRun()
    handoff = CallHandoff(run, limit=2)
    assert handoff.put(call("a"))
    assert run.entered.acquire(timeout=30)
    assert handoff.put(call("b", 2))  # 2 rows wait: the limit
    returned = threading.Event()

    def put_c() -> None:
        handoff.put(call("c"))
        returned.set()

    putter = threading.Thread(target=put_c)
    putter.start()
    assert not returned.is_set()  # "a" is still at its gate, so "b" still waits, so "c" cannot go in
    run.gate.release()  # "a" ends; "b" is taken, which makes room for "c"
    assert run.entered.acquire(timeout=30)
    assert returned.wait(timeout=30)
    closer = threading.Thread(target=handoff.close)
    closer.start()  # "c" is run before the thread ends
    run.gate.release()
    assert run.entered.acquire(timeout=30)
    run.gate.release()
    closer.join(timeout=30)
    assert not closer.is_alive()
    assert run.groups == [["a"], ["b"], ["c"]]
    assert not handoff.put(call("late"))  # closed: the caller runs it


def test_a_run_that_raises_does_not_stop_the_thread() -> None:
    seen: list[str] = []

    def run(calls: list[HandedCall]) -> None:
        seen.extend(c.requests[0] for c in calls)
        if seen == ["a"]:
            raise RuntimeError("a batch failed")

    handoff = CallHandoff(run, limit=1)
    handoff.put(call("a"))
    handoff.put(call("b"))
    handoff.close()
    assert seen == ["a", "b"]


class Clock:
    """The hand-off's clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def lone_caller(handoff: CallHandoff, clock: Clock, requests: int = 1, after_s: float = 1.0) -> bool:
    """One `execute` call of `requests` requests, `after_s` after the last one: whether it ran on the
    caller's thread (a call handed over runs at once, and answers before the next)."""
    clock.now += after_s
    here = handoff.run_here(requests)
    if here:
        handoff.ran_here()
    else:
        assert handoff.put(HandedCall([f"call-{clock.now}"] * requests, [{"x": np.zeros((requests, 2), np.float32)}],
                                      full=False))
    return here


class AnsweringRun:
    """The hand-off's `run`: answers each request (`CallHandoff.settled`), then records it."""

    def __init__(self) -> None:
        self.handoff: CallHandoff | None = None
        self.answered = threading.Semaphore(0)

    def __call__(self, calls: list[HandedCall]) -> None:
        for c in calls:
            assert self.handoff is not None
            self.handoff.settled(len(c.requests))
            self.answered.release()


def answering_handoff(clock: Clock, quiet_calls: int) -> tuple[CallHandoff, AnsweringRun]:
    run = AnsweringRun()
    handoff = CallHandoff(run, limit=4, queued_within_s=0.001, quiet_calls=quiet_calls, clock=clock)
    run.handoff = handoff
    return handoff, run


def test_calls_that_come_alone_run_on_the_callers_thread_until_one_meets_another() -> None:
    clock = Clock()
    handoff, run = answering_handoff(clock, quiet_calls=3)

    def lone(requests: int = 1, after_s: float = 1.0) -> bool:
        here = lone_caller(handoff, clock, requests, after_s)
        if not here:
            assert run.answered.acquire(timeout=30)  # its client's next query comes after its answer
        return here

    assert [lone() for _ in range(5)] == [False, False, True, True, True]
    # a call with others in it (Triton's batcher queued them together) meets another: handed over
    assert not lone(requests=2)
    assert [lone() for _ in range(3)] == [False, False, True]
    # a call that came within Triton's round trip of the caller's own run was queued behind it
    assert not lone(after_s=0.0005)
    # one as soon after a handed call meets none: `execute` returned at once, holding nothing back
    assert [lone(after_s=0.0005) for _ in range(3)] == [False, False, True]
    handoff.close()


def test_a_call_after_a_handed_run_answered_waits_for_its_last_steps_and_runs_here() -> None:
    clock = Clock()
    events: list[str] = []
    answered, gate = threading.Event(), threading.Event()
    handoff: CallHandoff

    def run(calls: list[HandedCall]) -> None:
        handoff.settled(sum(len(c.requests) for c in calls))
        answered.set()
        assert gate.wait(timeout=30)  # the run's last steps, after its answer left
        events.append("handed run ended")

    handoff = CallHandoff(run, limit=4, queued_within_s=0.001, quiet_calls=1, clock=clock)
    assert handoff.put(call("a"))
    assert answered.wait(timeout=30)
    clock.now += 1.0
    decided: list[bool] = []
    caller = threading.Thread(target=lambda: decided.append(handoff.run_here(1)))
    caller.start()
    caller.join(0.05)
    assert decided == []  # it met nothing, so it is the caller's, once the run's last steps end
    gate.set()
    caller.join(30)
    assert decided == [True]
    events.append("own run")
    handoff.ran_here()
    handoff.close()
    assert events == ["handed run ended", "own run"]


def test_a_call_meeting_a_handed_run_is_handed_over() -> None:
    clock = Clock()
    run = GatedRun()
    handoff = CallHandoff(run, limit=4, queued_within_s=0.001, quiet_calls=1, clock=clock)
    assert handoff.put(call("a"))
    assert run.entered.acquire(timeout=30)  # "a" runs, held at its gate
    clock.now += 1.0
    assert not handoff.run_here(1)  # alone by the clock, but it met "a": handed over
    run.gate.release()
    handoff.close()


def test_a_put_while_the_caller_runs_its_own_call_waits_for_it_to_end() -> None:
    own_run_ended = threading.Event()
    ran: list[tuple[str, bool]] = []  # each call run, and whether the caller's own run had ended then
    handoff = CallHandoff(lambda calls: ran.extend((c.requests[0], own_run_ended.is_set()) for c in calls),
                          limit=4, queued_within_s=0.001, quiet_calls=1, clock=Clock())
    assert handoff.run_here(1)  # the first call, alone: the caller runs it
    assert handoff.put(call("b"))  # put meanwhile (from another thread, in a server with several)
    assert handoff.put(call("c"))
    own_run_ended.set()
    handoff.ran_here()
    handoff.close()  # runs "b" and "c" before it returns
    assert ran == [("b", True), ("c", True)]


def test_with_no_quiet_calls_set_every_call_is_handed_over() -> None:
    clock = Clock()
    handoff = CallHandoff(lambda calls: None, limit=4, clock=clock)
    assert not any(lone_caller(handoff, clock, after_s=10.0) for _ in range(20))
    handoff.close()


@pytest.mark.parametrize("engine, device, handed", [
    ("onnxruntime", "cpu", False), ("torch", "cpu", False), ("torch", "cuda", True), ("simulated", "cpu", True)])
def test_calls_are_handed_off_by_default_only_where_a_device_runs_the_batches(engine: str, device: str,
                                                                            handed: bool) -> None:
    assert runs_on_device(RuntimeSettings(engine=engine, device=device)) is handed  # the CPU path is untouched


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=24), st.integers(1, 8), st.integers(1, 3))
def test_every_call_runs_once_in_order_in_groups_within_the_limit(rows: list[int], limit: int,
                                                                 producers: int) -> None:
    """Calls of random rows put by several threads at once (each its own calls, in its own order),
    however the threads interleave: each call runs exactly once, each thread's calls in the order it
    put them, a group holds more than `limit` rows only where it is one call, and `close` returns
    after running all of them."""
    groups: list[list[HandedCall]] = []
    handoff = CallHandoff(groups.append, limit)
    mine = [[call(f"p{k}-{i}", r) for i, r in enumerate(rows) if i % producers == k] for k in range(producers)]
    threads = [threading.Thread(target=lambda calls=calls: [handoff.put(c) for c in calls]) for calls in mine]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    handoff.close()
    ran = [c.requests[0] for group in groups for c in group]
    assert sorted(ran) == sorted(c.requests[0] for calls in mine for c in calls)  # each once
    for calls in mine:
        names = [c.requests[0] for c in calls]
        assert [n for n in ran if n in names] == names
    assert all(len(g) == 1 or sum(c.rows for c in g) <= limit for g in groups)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=24), st.integers(1, 3))
def test_own_runs_and_handed_runs_never_overlap_and_every_call_runs_once(alone: list[bool], producers: int) -> None:
    """Several threads make calls, each either run by its caller (where `run_here` allows) or put:
    however they interleave, no two runs are ever under way at once (they share the engines and
    scratch buffers) and every call runs exactly once."""
    ran: list[str] = []
    active, most = [0], [0]
    lock = threading.Lock()

    def running(names: list[str]) -> None:
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        for _ in range(5):  # a batch's work: it lets go of the GIL, as an engine's run does
            time.sleep(0)
        with lock:
            ran.extend(names)
            active[0] -= 1

    handoff = CallHandoff(lambda calls: running([c.requests[0] for c in calls]), limit=4,
                          queued_within_s=0.0, quiet_calls=1, clock=Clock())

    def produce(k: int) -> None:
        for i, lone in enumerate(alone):
            if i % producers != k:
                continue
            name = f"p{k}-{i}"
            if lone and handoff.run_here(1):
                running([name])
                handoff.ran_here()
            else:
                assert handoff.put(call(name))

    threads = [threading.Thread(target=produce, args=(k,)) for k in range(producers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    handoff.close()
    assert sorted(ran) == sorted(f"p{i % producers}-{i}" for i in range(len(alone)))
    assert most[0] == 1
