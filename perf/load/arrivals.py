"""Arrival schedules for open-loop runs (perf.load.drivers.run_open_loop): send offsets in seconds
from the run's start, the first query at 0.

    offsets = poisson(rate=200, n=2000, rng=0)

Poisson, evenly spaced, Gamma with a coefficient of variation (burstiness), and the paper's §8.3
stepping load (with `stepping_rates`, the rate each query was sent at, for perf.load.stats.step_summaries).
"""
from __future__ import annotations

import math
import time
from typing import Callable, Iterator, Sequence

import numpy as np

__all__ = ["RngLike", "constant", "gamma", "paced", "poisson", "stepping", "stepping_rates"]

RngLike = np.random.Generator | int | None


def paced(offsets: Sequence[float], order: Sequence[int] | None = None,
          on_start: Callable[[float], None] | None = None) -> Iterator[int]:
    """The indices of `offsets` (in `order`, default as given), each yielded at its send time: the
    clock starts at the first step (`on_start(t0)`, t0 from `time.perf_counter`), and query i is
    yielded once `t0 + offsets[i]` has come (time.sleep: sub-ms precise). The one send loop of every
    open-loop tool: what to send at each time is the caller's."""
    t0 = time.perf_counter()
    if on_start is not None:
        on_start(t0)
    for i in (range(len(offsets)) if order is None else order):
        delay = t0 + float(offsets[i]) - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        yield i


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
