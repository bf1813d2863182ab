"""Transports for the load drivers (perf.load.drivers): start a prebuilt request (perf.load.wire) without
waiting, and record its answer from a callback.

gRPC: the serialized `ModelInferRequest` sent as bytes on a raw channel method, as a future;
callbacks run on gRPC's threads. HTTP: the body POSTed with aiohttp on an asyncio loop in its own
thread. `record.send` is taken when the request leaves, `record.answer` when it comes back.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from perf.load.stats import QueryRecord
from perf.load.wire import Query, grpc_request, http_request

__all__ = ["Done", "GrpcTransport", "HttpTransport", "Transport", "make_transport"]

Done = Callable[[QueryRecord], None]


class Transport:
    """Starts prebuilt requests; sets `record.send` when the request leaves and `record.answer`,
    `ok`, `error` when it comes back, then calls `done(record)` (on a transport thread)."""

    def __init__(self, url: str, model: str, timeout: float, version: str, keep_outputs: bool,
                 add_batch_dim: bool, t0: Callable[[], float]) -> None:
        self.url, self.model, self.timeout, self.version = url, model, timeout, version
        self.keep_outputs, self.add_batch_dim, self._t0 = keep_outputs, add_batch_dim, t0
        self.outputs: dict[int, dict[str, np.ndarray]] = {}

    def build(self, query: Query, qid: int) -> Any:
        raise NotImplementedError

    def submit(self, record: QueryRecord, request: Any, done: Done) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def _finish(self, record: QueryRecord, ok: bool, error: str | None, outputs: dict | None, done: Done) -> None:
        record.answer = time.perf_counter() - self._t0()
        record.ok, record.error = ok, error
        if outputs is not None:
            self.outputs[record.id] = outputs
        done(record)


class GrpcTransport(Transport):
    """gRPC futures on `channels` connections (round-robin); callbacks run on gRPC's threads."""

    def __init__(self, *args: Any, channels: int = 1) -> None:
        super().__init__(*args)
        import grpc

        self._grpc = grpc
        self._channels, self._methods = [], []
        try:
            for k in range(channels):
                # a distinct arg per channel, or gRPC shares one connection between equal channels
                options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1),
                           ("grpc.dvabatch_load_channel", k)]
                channel = grpc.insecure_channel(self.url, options=options)
                self._channels.append(channel)
                grpc.channel_ready_future(channel).result(timeout=max(min(self.timeout, 30.0), 1.0))
                self._methods.append(channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                                         request_serializer=None, response_deserializer=None))
        except grpc.FutureTimeoutError:
            self.close()
            raise ConnectionError(f"no gRPC connection to {self.url}") from None
        self._next = 0

    def build(self, query: Query, qid: int) -> bytes:
        return grpc_request(self.model, query, self.add_batch_dim, self.version, str(qid))

    def submit(self, record: QueryRecord, request: bytes, done: Done) -> None:
        method = self._methods[self._next % len(self._methods)]
        self._next += 1
        record.send = time.perf_counter() - self._t0()
        try:
            future = method.future(request, timeout=self.timeout)
        except Exception as exc:  # noqa: BLE001 - e.g. the channel was closed: the query's error, not the run's
            self._finish(record, False, f"{type(exc).__name__}: {exc}", None, done)
            return
        future.add_done_callback(lambda f: self._answered(record, f, done))

    def _answered(self, record: QueryRecord, future: Any, done: Done) -> None:
        error = future.exception()
        if error is not None:
            code = error.code() if isinstance(error, self._grpc.Call) else None
            message = f"{code.name}: {error.details()}" if code is not None else f"{type(error).__name__}: {error}"
            self._finish(record, False, message, None, done)
            return
        outputs = None
        if self.keep_outputs:
            from tritonclient.grpc import InferResult, service_pb2

            try:
                result = InferResult(service_pb2.ModelInferResponse.FromString(future.result()))
                outputs = {o.name: result.as_numpy(o.name) for o in result.get_response().outputs}
            except Exception as exc:  # noqa: BLE001 - an unreadable answer is this query's error
                self._finish(record, False, f"unreadable answer: {type(exc).__name__}: {exc}", None, done)
                return
        self._finish(record, True, None, outputs, done)

    def close(self) -> None:
        for channel in self._channels:
            channel.close()


class HttpTransport(Transport):
    """aiohttp on an asyncio loop in its own thread; `record.send` is taken when the POST starts.
    One connection per query in flight (aiohttp opens more as needed; `channels` is unused)."""

    def __init__(self, *args: Any, channels: int = 1) -> None:
        super().__init__(*args)
        import aiohttp

        version = f"/versions/{self.version}" if self.version else ""
        self._endpoint = f"http://{self.url}/v2/models/{self.model}{version}/infer"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="load-http", daemon=True)
        self._thread.start()

        async def session() -> Any:
            return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=self.timeout))

        self._session = asyncio.run_coroutine_threadsafe(session(), self._loop).result()
        self._tasks: set[asyncio.Task] = set()  # the loop keeps only weak references to tasks
        try:  # fail before the run, as gRPC does, and open a connection outside the clock
            asyncio.run_coroutine_threadsafe(self._live(), self._loop).result()
        except Exception as exc:  # noqa: BLE001 - whatever kept us from the server
            self.close()
            raise ConnectionError(f"no HTTP connection to {self.url}: {type(exc).__name__}: {exc}") from None

    async def _live(self) -> None:
        async with self._session.get(f"http://{self.url}/v2/health/live") as response:
            await response.read()

    def build(self, query: Query, qid: int) -> tuple[bytes, dict[str, str]]:
        return http_request(query, self.add_batch_dim, str(qid))

    def submit(self, record: QueryRecord, request: tuple[bytes, dict[str, str]], done: Done) -> None:
        record.send = time.perf_counter() - self._t0()  # replaced when the POST really starts
        self._loop.call_soon_threadsafe(self._start, record, request, done)

    def _start(self, record: QueryRecord, request: tuple[bytes, dict[str, str]], done: Done) -> None:
        task = self._loop.create_task(self._post(record, request, done))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _post(self, record: QueryRecord, request: tuple[bytes, dict[str, str]], done: Done) -> None:
        body, headers = request
        record.send = time.perf_counter() - self._t0()
        try:
            async with self._session.post(self._endpoint, data=body, headers=headers) as response:
                payload = await response.read()
                if response.status != 200:
                    self._finish(record, False, f"HTTP {response.status}: {_http_error(payload)}", None, done)
                    return
                outputs = None
                if self.keep_outputs:
                    import tritonclient.http as httpclient

                    length = response.headers.get("Inference-Header-Content-Length")
                    result = httpclient.InferenceServerClient.parse_response_body(
                        payload, header_length=int(length) if length else None)  # aiohttp decoded it
                    outputs = {o["name"]: result.as_numpy(o["name"]) for o in result.get_response()["outputs"]}
        except TimeoutError:
            self._finish(record, False, f"DEADLINE_EXCEEDED: no answer within {self.timeout} s", None, done)
            return
        except Exception as exc:  # noqa: BLE001 - the query's error, not the run's
            self._finish(record, False, f"{type(exc).__name__}: {exc}", None, done)
            return
        self._finish(record, True, None, outputs, done)

    def close(self) -> None:
        if self._loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self._session.close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


def _http_error(payload: bytes) -> str:
    try:
        return str(json.loads(payload).get("error", ""))
    except ValueError:
        return payload.decode(errors="replace")


def make_transport(protocol: str, url: str, model: str, timeout: float, version: str, keep_outputs: bool,
                   add_batch_dim: bool, channels: int, t0: Callable[[], float]) -> Transport:
    if channels < 1:
        raise ValueError(f"channels must be >= 1, got {channels}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    kinds = {"grpc": GrpcTransport, "http": HttpTransport}
    if protocol not in kinds:
        raise ValueError(f"protocol must be one of {sorted(kinds)}, got {protocol!r}")
    return kinds[protocol](url, model, timeout, version, keep_outputs, add_batch_dim, t0, channels=channels)
