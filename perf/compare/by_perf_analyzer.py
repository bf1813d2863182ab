"""DVABatch beside Triton's dynamic batcher, measured by NVIDIA's perf_analyzer (issue "faster by default").

    python -m perf.compare.by_perf_analyzer [--model bert] [--size bench] [--latency-target-ms 500]
        [--lengths rte] [--quick] [--out work/perf]
    python -m perf.compare.by_perf_analyzer --model-dir model_repository/my_model --lengths sst2

`--model-dir` takes any sliced model folder (`dvabatch slice` wrote it) instead of a zoo model. The
report also gives, for DVABatch, the share of each figure's answers that came from a row of the
batch table, and the share that took the one-stage route (the unsliced model:
`Scheduler.serve_whole_model`), so the pipeline's own part shows.

One tritonserver serves the zoo model sliced as `dvabatch slice` would (the config.pbtxt the slicer
wrote, untouched: its policy choice and settings) beside two baselines on the unsliced model, with
the same threads as each served dvabatch stage (every core, `available_cores()`):
ZeroBatch (Triton's dynamic batcher, no queue delay) and DelayBatch (the same with a queue delay
of one lone query's profiled time, the sum of the stages' batch-1 times). Every perf_analyzer run
sends the same input data: seeded queries of GLUE-like lengths (`--lengths`, default "rte"), one
entry per request. For each system:

0. a short closed-loop warm-up, not kept;
1. concurrency 1: the latency of a lone query (mean, p50, p99), the average of two rounds with the
   systems' order reversed;
2. closed loop at bs_max clients: its closed-loop peak;
3. Poisson arrivals (open loop) at each level of one grid of rates, the same for every system:
   0.3x to 1.2x (`--quick`: 0.5x to 1.2x) of the highest closed-loop peak of them all, by 0.1x,
   lowest first. Each level is the median of the plan's rounds, the systems' order alternating; a
   system stops at its first level whose p99 passes the target or whose answered throughput did
   not keep up (>= 90 % of what the generator delivered at the lowest level, see `sustained`).
   Its sustained rate is the highest level it passed. One grid and medians of alternating rounds
   keep one system's noisy peak, or one stall in one window, from deciding the ratio;
4. Poisson at 0.5x and 0.9x the better baseline's sustained rate, and bursty arrivals at 0.5x
   (Gamma gaps with a coefficient of variation of 4, one seeded schedule sent by perf_analyzer's
   `--request-intervals`): the same rates for every system, the order of the systems alternating;
   mean and p99, and each system's executions by batch size over those runs (Triton's batch
   statistics).

`--delays 500,1000,2000,4000` serves one DelayBatch per queue delay instead of the one delayed by a
lone query's profiled time; the better baseline at each figure is then the best of them all.

`--light` measures the loads most services see most of the day: each baseline is served twice, its
onnxruntime threads sleeping between runs (the runtime's setting) and spinning (onnxruntime's own
default, what a user's model does), and the better baseline at each figure is the faster of all of
them; the baselines alone step to their sustained rate (p99 <= 100 ms, one round a step); the fixed loads are Poisson
at 0.25x, 0.5x and 0.9x of it; 5 rounds each of concurrency 1, the closed-loop sweep and the fixed
loads, every round reported, the median deciding; targets: concurrency-1 mean within +0.1 ms, at
0.25x and 0.5x mean and p99 <= 1.0x, closed loop >= 0.95x at every point (results: light.json).

The report gives DVABatch's ratios against the better baseline for each figure (the lower latency,
the higher sustained rate) beside the targets: concurrency-1 mean within +0.3 ms; at 0.5x mean
<= 1.0x and p99 <= 0.8x; at 0.9x both <= 0.5x; sustained rate >= 1.5x. Every request must succeed:
Triton's own statistics (`/v2/models/NAME/stats`, fail count) are read after the runs; a failure
makes the command exit 1. Defaults take about 6-12 minutes at the "bench" size on 2 cores (plus
slicing, once); `--quick` about two. Results: OUT/perf_analyzer_side_by_side/MODEL/SIZE/results.json,
and beside it latency.png (`--light`: light_latency.png; `perf.compare.plot`): each system's mean and
p99 at the fixed Poisson loads (the bursty one is left out: it shares 0.5x's rate) and its lone query.
On stderr, the progress of the steps, with the time left once the fixed loads (loads x rounds x
systems) are all that is left: the stepping's length is not known before it ends.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import re
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dvabatch_backend.runtime.engine import available_cores
from dvabatch_backend.tools.progress import StepProgress
from perf.compare.plot import Curve, LoadPoint, plot_latency, written_line
from perf.load.arrivals import gamma
from perf.load.drivers import alternating
from perf.load.perf_analyzer import (PerfAnalyzerError, PerfResult, PerfRow, run_perf_analyzer, write_input_data,
                                     write_request_intervals)

DEFAULT_OUT = Path(__file__).resolve().parents[2] / "work" / "perf"
LATENCY_TARGET_MS = 500.0
KEEP_UP = 0.9  # answered throughput / sent rate for a step to count as sustained
RATE_FRACTIONS = (0.3, 1.2, 0.1)  # start, end, step: fractions of the highest closed-loop peak
QUICK_RATE_FRACTIONS = (0.5, 1.2, 0.1)
MEASUREMENT_INTERVAL_MS = 3000
QUICK_MEASUREMENT_INTERVAL_MS = 1000
WINDOWS = 3  # perf_analyzer judges a level over 3 windows; -r 3 with a huge -s: exactly 3 per level
INPUT_QUERIES = 200
LOAD_ROUNDS = 3  # concurrency 1, the closed-loop sweep, the fixed loads: each a median of this many rounds
CONCURRENCIES = (1, 2, 4, 8, 16)  # closed-loop throughput at each (capped at bs_max)
FIXED_LOAD_WINDOWS_X = 2  # the fixed rates get windows this many times longer: more queries for a p99
# DVABatch against the better baseline (issue "faster by default"): c=1 mean difference (ms), and ratios
TARGETS = {"c1_mean_plus_ms": 0.1, "0.5x mean": 0.95, "0.5x p99": 0.8, "0.9x mean": 0.7, "0.9x p99": 0.5,
           "0.5x gamma4 mean": 1.0, "0.5x gamma4 p99": 1.0, "sustained": 1.5, "closed loop": 1.0}
DVA, ZERO, DELAY = "DVABatch", "ZeroBatch", "DelayBatch"
# `--overhead`: where a query's time goes in the served path, beside ZeroBatch (which returns its answers
# from `execute`): the same model answering through the response sender inside `execute`, or from one
# worker thread; and an echo model (no engine: the least a Python-backend model pays here)
ZERO_SENDER, ZERO_THREAD, ECHO = "ZeroBatch-sender", "ZeroBatch-thread", "Echo"
# and DVABatch with the fast path off: the pipeline's own figures, and its stub's memory without the
# unsliced model beside the stages
PIPELINE_ONLY = "DVABatch-pipeline"
# `--sliced DIR`: the same model sliced another way (say `dvabatch slice --stages 2` where the slicer chose
# one stage), served beside and measured as DVABatch is, so the pipeline's own standing shows
SLICED = "DVABatch-sliced"
OVERHEAD = {ZERO_SENDER: "sender", ZERO_THREAD: "thread", ECHO: "echo", PIPELINE_ONLY: "pipeline"}


# `--spinning`: each baseline also served with onnxruntime's threads spin-waiting for work (onnxruntime's
# own default, what a user's ZeroBatch does unless told otherwise), labelled with this suffix
SPIN = "-spin"


def is_baseline(label: str) -> bool:
    """ZeroBatch, or a DelayBatch ("DelayBatch", or "DelayBatch-2ms" from `--delays`), either with
    its threads spinning ("ZeroBatch-spin")."""
    label = label.removesuffix(SPIN)
    return label == ZERO or label == DELAY or label.startswith(f"{DELAY}-")


@dataclass(frozen=True)
class FixedLoad:
    """One fixed open-loop load: `fraction` of the better baseline's sustained rate, with Poisson
    arrivals (`cv` 1) or bursty Gamma ones (`cv` > 1: gaps with that coefficient of variation, the
    same seeded schedule for every system, sent by perf_analyzer's `--request-intervals`)."""

    fraction: float
    cv: float = 1.0

    @property
    def key(self) -> str:
        return f"{self.fraction:g}x" if self.cv == 1 else f"{self.fraction:g}x gamma{self.cv:g}"


FIXED_LOADS = (FixedLoad(0.5), FixedLoad(0.9), FixedLoad(0.5, cv=4.0))
# `--light` (issue "never slower than Triton's batcher when load is light"): the loads most services
# see most of the day, against the better baseline with its threads spinning or not, whichever is faster
LIGHT_LOADS = (FixedLoad(0.25), FixedLoad(0.5), FixedLoad(0.9))
LIGHT_TARGETS = {"c1_mean_plus_ms": 0.1, "0.25x mean": 1.0, "0.25x p99": 1.0, "0.5x mean": 1.0, "0.5x p99": 1.0,
                 "closed loop": 0.95}
LIGHT_ROUNDS, LIGHT_LATENCY_TARGET_MS, LIGHT_INTERVAL_MS = 5, 100.0, 1500
LIGHT_STEP_ROUNDS = 1  # the baselines' steps to their sustained rate: what the loads are fractions of, not a figure
GAMMA_SEED, GAMMA_SENDS = 0, 20_000  # perf_analyzer loops the schedule past its end


def loads_and_targets(light: bool) -> tuple[tuple[FixedLoad, ...], dict[str, float]]:
    """The fixed loads and the targets of a plan: `--light`'s, or the default's."""
    return (LIGHT_LOADS, LIGHT_TARGETS) if light else (FIXED_LOADS, TARGETS)


@dataclass(frozen=True)
class Plan:
    """How long and how far each measurement goes."""

    measurement_interval_ms: int
    rate_fractions: tuple[float, float, float]
    latency_target_ms: float
    load_rounds: int = LOAD_ROUNDS
    closed_loop_sweep: bool = True  # the closed-loop throughput at each of CONCURRENCIES clients
    light: bool = False  # `--light`: LIGHT_LOADS and LIGHT_TARGETS; the baselines alone step to their sustained rate

    @property
    def fixed_loads(self) -> tuple[FixedLoad, ...]:
        return loads_and_targets(self.light)[0]

    @classmethod
    def for_args(cls, quick: bool, latency_target_ms: float, interval_ms: int | None = None,
                 rounds: int | None = None, closed_loop_sweep: bool = True, rate_step: float | None = None,
                 light: bool = False) -> Plan:
        default = QUICK_MEASUREMENT_INTERVAL_MS if quick else LIGHT_INTERVAL_MS if light else MEASUREMENT_INTERVAL_MS
        start, end, step = QUICK_RATE_FRACTIONS if quick else RATE_FRACTIONS
        return cls(interval_ms or default, (start, end, rate_step or step), latency_target_ms,
                   rounds or (1 if quick else LIGHT_ROUNDS if light else LOAD_ROUNDS), closed_loop_sweep, light)

    def rates(self, peak: float) -> list[float]:
        """The grid of Poisson rates (requests/s, whole numbers, at least 1, no repeats) over `peak`."""
        start, end, step = self.rate_fractions
        fractions = np.arange(start, end + step / 2, step)
        return sorted({max(1.0, float(round(f * peak))) for f in fractions})


@dataclass
class SystemResult:
    """One system's figures (latencies in ms, rates and throughputs in requests/s)."""

    label: str
    model: str
    c1_mean_ms: float | None = None
    c1_p50_ms: float | None = None
    c1_p99_ms: float | None = None
    closed_loop_peak: float | None = None
    closed_loop: dict[str, float] = field(default_factory=dict)  # clients -> throughput (requests/s)
    c1_mean_spread_ms: tuple[float, float] | None = None  # the rounds' lowest and highest mean
    c1_rounds: list[dict[str, float]] = field(default_factory=list)  # every round's mean, p50, p99 (ms)
    closed_loop_rounds: dict[str, list[float]] = field(default_factory=dict)  # clients -> every round's requests/s
    sustained_rate: float | None = None
    sustained_p99_ms: float | None = None
    steps: list[dict[str, float]] = field(default_factory=list)
    # "0.5x" -> rate, and the rounds' medians of throughput, mean_ms, p99_ms, with mean_spread/p99_spread (min, max)
    loads: dict[str, dict[str, Any]] = field(default_factory=dict)
    load_rounds: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    # DVABatch (and DVABatch-sliced): the share of each figure's answers from a row of the batch
    # table, and the share that ran the unsliced model (the one-stage route)
    table_share: dict[str, float] = field(default_factory=dict)
    whole_model_share: dict[str, float] = field(default_factory=dict)
    # each fixed load's executions by batch size (Triton's batch_stats, over the load's rounds)
    batch_histograms: dict[str, dict[str, int]] = field(default_factory=dict)
    stub_rss_mb: float | None = None  # its Python-backend stub's resident memory after the runs
    succeeded: int = 0  # Triton's statistics after every run
    failed: int = 0
    refused: int = 0  # refused by the model's admission (dvabatch_refused_queries_total): overload answered
    refused_levels: list[str] = field(default_factory=list)  # the runs whose only errors were those refusals
    perf_analyzer_errors: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------
# the repository


def delay_batch_delay_us(manifest: Any) -> int:
    """DelayBatch's queue delay: one lone query's profiled time (the stages' batch-1 times summed)."""
    times = manifest.stage_times()
    return max(100, round(sum(t[min(t)] for t in times) * 1e6)) if times else 1000


def build_repository(scratch: Path, model_dir: Path, delay_batch_too: bool = True,
                     overhead: bool = False, delays_us: Sequence[int] = (),
                     sliced: Path | None = None, spinning: bool = False) -> dict[str, str]:
    """scratch/NAME (the slicer's config.pbtxt as written, its version folder linked),
    scratch/NAME_zerobatch and scratch/NAME_delaybatch (with `delays_us`, one DelayBatch per delay
    instead, labelled "DelayBatch-0.5ms" ...; with `overhead` the `OVERHEAD` variants of
    ZeroBatch; with `sliced` that folder as NAME_sliced; with `spinning` each baseline twice, the
    second with onnxruntime's threads spinning, labelled "...-spin"); returns {label: model name}."""
    from dvabatch_backend.runtime.manifest import Manifest
    from perf.baselines import add_baseline, delay_batch, zero_batch
    from slicer.triton_files import add_model_copy

    version_dir = (model_dir / "1").resolve()
    manifest = Manifest.load(version_dir / "manifest.json")
    names = {DVA: manifest.name, ZERO: f"{manifest.name}_zerobatch"}
    add_model_copy(scratch, model_dir, manifest.name)
    if sliced is not None:
        names[SLICED] = f"{manifest.name}_sliced"
        add_model_copy(scratch, sliced, names[SLICED])
    zero_batch(scratch, version_dir, names[ZERO], threads=available_cores(), bs_max=manifest.max_batch_size)
    delays = {f"{DELAY}-{d / 1000:g}ms": d for d in delays_us} or (
        {DELAY: delay_batch_delay_us(manifest)} if delay_batch_too else {})
    for label, delay in delays.items():
        names[label] = f"{manifest.name}_delaybatch" + (f"_{delay}us" if delays_us else "")
        delay_batch(scratch, version_dir, delay, names[label], threads=available_cores(),
                    bs_max=manifest.max_batch_size)
    if overhead:
        for label, respond in OVERHEAD.items():
            names[label] = f"{manifest.name}_{respond}"
            if label == PIPELINE_ONLY:
                add_model_copy(scratch, model_dir, names[label], {"fast_path": "false"})
                continue
            add_baseline(scratch, version_dir, names[label], 0, threads=available_cores(),
                         bs_max=manifest.max_batch_size, respond=respond)
    if spinning:
        for label in [label for label in names if is_baseline(label)]:
            delay = 0 if label == ZERO else delays.get(label, 0)
            names[label + SPIN] = names[label] + "_spin"
            add_baseline(scratch, version_dir, names[label + SPIN], delay, threads=available_cores(),
                         bs_max=manifest.max_batch_size, spinning=True)
    return names


def write_queries(path: Path, model_dir: Path, int_high: dict[str, int], preset: str, n: int = INPUT_QUERIES,
                  seed: int = 0) -> Path:
    from dvabatch_backend.runtime.manifest import Manifest
    from perf.baselines.bench import sample_queries

    manifest = Manifest.load(model_dir / "1" / "manifest.json")
    queries, _ = sample_queries(manifest, {**int_high, **manifest.input_bounds}, n, seed, preset)
    return write_input_data(path, queries)


# ----------------------------------------------------------------------------------------------
# measuring


def model_stats(http_url: str, model: str) -> list[dict[str, Any]]:
    """Triton's statistics of `model` (`/v2/models/NAME/stats`), one entry per version."""
    with urllib.request.urlopen(f"http://{http_url}/v2/models/{model}/stats", timeout=10) as response:
        return json.loads(response.read())["model_stats"]


def failure_counts(http_url: str, model: str) -> tuple[int, int]:
    """(succeeded, failed) inference requests of `model` so far, from Triton's statistics."""
    stats = model_stats(http_url, model)
    inference = [s["inference_stats"] for s in stats]
    return (sum(int(s["success"]["count"]) for s in inference), sum(int(s["fail"]["count"]) for s in inference))


def batch_counts(http_url: str, model: str) -> dict[int, int]:
    """Executions of `model` so far by the number of requests Triton handed each (its statistics'
    batch_stats). For the baselines that is the batch the engine ran; for DVABatch on the fast path
    (one buffer pair) it is the rows its `execute` ran inline, in the batches its policy made."""
    counts: dict[int, int] = {}
    for entry in (b for s in model_stats(http_url, model) for b in s.get("batch_stats", [])):
        size = int(entry["batch_size"])
        counts[size] = counts.get(size, 0) + int(entry["compute_infer"]["count"])
    return counts


def histogram_delta(after: dict[int, int], before: dict[int, int]) -> dict[str, int]:
    """Executions by batch size between two `batch_counts` readings (keys as strings, for JSON)."""
    return {str(size): n - before.get(size, 0) for size, n in sorted(after.items()) if n > before.get(size, 0)}


def stub_pid(server: Any, model: str) -> int:
    """The pid of the Python-backend stub serving `model` (its command line names the model's folder)."""
    import psutil

    for child in psutil.Process(server.pid).children() if server.pid else []:
        try:
            command = " ".join(child.cmdline()) + " "
        except psutil.Error:
            continue
        if f"/{model}/" in command:
            return child.pid
    raise LookupError(f"no stub serving {model!r} under tritonserver {server.pid}")


def stub_rss_mb(server: Any, model: str) -> float | None:
    """Resident memory (MiB) of the stub serving `model`, or None if it is not found."""
    import psutil

    try:
        return round(psutil.Process(stub_pid(server, model)).memory_info().rss / 2**20, 1)
    except (LookupError, psutil.Error):
        return None


TABLE_QUERIES, WHOLE_MODEL_QUERIES = "dvabatch_table_answered_queries_total", "dvabatch_whole_model_queries_total"


def counter_totals(metrics_url: str, model: str, names: Sequence[str]) -> list[float]:
    """The model's totals of each counter in `names` (0 for one it lacks: the baselines)."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    return [sum(float(m.group(1)) for m in re.finditer(
        rf'^{name}{{[^}}]*model="{re.escape(model)}"[^}}]*}} ([0-9.e+-]+)$', text, re.M)) for name in names]


class TableShare:
    """Counts, around one measurement, the shares of a DVABatch model's answers (the slicer's config,
    and `--sliced`'s) from a row of the batch table, and by the unsliced model."""

    METRICS_PERIOD_S = 0.6  # the adapter samples its counters every 0.25 s: wait for the last sample

    def __init__(self, server: Any, system: SystemResult) -> None:
        self._server, self._system = server, system

    def __call__(self, key: str, measure: Any) -> None:
        if self._system.label not in (DVA, SLICED):
            measure()
            return
        names = (TABLE_QUERIES, WHOLE_MODEL_QUERIES)
        before = counter_totals(self._server.metrics_url, self._system.model, names)
        answered_before = failure_counts(self._server.http_url, self._system.model)[0]
        measure()
        time.sleep(self.METRICS_PERIOD_S)
        tabled, whole = (after - b for after, b in
                         zip(counter_totals(self._server.metrics_url, self._system.model, names), before))
        answered = failure_counts(self._server.http_url, self._system.model)[0] - answered_before
        if answered > 0:
            self._system.table_share[key] = round(tabled / answered, 3)
            self._system.whole_model_share[key] = round(whole / answered, 3)


def _run(url: str, model: str, data: Path, plan: Plan, windows_x: int = 1, **load: Any) -> PerfResult:
    interval_ms = plan.measurement_interval_ms * windows_x
    windows_s = WINDOWS * interval_ms / 1000
    return run_perf_analyzer(model, url, protocol="grpc", input_data=data,
                             measurement_interval_ms=interval_ms, stability_percentage=1000.0,
                             max_trials=WINDOWS, timeout=max(120.0, 40 * windows_s), **load)


# how the model words a refusal under overload (admission.py): perf_analyzer stops at the first, and
# the run is the system's answer to more than it serves, not an error of the measurement
REFUSAL = "Exceeds maximum queue size"


def _note_errors(result: PerfResult, system: SystemResult, what: str, allow_missing: bool = False) -> None:
    """A perf_analyzer run that exited badly or left levels out (unless a latency stop explains it:
    then even no level at all is an answer, the lowest rate was already past the target). A run
    whose only errors are the model's refusals is noted as refused."""
    text = result.stdout_tail + result.stderr_tail
    latency_stop = allow_missing and "went over the set limit" in text
    errors = re.findall(r"had error: (.*)", text)
    if result.returncode != 0 and errors and all(REFUSAL in e for e in errors):
        system.refused_levels.append(what)
        return
    if result.returncode != 0 or (not result.rows and not latency_stop) or (result.missing_levels and not allow_missing):
        tail = (result.stderr_tail or result.stdout_tail).strip().splitlines()[-3:]
        system.perf_analyzer_errors.append(f"{what}: {result.describe().splitlines()[0]}: {' | '.join(tail)}")


def warm_up(url: str, system: SystemResult, data: Path, plan: Plan, bs_max: int) -> None:
    """One short closed-loop run at bs_max clients, not kept: the engines meet their first batch
    sizes and lengths (onnxruntime plans memory per new shape) before anything is measured."""
    short = dataclasses.replace(plan, measurement_interval_ms=max(300, plan.measurement_interval_ms // 4))
    # its result is not looked at: a window too short for a slow system's first answers is no error
    # here, and a failed request is still counted, by Triton's statistics at the end
    _run(url, system.model, data, short, concurrency_range=(bs_max,))


def measure_lone(url: str, systems: Sequence[SystemResult], data: Path, plan: Plan) -> None:
    """Concurrency 1, the plan's rounds with the systems' order reversed each round; the figures
    are the rounds' medians, with the means' spread (one lone query's latency moves with whatever
    else the machine does)."""
    figures: dict[str, list[tuple[float, float, float]]] = {s.label: [] for s in systems}
    for r in range(plan.load_rounds):
        for system in alternating(systems, r):
            lone = _run(url, system.model, data, plan, concurrency_range=(1,))
            _note_errors(lone, system, "concurrency 1")
            if lone.rows:
                row = lone.rows[0]
                figures[system.label].append((row.avg_us / 1e3, row.p50_us / 1e3, row.p99_us / 1e3))
                system.c1_rounds.append({"round": r + 1, "mean_ms": row.avg_us / 1e3, "p50_ms": row.p50_us / 1e3,
                                         "p99_ms": row.p99_us / 1e3})
    for system in systems:
        if figures[system.label]:
            system.c1_mean_ms, system.c1_p50_ms, system.c1_p99_ms = (
                round(float(np.median(column)), 3) for column in zip(*figures[system.label]))
            means = [f[0] for f in figures[system.label]]
            system.c1_mean_spread_ms = (round(min(means), 3), round(max(means), 3))


def measure_closed_loop(url: str, systems: Sequence[SystemResult], data: Path, plan: Plan, bs_max: int) -> None:
    """Closed-loop throughput at each of CONCURRENCIES clients (up to bs_max): the median of the
    plan's rounds (one window moves by a fifth here), the systems' order alternating."""
    for i, clients in enumerate(c for c in CONCURRENCIES if c <= bs_max):
        for r in range(plan.load_rounds):
            for system in alternating(systems, i + r):
                result = _run(url, system.model, data, plan, concurrency_range=(clients,))
                _note_errors(result, system, f"concurrency {clients}")
                if result.rows:
                    rounds = system.closed_loop_rounds.setdefault(str(clients), [])
                    rounds.append(result.rows[0].throughput)
                    system.closed_loop[str(clients)] = round(float(np.median(rounds)), 1)


def measure_peak(url: str, system: SystemResult, data: Path, plan: Plan, bs_max: int) -> None:
    full = _run(url, system.model, data, plan, concurrency_range=(bs_max,))
    _note_errors(full, system, f"concurrency {bs_max}")
    if full.rows:
        system.closed_loop_peak = full.rows[0].throughput


def sustained(rows: Sequence[PerfRow], latency_target_ms: float) -> PerfRow | None:
    """The highest rate whose p99 is within the target and whose throughput kept up with it.

    perf_analyzer's Poisson generator reports fewer answers per second than the rate it was given
    even from a system far from saturation (about 0.75x of 18/s on 2 cores, the same for every
    system), so "kept up" is judged against what the generator delivered at the lowest step (the
    system there far from its peak): throughput >= KEEP_UP x rate x that step's throughput/rate."""
    if not rows:
        return None
    lowest = min(rows, key=lambda r: r.level)
    delivered = min(1.0, lowest.throughput / lowest.level) if lowest.level > 0 else 1.0
    good = [r for r in rows
            if r.p99_us / 1e3 <= latency_target_ms and r.throughput >= KEEP_UP * delivered * r.level]
    return max(good, key=lambda r: r.level, default=None)


def median_row(rows: Sequence[PerfRow]) -> PerfRow:
    """One level's rounds as one row: the median of each figure."""
    def median(figure: str) -> float:
        return float(np.median([getattr(r, figure) for r in rows]))

    return dataclasses.replace(rows[0], throughput=median("throughput"), p50_us=median("p50_us"),
                               p90_us=median("p90_us"), p95_us=median("p95_us"), p99_us=median("p99_us"),
                               avg_us=median("avg_us"))


def measure_sustained(url: str, systems: Sequence[SystemResult], data: Path, plan: Plan, rates: Sequence[float],
                      progress: Any = print, step_rounds: int | None = None) -> None:
    """Poisson at each of `rates` (one grid for every system), lowest first, each level the median of
    the plan's rounds (or `step_rounds`) with the systems' order alternating; a system stops at its first level past the
    target or not kept up (`sustained`; perf_analyzer never stable there, past its timeout, too). Fills each system's `steps` and sustained rate."""
    levels: dict[str, list[PerfRow]] = {s.label: [] for s in systems}
    active = list(systems)
    for i, rate in enumerate(rates):
        rounds: dict[str, list[PerfRow]] = {s.label: [] for s in active}
        for r in range(step_rounds or plan.load_rounds):
            for system in alternating(active, i + r):
                progress(f"{system.label}: Poisson at {rate:g}/s, round {r + 1}")
                try:
                    result = _run(url, system.model, data, plan, async_mode=True, **arrivals(rate, None))
                except PerfAnalyzerError as exc:  # never stable at this level (it fell behind): its last level
                    progress(f"{system.label}: Poisson at {rate:g}/s not kept up: {str(exc).splitlines()[0]}")
                    continue
                _note_errors(result, system, f"request rate {rate:g}")
                rounds[system.label] += result.rows[:1]
        for system in list(active):
            if not rounds[system.label]:
                active.remove(system)
                continue
            row = median_row(rounds[system.label])
            levels[system.label].append(row)
            system.steps.append({"rate": rate, "throughput": row.throughput, "p50_ms": row.p50_us / 1e3,
                                 "p99_ms": row.p99_us / 1e3, "rounds": len(rounds[system.label])})
            best = sustained(levels[system.label], plan.latency_target_ms)
            if best is None or best.level != rate:  # past the target, or fell behind: its last level
                active.remove(system)
            else:
                system.sustained_rate, system.sustained_p99_ms = rate, row.p99_us / 1e3
        if not active:
            break


def arrivals(rate: float, intervals: Path | None) -> dict[str, Any]:
    """perf_analyzer's load arguments for Poisson at `rate`, or for the schedule in `intervals`."""
    if intervals is not None:
        return {"request_intervals": intervals}
    return {"request_rate_range": (rate,), "request_distribution": "poisson"}


def write_gamma_intervals(path: Path, rate: float, cv: float) -> Path:
    """The seeded Gamma schedule at `rate` with coefficient of variation `cv`, as a --request-intervals file."""
    return write_request_intervals(path, gamma(rate, cv, GAMMA_SENDS, rng=GAMMA_SEED))


def measure_fixed_load(url: str, system: SystemResult, data: Path, plan: Plan, key: str, rate: float,
                       http_url: str | None = None, intervals: Path | None = None) -> None:
    """One fixed load, longer windows: Poisson at `rate`, or the schedule in `intervals` (its mean
    rate `rate`); one round's mean and p99 (no latency stop: the figure is wanted);
    `system.loads[key]` holds the medians of the rounds so far, with their spread; with
    `http_url`, `system.batch_histograms[key]` the executions by batch size over its rounds."""
    before = batch_counts(http_url, system.model) if http_url else {}
    result = _run(url, system.model, data, plan, windows_x=FIXED_LOAD_WINDOWS_X, async_mode=True,
                  **arrivals(rate, intervals))
    if http_url:
        seen = system.batch_histograms.setdefault(key, {})
        for size, n in histogram_delta(batch_counts(http_url, system.model), before).items():
            seen[size] = seen.get(size, 0) + n
    _note_errors(result, system, f"request rate {rate:g}")
    if result.rows:
        row = result.rows[0]
        rounds = system.load_rounds.setdefault(key, [])
        rounds.append({"throughput": row.throughput, "mean_ms": row.avg_us / 1e3, "p99_ms": row.p99_us / 1e3})
        summary: dict[str, Any] = {"rate": rate, "rounds": len(rounds)}
        for stat in ("throughput", "mean_ms", "p99_ms"):
            values = [r[stat] for r in rounds]
            summary[stat] = round(float(np.median(values)), 3)
            if stat != "throughput":
                summary[stat.replace("_ms", "_spread")] = (round(min(values), 3), round(max(values), 3))
        system.loads[key] = summary


def fixed_rates(baselines: Sequence[SystemResult],
                loads: Sequence[FixedLoad] = FIXED_LOADS) -> tuple[dict[str, float], str]:
    """Each fixed load's rate by its key (its fraction x the better baseline's sustained rate: the
    highest of theirs), and what they are fractions of: its closed-loop peak when none sustained a step."""
    best = max(baselines, key=lambda b: b.sustained_rate or 0.0)
    base, of = best.sustained_rate, f"{best.label}'s sustained rate (the better baseline's)"
    if not base:
        best = max(baselines, key=lambda b: b.closed_loop_peak or 0.0)
        base, of = best.closed_loop_peak or 1.0, f"{best.label}'s closed-loop peak (no baseline sustained a step)"
    return {load.key: max(1.0, round(load.fraction * base, 1)) for load in loads}, of


def compare(server: Any, names: dict[str, str], data: Path, plan: Plan, bs_max: int,
            progress: Any = print) -> tuple[list[SystemResult], str]:
    """Every measurement of every system on the running server, in the module docstring's order;
    returns the systems and what the fixed rates are fractions of. `progress` is told each step as it
    begins; a `StepProgress` is also told (`expect`) how many fixed-load runs are left once the stepping
    is done."""
    systems = [SystemResult(label, model) for label, model in names.items()]
    for system in systems:
        progress(f"{system.label}: warm-up")
        warm_up(server.grpc_url, system, data, plan, bs_max)
    share = {s.label: TableShare(server, s) for s in systems}
    progress(f"concurrency 1, {plan.load_rounds} round(s)")
    lone = share.get(DVA, share[systems[0].label])  # the rounds take every system in turn
    lone("c1", lambda: measure_lone(server.grpc_url, systems, data, plan))
    main = [s for s in systems if s.label not in OVERHEAD]  # the overhead variants: c=1 and their peak only
    for system in systems:
        progress(f"{system.label}: concurrency {bs_max} (closed loop)")
        share[system.label]("closed loop", lambda: measure_peak(server.grpc_url, system, data, plan, bs_max))
    if plan.closed_loop_sweep:
        progress(f"closed loop at {', '.join(str(c) for c in CONCURRENCIES if c <= bs_max)} clients")
        share.get(DVA, share[main[0].label])("closed loop sweep",
                                             lambda: measure_closed_loop(server.grpc_url, main, data, plan, bs_max))
    overhead_systems = [s for s in systems if s.label in OVERHEAD]
    systems = main
    if not any(s.closed_loop_peak for s in systems):
        raise RuntimeError("no closed-loop peak was measured: " + "; ".join(
            e for s in systems for e in s.perf_analyzer_errors))
    grid = plan.rates(max(s.closed_loop_peak or 0.0 for s in systems))
    stepping = [s for s in systems if is_baseline(s.label)] if plan.light else systems
    progress(f"Poisson request rates {', '.join(f'{r:g}' for r in grid)}/s, {'the baselines' if plan.light else 'every system'}")
    share.get(DVA, share[systems[0].label])(
        "stepping", lambda: measure_sustained(server.grpc_url, stepping, data, plan, grid, progress,
                                              LIGHT_STEP_ROUNDS if plan.light else None))
    rates, of = fixed_rates([s for s in systems if is_baseline(s.label)] or systems[-1:], plan.fixed_loads)
    schedules = {load.key: write_gamma_intervals(data.with_name(f"intervals-{i}.txt"), rates[load.key], load.cv)
                 for i, load in enumerate(plan.fixed_loads) if load.cv != 1}
    # a StepProgress: the stepping's end was not known before it came; the fixed loads' steps are
    expect = getattr(progress, "expect", None)
    if expect is not None:
        expect(plan.load_rounds * len(plan.fixed_loads) * len(systems))
    for r in range(plan.load_rounds):
        for i, load in enumerate(plan.fixed_loads):
            key, rate = load.key, rates[load.key]
            shape = f"Gamma CV {load.cv:g}" if load.cv != 1 else "Poisson"
            for system in alternating(systems, i + r):
                progress(f"{system.label}: {shape} at {rate:g}/s ({key} {of}), round {r + 1}")
                share[system.label](key, lambda: measure_fixed_load(server.grpc_url, system, data, plan, key, rate,
                                                                    server.http_url, schedules.get(key)))
    everyone = systems + [s for s in overhead_systems]
    for system in everyone:
        system.succeeded, system.failed = failure_counts(server.http_url, system.model)
        # Triton counts a request the backend answered with an error as a success: the refusals are the model's count
        system.refused = int(counter_totals(server.metrics_url, system.model, ["dvabatch_refused_queries_total"])[0])
        system.stub_rss_mb = stub_rss_mb(server, system.model)
    return everyone, of


def spreads_overlap(mine: Sequence[float] | None, theirs: Sequence[float] | None) -> bool | None:
    """Whether two (lowest, highest) ranges of rounds overlap; None when either is unknown."""
    if not mine or not theirs:
        return None
    return mine[0] <= theirs[1] and theirs[0] <= mine[1]


def verdicts(systems: Sequence[SystemResult], light: bool = False) -> dict[str, dict[str, Any]]:
    """DVABatch against the better baseline for each figure: {figure: {value, better baseline, target, met}}.
    Latencies: the lower baseline; rates: the higher. A figure some system lacks is left out. Figures
    measured in rounds (concurrency 1, the fixed loads) also say whether DVABatch's rounds and the
    better baseline's overlap (`within_spread`; None when either has no spread): a ratio whose
    rounds overlap is within the machine's noise, whichever side of the target it falls. `light`: the
    `--light` loads and targets."""
    loads, targets = loads_and_targets(light)
    by_label = {s.label: s for s in systems}
    dva, baselines = by_label.get(DVA), [s for s in systems if is_baseline(s.label)]
    if dva is None or not baselines:
        return {}
    out: dict[str, dict[str, Any]] = {}

    def best(values: dict[str, float | None], lower: bool) -> tuple[str, float] | None:
        known = {k: v for k, v in values.items() if v is not None}
        if not known:
            return None
        label = (min if lower else max)(known, key=lambda k: known[k])
        return label, known[label]

    base = best({b.label: b.c1_mean_ms for b in baselines}, lower=True)
    if base and dva.c1_mean_ms is not None:
        diff = dva.c1_mean_ms - base[1]
        allowed = max(targets["c1_mean_plus_ms"], 0.01 * base[1])  # +0.1 ms, or +1 % past 10 ms a query
        out["c1 mean (ms over)"] = {"value": round(diff, 3), "baseline": base[0], "target": round(allowed, 3),
                                    "met": diff <= allowed, "within_spread": spreads_overlap(
                                        dva.c1_mean_spread_ms, by_label[base[0]].c1_mean_spread_ms)}
    for clients, mine in dva.closed_loop.items():
        base = best({b.label: b.closed_loop.get(clients) for b in baselines}, lower=False)
        if base and base[1] > 0:
            ratio = mine / base[1]
            out[f"closed loop c{clients}"] = {"value": round(ratio, 3), "baseline": base[0],
                                              "target": targets["closed loop"], "met": ratio >= targets["closed loop"]}
    for key in (load.key for load in loads):
        for stat in ("mean", "p99"):
            target = targets.get(f"{key} {stat}")
            base = best({b.label: b.loads.get(key, {}).get(f"{stat}_ms") for b in baselines}, lower=True)
            mine = dva.loads.get(key, {}).get(f"{stat}_ms")
            if target is not None and base is not None and mine is None and dva.refused_levels:
                # refused as overload: more than it serves, where the baseline kept up
                out[f"{key} {stat}"] = {"value": None, "baseline": base[0], "target": target, "met": False}
                continue
            if target is None or base is None or mine is None or base[1] <= 0:
                continue
            ratio = mine / base[1]
            out[f"{key} {stat}"] = {"value": round(ratio, 3), "baseline": base[0], "target": target,
                                    "met": ratio <= target, "within_spread": spreads_overlap(
                                        dva.loads[key].get(f"{stat}_spread"),
                                        by_label[base[0]].loads[key].get(f"{stat}_spread"))}
    base = best({b.label: b.sustained_rate for b in baselines}, lower=False)
    if base and dva.sustained_rate and "sustained" in targets:
        ratio = dva.sustained_rate / base[1]
        out["sustained"] = {"value": round(ratio, 3), "baseline": base[0], "target": targets["sustained"],
                            "met": ratio >= targets["sustained"]}
    return out


# ----------------------------------------------------------------------------------------------
# the report


def table(systems: Sequence[SystemResult], latency_target_ms: float, light: bool = False) -> list[str]:
    def num(value: float | None, digits: int = 1) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    def spread(pair: Any) -> str:
        return "" if not pair else f" [{pair[0]:.1f}-{pair[1]:.1f}]"

    keys = [load.key for load in loads_and_targets(light)[0]]
    lines = [f"{'system':<16} {'c=1 mean':>8} {'c=1 p99':>8} {'closed peak/s':>13} {'sustained/s':>11} "
             + " ".join(f"{k + ' mean/p99 ms':>18}" for k in keys) + f" {'ok/failed':>12}"]
    for s in systems:
        fixed = " ".join(f"{num(s.loads.get(k, {}).get('mean_ms')) + ' / ' + num(s.loads.get(k, {}).get('p99_ms')):>18}"
                         for k in keys)
        lines.append(f"{s.label:<16} {num(s.c1_mean_ms, 2):>8} {num(s.c1_p99_ms, 2):>8} {num(s.closed_loop_peak):>13} "
                     f"{num(s.sustained_rate, 0):>11} {fixed} {s.succeeded:>6}/{s.failed:<5}")
    rates = {k: next((s.loads[k]["rate"] for s in systems if k in s.loads), None) for k in keys}
    lines.append("fixed rates: " + ", ".join(f"{k} = {num(r)}/s" for k, r in rates.items()))
    for s in systems:
        if s.closed_loop:
            lines.append(f"{s.label} closed loop (clients: requests/s): "
                         + ", ".join(f"{c}: {t:.0f}" for c, t in s.closed_loop.items()))
        rounds = max((load.get("rounds", 1) for load in s.loads.values()), default=0)
        if s.c1_mean_spread_ms or rounds > 1:
            lines.append(f"{s.label} spread of rounds: c=1 mean{spread(s.c1_mean_spread_ms)} ms"
                         + "".join(f"; {k} mean{spread(s.loads.get(k, {}).get('mean_spread'))} "
                                   f"p99{spread(s.loads.get(k, {}).get('p99_spread'))} ms" for k in keys if k in s.loads))
    for s in systems:
        for key, counts in s.batch_histograms.items():
            total = sum(counts.values()) or 1
            mean = sum(int(b) * n for b, n in counts.items()) / total
            lines.append(f"{s.label} batch sizes at {key} (executions): mean {mean:.1f}; "
                         + ", ".join(f"{b}: {n}" for b, n in counts.items()))
    lines += overhead_lines(systems)
    for s in systems:
        if s.c1_rounds:
            lines.append(f"{s.label} concurrency-1 rounds (mean/p99 ms): "
                         + ", ".join(f"{r['mean_ms']:.2f}/{r['p99_ms']:.1f}" for r in s.c1_rounds))
        for key, rounds in s.load_rounds.items():
            lines.append(f"{s.label} {key} rounds (mean/p99 ms): "
                         + ", ".join(f"{r['mean_ms']:.2f}/{r['p99_ms']:.1f}" for r in rounds))
        for clients, rounds in s.closed_loop_rounds.items():
            lines.append(f"{s.label} closed loop c{clients} rounds (requests/s): " + ", ".join(f"{t:.0f}" for t in rounds))
    for figure, v in verdicts(systems, light).items():
        sign = ">=" if figure == "sustained" or figure.startswith("closed loop") else "<="
        noise: dict[bool | None, str] = {True: " (the rounds overlap: within the spread)",
                                         False: " (the rounds do not overlap)", None: ""}
        value = "refused (overload)" if v["value"] is None else f"{v['value']:g}"
        lines.append(f"DVABatch {figure}: {value} vs {v['baseline']} (target {sign} {v['target']:g}): "
                     f"{'met' if v['met'] else 'NOT met'}{noise[v.get('within_spread')]}")
    lines.append(f"sustained: the highest Poisson rate with p99 <= {latency_target_ms:g} ms and >= {KEEP_UP:.0%} of it "
                 "answered")
    for s in systems:
        if s.table_share:
            lines.append(f"{s.label} answers from a row of the batch table: "
                         + ", ".join(f"{k} {v:.0%}" for k, v in s.table_share.items()))
            lines.append(f"{s.label} answers by the unsliced model (the one-stage route): "
                         + ", ".join(f"{k} {v:.0%}" for k, v in s.whole_model_share.items()))
    for s in systems:
        steps = ", ".join(f"{st['rate']:g}/s: {st['throughput']:.0f}/s p99 {st['p99_ms']:.0f} ms" for st in s.steps)
        lines.append(f"  {s.label} steps: {steps or '-'}")
        lines += [f"  {s.label} perf_analyzer: {e}" for e in s.perf_analyzer_errors]
        if s.refused_levels:
            lines.append(f"  {s.label} refused overload ({s.refused} requests, \"{REFUSAL}\") at: {', '.join(s.refused_levels)}")
    return lines


def overhead_lines(systems: Sequence[SystemResult]) -> list[str]:
    """With `--overhead`: each variant's concurrency-1 mean and peak beside ZeroBatch's, and DVABatch's."""
    by_label = {s.label: s for s in systems}
    zero = by_label.get(ZERO)
    if zero is None or zero.c1_mean_ms is None or not any(label in by_label for label in OVERHEAD):
        return []
    lines = ["served path, concurrency-1 mean over ZeroBatch's (returns from execute) and closed-loop peak:"]
    for label in (ECHO, ZERO_SENDER, ZERO_THREAD, DVA, PIPELINE_ONLY):
        s = by_label.get(label)
        if s is not None and s.c1_mean_ms is not None:
            lines.append(f"  {label:<17} {s.c1_mean_ms:7.2f} ms ({s.c1_mean_ms - zero.c1_mean_ms:+.2f}), "
                         f"peak {s.closed_loop_peak or 0:.0f}/s, stub RSS {s.stub_rss_mb or 0:.0f} MiB")
    return lines


# ----------------------------------------------------------------------------------------------
# command line


def run(zoo_name: str, size: str, out: Path, plan: Plan, preset: str, model_dir: Path | None = None,
        overhead: bool = False, delays_us: Sequence[int] = (),
        sliced: Path | None = None) -> tuple[list[SystemResult], dict[str, Any]]:
    """Slices (or reuses OUT/sliced/SIZE/MODEL), or takes `model_dir` (any sliced model folder, as
    `dvabatch slice` wrote it), serves the systems from one server, measures them."""
    from dvabatch_backend.runtime.manifest import Manifest
    from dvabatch_backend.tools.serve import TritonServer
    from perf.baselines import bench
    from perf.load.perf_analyzer import ensure_system_deps

    ensure_system_deps()
    if model_dir is None:
        version_dir, manifest, int_high, reused = bench.sliced(zoo_name, size, out,
                                                              progress=lambda m: print(m, flush=True))
        model_dir = version_dir.parent
    else:
        manifest, int_high, reused = Manifest.load(model_dir / "1" / "manifest.json"), {}, True
        zoo_name, size = manifest.name, "own"
    progress = StepProgress("compare", sys.stderr)
    with tempfile.TemporaryDirectory(prefix="dvabatch-pa-side-by-side-") as tmp, contextlib.closing(progress):
        scratch = Path(tmp)
        names = build_repository(scratch / "repo", model_dir, overhead=overhead, delays_us=delays_us, sliced=sliced,
                                 spinning=plan.light)
        data = write_queries(scratch / "input_data.json", model_dir, int_high, preset)
        with TritonServer(scratch / "repo") as server:
            for name in names.values():
                server.wait_model_ready(name, timeout=300)
            print(f"tritonserver up; {names[DVA]} (the slicer's config) beside "
                  f"{', '.join(n for k, n in names.items() if k != DVA)} ({available_cores()} threads; "
                  f"DelayBatch's delay {', '.join(map(str, delays_us)) or delay_batch_delay_us(manifest)} us)",
                  flush=True)
            systems, fixed_of = compare(server, names, data, plan, manifest.max_batch_size, progress=progress)
    info = {"model": zoo_name, "size": size, "slice": str(model_dir), "reused_slice": reused, "lengths": preset,
            "bs_max": manifest.max_batch_size, "max_length": manifest.max_length, "plan": asdict(plan),
            "baseline_threads": available_cores(), "policy": _policy(model_dir / "config.pbtxt"),
            "delay_batch_delay_us": list(delays_us) or delay_batch_delay_us(manifest), "fixed_rates_of": fixed_of,
            "verdicts": verdicts(systems, plan.light), "sliced": str(sliced) if sliced else None,
            "stage_count": manifest.extra.get("slicing", {}).get("stage_count")}
    return systems, info


def curves(systems: Sequence[SystemResult], loads: Sequence[FixedLoad]) -> list[Curve]:
    """The figures `perf.compare.plot` draws: each system's (the `--overhead` variants left out: they
    have no loads) mean and p99 at each fixed Poisson load's rate, and its concurrency-1 mean and p99.
    The bursty loads are left out: one of them shares a Poisson load's rate, and a line through both
    would mix two kinds of arrivals."""
    poisson_loads = [load for load in loads if load.cv == 1]
    out = []
    for s in systems:
        if s.label in OVERHEAD:
            continue
        points = [LoadPoint(s.loads[load.key]["rate"], s.loads[load.key].get("mean_ms"),
                            s.loads[load.key].get("p99_ms"), load.fraction)
                  for load in poisson_loads if load.key in s.loads]
        out.append(Curve(s.label, points, lone_mean_ms=s.c1_mean_ms, lone_p99_ms=s.c1_p99_ms))
    return out


def _policy(config_pbtxt: Path) -> str:
    from slicer.model_config import parameters

    return parameters(config_pbtxt.read_text()).get("policy", "?")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.compare.by_perf_analyzer",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bert", help="a zoo model (default: %(default)s)")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="any sliced model folder (config.pbtxt and 1/), instead of a zoo model")
    parser.add_argument("--size", default="bench", help="zoo size preset (default: %(default)s)")
    parser.add_argument("--lengths", default="rte", help="perf.load.lengths preset (default: %(default)s)")
    parser.add_argument("--latency-target-ms", type=float, default=None,
                        help=f"the p99 a sustained rate keeps (default {LATENCY_TARGET_MS:g}; --light {LIGHT_LATENCY_TARGET_MS:g})")
    parser.add_argument("--measurement-interval", type=int, default=None, metavar="MS",
                        help=f"perf_analyzer's window (default {MEASUREMENT_INTERVAL_MS}, --quick "
                             f"{QUICK_MEASUREMENT_INTERVAL_MS})")
    parser.add_argument("--quick", action="store_true", help="shorter windows, fewer steps, one round of concurrency 1 and of the fixed loads")
    parser.add_argument("--rounds", type=int, default=None,
                        help=f"rounds of concurrency 1, the closed-loop sweep and the fixed loads, each figure their median "
                             f"(default {LOAD_ROUNDS}; --quick 1)")
    parser.add_argument("--sliced", type=Path, default=None, metavar="DIR",
                        help="the same model sliced another way (e.g. `dvabatch slice --stages 2`), served beside "
                             f"as {SLICED!r} and measured as DVABatch is")
    parser.add_argument("--rate-step", type=float, default=None, metavar="FRACTION",
                        help="the step of the grid of Poisson rates, a fraction of the highest closed-loop peak "
                             f"(default {RATE_FRACTIONS[2]:g}; a coarser grid measures fewer levels)")
    parser.add_argument("--no-closed-loop-sweep", action="store_true",
                        help=f"skip the closed-loop throughput at each of {CONCURRENCIES} clients")
    parser.add_argument("--overhead", action="store_true",
                        help="also serve ZeroBatch answering through its response sender and from a worker thread, "
                             "and an echo model: where a query's time goes in the served path")
    parser.add_argument("--delays", default="", metavar="US,US,...",
                        help="one DelayBatch per queue delay (microseconds), e.g. 500,1000,2000,4000; the better "
                             "baseline at each figure is the best of them and ZeroBatch (default: one DelayBatch, "
                             "delayed by a lone query's profiled time)")
    parser.add_argument("--light", action="store_true",
                        help=f"light load: concurrency 1, Poisson at {', '.join(l.key for l in LIGHT_LOADS)} the better "
                             f"baseline's sustained rate (p99 <= {LIGHT_LATENCY_TARGET_MS:g} ms unless "
                             "--latency-target-ms), the closed-loop sweep; each baseline also with onnxruntime's "
                             f"threads spinning; {LIGHT_ROUNDS} rounds, {LIGHT_INTERVAL_MS} ms windows")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="slices and results (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        delays_us = tuple(int(d) for d in args.delays.split(",") if d.strip())
    except ValueError:
        parser.error(f"--delays takes microseconds separated by commas, got {args.delays!r}")
    if args.rate_step is not None and args.rate_step <= 0:
        parser.error(f"--rate-step must be > 0, got {args.rate_step}")
    target = args.latency_target_ms or (LIGHT_LATENCY_TARGET_MS if args.light else LATENCY_TARGET_MS)
    plan = Plan.for_args(args.quick, target, args.measurement_interval, args.rounds,
                         not args.no_closed_loop_sweep, args.rate_step, args.light)
    began = time.perf_counter()
    systems, info = run(args.model, args.size, args.out, plan, args.lengths, args.model_dir, args.overhead, delays_us,
                        args.sliced)
    for line in table(systems, plan.latency_target_ms, plan.light):
        print(line)
    if info["stage_count"]:
        print(f"the slicer's choice: {info['stage_count']['chosen']} stage(s), policy {info['policy']}: "
              f"{info['stage_count']['why']}")
    results = (args.out / "perf_analyzer_side_by_side" / info["model"] / info["size"]
               / ("light.json" if plan.light else "results.json"))
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps({**info, "systems": [asdict(s) for s in systems]}, indent=2) + "\n")
    plot = results.with_name(("light_" if plan.light else "") + "latency.png")
    written = plot_latency(curves(systems, plan.fixed_loads), plot,
                           x_label="offered load: Poisson arrivals, requests/s (below: the fraction of "
                                   f"{info['fixed_rates_of']})",
                           title=f"{info['model']} ({info['size']}): mean and p99 latency, measured by perf_analyzer")
    print(written_line(written, plot))
    print(f"took {time.perf_counter() - began:.0f} s; results in {results}")
    broken = [s.label for s in systems if s.failed or s.perf_analyzer_errors or not s.succeeded]
    if broken:
        print(f"ERROR: failed requests or perf_analyzer errors for {', '.join(broken)}", file=sys.stderr)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
