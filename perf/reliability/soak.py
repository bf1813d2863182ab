"""A soak run against the real tritonserver: nothing lost, duplicated or wrong, and no memory drift.

    python -m perf.reliability.soak --seconds 600 [--size test|bench] [--model bert]

Slices a zoo model (`--size test`: the small one the tests use; `bench`: the benchmarks' size) and
serves it from one tritonserver as several variants, one per policy (pipelined, input, load,
hybrid), all over the same sliced folder. Then:

1. **The sustained rate, roughly**: every variant under closed loop at once (a few clients each, a
   few seconds), the sum of their throughputs is the mixed peak, and 0.8 x that peak is taken as the
   sustained rate (a rough estimate: no stepping load is run).
2. **The soak**: open-loop Poisson arrivals at 0.9 x the sustained rate for `--seconds`, each query
   to a variant and over a protocol (gRPC or HTTP) drawn at random, of mixed lengths (`--lengths`, a
   perf.load.lengths preset). One query in `--sample-every` is checked against the unsliced model run on
   it alone (the same output names and shapes, atol 1e-4, rtol 1e-3). Every second the RSS of the
   variants' backend stub processes is read (psutil, resident set size).
3. **The tally**: sent, answered (ok), rejected (an error from the server, by message), lost (no
   answer at all within the grace period after the last send, or the client's timeout), duplicated
   (a query answered more than once), wrong (a sampled answer that differs) and memory drift: the
   stubs' total RSS over the last tenth of the run against the tenth after the warm-up (the first
   20 %), in %. The command exits 1 when lost, duplicated or wrong is not 0, a stub process changed
   (a crash), or the drift exceeds 10 %.
"""
from __future__ import annotations

import argparse
import logging
import queue
import re
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import psutil

from dvabatch_backend.runtime.manifest import Manifest
from dvabatch_backend.tools.serve import TritonServer, stub_processes
from perf.load.arrivals import paced, poisson
from perf.load.drivers import run_closed_loop
from perf.load.stats import QueryRecord
from perf.load.transport import Transport, make_transport

log = logging.getLogger("perf.reliability.soak")

__all__ = ["SoakResult", "main", "soak"]

POLICIES = ("pipelined", "input", "load", "hybrid")
PROTOCOLS = ("grpc", "http")
SUSTAINED_OF_PEAK = 0.8  # the rough sustained rate: 0.8 x the closed-loop peak
LOAD_OF_SUSTAINED = 0.9  # the soak's rate: 0.9 x the sustained rate
MAX_DRIFT_PCT = 10.0
ATOL, RTOL = 1e-4, 1e-3  # as the real-export tests
POOL = 400  # distinct queries, sent again and again (references computed once each)


@dataclass
class SoakResult:
    seconds: float
    peak_qps: float
    rate_qps: float
    sent: int = 0
    answered: int = 0  # ok answers
    rejected: Counter = field(default_factory=Counter)  # error message (numbers as N) -> count
    lost: int = 0
    duplicated: int = 0
    sampled: int = 0  # sampled answers checked against the unsliced model
    sample_due: int = 0  # answers due a check: answered with a result, at a sampled index
    wrong: list[str] = field(default_factory=list)
    rss_warm_mb: float = 0.0
    rss_end_mb: float = 0.0
    rss_samples: int = 0
    crashes: list[str] = field(default_factory=list)
    by_variant: Counter = field(default_factory=Counter)
    by_protocol: Counter = field(default_factory=Counter)
    latency_p50_ms: float | None = None
    latency_p99_ms: float | None = None

    @property
    def drift_pct(self) -> float:
        return 100.0 * (self.rss_end_mb - self.rss_warm_mb) / self.rss_warm_mb if self.rss_warm_mb else 0.0

    def failures(self) -> list[str]:
        out = []
        if self.lost:
            out.append(f"{self.lost} lost")
        if self.duplicated:
            out.append(f"{self.duplicated} duplicated")
        if self.wrong:
            out.append(f"{len(self.wrong)} wrong")
        if self.crashes:
            out.append(f"stub processes changed: {self.crashes}")
        if self.drift_pct > MAX_DRIFT_PCT:
            out.append(f"memory drift {self.drift_pct:.1f} % > {MAX_DRIFT_PCT} %")
        return out

    def report(self) -> list[str]:
        lines = [
            f"soak: {self.seconds:.0f} s at {self.rate_qps:.1f} qps (0.9 x sustained; sustained = 0.8 x the "
            f"closed-loop mixed peak {self.peak_qps:.1f} qps, a rough estimate)",
            f"  sent {self.sent}, answered {self.answered}, rejected {sum(self.rejected.values())}, lost {self.lost}, "
            f"duplicated {self.duplicated}, wrong {len(self.wrong)} of {self.sampled} sampled ({self.sample_due} due)",
            f"  by variant: {dict(self.by_variant)}; by protocol: {dict(self.by_protocol)}",
            f"  latency p50 {_ms(self.latency_p50_ms)}, p99 {_ms(self.latency_p99_ms)}",
            f"  stub RSS: {self.rss_warm_mb:.1f} MB after warm-up, {self.rss_end_mb:.1f} MB at the end: drift "
            f"{self.drift_pct:+.2f} % ({self.rss_samples} samples)",
        ]
        lines += [f"  rejected {n}: {message}" for message, n in self.rejected.most_common()]
        lines += [f"  WRONG: {w}" for w in self.wrong[:20]]
        lines += [f"  CRASH: {c}" for c in self.crashes]
        return lines


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


# ----------------------------------------------------------------------------------------------
# serving


@dataclass
class Served:
    server: TritonServer
    names: list[str]
    version_dir: Path
    manifest: Manifest
    int_high: dict[str, int]


@contextmanager
def serve_variants(out_dir: Path, zoo_name: str, size: str, policies: Sequence[str] = POLICIES,
                   log_path: Path | None = None) -> Iterator[Served]:
    """The zoo model sliced into `out_dir` and served as one variant per policy."""
    from perf.baselines.bench import sliced
    from slicer.triton_files import add_model_variant

    version_dir, manifest, int_high, _ = sliced(zoo_name, size, out_dir)
    repo = out_dir / "soak_repository"
    names = [f"{zoo_name}_{policy}" for policy in policies]
    for name, policy in zip(names, policies):
        add_model_variant(repo, version_dir, name, policy=policy)
    with TritonServer(repo, explicit=True, load=names, log_path=log_path) as server:
        for name in names:
            server.wait_model_ready(name, timeout=300)
        yield Served(server, names, version_dir, manifest, dict(int_high))


def stub_pids(server: TritonServer, names: Sequence[str]) -> list[int]:
    """The backend stub processes of these models (their model.py is under the model's folder)."""
    prefixes = tuple(str(server.model_repository / name) + "/" for name in names)
    return sorted(stub_processes(lambda argv: len(argv) > 1 and argv[1].startswith(prefixes)))


def rss_mb(pid: int) -> float | None:
    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except psutil.Error:
        return None


class RssSampler:
    """Reads the stubs' total RSS every `every` seconds on its own thread: (seconds since start, MB)."""

    def __init__(self, pids: Sequence[int], every: float = 1.0) -> None:
        self.pids, self.every = list(pids), every
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="soak-rss", daemon=True)
        self._t0 = 0.0

    def start(self) -> RssSampler:
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            values = [rss_mb(pid) for pid in self.pids]
            if all(v is not None for v in values):
                self.samples.append((time.perf_counter() - self._t0, float(sum(values))))  # type: ignore[arg-type]
            self._stop.wait(self.every)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def mean_between(self, start: float, end: float) -> float:
        """The mean RSS over samples taken in [start, end) seconds (at least the nearest one)."""
        inside = [mb for t, mb in self.samples if start <= t < end]
        if not inside and self.samples:
            inside = [min(self.samples, key=lambda s: abs(s[0] - start))[1]]
        return float(np.mean(inside)) if inside else 0.0


# ----------------------------------------------------------------------------------------------
# queries and their checks


class QueryPool:
    """`POOL` seeded queries of mixed lengths, and each one's answer from the unsliced model (lazily)."""

    def __init__(self, served: Served, preset: str, seed: int, size: int = POOL) -> None:
        import onnxruntime as ort

        from perf.baselines.bench import sample_queries

        self.queries, _ = sample_queries(served.manifest, served.int_high, size, seed, preset=preset)
        self._full = ort.InferenceSession(str(served.version_dir / (served.manifest.full_model or "model.onnx")),
                                          providers=["CPUExecutionProvider"])
        self._references: dict[int, dict[str, np.ndarray]] = {}
        self.batch_axes = dict(served.manifest.output_batch_axes)

    def reference(self, k: int) -> dict[str, np.ndarray]:
        if k not in self._references:
            names = [o.name for o in self._full.get_outputs()]
            outputs = self._full.run(names, {n: v[None] for n, v in self.queries[k].items()})
            self._references[k] = dict(zip(names, outputs))
        return self._references[k]

    def mismatch(self, k: int, got: Mapping[str, np.ndarray]) -> str | None:
        want = self.reference(k)
        if sorted(got) != sorted(want):
            return f"outputs {sorted(got)}, expected {sorted(want)}"
        for name, ref in want.items():
            if got[name].shape != ref.shape:
                return f"{name}: shape {got[name].shape}, expected {ref.shape}"
            if not np.allclose(got[name], ref, atol=ATOL, rtol=RTOL, equal_nan=True):
                return f"{name}: max |diff| {np.nanmax(np.abs(got[name] - ref)):.3g}"
        return None


class Checker:
    """Compares sampled answers with the unsliced model on its own thread (not on the transports')."""

    def __init__(self, pool: QueryPool) -> None:
        self.pool = pool
        self.checked = 0
        self.due = 0  # answers submitted for a check
        self._due_lock = threading.Lock()  # submit is called on the transports' threads
        self.wrong: list[str] = []
        self._queue: queue.SimpleQueue[tuple[str, int, dict[str, np.ndarray]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="soak-checker", daemon=True)
        self._thread.start()

    def submit(self, what: str, k: int, outputs: dict[str, np.ndarray] | None) -> None:
        """An answer due a check; None: its outputs were not kept, which is reported wrong."""
        with self._due_lock:
            self.due += 1
        self._queue.put((what, k, outputs))

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            what, k, outputs = item
            problem = "its outputs were not kept" if outputs is None else self.pool.mismatch(k, outputs)
            self.checked += 1
            if problem:
                self.wrong.append(f"{what} (pool query {k}): {problem}")

    def close(self) -> None:
        """Check what was submitted, then stop: `checked` and `wrong` are final once this returns."""
        self._queue.put(None)
        self._thread.join()
        self._thread.join(120)


# ----------------------------------------------------------------------------------------------
# the runs


def measure_peak(served: Served, pool: QueryPool, seconds: float, clients_each: int = 2) -> float:
    """Every variant under closed loop at once (`clients_each` clients, gRPC): the sum of throughputs."""
    results: dict[str, Any] = {}

    def one(name: str) -> None:
        results[name] = run_closed_loop(served.server.grpc_url, name, pool.queries, clients_each, duration=seconds,
                                        timeout=60)

    threads = [threading.Thread(target=one, args=(name,)) for name in served.names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    errors = {name: len(r.errors()) for name, r in results.items() if r.errors()}
    if errors:
        log.warning("soak: errors while measuring the peak: %s", errors)
    return float(sum(r.throughput() for r in results.values()))


class _Tally:
    """Answers by query id, under a lock (callbacks come on the transports' threads)."""

    def __init__(self, n: int) -> None:
        self.sent_count = n
        self.by_variant: Counter = Counter()
        self.by_protocol: Counter = Counter()
        self.answers = np.zeros(n, dtype=np.int32)
        self.ok = 0
        self.errors: Counter = Counter()
        self.lost = 0
        self.latencies: list[float] = []
        self._lock = threading.Lock()
        self._pending = 0
        self._idle = threading.Condition(self._lock)

    def sent(self) -> None:
        with self._lock:
            self._pending += 1

    def answered(self, record: QueryRecord) -> bool:
        """Counts the answer; True the first time this query is answered."""
        with self._lock:
            self.answers[record.id] += 1
            first = self.answers[record.id] == 1
            if first:
                self._pending -= 1
                if record.ok:
                    self.ok += 1
                    if record.latency is not None:
                        self.latencies.append(record.latency)
                elif _no_answer(record.error or ""):
                    self.lost += 1  # the client gave up: the server never answered
                else:
                    self.errors[re.sub(r"\d+", "N", record.error or "")] += 1
                if self._pending == 0:
                    self._idle.notify_all()
            return bool(first)

    def wait_idle(self, timeout: float) -> bool:
        with self._lock:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)


# gRPC errors that come from the connection, not from the server's answer
_CONNECTION_LOST = ("failed to connect", "Stream removed", "Connection reset", "Socket closed", "recvmsg")


def _no_answer(error: str) -> bool:
    """True when the error is the client's (a timeout, a refused or dropped connection), not an
    answer from the server: HTTP answers read "HTTP <status>: ...", gRPC ones "<STATUS_CODE>: ..."."""
    if error.startswith("HTTP "):
        return False
    code, _, details = error.partition(": ")
    if not re.fullmatch(r"[A-Z_]+", code) or code == "DEADLINE_EXCEEDED":
        return True  # an exception on the client (aiohttp's, a timeout), or the deadline passed
    return code == "UNAVAILABLE" and any(marker in details for marker in _CONNECTION_LOST)


def run_open_loop_mixed(served: Served, pool: QueryPool, rate: float, seconds: float, seed: int,
                        sample_every: int, grace: float, checker: Checker) -> _Tally:
    """Poisson arrivals at `rate` for `seconds`, each query to a random variant over a random protocol."""
    rng = np.random.default_rng(seed)
    n = max(1, int(rate * seconds))
    offsets = poisson(rate, n, rng)
    offsets = offsets[offsets < seconds] if n > 1 else offsets
    n = len(offsets)
    picks = rng.integers(0, len(pool.queries), size=n)
    variants = rng.integers(0, len(served.names), size=n)
    protocols = rng.integers(0, len(PROTOCOLS), size=n)
    clock = {"t0": 0.0}
    transports: dict[tuple[str, str], Transport] = {}
    tally = _Tally(n)
    try:
        for name in served.names:
            for protocol in PROTOCOLS:
                url = served.server.grpc_url if protocol == "grpc" else served.server.http_url
                # keep_outputs: answers are parsed; all but the sampled ones dropped at once
                transports[(name, protocol)] = make_transport(protocol, url, name, grace, "", True, True, 1,
                                                              lambda: clock["t0"])
        requests = {key: {} for key in transports}

        def request(key: tuple[str, str], k: int) -> Any:
            built = requests[key].get(k)
            if built is None:
                built = requests[key][k] = transports[key].build(pool.queries[k], k)
            return built

        for i in range(n):  # serialized before the clock starts
            request((served.names[variants[i]], PROTOCOLS[protocols[i]]), int(picks[i]))

        def done_for(i: int, key: tuple[str, str]) -> Any:
            def done(record: QueryRecord) -> None:
                outputs = transports[key].outputs.pop(record.id, None)
                first = tally.answered(record)
                if first and record.ok and i % sample_every == 0:
                    checker.submit(f"query {i} ({key[0]}, {key[1]})", int(picks[i]), outputs)

            return done

        for i in paced(offsets[:n], on_start=lambda t0: clock.__setitem__("t0", t0)):
            key = (served.names[variants[i]], PROTOCOLS[protocols[i]])
            # the record's id is the query's index: transports key kept outputs by it
            record = QueryRecord(i, 0.0, scheduled=float(offsets[i]))
            tally.sent()
            transports[key].submit(record, request(key, int(picks[i])), done_for(i, key))
        if not tally.wait_idle(grace + 5.0):
            log.warning("soak: queries still unanswered %.0f s after the last send", grace + 5.0)
    finally:
        for transport in transports.values():
            transport.close()
    tally.lost += int(np.count_nonzero(tally.answers == 0))  # never answered, not even by a timeout
    tally.by_variant.update(served.names[v] for v in variants)
    tally.by_protocol.update(PROTOCOLS[p] for p in protocols)
    return tally


def soak(seconds: float, out_dir: Path, *, zoo_name: str = "bert", size: str = "test", preset: str = "sst2",
         sample_every: int = 10, warmup_fraction: float = 0.2, grace: float = 60.0, seed: int = 0,
         peak_seconds: float | None = None) -> SoakResult:
    """The whole soak (see the module's docstring); `out_dir` holds the slices and the repository."""
    with serve_variants(out_dir, zoo_name, size, log_path=out_dir / "tritonserver.log") as served:
        pool = QueryPool(served, preset, seed)
        peak_s = peak_seconds if peak_seconds is not None else float(np.clip(seconds / 20, 2.0, 10.0))
        peak = measure_peak(served, pool, peak_s)
        rate = LOAD_OF_SUSTAINED * SUSTAINED_OF_PEAK * peak
        log.info("soak: mixed closed-loop peak %.1f qps; sending %.1f qps for %.0f s", peak, rate, seconds)
        pids = stub_pids(served.server, served.names)
        rss = RssSampler(pids).start()
        checker = Checker(pool)
        try:
            tally = run_open_loop_mixed(served, pool, rate, seconds, seed + 1, sample_every, grace, checker)
        except ConnectionError as exc:  # the server went away before the soak began
            tally = _Tally(0)
            log.error("soak: %s", exc)
        finally:
            checker.close()
            rss.stop()
        result = SoakResult(seconds, peak, rate, sent=tally.sent_count, answered=tally.ok, rejected=tally.errors,
                            lost=tally.lost, duplicated=int(np.sum(np.maximum(tally.answers - 1, 0))),
                            sampled=checker.checked, sample_due=checker.due, wrong=checker.wrong,
                            rss_samples=len(rss.samples),
                            by_variant=tally.by_variant, by_protocol=tally.by_protocol)
        window = max(seconds / 10, 2.0)
        warm = warmup_fraction * seconds
        result.rss_warm_mb = rss.mean_between(warm, warm + window)
        result.rss_end_mb = rss.mean_between(seconds - window, seconds + 1)
        if tally.latencies:
            result.latency_p50_ms, result.latency_p99_ms = (float(v) * 1e3 for v in
                                                            np.percentile(tally.latencies, [50, 99]))
        now = stub_pids(served.server, served.names)
        if now != pids:
            result.crashes.append(f"stubs {pids} -> {now}")
        if served.server.exited():
            result.crashes.append(f"tritonserver exited:\n{served.server.log_tail(60)}")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.reliability.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=600.0, help="length of the soak (default: %(default)s)")
    parser.add_argument("--model", default="bert", help="zoo model (default: %(default)s)")
    parser.add_argument("--size", default="test", choices=("test", "bench"), help="zoo size (default: %(default)s)")
    parser.add_argument("--lengths", default="sst2", help="perf.load.lengths preset (default: %(default)s)")
    parser.add_argument("--sample-every", type=int, default=10, help="check one answer in N (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="keep the slices here (default: a temporary folder)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with tempfile.TemporaryDirectory(prefix="dvabatch-soak-") as tmp:
        result = soak(args.seconds, args.out or Path(tmp), zoo_name=args.model, size=args.size, preset=args.lengths,
                      sample_every=args.sample_every, seed=args.seed)
    for line in result.report():
        print(line)
    failures = result.failures()
    print("FAIL: " + "; ".join(failures) if failures else "PASS")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
