"""DVABatch beside ZeroBatch, measured by NVIDIA's perf_analyzer: each system's sustained open-loop rate.

    python -m perf.perf_analyzer_side_by_side [--model bert] [--size bench] [--latency-target-ms 500]
        [--lengths rte] [--quick] [--out work/perf]

One tritonserver serves the zoo model sliced as `dvabatch slice` would (the config.pbtxt the slicer
wrote, untouched: its policy choice and settings) beside ZeroBatch (the unsliced model behind
Triton's dynamic batcher, no queue delay, with the same threads as the dvabatch stages' global pool:
every core, `available_cores()`). Every perf_analyzer run sends the same input data: seeded
queries of GLUE-like lengths (`--lengths`, default "rte"), one entry per request. For each system:

1. concurrency 1: the latency of a lone query (p50, p99);
2. closed loop at bs_max clients: its closed-loop peak;
3. `--request-rate-range` with `--request-distribution poisson` (open loop), stepping from 0.3x to
   1.2x of the larger closed-loop peak (the same rates for both systems), stopping once p99 passes
   the target (`--percentile 99 -l TARGET`).

A system's sustained rate is the highest step whose p99 is within the target and whose answered
throughput kept up with the rate (>= 90 %). Every request must succeed: Triton's own statistics
(`/v2/models/NAME/stats`, fail count) are read after the runs; a failure makes the command exit 1.
Defaults take about 3-5 minutes at the "bench" size on 2 cores (plus slicing, once); `--quick`
about a minute. Results: OUT/perf_analyzer_side_by_side/SIZE/results.json.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dvabatch_backend.runtime.engine import available_cores
from perf.perf_analyzer import PerfResult, PerfRow, run_perf_analyzer, write_input_data

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "work" / "perf"
LATENCY_TARGET_MS = 500.0
KEEP_UP = 0.9  # answered throughput / sent rate for a step to count as sustained
RATE_FRACTIONS = (0.3, 1.2, 0.1)  # start, end, step: fractions of the larger closed-loop peak
QUICK_RATE_FRACTIONS = (0.4, 1.2, 0.2)
MEASUREMENT_INTERVAL_MS = 2000
QUICK_MEASUREMENT_INTERVAL_MS = 1000
WINDOWS = 3  # perf_analyzer judges a level over 3 windows; -r 3 with a huge -s: exactly 3 per level
INPUT_QUERIES = 200


@dataclass(frozen=True)
class Plan:
    """How long and how far each measurement goes."""

    measurement_interval_ms: int
    rate_fractions: tuple[float, float, float]
    latency_target_ms: float

    @classmethod
    def for_args(cls, quick: bool, latency_target_ms: float, interval_ms: int | None = None) -> Plan:
        default = QUICK_MEASUREMENT_INTERVAL_MS if quick else MEASUREMENT_INTERVAL_MS
        return cls(interval_ms or default, QUICK_RATE_FRACTIONS if quick else RATE_FRACTIONS, latency_target_ms)

    def rates(self, peak: float) -> tuple[float, float, float]:
        """(start, end, step) in requests/s, whole numbers (perf_analyzer's range takes them so)."""
        start, end, step = (max(1.0, round(f * peak)) for f in self.rate_fractions)
        return start, max(start, end), step


@dataclass
class SystemResult:
    """One system's figures (latencies in ms, rates and throughputs in requests/s)."""

    label: str
    model: str
    c1_p50_ms: float | None = None
    c1_p99_ms: float | None = None
    closed_loop_peak: float | None = None
    sustained_rate: float | None = None
    sustained_p99_ms: float | None = None
    steps: list[dict[str, float]] = field(default_factory=list)
    succeeded: int = 0  # Triton's statistics after every run
    failed: int = 0
    perf_analyzer_errors: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------
# the repository


def build_repository(scratch: Path, model_dir: Path) -> tuple[str, str]:
    """scratch/NAME (the slicer's config.pbtxt as written, its version folder linked) and
    scratch/NAME_zerobatch; returns both names."""
    from dvabatch_backend.runtime.manifest import Manifest
    from perf.baselines import zero_batch

    version_dir = (model_dir / "1").resolve()
    manifest = Manifest.load(version_dir / "manifest.json")
    dva_name, zero_name = manifest.name, f"{manifest.name}_zerobatch"
    (scratch / dva_name).mkdir(parents=True)
    shutil.copyfile(model_dir / "config.pbtxt", scratch / dva_name / "config.pbtxt")
    (scratch / dva_name / "1").symlink_to(version_dir, target_is_directory=True)
    zero_batch(scratch, version_dir, zero_name, threads=available_cores(), bs_max=manifest.max_batch_size)
    return dva_name, zero_name


def write_queries(path: Path, model_dir: Path, int_high: dict[str, int], preset: str, n: int = INPUT_QUERIES,
                  seed: int = 0) -> Path:
    from dvabatch_backend.runtime.manifest import Manifest
    from perf.bench import sample_queries

    manifest = Manifest.load(model_dir / "1" / "manifest.json")
    queries, _ = sample_queries(manifest, {**int_high, **manifest.input_bounds}, n, seed, preset)
    return write_input_data(path, queries)


# ----------------------------------------------------------------------------------------------
# measuring


def failure_counts(http_url: str, model: str) -> tuple[int, int]:
    """(succeeded, failed) inference requests of `model` so far, from Triton's statistics."""
    with urllib.request.urlopen(f"http://{http_url}/v2/models/{model}/stats", timeout=10) as response:
        stats = json.loads(response.read())["model_stats"]
    inference = [s["inference_stats"] for s in stats]
    return (sum(int(s["success"]["count"]) for s in inference), sum(int(s["fail"]["count"]) for s in inference))


def _run(url: str, model: str, data: Path, plan: Plan, **load: Any) -> PerfResult:
    windows_s = WINDOWS * plan.measurement_interval_ms / 1000
    return run_perf_analyzer(model, url, protocol="grpc", input_data=data,
                             measurement_interval_ms=plan.measurement_interval_ms, stability_percentage=1000.0,
                             max_trials=WINDOWS, timeout=max(120.0, 40 * windows_s), **load)


def _note_errors(result: PerfResult, system: SystemResult, what: str, allow_missing: bool = False) -> None:
    """A perf_analyzer run that exited badly or left levels out (unless a latency stop explains it:
    then even no level at all is an answer, the lowest rate was already past the target)."""
    latency_stop = allow_missing and "went over the set limit" in (result.stdout_tail + result.stderr_tail)
    if result.returncode != 0 or (not result.rows and not latency_stop) or (result.missing_levels and not allow_missing):
        tail = (result.stderr_tail or result.stdout_tail).strip().splitlines()[-3:]
        system.perf_analyzer_errors.append(f"{what}: {result.describe().splitlines()[0]}: {' | '.join(tail)}")


def measure_closed_loop(url: str, system: SystemResult, data: Path, plan: Plan, bs_max: int) -> None:
    lone = _run(url, system.model, data, plan, concurrency_range=(1,))
    _note_errors(lone, system, "concurrency 1")
    if lone.rows:
        system.c1_p50_ms, system.c1_p99_ms = lone.rows[0].p50_us / 1e3, lone.rows[0].p99_us / 1e3
    full = _run(url, system.model, data, plan, concurrency_range=(bs_max,))
    _note_errors(full, system, f"concurrency {bs_max}")
    if full.rows:
        system.closed_loop_peak = full.rows[0].throughput


def sustained(rows: Sequence[PerfRow], latency_target_ms: float) -> PerfRow | None:
    """The highest rate whose p99 is within the target and whose throughput kept up with it."""
    good = [r for r in rows if r.p99_us / 1e3 <= latency_target_ms and r.throughput >= KEEP_UP * r.level]
    return max(good, key=lambda r: r.level, default=None)


def measure_open_loop(url: str, system: SystemResult, data: Path, plan: Plan,
                      rates: tuple[float, float, float]) -> None:
    # --percentile 99 makes -l (the latency threshold, ms) apply to p99: the sweep ends past the target
    stop = ["--percentile", "99", "-l", f"{plan.latency_target_ms:g}"]
    result = _run(url, system.model, data, plan, request_rate_range=rates, request_distribution="poisson",
                  async_mode=True, extra_args=stop)
    _note_errors(result, system, "request rate", allow_missing=True)
    system.steps = [{"rate": r.level, "throughput": r.throughput, "p50_ms": r.p50_us / 1e3,
                     "p99_ms": r.p99_us / 1e3} for r in result.rows]
    best = sustained(result.rows, plan.latency_target_ms)
    if best is not None:
        system.sustained_rate, system.sustained_p99_ms = best.level, best.p99_us / 1e3


def compare(server: Any, names: dict[str, str], data: Path, plan: Plan, bs_max: int,
            progress: Any = print) -> list[SystemResult]:
    """Every measurement of both systems on the running server, in the module docstring's order."""
    systems = [SystemResult(label, model) for label, model in names.items()]
    for system in systems:
        progress(f"{system.label}: concurrency 1 and {bs_max} (closed loop)")
        measure_closed_loop(server.grpc_url, system, data, plan, bs_max)
    peak = max((s.closed_loop_peak or 0.0) for s in systems)
    if peak <= 0:
        raise RuntimeError("no closed-loop peak was measured: " + "; ".join(
            e for s in systems for e in s.perf_analyzer_errors))
    rates = plan.rates(peak)
    for system in systems:
        progress(f"{system.label}: Poisson request rates {rates[0]:g} to {rates[1]:g} by {rates[2]:g}/s")
        measure_open_loop(server.grpc_url, system, data, plan, rates)
    for system in systems:
        system.succeeded, system.failed = failure_counts(server.http_url, system.model)
    return systems


# ----------------------------------------------------------------------------------------------
# the report


def table(systems: Sequence[SystemResult], latency_target_ms: float) -> list[str]:
    def num(value: float | None, digits: int = 1) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    lines = [f"{'system':<10} {'c=1 p50 ms':>10} {'c=1 p99 ms':>10} {'closed peak/s':>13} "
             f"{'sustained/s':>11} {'its p99 ms':>10} {'requests ok/failed':>19}"]
    for s in systems:
        lines.append(f"{s.label:<10} {num(s.c1_p50_ms, 2):>10} {num(s.c1_p99_ms, 2):>10} {num(s.closed_loop_peak):>13} "
                     f"{num(s.sustained_rate, 0):>11} {num(s.sustained_p99_ms):>10} {s.succeeded:>11}/{s.failed:<7}")
    lines.append(f"sustained: the highest Poisson rate with p99 <= {latency_target_ms:g} ms and >= {KEEP_UP:.0%} of it "
                 "answered")
    for s in systems:
        steps = ", ".join(f"{st['rate']:g}/s: {st['throughput']:.0f}/s p99 {st['p99_ms']:.0f} ms" for st in s.steps)
        lines.append(f"  {s.label} steps: {steps or '-'}")
        lines += [f"  {s.label} perf_analyzer: {e}" for e in s.perf_analyzer_errors]
    return lines


# ----------------------------------------------------------------------------------------------
# command line


def run(zoo_name: str, size: str, out: Path, plan: Plan, preset: str) -> tuple[list[SystemResult], dict[str, Any]]:
    """Slices (or reuses OUT/sliced/SIZE/MODEL), serves both systems from one server, measures them."""
    from dvabatch_backend.tools.serve import TritonServer
    from perf.bench import sliced
    from perf.perf_analyzer import ensure_system_deps

    ensure_system_deps()
    version_dir, manifest, int_high, reused = sliced(zoo_name, size, out, progress=lambda m: print(m, flush=True))
    model_dir = version_dir.parent
    with tempfile.TemporaryDirectory(prefix="dvabatch-pa-side-by-side-") as tmp:
        scratch = Path(tmp)
        dva_name, zero_name = build_repository(scratch / "repo", model_dir)
        data = write_queries(scratch / "input_data.json", model_dir, int_high, preset)
        with TritonServer(scratch / "repo") as server:
            for name in (dva_name, zero_name):
                server.wait_model_ready(name, timeout=300)
            print(f"tritonserver up; {dva_name} (the slicer's config) beside {zero_name} "
                  f"({available_cores()} threads)", flush=True)
            systems = compare(server, {"DVABatch": dva_name, "ZeroBatch": zero_name}, data, plan,
                              manifest.max_batch_size, progress=lambda m: print(m, flush=True))
    info = {"model": zoo_name, "size": size, "slice": str(model_dir), "reused_slice": reused, "lengths": preset,
            "bs_max": manifest.max_batch_size, "max_length": manifest.max_length, "plan": asdict(plan),
            "baseline_threads": available_cores(), "policy": _policy(model_dir / "config.pbtxt")}
    return systems, info


def _policy(config_pbtxt: Path) -> str:
    from perf.model_analyzer import config_parameters

    return config_parameters(config_pbtxt.read_text()).get("policy", "?")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.perf_analyzer_side_by_side",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bert", help="a zoo model (default: %(default)s)")
    parser.add_argument("--size", default="bench", help="zoo size preset (default: %(default)s)")
    parser.add_argument("--lengths", default="rte", help="perf.lengths preset (default: %(default)s)")
    parser.add_argument("--latency-target-ms", type=float, default=LATENCY_TARGET_MS)
    parser.add_argument("--measurement-interval", type=int, default=None, metavar="MS",
                        help=f"perf_analyzer's window (default {MEASUREMENT_INTERVAL_MS}, --quick "
                             f"{QUICK_MEASUREMENT_INTERVAL_MS})")
    parser.add_argument("--quick", action="store_true", help="shorter windows and fewer steps: about a minute")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="slices and results (default: %(default)s)")
    args = parser.parse_args(argv)
    plan = Plan.for_args(args.quick, args.latency_target_ms, args.measurement_interval)
    began = time.perf_counter()
    systems, info = run(args.model, args.size, args.out, plan, args.lengths)
    for line in table(systems, plan.latency_target_ms):
        print(line)
    results = args.out / "perf_analyzer_side_by_side" / args.size / "results.json"
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps({**info, "systems": [asdict(s) for s in systems]}, indent=2) + "\n")
    print(f"took {time.perf_counter() - began:.0f} s; results in {results}")
    broken = [s.label for s in systems if s.failed or s.perf_analyzer_errors or not s.succeeded]
    if broken:
        print(f"ERROR: failed requests or perf_analyzer errors for {', '.join(broken)}", file=sys.stderr)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
