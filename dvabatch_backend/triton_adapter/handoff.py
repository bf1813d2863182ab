"""The hand-off of `execute` calls to a thread of their own, where the model runs on a device.

No Triton import here: the adapter (model.py) hands its calls over, and tests order this with gates.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..runtime.query import request_rows

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HandedCall:
    """One `execute` call's requests handed to `CallHandoff`, their inputs read (and owned)."""
    requests: list[Any]
    tensors: list[dict[str, np.ndarray]]
    full: bool  # the call came full (the adapter's `_came_full`)

    @property
    def rows(self) -> int:
        return sum(request_rows(self.tensors))


class CallHandoff:
    """Where the model runs on a device (a GPU, or its stand-in; parameter `hand_off_calls`),
    `execute` hands a fast-path call to this thread and returns, so that the host's work between two
    batches (Triton's round trip to the next call, reading its requests) runs while the device runs
    the batch before, instead of after it: on one thread the host's work and the device's take
    turns, each leaving the other idle. The thread runs what was handed over, the calls that came
    meanwhile together (up to `limit` rows, one batch: the entry's stretch), each answer sent as its
    batch ends.

    A call is its caller's to run (`run_here`), as `execute` runs it without a hand-off, while calls
    come alone: where nothing handed over waits or has a request unanswered, and none of the last
    `quiet_calls` calls met another (found one waiting or unanswered in the hand-off, came with other
    requests, or came within `queued_within_s` of the end of the caller's last own run, Triton's
    round trip to a call it queued meanwhile). Then nothing would run beside it, and a thread's wake
    and a send of its own only add to its latency. Gaps between calls alone do not tell load from a
    lone client (a lone client's next query and a loaded device's next call follow a return about
    equally soon); calls that meet are what load is, and under load a call run by its caller costs
    the next one the overlap. A handed run whose requests are all answered (`settled`) meets no
    call: a lone client's next query can come before the run's last steps end, and waits for them.

    `put` waits while `limit` rows already wait: Triton's queue then holds what comes, as it does
    while `execute` runs a batch itself (where its batcher forms full calls and overload is seen,
    `InlineHold.caller_backlog`). `close` runs what was handed over, then ends the thread; a call
    put after it is the caller's to run. Its state (`_calls`, `_rows`, `_running`, `_unsettled`,
    `_closed`, `_quiet`, `_own_run_ended` and the counts `handed`, `ran_here_calls`, read unlocked by
    the metrics) is guarded by `_cond`."""

    def __init__(self, run: Callable[[list[HandedCall]], None], limit: int, queued_within_s: float = 0.0,
                 quiet_calls: int = 0, clock: Callable[[], float] = time.perf_counter) -> None:
        self._run = run
        self._limit = max(1, limit)
        self._queued_within_s = queued_within_s
        self._quiet_needed = quiet_calls  # 0: every call is handed over
        self._quiet = 0  # calls in a row that met no other (`run_here`)
        self._clock = clock
        self._calls: list[HandedCall] = []
        self._rows = 0
        self._running = False  # a run under way: the thread's, or its caller's (`run_here`)
        self._unsettled = 0  # requests of the thread's run not yet answered (`settled`)
        self._closed = False
        self._own_run_ended = -math.inf  # when the caller's last own run ended (`ran_here`)
        self.handed = 0  # calls handed over (`put`), and run by their caller (`run_here`): the metrics'
        self.ran_here_calls = 0
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="dvabatch-call-handoff", daemon=True)
        self._thread.start()

    def put(self, call: HandedCall) -> bool:
        """Hand `call` over (waiting while a batch's rows already wait); False once closed."""
        with self._cond:
            while self._rows >= self._limit and not self._closed:
                self._cond.wait()
            if self._closed:
                return False
            self._calls.append(call)
            self._rows += call.rows
            self.handed += 1
            self._cond.notify_all()
        return True

    def run_here(self, requests: int) -> bool:
        """Whether the caller runs its call of `requests` requests itself (calls come alone: see the
        class). True holds back what is put meanwhile until `ran_here`: one run at a time; where the
        thread's run has answered all its requests, its last steps end first."""
        with self._cond:
            busy = bool(self._calls) or self._unsettled > 0
            met = busy or requests > 1 or self._clock() - self._own_run_ended <= self._queued_within_s
            self._quiet = 0 if met else self._quiet + 1
            if busy or not self._quiet_needed or self._quiet < self._quiet_needed:
                return False
            while self._running:  # the thread's run after its last answer (no call waits: the caller puts)
                self._cond.wait()
            self._running = True
            self.ran_here_calls += 1
            return True

    def ran_here(self) -> None:
        """The caller's own run (`run_here`) ended: a call that comes soon after was queued meanwhile."""
        with self._cond:
            self._running = False
            self._own_run_ended = self._clock()
            self._cond.notify_all()

    def settled(self, requests: int = 1) -> None:
        """The thread's run answered `requests` of its requests (or handed them on)."""
        with self._cond:
            self._unsettled -= requests

    def waiting(self) -> bool:
        """Whether a call waits to run (read without the lock: a hint for where answers are sent)."""
        return bool(self._calls)

    def _take(self) -> list[HandedCall]:
        """The calls waiting, from the first, while their rows fit `limit` (the first always)."""
        taken, rows = [], 0
        while self._calls and (not taken or rows + self._calls[0].rows <= self._limit):
            call = self._calls.pop(0)
            taken.append(call)
            rows += call.rows
        self._rows -= rows
        return taken

    def _loop(self) -> None:
        while True:
            with self._cond:
                # the caller's own run ends first, closed or not
                while self._running or (not self._calls and not self._closed):
                    self._cond.wait()
                if not self._calls:
                    return  # closed, and nothing left to run
                calls = self._take()
                self._running = True
                self._unsettled = sum(len(call.requests) for call in calls)
                self._cond.notify_all()  # room for a waiting `put`
            try:
                self._run(calls)
            except Exception:  # noqa: BLE001 - `run` answers its calls' requests; the thread serves on
                log.exception("a handed-off call failed")
            finally:
                with self._cond:
                    self._running = False
                    self._unsettled = 0
                    self._cond.notify_all()  # a caller waiting to run its own call (`run_here`)

    def close(self, timeout: float = 60.0) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)
