"""The Triton adapter: a thin `TritonPythonModel` over the runtime.

It translates requests into queries and answers into responses. `execute` submits every request's
rows to the scheduler (a request of shape [k, ...] is k queries that share one response), where the
policy batches them into rows of the batch table like any other. While the engine loop is idle,
`execute` then runs the loop's steps that answer them on its own thread (`Pipeline.serve_here`:
no wake-up of the loop's) and, where every request was answered, returns their responses as one
message to the server rather than a send each. Requests not answered by then (the policy's window
holds them, or the loop was busy) are answered through their response senders as their rows leave
the pipeline; responses are built and sent by responder threads, not the engine loop, since a send
is a round trip to the server process.

Where the model runs on a device (a GPU, or its stand-in; parameter `hand_off_calls`), `execute`
leaves the steps to the loop and returns at once where `Pipeline.hands_over` says so (work in
flight, or requests that met each other, whose batch runs longer than a hand-over costs): the host
reads the next call while the device runs. Markers (queue_marker.py), answered at once, unrun,
measure Triton's own queue: a call whose oldest request waited there past the bound is refused.

Settings come from `config.pbtxt` parameters (`config.PARAMETERS`, checked at load with the bad value
named). Only this module imports `triton_python_backend_utils`; the runtime does not.
"""
from __future__ import annotations

import gc
import json
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import triton_python_backend_utils as pb_utils

from ..runtime.admission import QUEUE_BATCHES
from ..runtime.errors import BadInputError, CancelledError, QueryError, RefusedError, ShuttingDownError
from ..runtime.manifest import Manifest
from ..runtime.query import Answer, request_rows
from ..runtime.loading import load_pipeline
from ..runtime.pipeline import CallRoute, Pipeline
from . import parameters
from .config import parse_parameters
from .metrics import StageMetrics
from .queue_marker import MARKERS_PER_BOUND, QueueMarker


# The pytriton wheel's backend stub (python_backend 24.10) reads a numpy dtype's item size with a
# pybind11 older than numpy 2, and under numpy 2 reads 0: a response's byte size is then 0 (it leaves
# with the right shapes and no data), and `as_numpy` gives an input zero strides (every element reads
# as the first). DLPack carries each element's width, so tensors cross by DLPack under numpy 2. It has
# no strings: an object (string) output keeps the numpy route; the runtime batches numeric inputs only.
_STUB_MISREADS_NUMPY = np.lib.NumpyVersion(np.__version__) >= "2.0.0"


def input_array(tensor: Any) -> np.ndarray:
    """A request tensor's data as numpy (a view of the request's memory, valid while it lives)."""
    if _STUB_MISREADS_NUMPY:
        return np.from_dlpack(tensor)
    return tensor.as_numpy()


def output_tensor(name: str, array: np.ndarray) -> Any:
    """The response tensor `name` holding `array` (its data is copied out when the response is sent)."""
    if not _STUB_MISREADS_NUMPY or array.dtype.hasobject:
        return pb_utils.Tensor(name, array)
    if not (array.flags.c_contiguous and array.flags.writeable):  # numpy exports only these by DLPack
        array = np.array(array, order="C")
    return pb_utils.Tensor.from_dlpack(name, array)


RESPONDER_THREADS = 2


class _Responder:
    """A pool of threads that send the responses handed to them; `close` waits (up to `timeout`) for
    what is queued. Several threads, because a send waits for the server process to take the
    response, and responses to different requests need no order."""

    def __init__(self, threads: int = RESPONDER_THREADS) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="dvabatch-responder")
        self._pending: set[Future[None]] = set()
        self._lock = threading.Lock()  # guards _pending (added by execute's callers, removed by the pool)

    def submit(self, answer: "_RequestAnswer") -> None:
        self._track(self._pool.submit(_send, answer))

    def _track(self, future: "Future[None]") -> None:
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(self._done)

    def _done(self, future: "Future[None]") -> None:
        with self._lock:
            self._pending.discard(future)

    def close(self, timeout: float = 30.0) -> None:
        with self._lock:
            pending = list(self._pending)
        wait(pending, timeout)
        self._pool.shutdown(wait=False)


def _send(answer: "_RequestAnswer") -> None:
    try:
        answer.send()
    except Exception as exc:  # noqa: BLE001 - one failed send (a client gone) must not stop the others
        pb_utils.Logger.log_error(f"dvabatch: sending a response failed: {exc}")


class _RequestAnswer:
    """Collects the answers of one request's rows. When all are in it hands itself to the responder,
    unless `held`: `execute` is running the steps that answer it, and returns its response
    (`release`)."""

    def __init__(self, request: Any, rows: int, output_names: list[str], responder: _Responder,
                 batch_axes: Mapping[str, int], held: bool = False) -> None:
        self._request = request  # its response sender is asked for only to send: a response returned by
        # `execute` needs none, and each one asked for costs the stub a round of its own
        self._answers: list[Answer | None] = [None] * rows
        self._missing = rows
        self._names = output_names
        self._batch_axes = batch_axes  # outputs served in a layout whose batch axis is not the first
        self._responder = responder
        self._lock = threading.Lock()  # guards _answers, _missing and _held
        self._held = held
        # held while the final response is sent, and while the cancel watch asks Triton about the
        # request: once the final response is out Triton frees the request, and asking then crashes it
        self.sending = threading.Lock()
        self.sent = False
        self.query_ids: list[int] = []  # its rows' queries, once submitted

    @property
    def answered(self) -> bool:
        return not self._missing

    def reply_for(self, row: int) -> Any:
        def reply(answer: Answer) -> None:
            with self._lock:
                self._answers[row] = answer
                self._missing -= 1
                if self._missing or self._held:
                    return
            self._responder.submit(self)

        return reply

    def release(self) -> bool:
        """No longer held: True where it was held and every row is answered (the caller returns or
        sends the response), else False (it is sent when its last row is answered, or was)."""
        with self._lock:
            was_held, self._held = self._held, False
            return was_held and not self._missing

    def response(self) -> Any:
        errors = [a.error for a in self._answers if a is not None and a.error is not None]
        if errors:
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(_describe(errors), _code(errors[0])))
        return pb_utils.InferenceResponse(output_tensors=[output_tensor(name, self._batched(name)) for name in self._names])

    def send(self) -> None:
        response = self.response()
        with self.sending:
            self.sent = True
            self._request.get_response_sender().send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def is_cancelled(self, request: Any) -> bool:
        """Whether Triton reports `request` cancelled; False once its final response is sent."""
        with self.sending:
            return not self.sent and bool(request.is_cancelled())

    def _batched(self, name: str) -> np.ndarray:
        """Output `name` of every row, along its batch axis. One row (most requests): a view with the
        batch axis added, no copy (the runtime's answer is already the query's own array)."""
        axis = self._batch_axes.get(name, 0)
        if len(self._answers) == 1:
            # contiguous already (scatter copies each answer): ascontiguousarray is then a no-op guard
            return np.ascontiguousarray(np.expand_dims(self._answers[0].outputs[name], axis))  # type: ignore[union-attr,index]
        return np.stack([a.outputs[name] for a in self._answers], axis=axis)  # type: ignore[union-attr,index]


def _cancelled_code() -> int:
    """Triton's CANCELLED (UNAVAILABLE on a stub without it); read when answering: pb_utils's error
    codes are not there yet when the stub imports this module."""
    return getattr(pb_utils.TritonError, "CANCELLED", pb_utils.TritonError.UNAVAILABLE)


def _code(error: QueryError) -> int:
    """Triton's status for the error: the client's mistake, overload or a stop, a cancellation, or ours."""
    if isinstance(error, BadInputError):
        return pb_utils.TritonError.INVALID_ARG
    if isinstance(error, (ShuttingDownError, RefusedError)):
        return pb_utils.TritonError.UNAVAILABLE
    if isinstance(error, CancelledError):
        return _cancelled_code()
    return pb_utils.TritonError.INTERNAL


def _describe(errors: list[QueryError]) -> str:
    first = str(errors[0])
    return first if len(errors) == 1 else f"{first} (and {len(errors) - 1} more row(s) failed)"


class _CancelWatch:
    """A thread that asks Triton whether queued requests were cancelled (a gRPC client's deadline
    or cancel), and has the scheduler drop their queries before a stage runs them. Requests with a
    query not yet taken by stage 0 are asked, round robin, 1/`QUEUE_BATCHES` of them a round, a
    round a batch time (`Admission.batch_seconds`: no sooner can a dropped query make room): each
    is asked once within the bound, and the round trips to the server take the stub's cores no
    more often. With none to ask it sleeps until one is added (a light load adds none)."""

    def __init__(self, pipeline: Pipeline) -> None:
        self._pipeline = pipeline
        self._open: dict[int, tuple[Any, _RequestAnswer, list[int]]] = {}  # first query id -> (request, answer, ids)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._added = threading.Event()  # set by `add` (and `close`): the watch has something to ask
        self._thread = threading.Thread(target=self._loop, name="dvabatch-cancel-watch", daemon=True)
        self._thread.start()

    def add(self, request: Any, answer: "_RequestAnswer") -> None:
        ids = answer.query_ids
        if ids:
            with self._lock:
                self._open[ids[0]] = (request, answer, ids)
            self._added.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                idle = not self._open
            if idle:  # cleared before the next look: an `add` after that look sets it again
                self._added.wait()
                self._added.clear()
                continue
            if self._stop.wait(self._pipeline.admission.batch_seconds()):
                break
            try:
                self._poll()
            except Exception as exc:  # noqa: BLE001 - the watch must outlive one failed round trip
                pb_utils.Logger.log_warn(f"dvabatch: checking for cancelled requests failed: {exc}")

    def _poll(self) -> None:
        with self._lock:
            entries = list(self._open.items())
        asked, most = 0, -(-len(entries) // QUEUE_BATCHES)
        for first, (request, answer, ids) in entries:
            if not self._pipeline.any_queued(ids):  # running or answered: too late to save work
                with self._lock:
                    self._open.pop(first, None)
                continue
            if asked == most:
                break
            asked += 1
            cancelled = answer.is_cancelled(request)
            with self._lock:
                entry = self._open.pop(first, None)
                if entry is not None and not cancelled:
                    self._open[first] = entry  # to the back: the next round asks the others first
            if cancelled:
                self._pipeline.cancel(ids)

    def close(self) -> None:
        self._stop.set()
        self._added.set()
        self._thread.join()
        with self._lock:
            self._open.clear()


def _error_response(error: QueryError) -> Any:
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(error), _code(error)))


def _device_bytes(device: str) -> int | None:
    """Device memory this process holds (torch's caching allocator: the engines' weights, their
    CUDA graphs' pools, the boundaries), or None off a GPU."""
    if device != "cuda":
        return None
    import torch

    return int(torch.cuda.memory_reserved())


def _call_capacity(config: Mapping[str, Any]) -> int:
    """The most rows Triton's dynamic batcher hands one `execute` call (max_batch_size); 0 where no
    batcher forms calls (Triton then hands requests one at a time, and no call says its queue stands)."""
    return int(config.get("max_batch_size") or 0) if "dynamic_batching" in config else 0


def _request_timeout_us(request: Any) -> int | None:
    """The request's own timeout (the client's `timeout` parameter, microseconds), or None."""
    try:
        timeout = int(request.timeout())
    except Exception:  # noqa: BLE001 - a stub without timeouts: the model's default applies
        return None
    return timeout or None


def _split_rows(arrays: Mapping[str, np.ndarray], copy: bool = True) -> list[dict[str, np.ndarray]]:
    """One dict of tensors per row of a request's inputs (each row copied, or a view)."""
    counts = {name: arr.shape[0] if arr.ndim else 0 for name, arr in arrays.items()}
    if len(set(counts.values())) != 1 or 0 in counts.values():
        raise ValueError(f"inputs disagree on the number of rows: {counts}")
    k = next(iter(counts.values()))
    return [{name: np.array(arr[i], copy=True) if copy else arr[i] for name, arr in arrays.items()} for i in range(k)]


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        from policies import load_object, load_policy

        config = json.loads(args["model_config"])
        model_dir = Path(args["model_repository"]) / args["model_version"]
        settings = parse_parameters(parameters.string_parameters(config), model_dir, parameters.triton_queue_policy(config))
        manifest = Manifest.load(settings.manifest)
        policy = load_policy(settings.policy, settings.policy_params, model_dir)
        self._manifest = manifest
        wrap = load_object(settings.engine_wrapper, model_dir, "engine_wrapper") if settings.engine_wrapper else None
        began, held_before = time.perf_counter(), _device_bytes(settings.runtime.device)
        self._scheduler: Pipeline = load_pipeline(
            settings.manifest.parent, policy, settings.runtime, manifest_file=settings.manifest.name, wrap=wrap
        ).start()
        load_seconds = time.perf_counter() - began
        device_bytes = None if held_before is None else _device_bytes(settings.runtime.device) - held_before
        self._output_names = [t.name for t in manifest.outputs]
        self._input_names = [t.name for t in manifest.inputs]
        self._call_capacity = _call_capacity(config)
        self._responder = _Responder()
        self._hand_off = settings.hand_off_calls
        self._cancel_watch = _CancelWatch(self._scheduler)
        admission = self._scheduler.admission
        # Triton's queue is measured where the runtime bounds it (Triton's own policy is not set) and
        # `execute` holds it while serving (the fast path: else `execute` submits and returns)
        own_policy = (config.get("dynamic_batching") or {}).get("default_queue_policy")
        calls = admission.caller_bound()
        self._markers = (QueueMarker(args["model_name"], config, calls / MARKERS_PER_BOUND)
                         if calls and self._call_capacity and settings.runtime.fast_path and not own_policy else None)
        self._metrics = StageMetrics(self._scheduler, args["model_name"], device_calls=self._hand_off)
        self._metrics.loaded(load_seconds, device_bytes)
        # what loading left lives as long as the stub (which exits on unload): kept out of the
        # collector's full sweeps, which would walk every object the loaded model holds while
        # queries wait
        gc.collect()
        gc.freeze()
        admission = self._scheduler.admission
        budgets = ", ".join(f"{b * 1000:.1f}" for b in admission.stage_budgets())
        bound = f"a bound of {admission.wait_bound() * 1000:.0f} ms" if admission.derived_bound else "a queue policy"
        pb_utils.Logger.log_info(
            f"dvabatch: {manifest.name} with {manifest.num_stages} stages, policy {settings.policy}, "
            f"{settings.runtime.num_buffer_pairs} buffer pairs, {bound}, "
            f"fast path {self._scheduler.fast_path_engine}"
            + (f", slo {settings.runtime.slo.slo_ms:g} ms (stage budgets {budgets} ms)" if budgets else "")
            + f"; loaded in {load_seconds:.1f} s"
            + (f", {device_bytes / 2**20:.0f} MiB of device memory" if device_bytes is not None else "")
        )

    def execute(self, requests: list[Any]) -> list[Any] | None:
        markers = self._markers.take(requests) if self._markers is not None else []
        at = {position for position, _ in markers}  # answered at once, unrun (queue_marker.py)
        others = [r for k, r in enumerate(requests) if k not in at] if at else requests
        responses = self._serve_call(others, len(requests), markers)
        if not at:
            return responses
        if responses is None:  # the others are answered by sends: so are the markers
            for k in at:
                requests[k].get_response_sender().send(QueueMarker.response(),
                                                       flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return None
        served = iter(responses)
        return [QueueMarker.response() if k in at else next(served) for k in range(len(requests))]

    def _serve_call(self, requests: list[Any], call_size: int, markers: list[tuple[int, float]]) -> list[Any] | None:
        """`execute` for the call's requests other than markers (`call_size`: the call's, with them)."""
        waited = self._markers.oldest_wait() if self._markers is not None else None  # before the call counts
        ready: list[dict[str, np.ndarray]] = [self._inputs(request) for request in requests]  # type: ignore[misc]
        whole = bool(requests) and all(t is not None for t in ready)
        full = whole and self._came_full(ready, call_size - len(requests))
        if self._markers is not None:
            self._markers.came(call_size, markers, full, ready[0] if full else None)
        if not whole:  # an input missing: each request read (and refused) alone
            self._watch(requests, self._submit(requests))
            return None if requests else []
        route = self._scheduler.route_call(len(requests), sum(request_rows(ready)), self._hand_off, waited)
        if route is CallRoute.REFUSED:  # Triton's queue held it past the bound: its oldest
            return [_error_response(e) for e in self._scheduler.scheduler.refuse_caller_backlog(len(requests), waited or 0.0)]
        if self._markers is not None:
            self._markers.served()
        if route is CallRoute.LOOP:
            self._watch(requests, self._submit(requests, ready))
            return None
        answers: list[_RequestAnswer | None] = []

        # where a call's requests make several batches, each request leaves as its batch is done (a
        # send each), not with the call's last batch; a call of one batch returns its responses
        def send_answered() -> None:  # a later batch is about to run: the answers so far leave now
            for answer in answers:
                if answer is not None and answer.release():
                    self._responder.submit(answer)

        self._scheduler.serve_here(lambda here: answers.extend(self._submit(requests, ready, held=True, borrow=here)),
                                   lambda: all(a is None or a.answered for a in answers), send_answered)
        return self._release(requests, answers)

    def _release(self, requests: list[Any], answers: list[_RequestAnswer | None]) -> list[Any] | None:
        """After `execute` ran the steps it could: where every request was answered, their responses
        in order (returned by execute: one message); else the answered ones are sent, and the rest
        go when their last row is answered, watched for cancellation meanwhile."""
        done = [a is not None and a.release() for a in answers]
        if all(done):
            return [a.response() for a in answers]  # type: ignore[union-attr]
        for answer, answered in zip(answers, done):
            if answered:
                self._responder.submit(answer)  # type: ignore[arg-type]
        self._watch(requests, answers)
        return None

    def _watch(self, requests: list[Any], answers: list[_RequestAnswer | None]) -> None:
        """Have the cancel watch ask about the requests not yet answered."""
        for request, answer in zip(requests, answers):
            if answer is not None and not answer.answered:
                self._cancel_watch.add(request, answer)

    def _came_full(self, tensors: list[dict[str, np.ndarray]], markers: int = 0) -> bool:
        """Whether Triton's batcher handed over a full batch: the next request of the largest size
        here would not have fitted its max_batch_size: Triton's queue held more than the call.
        `markers`: the call's markers besides, a row each."""
        rows = request_rows(tensors)
        return bool(self._call_capacity) and sum(rows) + markers + max(rows) > self._call_capacity


    def _submit(self, requests: list[Any], tensors: list[dict[str, np.ndarray]] | None = None,
                held: bool = False, borrow: bool = False) -> list[_RequestAnswer | None]:
        """Hand each request's rows to the scheduler; each request's answer, None where the request
        was refused as it was read (its error sent). `tensors`: the requests' inputs, read already
        (else read here, while `execute` runs). `held`: the caller runs the steps and returns the
        responses (`_release`); else each is sent when its last row is answered. `borrow`: the rows
        are views of the requests' memory, copied by the scheduler if still queued when `execute`
        lets go of the loop's step (`Scheduler.submit_call`)."""
        answers: list[_RequestAnswer | None] = []
        calls: list[list[tuple[dict[str, np.ndarray], Any]]] = []
        timeouts: list[int | None] = []
        for k, request in enumerate(requests):
            try:
                rows = self._rows(request) if tensors is None else _split_rows(tensors[k], copy=not borrow)
            except ValueError as exc:
                request.get_response_sender().send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG)),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                answers.append(None)
                continue
            answer = _RequestAnswer(request, len(rows), self._output_names, self._responder,
                                    self._manifest.output_batch_axes, held)
            calls.append([(row, answer.reply_for(i)) for i, row in enumerate(rows)])
            timeouts.append(_request_timeout_us(request))
            answers.append(answer)
        submitted = [a for a in answers if a is not None]
        for answer, ids in zip(submitted, self._scheduler.submit_call(calls, timeouts, borrow)):
            answer.query_ids = ids
        return answers

    def _inputs(self, request: Any) -> dict[str, np.ndarray] | None:
        """The request's input tensors by name (views of its memory), or None if one is missing."""
        arrays = {}
        for name in self._input_names:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is None:
                return None
            arrays[name] = input_array(tensor)
        return arrays

    def _rows(self, request: Any) -> list[dict[str, np.ndarray]]:
        """One dict of tensors per row of the request (copied: no views into request memory)."""
        arrays = {}
        for spec in self._manifest.inputs:
            tensor = pb_utils.get_input_tensor_by_name(request, spec.name)
            if tensor is None:
                raise ValueError(f"missing input {spec.name!r}; the model expects {[t.name for t in self._manifest.inputs]}")
            arrays[spec.name] = input_array(tensor)
        return _split_rows(arrays)

    def finalize(self) -> None:
        """Answer what is in flight ("shutting down") and join every thread the model started."""
        if self._markers is not None:
            self._markers.close()  # no marker is out once Triton unloads the model: its senders end
        self._cancel_watch.close()
        self._scheduler.stop()  # its last answers go to the responder, which sends them before it ends
        self._responder.close()
        self._metrics.close()
