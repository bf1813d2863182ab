"""The hand-off of `execute` calls to a thread of their own (triton_adapter/handoff.py), ordered by
gates: each call runs exactly once, in order; calls that came while one ran are run together up to
the limit; `put` waits while a batch's rows already wait; `close` runs what was handed over first."""
from __future__ import annotations

import threading

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
