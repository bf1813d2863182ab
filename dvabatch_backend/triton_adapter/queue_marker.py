"""Markers: requests the model sends itself, through Triton, to measure Triton's own queue.

The stub tells the backend neither how many requests wait before `execute` nor when one arrived.
A marker (id `MARKER_PREFIX` and a count, no outputs asked for, inputs of zeros shaped like a
request served) joins the back of that queue like any request, and `execute` answers it at once,
unrun: the calls between markers, and when each was sent, tell how long each call's oldest
request has waited (`runtime.caller_queue.CallerQueue`, which this owns). The clock is the count
of calls served: a wait is the calls a request waited through, at the pace the server really
serves them (its own round for each call included), and no time is read. Sent only while calls
come full (the queue holds more than a call), `MARKERS_PER_BOUND` in the calls the bound lets a
request wait through: none under a light load. Each is sent by a thread that waits for its
answer (the stub's `exec`), which leaves with the call it came in, so several may be out.
"""
from __future__ import annotations

import itertools
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping, Sequence

import numpy as np
import triton_python_backend_utils as pb_utils

from ..runtime.caller_queue import CallerQueue

MARKER_PREFIX = "dvabatch-queue-marker-"
# the oldest wait is measured again this often in the calls it may last; between markers it is
# worked out from the arrival rate
MARKERS_PER_BOUND = 2


class QueueMarker:
    def __init__(self, model_name: str, config: Mapping[str, Any], period: float) -> None:
        """`config`: the model's Triton config (its inputs); `period`: the fewest calls served
        between two markers' sends."""
        self._model = model_name
        self._inputs = [(i["name"], pb_utils.triton_string_to_numpy(i["data_type"]), [int(d) for d in i["dims"]])
                        for i in config.get("input", []) if not i.get("optional")]
        self._period = period
        self._queue = CallerQueue()  # execute's thread only, as are _served, _last and _shapes
        self._served = 0  # calls served: the clock
        self._last = -float("inf")  # the clock at the last send
        self._shapes: dict[str, tuple[int, ...]] = {}  # a served request's row shape, by input
        self._lock = threading.Lock()  # guards _sent (the senders add, `execute`'s thread takes)
        self._sent: dict[str, int] = {}  # marker id -> the clock when it was sent
        self._closed = False
        self._ids = itertools.count()
        # a request waits through about the bound at most, so no more than this many are out at once
        self._senders = ThreadPoolExecutor(MARKERS_PER_BOUND + 1, thread_name_prefix="dvabatch-queue-marker")

    def came(self, call_size: int, markers: list[tuple[int, float]], full: bool,
             tensors: Mapping[str, np.ndarray] | None = None) -> None:
        """A call of `call_size` requests came with `markers` (`take`): counted in the queue. A full
        one sends a marker, unless one went less than the period ago; `tensors`: a request of
        it, read, whose row shapes the markers take."""
        self._queue.came(call_size, markers, full)
        if tensors is not None:
            self._shapes = {name: arr.shape[1:] for name, arr in tensors.items()}
        if full and self._served - self._last >= self._period and not self._closed:
            self._last = self._served
            request = self._request()
            with self._lock:
                self._sent[request.request_id()] = self._served
            self._senders.submit(self._send, request)

    def served(self) -> None:
        """A call was served (not refused): the clock ticks."""
        self._served += 1

    def take(self, requests: Sequence[Any]) -> list[tuple[int, float]]:
        """The markers among `requests`: each one's position and send time (the caller answers them
        with `response()`). Reads no request's id where no marker is out."""
        if not self._sent:
            return []
        found = []
        for position, request in enumerate(requests):
            if request.request_id().startswith(MARKER_PREFIX):
                with self._lock:
                    sent = self._sent.pop(request.request_id(), None)
                if sent is not None:
                    found.append((position, float(sent)))
        return found

    def oldest_wait(self) -> float | None:
        """Calls the next call's oldest request has waited through in Triton's queue, or None."""
        with self._lock:
            out = min(self._sent.values(), default=None)  # the earliest marker still out: it came before
        arrival = self._queue.oldest_arrival(out)
        return None if arrival is None else self._served - arrival

    @staticmethod
    def response() -> Any:
        """A marker's answer: no outputs (it asked for none), and no error in Triton's counts."""
        return pb_utils.InferenceResponse(output_tensors=[])

    def close(self) -> None:
        """Send no more, and join the senders (a marker out is answered before Triton unloads the model)."""
        self._closed = True
        self._senders.shutdown(wait=True)

    def _request(self) -> Any:
        shapes = self._shapes
        tensors = [pb_utils.Tensor(name, np.full((1, *shapes.get(name, [max(d, 1) for d in dims])),
                                                 b"" if dtype == np.object_ else 0, dtype))
                   for name, dtype, dims in self._inputs]
        return pb_utils.InferenceRequest(model_name=self._model, request_id=f"{MARKER_PREFIX}{next(self._ids)}",
                                         inputs=tensors, requested_output_names=[])

    def _send(self, request: Any) -> None:
        try:
            response = request.exec()  # back once `execute` has answered it
            failed = response.error().message() if response.has_error() else None
        except Exception as exc:  # noqa: BLE001 - the server stopping; markers only measure
            failed = str(exc)
        with self._lock:  # out, whoever answered it (another instance of the model may have)
            self._sent.pop(request.request_id(), None)
        if failed is not None and not self._closed:
            pb_utils.Logger.log_warn(f"dvabatch: a queue marker failed: {failed}")
