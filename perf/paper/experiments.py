"""The paper's experiments (§8) reproduced on this machine: DVABatch side by side with the baselines
every Triton user has (ZeroBatch, DelayBatch), each model's systems served by one tritonserver
(`perf.baselines.bench.Bench`), every figure a ratio of runs made in one invocation.

    python -m perf.paper.experiments EXPERIMENT [--models bert,minilm] [--size bench] [--out perf/results]

| experiment | measures (paper figure) |
|---|---|
| figure14 | mean and p99 latency at 1/4, 3/5, 9/10 of ZeroBatch's peak (Figures 14 and 16); the limit: DVABatch's closed-loop peak against the padding-free compute bound |
| figure15 | a stepping load: every query's latency, and each system's peak load under the latency target (Figure 15) |
| figure18 | split only: DVABatch, DVABatch-split (the operator policy alone) and DelayBatch (Figure 18) |
| figure19 | 1 to 4 buffer pairs at 9/10 of ZeroBatch's peak (Figure 19) |
| figure20 | 1 to 4 stages: closed-loop peak throughput and its mean latency (Figure 20) |
| figure21 | closed loop at concurrency 1, no batch window: DVABatch's overhead over ZeroBatch (Figure 21) |
| all | all of them, one after another |

Each writes OUT/EXPERIMENT/results.json, report.md (ratios against both baselines) and a PNG plot.
Open-loop runs send the same seeded Poisson schedule and the same seeded queries (lengths from the
GLUE-like preset `perf.baselines.bench.LENGTH_PRESET`) to every system, the order rotating per load level.
The default size is the zoo's "bench" preset, chosen so that each experiment takes minutes here.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from dvabatch_backend.runtime.settings import EVERY_CORE
from perf.baselines.bench import LENGTH_PRESET, Bench, System, slug as _slug
from perf.load.drivers import alternating
from perf.load.stats import jsonable, latency_fields

__all__ = ["DEFAULT_FRACTIONS", "DEFAULT_MODELS", "DEFAULT_POLICIES", "EXPERIMENTS", "DVA", "SYSTEMS",
           "ExperimentSettings", "compute_bound", "figure14", "figure15", "figure18", "figure19", "figure20",
           "figure21", "main", "ratios", "report_markdown", "write_report"]

ZERO, DELAY, DVA = "ZeroBatch", "DelayBatch", "DVABatch"
SYSTEMS = (ZERO, DELAY, DVA)
DEFAULT_FRACTIONS = (0.25, 0.6, 0.9)
DEFAULT_POLICIES = {"bert": "input", "minilm": "input", "unet": "hybrid", "linknet": "hybrid",
                    "resnet152": "load", "vgg19": "load"}
# on a CPU a batch's time grows with its size, so stage 0 at bs_max (the paper's window) outlasts a
# whole query alone; measured here, any window costs more at low load than it buys at high load
# (the in-flight cap makes queries wait, and cluster, once the pipeline is full): no window
DEFAULT_POLICY_PARAMS: dict[str, dict[str, object]] = {"bert": {"window": 0}, "minilm": {"window": 0}}
DEFAULT_MODELS = {"figure14": tuple(DEFAULT_POLICIES), "figure15": ("bert", "minilm"),
                  "figure18": ("unet", "linknet"), "figure19": ("minilm",),
                  "figure20": ("resnet152",), "figure21": tuple(DEFAULT_POLICIES)}


@dataclass(frozen=True)
class ExperimentSettings:
    size: str = "bench"
    queries: int = 200  # per open-loop run
    peak_seconds: float = 5.0  # closed-loop peak measurements
    fractions: tuple[float, ...] = DEFAULT_FRACTIONS
    delays_us: tuple[int, ...] = (0, 1000, 2000, 5000)  # DelayBatch candidates
    tune_seconds: float = 2.0
    latency_target: float = 0.5  # seconds: goodput, and the stepping load's peak (p99 within it)
    seed: int = 0
    timeout: float = 60.0
    threads: int = EVERY_CORE  # per dvabatch stage: 0, every core (the served default: the stages in turn)
    baseline_threads: int | None = None  # None: every core
    policies: Mapping[str, str] = field(default_factory=dict)  # overrides of DEFAULT_POLICIES
    policy_params: Mapping[str, Mapping[str, object]] = field(default_factory=dict)  # per model
    steps: int = 8  # stepping load: rate steps
    step_queries: int = 60  # stepping load: queries per step
    progress: bool = False

    def policy(self, model: str) -> str:
        policies = {**DEFAULT_POLICIES, **self.policies}
        if model not in policies:
            raise ValueError(f"no policy for model {model!r}: give one with --policy {model}=POLICY")
        return policies[model]

    def dva_settings(self, model: str, **overrides: Any) -> dict[str, Any]:
        settings: dict[str, Any] = {"policy": self.policy(model), "num_buffer_pairs": 2}
        params = {**DEFAULT_POLICY_PARAMS.get(model, {}), **self.policy_params.get(model, {})}
        if params:
            settings["policy_params"] = params
        return {**settings, **overrides}

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["latency_target_ms"] = out.pop("latency_target") * 1e3
        out["length_preset"] = LENGTH_PRESET
        out.pop("progress")
        return out


# ----------------------------------------------------------------------------------------------
# shared steps


@contextmanager
def _served(model: str, out_dir: Path, systems: Sequence[System], settings: ExperimentSettings,
            bar: Any) -> Iterator[Bench]:
    """The model's systems served and warmed up (one progress step), stopped on leaving."""
    with Bench(model, settings.size, out_dir, systems, threads=settings.threads,
               baseline_threads=settings.baseline_threads, delays_us=settings.delays_us,
               tune_seconds=settings.tune_seconds, seed=settings.seed, timeout=settings.timeout,
               progress=lambda text: bar.set_description(text[:60])) as bench:
        bar.update(1)
        yield bench


def _entry(bench: Bench, **extra: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {**bench.info, "names": dict(bench.names), "systems": {
        label: {"kind": s.kind, "settings": dict(s.settings), "stages": s.stages} for label, s in bench.systems.items()}}
    if bench.delay_tuning is not None:
        entry["delay_tuning"] = bench.delay_tuning
    entry.update(extra)
    return entry


def _side_by_side(model: str, settings: ExperimentSettings) -> list[System]:
    """ZeroBatch, DelayBatch and DVABatch with the model's policy."""
    return [System(ZERO, "zerobatch"), System(DELAY, "delaybatch"), System(DVA, "dvabatch", settings.dva_settings(model))]


def _peak(bench: Bench, settings: ExperimentSettings, bar: Any, label: str = ZERO) -> dict[str, Any]:
    """`label`'s closed-loop throughput at bs_max clients (one progress step); raises on errors."""
    run = bench.closed_loop(label, bench.bs_max, settings.peak_seconds)
    if run.errors() or not run.throughput() > 0:
        raise RuntimeError(f"{label}: peak measurement failed: {len(run.errors())} errors, {run.throughput()} qps")
    bar.update(1)
    return {"system": label, "throughput_qps": run.throughput(), "concurrency": bench.bs_max,
            "summary": run.summary(settings.latency_target)}


def _summary(run: Any, settings: ExperimentSettings) -> dict[str, Any]:
    summary = run.summary(settings.latency_target)
    summary["sent"] = len(run.records)
    summary["error_messages"] = sorted({str(r.error) for r in run.errors()})[:5]
    return summary


def _loads(bench: Bench, labels: Sequence[str], peak_qps: float, fractions: Sequence[float],
           settings: ExperimentSettings, bar: Any, subject: str = DVA) -> list[dict[str, Any]]:
    """Open loop at each fraction of `peak_qps`: one seeded Poisson schedule and one seeded list of
    queries per level, sent to each system in turn (the order rotating per level)."""
    from perf.load.arrivals import poisson

    levels = []
    for k, fraction in enumerate(fractions):
        rate = fraction * peak_qps
        offsets = poisson(rate, settings.queries, rng=settings.seed + 100 + k)
        queries, lengths = bench.queries(settings.queries, settings.seed + 200 + k)
        order = [labels[(k + j) % len(labels)] for j in range(len(labels))]
        level: dict[str, Any] = {"fraction": fraction, "rate_qps": rate, "order": order,
                                 "length_mean": float(np.mean(lengths)) if lengths else None, "systems": {}}
        for label in order:
            bar.set_description(f"{bench.zoo_name}: {fraction:g} x peak, {label}")
            run = bench.open_loop(label, queries, offsets, lengths, fraction=fraction)
            level["systems"][label] = _summary(run, settings)
            bar.update(1)
        level["systems"] = {label: level["systems"][label] for label in labels}
        level["ratios"] = ratios(level["systems"], subject)
        levels.append(level)
    return levels


def ratios(systems: Mapping[str, Mapping[str, Any]], subject: str = DVA) -> dict[str, float | None]:
    """The subject's latency over each other system's (mean and p99): below 1 means the subject is
    faster. Keys: SUBJECT_vs_OTHER_STAT, slugged (dvabatch_vs_zerobatch_mean)."""
    out: dict[str, float | None] = {}
    mine = systems.get(subject, {})
    for other, theirs in systems.items():
        if other == subject:
            continue
        for stat in ("mean", "p99"):
            a, b = mine.get(f"latency_{stat}_ms"), theirs.get(f"latency_{stat}_ms")
            out[f"{_slug(subject)}_vs_{_slug(other)}_{stat}"] = a / b if a is not None and b else None
    return out


def compute_bound(version_dir: Path, manifest: Any, queries: Sequence[dict], lengths: Sequence[int] | None,
                  bs_max: int, threads: int, repeats: int = 2) -> dict[str, Any]:
    """The padding-free compute bound: the unsliced model on the queries pre-sorted by length, in full
    batches of bs_max (each padded to its own longest, which sorting makes nearly equal: nearly
    padding-free), on one
    onnxruntime session with `threads` threads; queries per second of the fastest of `repeats` passes."""
    import onnxruntime as ort

    from dvabatch_backend.runtime.engine import ort_session_options

    session = ort.InferenceSession(str(Path(version_dir) / (manifest.full_model or "model.onnx")),
                                   ort_session_options(threads))
    seq_inputs = {t.name for t in manifest.inputs if t.has_seq}
    order = np.argsort(lengths, kind="stable") if lengths else np.arange(len(queries))
    batches = []
    for start in range(0, len(order), bs_max):
        group = [int(i) for i in order[start:start + bs_max]]
        longest = max(lengths[i] for i in group) if lengths else 0
        batches.append({name: np.stack([_pad(queries[i][name], longest) if name in seq_inputs else queries[i][name]
                                        for i in group]) for name in queries[group[0]]})
    session.run(None, batches[-1])  # warm
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for feeds in batches:
            session.run(None, feeds)
        best = min(best, time.perf_counter() - t0)
    return {"qps": len(queries) / best, "queries": len(queries), "batch": bs_max, "threads": threads,
            "seconds": best}


def _pad(array: np.ndarray, length: int) -> np.ndarray:
    """Zero-pad the sequence axis (axis 0 of a query without its batch dim) to `length`."""
    if array.ndim == 0 or array.shape[0] >= length:
        return array
    return np.pad(array, [(0, length - array.shape[0])] + [(0, 0)] * (array.ndim - 1))


# ----------------------------------------------------------------------------------------------
# the experiments


def figure14(models: Sequence[str], out_dir: Path, settings: ExperimentSettings) -> dict[str, Any]:
    """Figures 14/16: latency at fractions of ZeroBatch's peak, and the limit (DVABatch's closed-loop
    peak at 2 x bs_max clients over the padding-free compute bound)."""
    results = _results("figure14", settings)
    bar = _bar(len(models) * (3 + len(settings.fractions) * len(SYSTEMS)), settings.progress)
    try:
        for model in models:
            systems = _side_by_side(model, settings)
            with _served(model, out_dir, systems, settings, bar) as bench:
                peak = _peak(bench, settings, bar)
                loads = _loads(bench, SYSTEMS, peak["throughput_qps"], settings.fractions, settings, bar)
                bar.set_description(f"{model}: the limit")
                limit = _limit(bench, settings)
                bar.update(1)
                results["models"][model] = _entry(bench, policy=settings.policy(model), peak=peak, loads=loads,
                                                  limit=limit)
    finally:
        bar.close()
    return results


def _limit(bench: Bench, settings: ExperimentSettings) -> dict[str, Any]:
    queries, lengths = bench.queries(max(8 * bench.bs_max, 64), settings.seed + 300)
    version_dir, manifest, _ = bench.slices[None]
    bound = compute_bound(version_dir, manifest, queries, lengths, bench.bs_max, bench.baseline_threads)
    run = bench.closed_loop(DVA, 2 * bench.bs_max, settings.peak_seconds, pool=queries)
    return {"compute_bound": bound, "dvabatch_peak_qps": run.throughput(), "concurrency": 2 * bench.bs_max,
            "errors": len(run.errors()), "ratio": run.throughput() / bound["qps"]}


def figure15(models: Sequence[str], out_dir: Path, settings: ExperimentSettings) -> dict[str, Any]:
    """Figure 15: the same stepping load (Poisson, the rate raised every `step_queries` queries from
    1/4 of ZeroBatch's peak to 1.5x it) to each system; the peak load is the highest step whose p99
    stays within the latency target."""
    from perf.load.arrivals import stepping, stepping_rates
    from perf.load.stats import peak_load, step_summaries

    results = _results("figure15", settings)
    bar = _bar(len(models) * (2 + len(SYSTEMS)), settings.progress)
    try:
        for model in models:
            systems = _side_by_side(model, settings)
            with _served(model, out_dir, systems, settings, bar) as bench:
                peak = _peak(bench, settings, bar)
                start = 0.25 * peak["throughput_qps"]
                step = (1.5 * peak["throughput_qps"] - start) / max(settings.steps - 1, 1)
                n = settings.steps * settings.step_queries
                rates = stepping_rates(start, step, settings.step_queries, n)
                offsets = stepping(start, step, settings.step_queries, n, rng=settings.seed + 400)
                queries, lengths = bench.queries(n, settings.seed + 500)
                by_system: dict[str, Any] = {}
                for label in SYSTEMS:
                    bar.set_description(f"{model}: stepping load, {label}")
                    run = bench.open_loop(label, queries, offsets, lengths, load="stepping")
                    records = sorted(run.records, key=lambda r: r.id)
                    by_system[label] = {
                        "peak_load_qps": peak_load(run, rates, settings.latency_target),
                        "steps": step_summaries(run, rates, settings.latency_target),
                        "summary": _summary(run, settings),
                        "latency_ms": [None if r.latency is None else r.latency * 1e3 for r in records]}
                    bar.update(1)
                peaks = {label: s["peak_load_qps"] for label, s in by_system.items()}
                results["models"][model] = _entry(
                    bench, policy=settings.policy(model), peak=peak, rates_qps=[float(r) for r in rates],
                    step_queries=settings.step_queries, stepping=by_system,
                    peak_ratios={f"dvabatch_vs_{_slug(b)}": (peaks[DVA] / peaks[b] if peaks[DVA] and peaks[b] else None)
                                 for b in (ZERO, DELAY)})
    finally:
        bar.close()
    return results


def figure18(models: Sequence[str], out_dir: Path, settings: ExperimentSettings) -> dict[str, Any]:
    """Figure 18: DVABatch (its policy), DVABatch-split (only `split`: the operator policy) and
    DelayBatch, at fractions of ZeroBatch's peak."""
    split = "DVABatch-split"
    labels = (DELAY, split, DVA)
    results = _results("figure18", settings)
    bar = _bar(len(models) * (2 + len(settings.fractions) * len(labels)), settings.progress)
    try:
        for model in models:
            systems = [System(ZERO, "zerobatch"), System(DELAY, "delaybatch"),
                       System(split, "dvabatch", settings.dva_settings(model, policy="operator")),
                       System(DVA, "dvabatch", settings.dva_settings(model))]
            with _served(model, out_dir, systems, settings, bar) as bench:
                peak = _peak(bench, settings, bar)
                loads = _loads(bench, labels, peak["throughput_qps"], settings.fractions, settings, bar)
                results["models"][model] = _entry(bench, policy=settings.policy(model), peak=peak, loads=loads)
    finally:
        bar.close()
    return results


def figure19(models: Sequence[str], out_dir: Path, settings: ExperimentSettings, pairs: Sequence[int] = (1, 2, 3, 4),
             fraction: float = 0.9) -> dict[str, Any]:
    """Figure 19: DVABatch with 1 to 4 buffer pairs at `fraction` of ZeroBatch's peak."""
    labels = tuple(f"{p} pair{'s' if p > 1 else ''}" for p in pairs)
    results = _results("figure19", settings)
    bar = _bar(len(models) * (2 + len(labels)), settings.progress)
    try:
        for model in models:
            systems = [System(ZERO, "zerobatch")] + [
                System(label, "dvabatch", settings.dva_settings(model, num_buffer_pairs=p)) for label, p in zip(labels, pairs)]
            with _served(model, out_dir, systems, settings, bar) as bench:
                peak = _peak(bench, settings, bar)
                loads = _loads(bench, labels, peak["throughput_qps"], (fraction,), settings, bar, subject=labels[1])
                results["models"][model] = _entry(bench, policy=settings.policy(model), peak=peak, loads=loads)
    finally:
        bar.close()
    return results


def figure20(models: Sequence[str], out_dir: Path, settings: ExperimentSettings,
             stages: Sequence[int] = (1, 2, 3, 4)) -> dict[str, Any]:
    """Figure 20: the model sliced into 1 to 4 stages; each one's closed-loop peak throughput (2 x
    bs_max clients) and the mean latency of that run, beside ZeroBatch's."""
    labels = tuple(f"{n} stage{'s' if n > 1 else ''}" for n in stages)
    results = _results("figure20", settings)
    bar = _bar(len(models) * (1 + len(labels) + 1), settings.progress)
    try:
        for model in models:
            systems = [System(ZERO, "zerobatch")] + [
                System(label, "dvabatch", settings.dva_settings(model), stages=n) for label, n in zip(labels, stages)]
            with _served(model, out_dir, systems, settings, bar) as bench:
                pool = bench.pool(max(8 * bench.bs_max, 64), seed_offset=600)
                peaks: dict[str, Any] = {}
                for label in (ZERO, *labels):
                    bar.set_description(f"{model}: peak of {label}")
                    run = bench.closed_loop(label, 2 * bench.bs_max, settings.peak_seconds, pool=pool)
                    peaks[label] = _summary(run, settings)
                    bar.update(1)
                results["models"][model] = _entry(bench, policy=settings.policy(model), concurrency=2 * bench.bs_max,
                                                  peaks=peaks)
    finally:
        bar.close()
    return results


def figure21(models: Sequence[str], out_dir: Path, settings: ExperimentSettings, rounds: int = 3) -> dict[str, Any]:
    """Figure 21: closed loop at concurrency 1, DVABatch with no batch window against ZeroBatch, in
    `rounds` interleaved rounds of peak_seconds / rounds each; the overhead is the difference of
    the mean latencies over all rounds. Every stage runs with the baselines' threads here, so the
    figure is the cost of slicing, the runtime and the serving path, not of fewer threads."""
    labels = (ZERO, DVA)
    cores = settings.baseline_threads or os.cpu_count() or 1
    settings = replace(settings, threads=cores, baseline_threads=cores)
    results = _results("figure21", settings)
    bar = _bar(len(models) * (1 + rounds * len(labels)), settings.progress)
    try:
        for model in models:
            dva = settings.dva_settings(model)
            if dva["policy"] == "input":
                dva["policy_params"] = {**dva.get("policy_params", {}), "window": 0}
            systems = [System(ZERO, "zerobatch"), System(DVA, "dvabatch", dva)]
            with _served(model, out_dir, systems, settings, bar) as bench:
                pool = bench.pool(64, seed_offset=700)
                latencies: dict[str, list[float]] = {label: [] for label in labels}
                errors = {label: 0 for label in labels}
                for k in range(rounds):
                    for label in alternating(labels, k):
                        bar.set_description(f"{model}: concurrency 1, {label}")
                        run = bench.closed_loop(label, 1, settings.peak_seconds / rounds, pool=pool)
                        latencies[label] += [float(x) for x in run.latencies()]  # seconds
                        errors[label] += len(run.errors())
                        bar.update(1)
                stats: dict[str, dict[str, Any]] = {
                    label: {"queries": len(v), "errors": errors[label], **latency_fields(v)}
                    for label, v in latencies.items()}
                if any(s["latency_mean_ms"] is None for s in stats.values()):
                    raise RuntimeError(f"{model}: a system answered no query at concurrency 1: {errors}")
                bar.set_description(f"{model}: overhead breakdown in process")
                breakdown = overhead_breakdown(bench, pool[:16], dva)
                # medians on both sides: the in-process figures are medians
                breakdown["served_dvabatch_p50_ms"] = stats[DVA]["latency_p50_ms"]
                breakdown["served_zerobatch_p50_ms"] = stats[ZERO]["latency_p50_ms"]
                breakdown["serving_path_ms"] = ((stats[DVA]["latency_p50_ms"] - stats[ZERO]["latency_p50_ms"])
                                                - (breakdown["runtime_ms"] - breakdown["unsliced_ms"]))
                results["models"][model] = _entry(
                    bench, policy=dva["policy"], rounds=rounds, closed_loop=stats, breakdown=breakdown,
                    overhead_ms=stats[DVA]["latency_mean_ms"] - stats[ZERO]["latency_mean_ms"],
                    ratio=stats[DVA]["latency_mean_ms"] / stats[ZERO]["latency_mean_ms"])
    finally:
        bar.close()
    return results


def overhead_breakdown(bench: Bench, queries: Sequence[dict], dva_settings: Mapping[str, Any],
                       repeats: int = 20) -> dict[str, float]:
    """Where DVABatch's single-query latency goes (`perf.costs.inprocess.overhead_breakdown`: the
    unsliced model with the baselines' threads, its stages in a row and the runtime with each
    stage's threads and the served policy, built as Triton does from string parameters)."""
    from perf.costs.inprocess import overhead_breakdown as in_process
    from policies import load_policy

    version_dir, _, _ = bench.slices[None]
    params = {k: str(v) for k, v in dict(dva_settings.get("policy_params", {})).items()}
    policy = load_policy(str(dva_settings["policy"]), params, version_dir)
    return in_process(version_dir, queries, policy, pairs=int(dva_settings.get("num_buffer_pairs", 2)),
                      threads=bench.threads, unsliced_threads=bench.baseline_threads, repeats=repeats)


# in the order `all` runs them (figure21 first: it is quick and slices every model for the rest)
EXPERIMENTS: dict[str, Callable[..., dict[str, Any]]] = {
    "figure21": figure21, "figure14": figure14, "figure18": figure18, "figure15": figure15,
    "figure19": figure19, "figure20": figure20}


def _results(name: str, settings: ExperimentSettings) -> dict[str, Any]:
    return {"experiment": name, "size": settings.size, "created_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "params": settings.to_json(), "models": {}}


class _NoBar:
    def update(self, n: int = 1) -> None: ...
    def set_description(self, text: str) -> None: ...
    def close(self) -> None: ...


def _bar(total: int, enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="step", dynamic_ncols=True)


# ----------------------------------------------------------------------------------------------
# report


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def report_markdown(results: Mapping[str, Any]) -> str:
    """The experiment's tables: figures per system, and DVABatch's ratios against the others."""
    params = results.get("params", {})
    name = results.get("experiment", "")
    lines = [f"# {name} (size {results.get('size')})", "",
             f"Lengths: {params.get('length_preset')} preset; latency target {_fmt(params.get('latency_target_ms'), 0)} ms; "
             f"{params.get('queries')} queries per open-loop run; onnxruntime threads per model below. Ratios are DVABatch's latency over the other system's "
             "(< 1: DVABatch is faster).", ""]
    for model, entry in results.get("models", {}).items():
        lines += [f"## {model}", "", _model_line(entry), ""]
        lines += _MODEL_TABLES.get(name, _loads_table)(entry)
        lines.append("")
    return "\n".join(lines)


def _model_line(entry: Mapping[str, Any]) -> str:
    tuning = entry.get("delay_tuning") or {}
    parts = [f"policy `{entry.get('policy')}`", f"{entry.get('stages')} stages", f"bs_max {entry.get('bs_max')}",
             f"{entry.get('threads_per_stage') or 'every core'} thread(s) per stage, baselines {entry.get('baseline_threads')}"]
    if entry.get("peak"):
        parts.append(f"ZeroBatch peak {_fmt(entry['peak'].get('throughput_qps'))} qps")
    if tuning:
        parts.append(f"DelayBatch delay {tuning.get('best_delay_us')} µs (tuned over "
                     f"{', '.join(tuning.get('qps_by_delay_us', {}))} µs)")
    return ", ".join(parts)


def _loads_table(entry: Mapping[str, Any]) -> list[str]:
    loads = entry.get("loads", [])
    if not loads:
        return []
    subject = DVA if DVA in loads[0]["systems"] else list(loads[0]["systems"])[min(1, len(loads[0]["systems"]) - 1)]
    lines = ["| load | rate qps | system | mean ms | p50 ms | p99 ms | throughput qps | goodput qps | answered/sent "
             f"| {subject}/this mean | {subject}/this p99 |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for level in loads:
        r = level.get("ratios", {})
        for system, s in level["systems"].items():
            mean_ratio = r.get(f"{_slug(subject)}_vs_{_slug(system)}_mean")
            p99_ratio = r.get(f"{_slug(subject)}_vs_{_slug(system)}_p99")
            lines.append(
                f"| {level['fraction']:g}×peak | {_fmt(level['rate_qps'])} | {system} "
                f"| {_fmt(s.get('latency_mean_ms'), 2)} | {_fmt(s.get('latency_p50_ms'), 2)} "
                f"| {_fmt(s.get('latency_p99_ms'), 2)} | {_fmt(s.get('throughput_qps'))} "
                f"| {_fmt(s.get('goodput_qps'))} | {s.get('answered')}/{s.get('sent')} "
                f"| {_fmt(mean_ratio, 2)} | {_fmt(p99_ratio, 2)} |")
    return lines


def _figure14_tables(entry: Mapping[str, Any]) -> list[str]:
    lines = _loads_table(entry)
    limit = entry.get("limit")
    if limit:
        bound = limit["compute_bound"]
        lines += ["", f"Limit: DVABatch closed-loop peak {_fmt(limit['dvabatch_peak_qps'])} qps at "
                      f"{limit['concurrency']} clients; padding-free compute bound {_fmt(bound['qps'])} qps "
                      f"(unsliced, sorted full batches of {bound['batch']}, {bound['threads']} thread(s)); "
                      f"ratio {_fmt(limit['ratio'], 2)}."]
    return lines


def _figure15_tables(entry: Mapping[str, Any]) -> list[str]:
    lines = ["| system | peak load under target (qps) | mean ms | p99 ms | answered/sent |", "|---|---|---|---|---|"]
    for label, s in entry.get("stepping", {}).items():
        summary = s["summary"]
        lines.append(f"| {label} | {_fmt(s['peak_load_qps'])} | {_fmt(summary.get('latency_mean_ms'), 2)} "
                     f"| {_fmt(summary.get('latency_p99_ms'), 2)} | {summary.get('answered')}/{summary.get('sent')} |")
    ratios_ = entry.get("peak_ratios", {})
    lines += ["", "DVABatch's peak load over " + ", ".join(f"{k.split('_vs_')[1]}: {_fmt(v, 2)}" for k, v in ratios_.items())]
    rows = ["", "| rate qps | " + " | ".join(f"{label} p99 ms" for label in entry.get("stepping", {})) + " |",
            "|---|" + "---|" * len(entry.get("stepping", {}))]
    steps = {label: s["steps"] for label, s in entry.get("stepping", {}).items()}
    for i, step in enumerate(next(iter(steps.values()), [])):
        rows.append(f"| {_fmt(step['rate_qps'])} | " + " | ".join(_fmt(v[i].get("latency_p99_ms"), 1) for v in steps.values()) + " |")
    return lines + rows


def _figure20_tables(entry: Mapping[str, Any]) -> list[str]:
    lines = [f"Closed loop at {entry.get('concurrency')} clients.", "",
             "| system | peak qps | mean ms | p99 ms | answered/sent |", "|---|---|---|---|---|"]
    for label, s in entry.get("peaks", {}).items():
        lines.append(f"| {label} | {_fmt(s.get('throughput_qps'))} | {_fmt(s.get('latency_mean_ms'), 2)} "
                     f"| {_fmt(s.get('latency_p99_ms'), 2)} | {s.get('answered')}/{s.get('sent')} |")
    return lines


def _figure21_tables(entry: Mapping[str, Any]) -> list[str]:
    lines = ["| system | queries | mean ms | p50 ms | p99 ms |", "|---|---|---|---|---|"]
    for label, s in entry.get("closed_loop", {}).items():
        lines.append(f"| {label} | {s['queries']} | {_fmt(s['latency_mean_ms'], 3)} | {_fmt(s['latency_p50_ms'], 3)} "
                     f"| {_fmt(s['latency_p99_ms'], 3)} |")
    lines += ["", f"Overhead: DVABatch mean − ZeroBatch mean = {_fmt(entry.get('overhead_ms'), 3)} ms "
                  f"(ratio {_fmt(entry.get('ratio'), 2)})."]
    b = entry.get("breakdown")
    if b:
        lines += ["", "Where it goes (one query at a time, medians in this process): unsliced "
                  f"{_fmt(b['unsliced_ms'], 3)} ms; its stages one after another {_fmt(b['stages_in_a_row_ms'], 3)} ms "
                  f"(slicing {_fmt(b['slicing_ms'], 3)} ms); through the runtime {_fmt(b['runtime_ms'], 3)} ms "
                  f"(hand-offs {_fmt(b['handoffs_ms'], 3)} ms); the rest of the served medians' difference, "
                  f"{_fmt(b['serving_path_ms'], 3)} ms, is the serving path (responses sent through the response "
                  "sender by responder threads instead of returned by execute)."]
    return lines


_MODEL_TABLES: dict[str, Callable[[Mapping[str, Any]], list[str]]] = {
    "figure14": _figure14_tables, "figure15": _figure15_tables, "figure20": _figure20_tables,
    "figure21": _figure21_tables}


def write_report(results: Mapping[str, Any], out_dir: Path) -> dict[str, Path]:
    """OUT/results.json, OUT/report.md and OUT/EXPERIMENT.png."""
    from perf.paper.plots import plot

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "results.json", "markdown": out_dir / "report.md"}
    paths["json"].write_text(json.dumps(results, indent=2, allow_nan=False, default=jsonable) + "\n")
    paths["markdown"].write_text(report_markdown(results) + "\n")
    png = plot(results, out_dir / f"{results['experiment']}.png")
    if png is not None:
        paths["png"] = png
    return paths


# ----------------------------------------------------------------------------------------------
# CLI


def _policies(text: str | None) -> dict[str, str]:
    out = {}
    for item in (text or "").split(","):
        if item.strip():
            model, _, policy = item.partition("=")
            if not policy:
                raise argparse.ArgumentTypeError(f"--policy wants MODEL=POLICY, got {item!r}")
            out[model.strip()] = policy.strip()
    return out


def _policy_param(text: str) -> tuple[str, str, str]:
    key, _, value = text.partition("=")
    model, _, name = key.partition(".")
    if not (model and name and value):
        raise argparse.ArgumentTypeError(f"--param wants MODEL.KEY=VALUE, got {text!r}")
    return model.strip(), name.strip(), value.strip()


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.paper.experiments", description=__doc__.split("\n\n")[0])
    parser.add_argument("experiment", choices=[*EXPERIMENTS, "all"])
    parser.add_argument("--models", help="comma-separated zoo models (default: the experiment's)")
    parser.add_argument("--size", default="bench", help="zoo preset (default bench)")
    parser.add_argument("--out", type=Path, default=Path("perf/results"), help="results go to OUT/EXPERIMENT/")
    parser.add_argument("--queries", type=int, default=200, help="queries per open-loop run")
    parser.add_argument("--peak-seconds", type=float, default=5.0, help="seconds of each closed-loop measurement")
    parser.add_argument("--tune-seconds", type=float, default=2.0, help="closed-loop seconds per delay candidate")
    parser.add_argument("--delays", default="0,1000,2000,5000", help="DelayBatch candidates, µs")
    parser.add_argument("--fractions", type=_floats, default=DEFAULT_FRACTIONS, help="loads, fractions of ZeroBatch's peak")
    parser.add_argument("--policy", type=_policies, default={}, help="overrides, MODEL=POLICY[,MODEL=POLICY]")
    parser.add_argument("--param", action="append", default=[], type=_policy_param, metavar="MODEL.KEY=VALUE",
                        help="a policy parameter of a model's DVABatch, e.g. minilm.window=0 (repeatable)")
    parser.add_argument("--latency-target-ms", type=float, default=500.0)
    parser.add_argument("--steps", type=int, default=8, help="stepping load: rate steps")
    parser.add_argument("--step-queries", type=int, default=60, help="stepping load: queries per step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=EVERY_CORE,
                        help="onnxruntime threads per dvabatch stage (default 0: every core, the served default)")
    parser.add_argument("--baseline-threads", type=int, default=None, help="onnxruntime threads of the baselines "
                        "(default: every core)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    policy_params: dict[str, dict[str, object]] = {}
    for model, key, value in args.param:
        policy_params.setdefault(model, {})[key] = value
    settings = ExperimentSettings(
        size=args.size, queries=args.queries, peak_seconds=args.peak_seconds, fractions=tuple(args.fractions),
        delays_us=tuple(int(d) for d in args.delays.split(",") if d.strip()), tune_seconds=args.tune_seconds,
        latency_target=args.latency_target_ms / 1e3, seed=args.seed, threads=args.threads,
        baseline_threads=args.baseline_threads, policies=args.policy, policy_params=policy_params, steps=args.steps,
        step_queries=args.step_queries, progress=not args.no_progress)
    names = list(EXPERIMENTS) if args.experiment == "all" else [args.experiment]
    for model in [*settings.policies, *settings.policy_params]:
        if model not in DEFAULT_POLICIES:
            parser.error(f"--policy/--param: unknown model {model!r}; models are {sorted(DEFAULT_POLICIES)}")
    failed = []
    for name in names:
        models = [m.strip() for m in args.models.split(",") if m.strip()] if args.models else list(DEFAULT_MODELS[name])
        results = EXPERIMENTS[name](models, args.out, settings)
        paths = write_report(results, args.out / name)
        print(report_markdown(results))
        print("wrote " + ", ".join(str(p) for p in paths.values()), flush=True)
        failed += [(name, m) for m, e in results["models"].items() if _errors(e)]
    if failed:
        print(f"runs with errors: {failed}", file=sys.stderr)
        return 1
    return 0


def _errors(entry: Mapping[str, Any]) -> int:
    """Queries that got an error or no answer anywhere in a model's entry."""
    count = 0
    for level in entry.get("loads", []):
        count += sum(s["errors"] for s in level["systems"].values())
    count += sum(s["summary"]["errors"] for s in entry.get("stepping", {}).values())
    count += sum(s["errors"] for s in entry.get("peaks", {}).values())
    count += sum(s["errors"] for s in entry.get("closed_loop", {}).values())
    count += (entry.get("limit") or {}).get("errors", 0)
    return count


if __name__ == "__main__":
    sys.exit(main())
