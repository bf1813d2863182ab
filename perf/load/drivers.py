"""Load drivers for a Triton server: open- and closed-loop runs that record every query.

    offsets = poisson(rate=200, n=2000, rng=0)                 # perf.load.arrivals: send times, s
    queries = [model_query(rng, L) for L in sample_lengths("rte", 2000, 128, rng)]
    result = run_open_loop("127.0.0.1:8001", "bert", queries, offsets)
    print(result.summary(latency_target=0.2))                  # perf.load.stats: mean/p50/p99, goodput, send lag
    result.save("run.json")

The real `perf_analyzer` (perf/load/perf_analyzer.py) drives fixed-rate and concurrency sweeps; these
drivers do what it cannot: an exact list of send times (perf.load.arrivals) with an exact list of
per-query inputs (lengths drawn from perf/load/lengths.py), recording every query's send and answer time.

Open loop: requests are serialized *before* the clock starts (perf.load.wire). One sender thread sleeps
until `start + offset` (time.sleep: sub-ms precise) and starts each request without waiting
(perf.load.transport); callbacks on the transport's threads record the answers. How late each send was
against its schedule is recorded (`send_lag`). Closed loop: `concurrency` client threads, each
sends a query, waits for its answer, sends the next.

The client shares the machine's cores with the server: when the server saturates them, sends
(and answer timestamps) are late by the scheduler's delays; `send_lag` says by how much.
"""
from __future__ import annotations

import gc
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from perf.load.arrivals import paced
from perf.load.stats import Floats, LoadResult, QueryRecord
from perf.load.transport import make_transport
from perf.load.wire import Query, query_length

__all__ = ["alternating", "run_closed_loop", "run_open_loop"]

T = TypeVar("T")


def alternating(systems: Sequence[T], turn: int) -> list[T]:
    """`systems` in order on even turns, reversed on odd ones: rounds measured side by side alternate
    who goes first, so neither always meets a machine warmed (or disturbed) by the other."""
    return list(systems) if turn % 2 == 0 else list(reversed(systems))


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
    transport = make_transport(protocol, client_url, model, timeout, model_version, keep_outputs, add_batch_dim,
                               channels, lambda: clock["t0"])
    tracker = _Tracker()
    records: list[QueryRecord] = []
    try:
        requests = [transport.build(q, i) for i, q in enumerate(queries)]
        sizes = list(lengths) if lengths is not None else [query_length(q, add_batch_dim) for q in queries]
        order = np.argsort(times, kind="stable").tolist()
        targets = times.tolist()
        cpu_before = time.process_time()  # the client's own CPU: a starved sender lags its schedule
        with _GcFrozen():
            started_at = time.time()
            for i in paced(targets, order, on_start=lambda t0: clock.__setitem__("t0", t0)):
                record = QueryRecord(i, 0.0, length=sizes[i], scheduled=targets[i])
                records.append(record)
                tracker.started()
                transport.submit(record, requests[i], tracker.answered)
            tracker.wait(timeout + 10.0)
        client_cpu_s = time.process_time() - cpu_before
    finally:
        transport.close()
    _unanswered(records, timeout)
    records.sort(key=lambda r: r.id)
    info = {"n": len(queries), "timeout_s": timeout, "channels": channels, "client_cpu_s": client_cpu_s,
            **(params or {})}
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
    transport = make_transport(protocol, client_url, model, timeout, model_version, keep_outputs, add_batch_dim,
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
