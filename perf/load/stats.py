"""What a load run recorded and the figures the paper reports over it: `QueryRecord` (one
query's send and answer times), `LoadResult` (a run: latency mean/p50/p90/p99/max, throughput,
goodput, send lag, JSON), per-step summaries and the peak load of a stepping run.

Times are `time.perf_counter()` seconds relative to the run's start; the run's wall-clock start
is `LoadResult.started_at`.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["Floats", "LoadResult", "QueryRecord", "jsonable", "peak_load", "step_summaries"]

Floats = Sequence[float] | np.ndarray


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


def latency_stats(seconds: Sequence[float] | np.ndarray, scale: float = 1e3) -> dict[str, float | None]:
    """mean, p50, p90, p99 and max of latencies given in seconds, times `scale` (ms by default; 1e6:
    us); None each where there is none. The one latency summary of every perf tool."""
    values = np.asarray(seconds, dtype=float)
    if values.size == 0:
        return dict.fromkeys(("mean", "p50", "p90", "p99", "max"))
    p50, p90, p99 = np.percentile(values, [50, 90, 99]) * scale
    return {"mean": float(values.mean() * scale), "p50": float(p50), "p90": float(p90), "p99": float(p99),
            "max": float(values.max() * scale)}


def latency_fields(seconds: Sequence[float] | np.ndarray, prefix: str = "latency") -> dict[str, float | None]:
    """`latency_stats` in ms as flat fields: PREFIX_mean_ms, PREFIX_p50_ms, ... PREFIX_max_ms."""
    return {f"{prefix}_{k}_ms": v for k, v in latency_stats(seconds).items()}


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
        offered and achieved send rates, send lag (ms) and the client's CPU in cores (open loop only)."""
        ok = self._ok()
        out: dict[str, Any] = {"mode": self.mode, "model": self.model, "protocol": self.protocol,
                               "queries": len(self.records), "answered": len(ok),
                               "errors": len(self.records) - len(ok), "duration_s": self.window()}
        out.update(latency_fields(self.latencies()))
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
            out.update(latency_fields(self.send_lags(), "send_lag"))
        if self.params.get("client_cpu_s") is not None and out["duration_s"] > 0:  # cores the client kept busy
            out["client_cpu_cores"] = self.params["client_cpu_s"] / out["duration_s"]
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
