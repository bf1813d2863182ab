"""Markers: requests the model sends to itself, through Triton, to measure Triton's own queue.

Triton's queue before `execute` is invisible to the backend: the stub tells neither how many
requests wait nor when one arrived. A marker (a request with no outputs asked for, id
`MARKER_PREFIX` and a count, inputs of zeros shaped like the requests served) joins the back of
that queue like any request, and `execute` answers it at once, unrun, with no outputs: the calls
between two markers, and when each marker was sent, tell `runtime.caller_queue.CallerQueue` how
long each call's oldest request has waited.

Sent only while calls come full (the queue holds more than a call), and no sooner than
`MARKERS_PER_BOUND` a bound apart: under overload a marker takes one row of a call about every
half bound, and under a light load none is sent. Each is sent by a thread of its own that waits
for its answer (the stub's `exec`), which leaves with the call it came in: several may be out.
"""
from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import triton_python_backend_utils as pb_utils

MARKER_PREFIX = "dvabatch-queue-marker-"
# markers sent in the time the bound lets a request wait: the oldest wait is measured again at least
# this often, while between markers it is worked out from the arrival rate
MARKERS_PER_BOUND = 2


class QueueMarker:
    def __init__(self, model_name: str, config: Mapping[str, Any], period: Callable[[], float]) -> None:
        """`config`: the model's Triton config (its inputs); `period()`: the least seconds between
        two markers' sends."""
        self._model = model_name
        self._inputs = [(i["name"], pb_utils.triton_string_to_numpy(i["data_type"]), [int(d) for d in i["dims"]])
                        for i in config.get("input", []) if not i.get("optional")]
        self._period = period
        self._lock = threading.Lock()  # guards _sent (the marker thread adds, `execute`'s thread takes)
        self._sent: dict[str, float] = {}  # marker id -> when it was sent (time.monotonic)
        self._shapes: dict[str, tuple[int, ...]] = {}  # a served request's row shape by input (execute's thread writes)
        self._wanted = threading.Event()  # set by `want`: calls come full, the queue is worth measuring
        self._stop = threading.Event()
        self._ids = itertools.count()
        # a marker's answer leaves with its call, so the next may be sent before it is back; the queue
        # holds a request at most about the bound, so this many are out at most
        self._senders = ThreadPoolExecutor(MARKERS_PER_BOUND + 1, thread_name_prefix="dvabatch-queue-marker")
        self._thread = threading.Thread(target=self._loop, name="dvabatch-queue-markers", daemon=True)
        self._thread.start()

    def want(self, tensors: Mapping[str, np.ndarray] | None = None) -> None:
        """A call came full: send a marker when the last is out and the period has passed.
        `tensors`: a request of that call, read, whose row shapes the markers take."""
        if tensors is not None:
            self._shapes = {name: arr.shape[1:] for name, arr in tensors.items()}
        self._wanted.set()

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
                    found.append((position, sent))
        return found

    def earliest_out(self) -> float | None:
        """When the earliest marker still out was sent (every request that comes out before it
        arrived before that), or None."""
        with self._lock:
            return min(self._sent.values(), default=None)

    @staticmethod
    def response() -> Any:
        """A marker's answer: no outputs (it asked for none), and no error in Triton's counts."""
        return pb_utils.InferenceResponse(output_tensors=[])

    def close(self) -> None:
        """Send no more, and join the threads (a marker out is answered before Triton unloads the model)."""
        self._stop.set()
        self._wanted.set()
        self._thread.join()
        self._senders.shutdown(wait=True)

    def _loop(self) -> None:
        last = -float("inf")
        while True:
            self._wanted.wait()
            if self._stop.is_set() or self._stop.wait(max(0.0, last + self._period() - time.monotonic())):
                return
            self._wanted.clear()
            last = time.monotonic()
            self._senders.submit(self._send)

    def _send(self) -> None:
        marker_id = f"{MARKER_PREFIX}{next(self._ids)}"
        request = pb_utils.InferenceRequest(model_name=self._model, request_id=marker_id, inputs=self._tensors(),
                                            requested_output_names=[])
        with self._lock:
            self._sent[marker_id] = time.monotonic()
        try:
            response = request.exec()  # back once `execute` has answered it
            failed = response.error().message() if response.has_error() else None
        except Exception as exc:  # noqa: BLE001 - the server stopping; markers only measure
            failed = str(exc)
        if failed is not None:
            with self._lock:
                self._sent.pop(marker_id, None)
            if not self._stop.is_set():
                pb_utils.Logger.log_warn(f"dvabatch: a queue marker failed: {failed}")

    def _tensors(self) -> list[Any]:
        shapes = self._shapes
        return [pb_utils.Tensor(name, np.full((1, *shapes.get(name, [max(d, 1) for d in dims])),
                                              b"" if dtype == np.object_ else 0, dtype))
                for name, dtype, dims in self._inputs]
