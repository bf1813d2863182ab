"""Load generators for a Triton server: arrival schedules, open- and closed-loop runs, results.

    offsets = poisson(rate=200, n=2000, rng=0)                 # send times, seconds from start
    queries = [model_query(rng, L) for L in sample_lengths("rte", 2000, 128, rng)]
    result = run_open_loop("127.0.0.1:8001", "bert", queries, offsets)
    print(result.summary(latency_target=0.2))                  # mean/p50/p99, throughput, goodput, send lag
    result.save("run.json")

The real `perf_analyzer` (perf/perf_analyzer.py) drives fixed-rate and concurrency sweeps; this
module drives what it cannot: an exact list of send times (Poisson, Gamma with a coefficient of
variation, the paper's §8.3 stepping load) with an exact list of per-query inputs (lengths
drawn from perf/lengths.py), recording every query's send and answer time.

Open loop: requests are serialized *before* the clock starts (gRPC: a `ModelInferRequest` sent
as bytes on a raw channel method; HTTP: the body from `tritonclient.http`'s
`generate_request_body`, POSTed with aiohttp on a loop thread). One sender thread sleeps until
`start + offset` (time.sleep: sub-ms precise) and starts each request without waiting (gRPC
futures); callbacks on the transport's threads record the answers. How late each send was
against its schedule is recorded (`send_lag`). Closed loop: `concurrency` client threads, each
sends a query, waits for its answer, sends the next.

The client shares the machine's cores with the server: when the server saturates them, sends
(and answer timestamps) are late by the scheduler's delays; `send_lag` says by how much.

Times are `time.perf_counter()` seconds relative to the run's start; the run's wall-clock start
is `LoadResult.started_at`. A query's inputs are given without the batch dim and sent as
`[1, ...]` (dtype from numpy: float32 -> FP32, int64 -> INT64, ...).
"""
from __future__ import annotations

import asyncio
import gc
import json
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "LoadResult",
    "QueryRecord",
    "constant",
    "gamma",
    "grpc_request",
    "http_request",
    "peak_load",
    "poisson",
    "query_length",
    "run_closed_loop",
    "run_open_loop",
    "step_summaries",
    "stepping",
    "stepping_rates",
    "triton_dtype",
]

Query = Mapping[str, np.ndarray]
Floats = Sequence[float] | np.ndarray
RngLike = np.random.Generator | int | None


# ----------------------------------------------------------------------------------------------
# arrival schedules: send offsets in seconds, the first query at 0


def _rng(rng: RngLike) -> np.random.Generator:
    return rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)


def _offsets(gaps: np.ndarray) -> np.ndarray:
    """Offsets from inter-arrival gaps: query i is sent gaps[1] + ... + gaps[i] after query 0."""
    if gaps.size == 0:
        return np.zeros(0)
    out = np.empty(gaps.size)
    out[0] = 0.0
    np.cumsum(gaps[1:], out=out[1:])
    return out


def _check(rate: float, n: int) -> None:
    if not rate > 0 or not math.isfinite(rate):
        raise ValueError(f"rate must be a positive number of queries per second, got {rate}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")


def poisson(rate: float, n: int, rng: RngLike = None) -> np.ndarray:
    """Poisson arrivals at `rate` qps: exponential gaps (mean 1/rate) between `n` queries."""
    _check(rate, n)
    return _offsets(_rng(rng).exponential(1.0 / rate, size=n))


def constant(rate: float, n: int) -> np.ndarray:
    """Evenly spaced arrivals, one every 1/rate seconds."""
    _check(rate, n)
    return np.arange(n) / rate


def gamma(rate: float, cv: float, n: int, rng: RngLike = None) -> np.ndarray:
    """Gamma-distributed gaps with mean 1/rate and coefficient of variation `cv` (burstiness).

    cv=1 is exactly `poisson(rate, n, rng)` (same draws for the same seed), cv=0 is `constant`,
    cv>1 is burstier than Poisson (shape 1/cv^2 < 1)."""
    _check(rate, n)
    if not cv >= 0 or not math.isfinite(cv):
        raise ValueError(f"cv must be >= 0, got {cv}")
    if cv == 0:
        return constant(rate, n)
    if cv == 1:
        return poisson(rate, n, rng)
    shape = 1.0 / cv**2
    return _offsets(_rng(rng).gamma(shape, 1.0 / (rate * shape), size=n))


def stepping_rates(start_rate: float, step: float, every: int, n: int, max_rate: float | None = None) -> np.ndarray:
    """The rate (qps) each of `n` queries is sent at: start_rate, raised by `step` every `every`
    queries, capped at `max_rate`."""
    _check(start_rate, n)
    if every < 1:
        raise ValueError(f"every must be >= 1 query, got {every}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    rates = start_rate + step * (np.arange(n) // every)
    return np.minimum(rates, max_rate) if max_rate is not None else rates.astype(float)


def stepping(start_rate: float, step: float, every: int, n: int, max_rate: float | None = None,
             rng: RngLike = None) -> np.ndarray:
    """The paper's §8.3 stepping load: Poisson arrivals whose rate starts at `start_rate` and is
    raised by `step` qps every `every` queries (up to `max_rate`). The gap before a query is
    drawn at that query's rate. (§8.3: 66 qps, raised every 2000 queries, 4000 qps after 30 000.)"""
    rates = stepping_rates(start_rate, step, every, n, max_rate)
    return _offsets(_rng(rng).exponential(1.0, size=n) / rates)


# ----------------------------------------------------------------------------------------------
# results


@dataclass
class QueryRecord:
    """One query: times in seconds from the run's start; `scheduled` is None in a closed loop."""

    id: int
    send: float
    answer: float | None = None
    ok: bool = False
    error: str | None = None
    length: int | None = None
    scheduled: float | None = None

    @property
    def latency(self) -> float | None:
        return None if self.answer is None else self.answer - self.send

    @property
    def send_lag(self) -> float | None:
        return None if self.scheduled is None else self.send - self.scheduled


def _stats_ms(values: np.ndarray, prefix: str) -> dict[str, float | None]:
    if values.size == 0:
        return {f"{prefix}_{k}_ms": None for k in ("mean", "p50", "p90", "p99", "max")}
    p50, p90, p99 = np.percentile(values, [50, 90, 99]) * 1e3
    return {f"{prefix}_mean_ms": float(values.mean() * 1e3), f"{prefix}_p50_ms": float(p50),
            f"{prefix}_p90_ms": float(p90), f"{prefix}_p99_ms": float(p99), f"{prefix}_max_ms": float(values.max() * 1e3)}


@dataclass
class LoadResult:
    """Every query of one run, and the figures the paper reports over them."""

    mode: str  # "open" or "closed"
    model: str
    url: str
    protocol: str
    started_at: float  # wall clock (time.time()) at offset 0
    records: list[QueryRecord]
    params: dict[str, Any] = field(default_factory=dict)
    outputs: dict[int, dict[str, np.ndarray]] = field(default_factory=dict, repr=False)  # keep_outputs only

    def _ok(self) -> list[QueryRecord]:
        return [r for r in self.records if r.ok]

    def latencies(self) -> np.ndarray:
        """Latencies (s) of the queries answered ok, in id order."""
        return np.array([r.latency for r in sorted(self._ok(), key=lambda r: r.id)], dtype=float)

    def send_lags(self) -> np.ndarray:
        return np.array([r.send - r.scheduled for r in self.records if r.scheduled is not None], dtype=float)

    def errors(self) -> list[QueryRecord]:
        return [r for r in self.records if not r.ok]

    def window(self) -> float:
        """Seconds from the first send to the last answer (ok or not): the run's span."""
        sends = [r.send for r in self.records]
        answers = [r.answer for r in self.records if r.answer is not None]
        if not sends or not answers:
            return 0.0
        return max(max(answers) - min(sends), 0.0)

    def throughput(self) -> float:
        """Queries answered ok per second over the run's window."""
        span = self.window()
        return len(self._ok()) / span if span > 0 else 0.0

    def goodput(self, latency_target: float) -> float:
        """Queries answered ok within `latency_target` seconds, per second over the run's window."""
        span = self.window()
        good = int(np.count_nonzero(self.latencies() <= latency_target))
        return good / span if span > 0 else 0.0

    def summary(self, latency_target: float | None = None) -> dict[str, Any]:
        """Flat figures: counts, latency (ms) mean/p50/p90/p99/max, throughput and goodput (qps),
        offered and achieved send rates, and send lag (ms; open loop only)."""
        ok = self._ok()
        out: dict[str, Any] = {"mode": self.mode, "model": self.model, "protocol": self.protocol,
                               "queries": len(self.records), "answered": len(ok),
                               "errors": len(self.records) - len(ok), "duration_s": self.window()}
        out.update(_stats_ms(self.latencies(), "latency"))
        out["throughput_qps"] = self.throughput()
        if latency_target is not None:
            out["latency_target_ms"] = latency_target * 1e3
            out["goodput_qps"] = self.goodput(latency_target)
        sends = sorted(r.send for r in self.records)
        out["send_rate_qps"] = (len(sends) - 1) / (sends[-1] - sends[0]) if len(sends) > 1 and sends[-1] > sends[0] else None
        scheduled = [r.scheduled for r in self.records if r.scheduled is not None]
        if scheduled:
            span = max(scheduled) - min(scheduled)
            out["offered_qps"] = (len(scheduled) - 1) / span if span > 0 else None
            out.update(_stats_ms(self.send_lags(), "send_lag"))
        return out

    def segments(self, size: int) -> list[LoadResult]:
        """The run cut into blocks of `size` queries in id order (e.g. the steps of a stepping load)."""
        ordered = sorted(self.records, key=lambda r: r.id)
        return [LoadResult(self.mode, self.model, self.url, self.protocol, self.started_at, ordered[i:i + size],
                           dict(self.params, segment=i // size)) for i in range(0, len(ordered), size)]

    def to_dict(self, records: bool = True, latency_target: float | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"mode": self.mode, "model": self.model, "url": self.url, "protocol": self.protocol,
                               "started_at": self.started_at, "params": self.params,
                               "summary": self.summary(latency_target)}
        if records:
            out["records"] = [asdict(r) for r in self.records]
        return out

    def to_json(self, records: bool = True, latency_target: float | None = None, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(records, latency_target), indent=indent, allow_nan=False, default=jsonable)

    def save(self, path: str | Path, latency_target: float | None = None) -> Path:
        path = Path(path)
        path.write_text(self.to_json(latency_target=latency_target))
        return path

    @classmethod
    def from_json(cls, text: str) -> LoadResult:
        data = json.loads(text)
        return cls(data["mode"], data["model"], data["url"], data["protocol"], data["started_at"],
                   [QueryRecord(**r) for r in data.get("records", [])], data.get("params", {}))


def jsonable(value: Any) -> Any:
    """`json.dumps` default: numpy scalars and arrays as plain numbers and lists."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def _by_rate(result: LoadResult, rates: Floats) -> dict[float, LoadResult]:
    groups: dict[float, list[QueryRecord]] = {}
    for record in result.records:
        groups.setdefault(float(rates[record.id]), []).append(record)
    return {rate: LoadResult(result.mode, result.model, result.url, result.protocol, result.started_at, groups[rate],
                             dict(result.params, rate_qps=rate)) for rate in sorted(groups)}


def step_summaries(result: LoadResult, rates: Floats, latency_target: float | None = None) -> list[dict[str, Any]]:
    """One summary per distinct rate of a stepping run, in increasing rate (`rates[i]` is the
    rate query id i was sent at, e.g. from `stepping_rates`)."""
    return [{"rate_qps": rate, **part.summary(latency_target)} for rate, part in _by_rate(result, rates).items()]


def peak_load(result: LoadResult, rates: Floats, latency_target: float, percentile: float = 99.0) -> float | None:
    """The highest step rate at which every query was answered and the `percentile` latency stayed
    within `latency_target` seconds, counting steps in increasing rate and stopping at the first
    that fails (as §8.3 reads the peak off a stepping load). None if even the first step fails."""
    peak = None
    for rate, part in _by_rate(result, rates).items():
        latencies = part.latencies()
        if part.errors() or latencies.size == 0 or np.percentile(latencies, percentile) > latency_target:
            break
        peak = rate
    return peak


# ----------------------------------------------------------------------------------------------
# requests


def triton_dtype(dtype: np.dtype) -> str:
    """Triton's datatype name for a numpy dtype: float32 -> FP32, int64 -> INT64, ..."""
    from tritonclient.utils import np_to_triton_dtype

    name = np_to_triton_dtype(np.dtype(dtype))
    if name is None:
        raise ValueError(f"no Triton datatype for numpy dtype {np.dtype(dtype)}")
    return name


def query_length(query: Query, add_batch_dim: bool = True) -> int | None:
    """A sequence query's actual length: the count of nonzeros in its attention mask when it has
    one, else the sequence dim of its first integer input (token ids); None for other models."""
    axis = 0 if add_batch_dim else 1
    for name, arr in query.items():
        if "mask" in name and arr.ndim > axis:
            return int(np.count_nonzero(arr))
    for arr in query.values():
        if np.issubdtype(arr.dtype, np.integer) and arr.ndim > axis:
            return int(arr.shape[axis])
    return None


def _batched(query: Query, add_batch_dim: bool) -> list[tuple[str, np.ndarray]]:
    return [(name, np.ascontiguousarray(arr[None] if add_batch_dim else arr)) for name, arr in query.items()]


def grpc_request(model: str, query: Query, add_batch_dim: bool = True, version: str = "", request_id: str = "") -> bytes:
    """A serialized KServe v2 `ModelInferRequest` (raw input contents) for one query."""
    from tritonclient.grpc import service_pb2
    from tritonclient.utils import serialize_byte_tensor

    request = service_pb2.ModelInferRequest(model_name=model, model_version=version, id=request_id)
    for name, arr in _batched(query, add_batch_dim):
        datatype = triton_dtype(arr.dtype)
        tensor = request.inputs.add()
        tensor.name, tensor.datatype = name, datatype
        tensor.shape.extend(arr.shape)
        request.raw_input_contents.append(serialize_byte_tensor(arr).tobytes() if datatype == "BYTES" else arr.tobytes())
    return request.SerializeToString()


def http_request(query: Query, add_batch_dim: bool = True, request_id: str = "") -> tuple[bytes, dict[str, str]]:
    """An HTTP/REST infer body (binary inputs, binary outputs) and its headers, for one query."""
    import tritonclient.http as httpclient

    inputs = []
    for name, arr in _batched(query, add_batch_dim):
        tensor = httpclient.InferInput(name, list(arr.shape), triton_dtype(arr.dtype))
        tensor.set_data_from_numpy(arr, binary_data=True)
        inputs.append(tensor)
    body, json_size = httpclient.InferenceServerClient.generate_request_body(inputs, request_id=request_id)
    # identity: Triton would otherwise gzip answers for aiohttp's default Accept-Encoding
    headers = {"Content-Type": "application/octet-stream", "Accept-Encoding": "identity"}
    if json_size is not None:
        headers["Inference-Header-Content-Length"] = str(json_size)
    return body, headers


# ----------------------------------------------------------------------------------------------
# transports: start a prebuilt request without waiting; a callback records its answer

Done = Callable[[QueryRecord], None]


class _Transport:
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


class _GrpcTransport(_Transport):
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


class _HttpTransport(_Transport):
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


def _transport(protocol: str, url: str, model: str, timeout: float, version: str, keep_outputs: bool,
               add_batch_dim: bool, channels: int, t0: Callable[[], float]) -> _Transport:
    if channels < 1:
        raise ValueError(f"channels must be >= 1, got {channels}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    kinds = {"grpc": _GrpcTransport, "http": _HttpTransport}
    if protocol not in kinds:
        raise ValueError(f"protocol must be one of {sorted(kinds)}, got {protocol!r}")
    return kinds[protocol](url, model, timeout, version, keep_outputs, add_batch_dim, t0, channels=channels)


class _Tracker:
    """Counts queries in flight; waits until all are answered."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.pending = 0

    def started(self) -> None:
        with self._cond:
            self.pending += 1

    def answered(self, _record: QueryRecord) -> None:
        with self._cond:
            self.pending -= 1
            if self.pending == 0:
                self._cond.notify_all()

    def wait(self, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.pending == 0, timeout)


class _GcFrozen:
    """For the length of a run, existing objects are frozen out of the cyclic collector, so that
    no full collection over thousands of prebuilt requests and records stalls a send."""

    def __enter__(self) -> None:
        gc.collect()
        gc.freeze()

    def __exit__(self, *exc: object) -> None:
        gc.unfreeze()


def _unanswered(records: Sequence[QueryRecord], timeout: float) -> None:
    for record in records:
        if record.answer is None and record.error is None:
            record.error = f"no answer recorded within {timeout} s of the last send"


# ----------------------------------------------------------------------------------------------
# open loop


def run_open_loop(client_url: str, model: str, queries: Sequence[Query], offsets: Floats,
                  protocol: str = "grpc", timeout: float = 60, *, lengths: Sequence[int | None] | None = None,
                  add_batch_dim: bool = True, keep_outputs: bool = False, channels: int = 1,
                  model_version: str = "", params: Mapping[str, Any] | None = None) -> LoadResult:
    """Send `queries[i]` at `offsets[i]` seconds after the start, never waiting for answers, and
    record every query's send and answer time. `client_url` is host:port of the protocol's
    endpoint (Triton: gRPC 8001, HTTP 8000). Every query ends answered ok or with an error (a
    late one with DEADLINE_EXCEEDED after `timeout` s).

    Requests are serialized before the clock starts; one sender thread sleeps until each send
    time (time.sleep, sub-ms precise) and starts the request without waiting (gRPC futures;
    HTTP POSTs handed to an asyncio loop thread); answers are recorded by callbacks.

    `lengths` per query (default: `query_length`); `add_batch_dim` (True: the arrays have no batch
    dim and go as [1, ...]); `keep_outputs` keeps every answer's arrays in `LoadResult.outputs`;
    `channels` gRPC connections used round-robin (gRPC only); `params` are recorded in the result.
    Raises ConnectionError when the server cannot be reached before the run."""
    if len(queries) != len(offsets):
        raise ValueError(f"{len(queries)} queries but {len(offsets)} offsets")
    if lengths is not None and len(lengths) != len(queries):
        raise ValueError(f"{len(queries)} queries but {len(lengths)} lengths")
    times = np.asarray(offsets, dtype=float).reshape(-1)
    if times.size and (not np.all(np.isfinite(times)) or times.min() < 0):
        raise ValueError("offsets must be finite and >= 0")
    clock = {"t0": 0.0}
    transport = _transport(protocol, client_url, model, timeout, model_version, keep_outputs, add_batch_dim,
                           channels, lambda: clock["t0"])
    tracker = _Tracker()
    records: list[QueryRecord] = []
    try:
        requests = [transport.build(q, i) for i, q in enumerate(queries)]
        sizes = list(lengths) if lengths is not None else [query_length(q, add_batch_dim) for q in queries]
        order = np.argsort(times, kind="stable").tolist()
        targets = times.tolist()
        with _GcFrozen():
            started_at = time.time()
            t0 = clock["t0"] = time.perf_counter()
            for i in order:
                delay = t0 + targets[i] - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                record = QueryRecord(i, 0.0, length=sizes[i], scheduled=targets[i])
                records.append(record)
                tracker.started()
                transport.submit(record, requests[i], tracker.answered)
            tracker.wait(timeout + 10.0)
    finally:
        transport.close()
    _unanswered(records, timeout)
    records.sort(key=lambda r: r.id)
    info = {"n": len(queries), "timeout_s": timeout, "channels": channels, **(params or {})}
    return LoadResult("open", model, client_url, protocol, started_at, records, info, transport.outputs)


# ----------------------------------------------------------------------------------------------
# closed loop


def run_closed_loop(client_url: str, model: str, make_query: Callable[[int], Query] | Sequence[Query],
                    concurrency: int, duration: float | None = None, n: int | None = None,
                    protocol: str = "grpc", timeout: float = 60, *, add_batch_dim: bool = True,
                    keep_outputs: bool = False, channels: int = 1, model_version: str = "",
                    params: Mapping[str, Any] | None = None) -> LoadResult:
    """`concurrency` clients, each sending its next query as soon as its last one is answered,
    until `duration` seconds have passed (queries then in flight still finish and count) or `n`
    queries were sent, whichever comes first. `make_query(i)` makes query i (called under a
    lock, on the clients' threads), or give a list of queries to cycle through (serialized once,
    before the run). Other options as `run_open_loop`."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if duration is None and n is None:
        raise ValueError("give a duration (seconds) or a number of queries n, or both")
    if (duration is not None and not duration > 0) or (n is not None and n < 0):
        raise ValueError(f"duration must be > 0 and n >= 0, got duration={duration}, n={n}")
    if not callable(make_query) and len(make_query) == 0:
        raise ValueError("make_query is an empty sequence")
    clock = {"t0": 0.0}
    transport = _transport(protocol, client_url, model, timeout, model_version, keep_outputs, add_batch_dim,
                           channels, lambda: clock["t0"])
    records: list[QueryRecord] = []
    lock = threading.Lock()
    limit_box = [n if n is not None else math.inf]
    try:
        pool: list[tuple[Any, int | None]] = []
        if not callable(make_query):
            pool = [(transport.build(q, k), query_length(q, add_batch_dim)) for k, q in enumerate(make_query)]

        def next_query() -> tuple[QueryRecord, Any] | None:
            with lock:
                i = len(records)
                if i >= limit_box[0] or time.perf_counter() >= deadline:
                    return None
                if pool:
                    request, size = pool[i % len(pool)]
                else:
                    query = make_query(i)  # type: ignore[operator]
                    request, size = transport.build(query, i), query_length(query, add_batch_dim)
                record = QueryRecord(i, 0.0, length=size)
                records.append(record)
                return record, request

        failures: list[Exception] = []

        def client() -> None:
            answered = threading.Event()
            try:
                while (item := next_query()) is not None:
                    answered.clear()
                    transport.submit(item[0], item[1], lambda _r: answered.set())
                    if not answered.wait(timeout + 10.0):
                        return
            except Exception as exc:  # noqa: BLE001 - make_query failed: stop every client, raise it below
                failures.append(exc)
                with lock:
                    limit_box[0] = 0

        with _GcFrozen():
            started_at = time.time()
            t0 = clock["t0"] = time.perf_counter()
            deadline = t0 + duration if duration is not None else math.inf
            threads = [threading.Thread(target=client, name=f"load-client-{k}", daemon=True) for k in range(concurrency)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        if failures:
            raise failures[0]
    finally:
        transport.close()
    _unanswered(records, timeout)
    info = {"concurrency": concurrency, "duration_s": duration, "n": n, "timeout_s": timeout, **(params or {})}
    return LoadResult("closed", model, client_url, protocol, started_at, records, info, transport.outputs)
