"""The Triton adapter: a thin `TritonPythonModel` over the runtime.

It translates requests into queries and answers into responses. When the pipeline holds nothing,
the requests of one `execute` call run on the fast path: inline on this thread, holding the engine
loop's step, in the batches the policy makes of them (`runtime/fast_path.py`), their responses
returned from `execute` as one message to the server rather than a send per request. Where the
model runs on a device (a GPU, or its stand-in; parameter `hand_off_calls`), a call goes to the
engine loop instead and `execute` returns, where `Pipeline.hands_over` says so (work in flight, or
requests that met each other, whose batch runs longer than a hand-over costs): the host reads the
next call while the device runs, and answers leave by response sender.

Calls that come full (Triton's batcher had max_batch_size rows waiting) say Triton's own queue, which
the runtime's admission cannot see, is not draining: they go the pipeline's way
(`InlineHold.caller_backlog`), so overload meets the runtime's bound and is refused. Otherwise
`execute` hands every request to the scheduler and returns None at once; each request is answered
through its response sender when all of its rows have left the pipeline. A request of shape [k, ...]
is k queries that share one response. Responses are built and sent by responder threads, not by the
stage executor whose batch finished: a send is a round trip to the server process, and the last
stage would otherwise stand idle through one per query of its batch.

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

from ..runtime.errors import BadInputError, CancelledError, QueryError, RefusedError, ShuttingDownError
from ..runtime.manifest import Manifest
from ..runtime.query import Answer, request_rows
from ..runtime.loading import load_pipeline
from ..runtime.pipeline import Pipeline
from . import parameters
from .config import parse_parameters
from .metrics import StageMetrics


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
    """Collects the answers of one request's rows; when all are in, hands itself to the responder."""

    def __init__(self, sender: Any, rows: int, output_names: list[str], responder: _Responder,
                 batch_axes: Mapping[str, int]) -> None:
        self._sender = sender
        self._answers: list[Answer | None] = [None] * rows
        self._missing = rows
        self._names = output_names
        self._batch_axes = batch_axes  # outputs served in a layout whose batch axis is not the first
        self._responder = responder
        self._lock = threading.Lock()
        # held while the final response is sent, and while the cancel watch asks Triton about the
        # request: once the final response is out Triton frees the request, and asking then crashes it
        self.sending = threading.Lock()
        self.sent = False

    def reply_for(self, row: int) -> Any:
        def reply(answer: Answer) -> None:
            with self._lock:
                self._answers[row] = answer
                self._missing -= 1
                if self._missing:
                    return
            self._responder.submit(self)

        return reply

    def send(self) -> None:
        errors = [a.error for a in self._answers if a is not None and a.error is not None]
        if errors:
            response = pb_utils.InferenceResponse(error=pb_utils.TritonError(_describe(errors), _code(errors[0])))
        else:
            tensors = [output_tensor(name, self._batched(name)) for name in self._names]
            response = pb_utils.InferenceResponse(output_tensors=tensors)
        with self.sending:
            self.sent = True
            self._sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

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


CANCEL_POLL_SECONDS = 0.05
# Requests asked per round. Each `is_cancelled` is a round trip to the server on the stub's one
# core, taken from the stages: a few a round, so that a deep backlog is asked about once in the
# time it may wait (admission.py: STANDING_WAIT, the bound) without the asking costing a core.
CANCEL_POLL_MAX = 8


class _CancelWatch:
    """A thread that asks Triton whether queued requests were cancelled (a gRPC client's deadline
    or cancel), and has the scheduler drop their queries before a stage runs them. Only requests
    with a query not yet taken by stage 0 are asked, at most `CANCEL_POLL_MAX` a round, round robin.
    With none to ask it sleeps until one is added: a light load answered on the fast path adds none,
    and a thread that woke every `CANCEL_POLL_SECONDS` for nothing would take the GIL and a core
    from the queries it serves."""

    def __init__(self, pipeline: Pipeline) -> None:
        self._pipeline = pipeline
        self._open: dict[int, tuple[Any, _RequestAnswer, list[int]]] = {}  # first query id -> (request, answer, ids)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._added = threading.Event()  # set by `add` (and `close`): the watch has something to ask
        self._thread = threading.Thread(target=self._loop, name="dvabatch-cancel-watch", daemon=True)
        self._thread.start()

    def add(self, request: Any, answer: "_RequestAnswer", ids: list[int]) -> None:
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
            if self._stop.wait(CANCEL_POLL_SECONDS):
                break
            try:
                self._poll()
            except Exception as exc:  # noqa: BLE001 - the watch must outlive one failed round trip
                pb_utils.Logger.log_warn(f"dvabatch: checking for cancelled requests failed: {exc}")

    def _poll(self) -> None:
        with self._lock:
            entries = list(self._open.items())
        asked = 0
        for first, (request, answer, ids) in entries:
            if not self._pipeline.any_queued(ids):  # running or answered: too late to save work
                with self._lock:
                    self._open.pop(first, None)
                continue
            if asked == CANCEL_POLL_MAX:
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


def _is_cancelled(request: Any, i: int, cancelled: set[int]) -> bool:
    """Whether Triton reports `request` cancelled (a round trip to the server); adds `i` to `cancelled` if so."""
    if request.is_cancelled():
        cancelled.add(i)
        return True
    return False


def _error_response(error: QueryError) -> Any:
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(error), _code(error)))


def _cancelled_response() -> Any:
    return pb_utils.InferenceResponse(error=pb_utils.TritonError("cancelled by the client before it ran", _cancelled_code()))


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


def _split_rows(arrays: Mapping[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """One dict of tensors per row of a request's inputs (each row copied)."""
    counts = {name: arr.shape[0] if arr.ndim else 0 for name, arr in arrays.items()}
    if len(set(counts.values())) != 1 or 0 in counts.values():
        raise ValueError(f"inputs disagree on the number of rows: {counts}")
    k = next(iter(counts.values()))
    return [{name: np.array(arr[i], copy=True) for name, arr in arrays.items()} for i in range(k)]


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
        self._fast_path = self._scheduler.scheduler.inline.allowed
        runtime = settings.runtime  # timeouts and a latency target: the pipeline drops what misses them
        self._inline_many = runtime.slo.slo_ms is None and runtime.queue.default_timeout_us == 0
        # where a call's batches take long, the requests answered before a later batch runs leave
        # then (a send each, on the stub's thread), not with the call's last batch; a call run as
        # one batch is returned by execute (one message)
        self._answers_early = self._scheduler.admission.long_passage
        self._call_capacity = _call_capacity(config)
        self._responder = _Responder()
        self._hand_off = settings.hand_off_calls
        self._cancel_watch = _CancelWatch(self._scheduler)
        self._metrics = StageMetrics(self._scheduler, args["model_name"], device_calls=self._hand_off)
        self._metrics.loaded(load_seconds, device_bytes)
        # what loading left lives as long as the stub (which exits on unload): kept out of the
        # collector's full sweeps, which would walk every object the loaded model holds while
        # queries wait
        gc.collect()
        gc.freeze()
        admission = self._scheduler.admission
        budgets = ", ".join(f"{b * 1000:.1f}" for b in admission.stage_budgets())
        pb_utils.Logger.log_info(
            f"dvabatch: {manifest.name} with {manifest.num_stages} stages, policy {settings.policy}, "
            f"{settings.runtime.num_buffer_pairs} buffer pairs, max_queue_size {admission.max_queue_size or 'unbounded'}, "
            f"fast path {self._scheduler.fast_path_engine}"
            + (f", slo {settings.runtime.slo.slo_ms:g} ms (stage budgets {budgets} ms)" if budgets else "")
            + f"; loaded in {load_seconds:.1f} s"
            + (f", {device_bytes / 2**20:.0f} MiB of device memory" if device_bytes is not None else "")
        )

    def execute(self, requests: list[Any]) -> list[Any] | None:
        refused = self._scheduler.refuse_at_door(len(requests))  # overload: refused unread (admission.py)
        if refused:  # returned by execute: one message to the server, not a send each
            return [_error_response(e) for e in refused]
        if self._fast_path:
            tensors = [self._inputs(request) for request in requests]
            if all(t is not None for t in tensors):
                full = self._came_full(tensors)  # type: ignore[arg-type]
                return self._fast(requests, tensors, full)  # type: ignore[arg-type]
        self._submit(requests)
        return None

    def _fast(self, requests: list[Any], tensors: list[dict[str, np.ndarray]], full: bool) -> list[Any] | None:
        """A call the fast path may take: run here, or, where the engines run beside the host and the
        rule says so (`Pipeline.hands_over`), handed to the engine loop, `execute` returning at once."""
        if self._hand_off and self._scheduler.hands_over(len(requests), sum(request_rows(tensors))):
            self._submit(requests, tensors)
            return None
        return self._inline(requests, tensors, full)

    def _inline(self, requests: list[Any], tensors: list[dict[str, np.ndarray]], full: bool) -> list[Any] | None:
        """`requests` (their inputs `tensors`) on the fast path where it takes them: where every
        request was answered here their responses are returned, in order (execute returns them: one
        message); else each is sent, and the rest handed to the pipeline."""
        done: dict[int, Any] = {}
        # several only without deadlines: later batches wait for earlier ones, so deadlines
        # stay the pipeline's to keep
        several = self._inline_many and not any(_request_timeout_us(r) for r in requests)
        cancelled: set[int] = set()  # requests Triton reports cancelled while they waited for a batch

        def answer(i: int, response: Any) -> None:
            done[i] = response

        def send_done() -> None:  # a later batch is about to run: the answers so far leave now
            for i in list(done):
                self._send(requests[i], done.pop(i))

        left = self._scheduler.run_inline_group(  # type: ignore[arg-type]
            tensors, lambda i, out: answer(i, self._response(out)), several,
            lambda i: _is_cancelled(requests[i], i, cancelled), full,
            lambda i, error: answer(i, _error_response(error)),
            send_done if self._answers_early else None)
        if not left and len(done) == len(requests):  # all answered here: returned by execute
            return [done[i] for i in range(len(requests))]
        for i, response in done.items():  # a batch failed (or answers went early): the rest the usual way
            self._send(requests[i], response)
        for i in cancelled:
            self._send(requests[i], _cancelled_response())
        left = [i for i in left if i not in cancelled]
        if left:
            self._submit([requests[i] for i in left], [tensors[i] for i in left])
        return None

    def _came_full(self, tensors: list[dict[str, np.ndarray]]) -> bool:
        """Whether Triton's batcher handed over a full batch: the next request of the largest size
        here would not have fitted its max_batch_size (`InlineHold.caller_backlog` says why it counts)."""
        rows = request_rows(tensors)
        return bool(self._call_capacity) and sum(rows) + max(rows) > self._call_capacity

    def _response(self, outputs: Mapping[str, np.ndarray]) -> Any:
        return pb_utils.InferenceResponse(output_tensors=[
            output_tensor(name, self._served_layout(name, rows)) for name, rows in outputs.items()])

    @staticmethod
    def _send(request: Any, response: Any, quiet: bool = False) -> None:
        """Send a response the fast path made, when it is not returned by `execute`. `quiet`: a
        failure is not logged (an error sent where an answer may have left already)."""
        try:
            request.get_response_sender().send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as exc:  # noqa: BLE001 - a client gone: its answer was given, and is lost alone
            if not quiet:
                pb_utils.Logger.log_error(f"dvabatch: sending a response failed: {exc}")

    def _submit(self, requests: list[Any], tensors: list[dict[str, np.ndarray]] | None = None) -> None:
        """Hand each request's rows to the scheduler; answered through its response sender.
        `tensors`: the requests' inputs, read already (else read here, while `execute` runs)."""
        for k, request in enumerate(requests):
            sender = request.get_response_sender()
            try:
                rows = self._rows(request) if tensors is None else _split_rows(tensors[k])
            except ValueError as exc:
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG)),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            answer = _RequestAnswer(sender, len(rows), self._output_names, self._responder,
                                    self._manifest.output_batch_axes)
            ids = self._scheduler.submit_many([(row, answer.reply_for(i)) for i, row in enumerate(rows)],
                                              timeout_us=_request_timeout_us(request))
            self._cancel_watch.add(request, answer, ids)

    def _inputs(self, request: Any) -> dict[str, np.ndarray] | None:
        """The request's input tensors by name (views of its memory), or None if one is missing."""
        arrays = {}
        for name in self._input_names:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is None:
                return None
            arrays[name] = input_array(tensor)
        return arrays

    def _served_layout(self, name: str, rows: np.ndarray) -> np.ndarray:
        """Rows of output `name` (batch axis first, as the runtime keeps them) in the model's layout."""
        axis = self._manifest.output_batch_axes.get(name, 0)
        return rows if axis == 0 else np.ascontiguousarray(np.moveaxis(rows, 0, axis))

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
        self._cancel_watch.close()
        self._scheduler.stop()  # its last answers go to the responder, which sends them before it ends
        self._responder.close()
        self._metrics.close()
