"""The paper's Figure 14/16 analogue: mean and p99 latency of ZeroBatch, DelayBatch and DVABatch at
1/4, 3/5 and 9/10 of ZeroBatch's peak throughput, per zoo model, served side by side by ONE server.

    python -m perf.experiments figure14 --models bert --size test --out perf/results/fig14 [--queries 200]

Per model: build the zoo model, slice it (reused if OUT/sliced/MODEL already holds it), and register
in OUT/repository the dvabatch variant (policy "input" for bert/minilm, "hybrid" for unet/linknet,
"load" for resnet152/vgg19 unless overridden), ZeroBatch, and one DelayBatch candidate per delay.
One tritonserver serves them all. The delay is tuned (`perf.baselines.tune_delay`, closed loop at
bs_max clients), and the winning candidate is DelayBatch. ZeroBatch's peak throughput is measured
closed loop at concurrency = bs_max. Then, for each load fraction, one seeded Poisson schedule and
one seeded list of queries (sequence lengths from the "rte" preset, clipped to the model's max
length) go open loop to each of the three systems in turn (the order rotates per load level).

`figure14(...)` returns the results dict; `write_report(results, out_dir)` writes results.json and
report.md (and fig14.png when matplotlib is installed).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from perf.load import jsonable

__all__ = ["DEFAULT_FRACTIONS", "DEFAULT_POLICIES", "SYSTEMS", "figure14", "main", "ratios", "report_markdown",
           "write_report"]

SYSTEMS = ("zerobatch", "delaybatch", "dvabatch")
LABELS = {"zerobatch": "ZeroBatch", "delaybatch": "DelayBatch", "dvabatch": "DVABatch"}
DEFAULT_FRACTIONS = (0.25, 0.6, 0.9)
DEFAULT_POLICIES = {"bert": "input", "minilm": "input", "unet": "hybrid", "linknet": "hybrid",
                    "resnet152": "load", "vgg19": "load"}
DEFAULT_DELAYS_US = (0, 1000, 2000, 5000)
LENGTH_PRESET = "rte"


# ----------------------------------------------------------------------------------------------
# models


def slice_options(zoo_name: str, size: str) -> Any:
    """SliceOptions sized for the zoo preset: small and quick for "test", fuller for "real"."""
    from slicer.slice_model import SliceOptions
    from slicer.zoo import entry

    max_length = entry(zoo_name).max_length.get(size, 0)
    if size == "test":
        return SliceOptions(stages=3, max_batch_size=8, max_length=max_length or 128, repeats=3,
                            batch_sizes=(1, 2, 4, 8), lengths=(max_length,) if max_length else None,
                            calibration_rounds=1)
    return SliceOptions(stages=None, max_batch_size=32, max_length=max_length or 128, repeats=5,
                        calibration_rounds=2)


def _sliced(zoo_name: str, size: str, out_dir: Path, say: Callable[[str], None]) -> tuple[Path, Any, dict, bool]:
    """(version dir, manifest, int bounds, reused?): slices into OUT/sliced/SIZE/MODEL unless it is there."""
    from dvabatch_backend.manifest import Manifest
    from slicer.profiler import int_bounds
    from slicer.slice_model import slice_model
    from slicer.zoo import build

    model = build(zoo_name, size)
    target = out_dir / "sliced" / size / zoo_name
    version_dir = target / "1"
    if (version_dir / "manifest.json").is_file() and (version_dir / "model.onnx").is_file():
        return version_dir, Manifest.load(version_dir / "manifest.json"), int_bounds(model), True
    if target.exists():
        shutil.rmtree(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    report = slice_model(model, target, slice_options(zoo_name, size), progress=say)
    return report.out_dir / "1", report.manifest, int_bounds(model), False


def _query_maker(manifest: Any, int_high: Mapping[str, int]) -> Callable[[np.random.Generator, int], dict]:
    """query(rng, length) -> one query's arrays without the batch dim (as tests' ServedModel.query)."""
    from slicer.profiler import random_inputs

    def query(rng: np.random.Generator, length: int) -> dict[str, np.ndarray]:
        feeds = random_inputs(manifest.inputs, 1, length, rng, dict(int_high))
        for name, arr in feeds.items():
            if "mask" in name:
                arr[:] = 1
        return {k: np.ascontiguousarray(v[0]) for k, v in feeds.items()}

    return query


def _queries(manifest: Any, int_high: Mapping[str, int], n: int, seed: int) -> tuple[list[dict], list[int] | None]:
    from perf.lengths import sample_lengths

    rng = np.random.default_rng(seed)
    make = _query_maker(manifest, int_high)
    if manifest.has_seq:
        lengths = [int(x) for x in sample_lengths(LENGTH_PRESET, n, manifest.max_length, rng)]
        return [make(rng, length) for length in lengths], lengths
    return [make(rng, 0) for _ in range(n)], None


# ----------------------------------------------------------------------------------------------
# the experiment


def figure14(models: Sequence[str], size: str, policy_by_model: Mapping[str, str] | None, out_dir: Path,
             queries_per_load: int = 200, seconds_for_peak: float = 5.0, *,
             fractions: Sequence[float] = DEFAULT_FRACTIONS, delays_us: Sequence[int] = DEFAULT_DELAYS_US,
             tune_seconds: float = 2.0, latency_target: float = 0.2, seed: int = 0, timeout: float = 60.0,
             threads: int = 1, num_buffer_pairs: int = 2, policy_params: Mapping[str, Mapping[str, object]] | None = None,
             progress: bool = False) -> dict[str, Any]:
    """Run the Figure 14/16 analogue for each zoo model; returns the results dict (JSON-ready).

    `latency_target` is in seconds (goodput counts answers within it); `policy_params` per model
    go to the dvabatch variant's config. Every model gets its own repository and server (one
    server for the three systems of a model)."""
    from perf.baselines import delay_candidates, tune_delay, zero_batch
    from perf.lengths import sample_lengths
    from perf.load import poisson, run_closed_loop, run_open_loop
    from slicer.triton_files import add_model_variant
    from dvabatch_backend.serve import TritonServer

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    policies = {**DEFAULT_POLICIES, **(policy_by_model or {})}
    for name in models:
        if name not in policies:
            raise ValueError(f"no policy for model {name!r}: give one in policy_by_model")
    if not fractions or any(not 0 < f for f in fractions):
        raise ValueError(f"load fractions must be > 0, got {list(fractions)}")
    steps_per_model = 3 + len(fractions) * len(SYSTEMS)
    bar = _bar(len(models) * steps_per_model, progress)
    results: dict[str, Any] = {
        "experiment": "figure14", "size": size, "created_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "params": {"queries_per_load": queries_per_load, "seconds_for_peak": seconds_for_peak,
                   "fractions": list(fractions), "delays_us": [int(d) for d in delays_us],
                   "tune_seconds": tune_seconds, "latency_target_ms": latency_target * 1e3, "seed": seed,
                   "timeout_s": timeout, "threads": threads, "length_preset": LENGTH_PRESET},
        "models": {},
    }
    try:
        for zoo_name in models:
            bar.set_description(f"{zoo_name}: slicing")
            version_dir, manifest, int_high, reused = _sliced(zoo_name, size, out_dir, lambda m: bar.set_postfix_str(m[:40]))
            bar.update(1)
            repo = out_dir / "repository" / zoo_name
            if repo.exists():
                shutil.rmtree(repo)
            repo.mkdir(parents=True)
            bs_max = manifest.max_batch_size
            names = {"dvabatch": f"{zoo_name}_dvabatch", "zerobatch": f"{zoo_name}_zerobatch"}
            settings: dict[str, Any] = {"policy": policies[zoo_name], "num_buffer_pairs": num_buffer_pairs,
                                        "threads_per_stage": threads}
            if policy_params and policy_params.get(zoo_name):
                settings["policy_params"] = dict(policy_params[zoo_name])
            add_model_variant(repo, version_dir, names["dvabatch"], **settings)
            zero_batch(repo, version_dir, names["zerobatch"], threads=threads, bs_max=bs_max)
            candidates = delay_candidates(repo, version_dir, delays_us, prefix=zoo_name, threads=threads, bs_max=bs_max)
            entry: dict[str, Any] = {"policy": policies[zoo_name], "bs_max": bs_max,
                                     "max_length": manifest.max_length if manifest.has_seq else None,
                                     "stages": len(manifest.stages), "sliced_dir": str(version_dir),
                                     "slice_reused": reused, "repository": str(repo)}
            with TritonServer(repo) as server:
                for model_name in [*names.values(), *candidates.values()]:
                    server.wait_model_ready(model_name, timeout=180)
                url = server.grpc_url

                # DelayBatch: the candidate delay of peak closed-loop throughput
                bar.set_description(f"{zoo_name}: tuning delay")
                make = _query_maker(manifest, int_high)
                def tune_query(rng: np.random.Generator) -> dict[str, np.ndarray]:
                    length = 0
                    if manifest.has_seq:
                        length = int(sample_lengths(LENGTH_PRESET, 1, manifest.max_length, rng)[0])
                    return {k: v[None] for k, v in make(rng, length).items()}

                best, qps = tune_delay(url, candidates, tune_query, concurrency=bs_max, seconds=tune_seconds)
                names["delaybatch"] = candidates[best]
                entry["delay_tuning"] = {"best_delay_us": best, "qps_by_delay_us": {str(d): q for d, q in qps.items()},
                                         "concurrency": bs_max, "seconds": tune_seconds}
                bar.update(1)

                # ZeroBatch's peak: closed loop at bs_max clients
                bar.set_description(f"{zoo_name}: ZeroBatch peak")
                pool, _ = _queries(manifest, int_high, max(4 * bs_max, 32), seed + 1)
                for system in SYSTEMS:  # warm every system up before anything is measured
                    warm = run_closed_loop(url, names[system], pool, concurrency=bs_max, n=2 * bs_max, timeout=timeout)
                    if warm.errors():
                        raise RuntimeError(f"{names[system]}: warm-up failed: {warm.errors()[0].error}")
                peak = run_closed_loop(url, names["zerobatch"], pool, concurrency=bs_max, duration=seconds_for_peak,
                                       timeout=timeout)
                peak_qps = peak.throughput()
                if peak.errors() or not peak_qps > 0:
                    raise RuntimeError(f"ZeroBatch peak measurement failed: {len(peak.errors())} errors, {peak_qps} qps")
                entry["peak"] = {"throughput_qps": peak_qps, "concurrency": bs_max,
                                 "summary": peak.summary(latency_target)}
                bar.update(1)

                # open loop at each load fraction, the same offsets and queries for every system
                entry["loads"] = []
                for k, fraction in enumerate(fractions):
                    rate = fraction * peak_qps
                    offsets = poisson(rate, queries_per_load, rng=seed + 100 + k)
                    queries, lengths = _queries(manifest, int_high, queries_per_load, seed + 200 + k)
                    order = [SYSTEMS[(k + j) % len(SYSTEMS)] for j in range(len(SYSTEMS))]
                    level: dict[str, Any] = {"fraction": fraction, "rate_qps": rate, "order": order,
                                             "length_mean": float(np.mean(lengths)) if lengths else None,
                                             "systems": {}}
                    for system in order:
                        bar.set_description(f"{zoo_name}: {fraction:g} x peak, {LABELS[system]}")
                        run = run_open_loop(url, names[system], queries, offsets, timeout=timeout,
                                            lengths=lengths, params={"fraction": fraction, "system": system})
                        summary = run.summary(latency_target)
                        summary["sent"] = len(run.records)
                        summary["error_messages"] = sorted({str(r.error) for r in run.errors()})[:5]
                        level["systems"][system] = summary
                        bar.update(1)
                    level["ratios"] = ratios(level["systems"])
                    entry["loads"].append(level)
            entry["names"] = names
            results["models"][zoo_name] = entry
    finally:
        bar.close()
    return results


def ratios(systems: Mapping[str, Mapping[str, Any]]) -> dict[str, float | None]:
    """DVABatch's latency over each baseline's (mean and p99): below 1 means DVABatch is faster."""
    out: dict[str, float | None] = {}
    dva = systems.get("dvabatch", {})
    for base in ("zerobatch", "delaybatch"):
        for stat in ("mean", "p99"):
            mine, theirs = dva.get(f"latency_{stat}_ms"), systems.get(base, {}).get(f"latency_{stat}_ms")
            out[f"dvabatch_vs_{base}_{stat}"] = mine / theirs if mine is not None and theirs else None
    return out


class _NoBar:
    def update(self, n: int = 1) -> None: ...
    def set_description(self, text: str) -> None: ...
    def set_postfix_str(self, text: str) -> None: ...
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
    params = results.get("params", {})
    lines = [f"# Figure 14/16 analogue (size {results.get('size')})", "",
             f"Open-loop Poisson, {params.get('queries_per_load')} queries per run, the same schedule and queries "
             f"for every system; lengths: {params.get('length_preset')} preset; goodput within "
             f"{_fmt(params.get('latency_target_ms'), 0)} ms. Ratios are DVABatch's latency over the "
             "baseline's (< 1: DVABatch is faster).", ""]
    for model, entry in results.get("models", {}).items():
        tuning = entry.get("delay_tuning", {})
        lines += [f"## {model}", "",
                  f"policy `{entry.get('policy')}`, {entry.get('stages')} stages, bs_max {entry.get('bs_max')}, "
                  f"ZeroBatch peak {_fmt(entry.get('peak', {}).get('throughput_qps'))} qps, "
                  f"DelayBatch delay {tuning.get('best_delay_us')} µs (tuned over "
                  f"{', '.join(tuning.get('qps_by_delay_us', {}))} µs)", "",
                  "| load | rate qps | system | mean ms | p50 ms | p99 ms | throughput qps | goodput qps | answered/sent "
                  "| DVA/this mean | DVA/this p99 |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for level in entry.get("loads", []):
            r = level.get("ratios", {})
            for system in SYSTEMS:
                s = level["systems"].get(system)
                if s is None:
                    continue
                mean_ratio = r.get(f"dvabatch_vs_{system}_mean") if system != "dvabatch" else None
                p99_ratio = r.get(f"dvabatch_vs_{system}_p99") if system != "dvabatch" else None
                lines.append(
                    f"| {level['fraction']:g}×peak | {_fmt(level['rate_qps'])} | {LABELS[system]} "
                    f"| {_fmt(s.get('latency_mean_ms'), 2)} | {_fmt(s.get('latency_p50_ms'), 2)} "
                    f"| {_fmt(s.get('latency_p99_ms'), 2)} | {_fmt(s.get('throughput_qps'))} "
                    f"| {_fmt(s.get('goodput_qps'))} | {s.get('answered')}/{s.get('sent')} "
                    f"| {_fmt(mean_ratio, 2)} | {_fmt(p99_ratio, 2)} |")
        lines.append("")
    return "\n".join(lines)


def write_report(results: Mapping[str, Any], out_dir: Path) -> dict[str, Path]:
    """OUT/results.json and OUT/report.md (and OUT/fig14.png when matplotlib is installed)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "results.json", "markdown": out_dir / "report.md"}
    paths["json"].write_text(json.dumps(results, indent=2, allow_nan=False, default=jsonable) + "\n")
    paths["markdown"].write_text(report_markdown(results) + "\n")
    png = _plot(results, out_dir / "fig14.png")
    if png is not None:
        paths["png"] = png
    return paths


def _plot(results: Mapping[str, Any], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001 - matplotlib is optional
        return None
    models = list(results.get("models", {}))
    if not models:
        return None
    fig, axes = plt.subplots(2, len(models), figsize=(4 * len(models), 6), squeeze=False)
    for col, model in enumerate(models):
        loads = results["models"][model]["loads"]
        x = np.arange(len(loads))
        for row, stat in enumerate(("mean", "p99")):
            ax = axes[row][col]
            for j, system in enumerate(SYSTEMS):
                values = [lv["systems"][system].get(f"latency_{stat}_ms") or 0.0 for lv in loads]
                ax.bar(x + (j - 1) * 0.27, values, 0.27, label=LABELS[system])
            ax.set_xticks(x, [f"{lv['fraction']:g}" for lv in loads])
            ax.set_title(f"{model}: {stat} latency")
            ax.set_ylabel("ms")
            ax.set_xlabel("fraction of ZeroBatch peak")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.experiments", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="experiment", required=True)
    p = sub.add_parser("figure14", help="latency at 1/4, 3/5, 9/10 of ZeroBatch's peak (Figure 14/16)")
    p.add_argument("--models", default="bert", help="comma-separated zoo models")
    p.add_argument("--size", default="test")
    p.add_argument("--out", type=Path, default=Path("perf/results/fig14"))
    p.add_argument("--queries", type=int, default=200, help="queries per open-loop run")
    p.add_argument("--peak-seconds", type=float, default=5.0, help="closed-loop seconds for ZeroBatch's peak")
    p.add_argument("--tune-seconds", type=float, default=2.0, help="closed-loop seconds per delay candidate")
    p.add_argument("--delays", default=",".join(map(str, DEFAULT_DELAYS_US)), help="DelayBatch candidates, µs")
    p.add_argument("--fractions", default=",".join(map(str, DEFAULT_FRACTIONS)))
    p.add_argument("--policy", type=_policies, default={}, help="overrides, MODEL=POLICY[,MODEL=POLICY]")
    p.add_argument("--latency-target-ms", type=float, default=200.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    results = figure14([m.strip() for m in args.models.split(",") if m.strip()], args.size, args.policy,
                       args.out, args.queries, args.peak_seconds,
                       fractions=[float(f) for f in args.fractions.split(",") if f.strip()],
                       delays_us=[int(d) for d in args.delays.split(",") if d.strip()],
                       tune_seconds=args.tune_seconds, latency_target=args.latency_target_ms / 1e3, seed=args.seed,
                       threads=args.threads, progress=not args.no_progress)
    paths = write_report(results, args.out)
    print(report_markdown(results))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    bad = [(m, lv["fraction"], s) for m, e in results["models"].items() for lv in e["loads"]
           for s, summary in lv["systems"].items() if summary["errors"]]
    if bad:
        print(f"runs with errors: {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
