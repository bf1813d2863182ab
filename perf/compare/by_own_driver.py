"""DVABatch side by side with ZeroBatch, driven by our own load generator (`perf.load.drivers`):

    python -m perf.compare --demo work/demo --driver own        (or: python -m perf.compare.by_own_driver DIR)
    python -m perf.compare --model-dir model_repository/my_model --driver own

serves the sliced model (a folder `dvabatch slice` wrote, or the one `dvabatch demo --out DIR`
served: DIR/demo.json names it) beside ZeroBatch, the unsliced `model.onnx` of its version folder
behind Triton's own dynamic batcher with no queue delay (`perf.baselines.zero_batch`), from one
tritonserver over a scratch repository (the folder is left as it is). ZeroBatch's peak
throughput is measured closed loop at bs_max clients; then the same seeded Poisson schedule of
variable-length queries (RTE-like lengths) goes open loop to both systems at each fraction of that
peak (`LOADS`: 0.5x and 0.9x), the order alternating, within about `--seconds` in all, after
each system answered `LONE_QUERIES` queries one at a time (concurrency 1). A table shows each
system's mean and p99 latency, answered/sent, and the ratios DVABatch/ZeroBatch of mean and p99
latency (< 1: DVABatch answers faster), and a line the concurrency-1 means. Any failed or unanswered query is printed and makes the
command exit with 1. The same figures are drawn (`perf.compare.plot`: mean and p99 against the
offered load, the lone query beside them) in OUT/latency.png, OUT being `--out` (default:
work/compare/MODEL under the repository, MODEL the served model's name). On stderr, the progress
of its steps (the peak, each system's lone queries, each load for each system) with the time left.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from dvabatch_backend.runtime.engine import available_cores
from dvabatch_backend.runtime.manifest import Manifest
from dvabatch_backend.tools.demo import read_record
from dvabatch_backend.tools.progress import StepProgress
from dvabatch_backend.tools.serve import TritonServer
from perf.load.arrivals import poisson
from perf.baselines.bench import sample_queries
from perf.compare.plot import FILE_NAME, Curve, LoadPoint, plot_latency, written_line
from perf.load.drivers import alternating, run_closed_loop, run_open_loop
from perf.paper.experiments import DVA, ZERO, ratios
from perf.load.stats import LoadResult

# fractions of ZeroBatch's peak, and bounds on the queries of one open-loop run (enough for a p99
# to mean something, few enough to stay within the time budget)
LOADS = (0.5, 0.9)
LONE_QUERIES = 40  # concurrency 1, per system
SECONDS = 45.0
MIN_QUERIES_PER_RUN = 30
MAX_QUERIES_PER_RUN = 150
QUERY_TIMEOUT_S = 30.0
# where the plot goes without --out: beside by_perf_analyzer's work/perf, outside any model
# repository (a folder there would be taken by Triton for a model)
DEFAULT_OUT = Path(__file__).resolve().parents[2] / "work" / "compare"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.compare.by_own_driver", description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path, metavar="DIR",
                        help="the model repository dvabatch demo --out DIR wrote, or a sliced model folder")
    parser.add_argument("--seconds", type=float, default=SECONDS, help="time budget of the runs (default: %(default)s)")
    parser.add_argument("--loads", default=",".join(f"{f:g}" for f in LOADS),
                        help="fractions of ZeroBatch's peak, comma separated (default: %(default)s)")
    # the same threads as the served dvabatch model: each stage, in turn, on every core (the
    # slicer's default: thread_pool per_stage, threads_per_stage 0)
    parser.add_argument("--baseline-threads", type=int, default=available_cores(), metavar="N",
                        help="onnxruntime threads of ZeroBatch's unsliced model (default: every core, %(default)s)")
    parser.add_argument("--out", type=Path, default=None, metavar="OUT",
                        help=f"the folder of the latency plot, OUT/{FILE_NAME} (default: "
                             f"{DEFAULT_OUT}/MODEL, MODEL the served model's name)")
    args = parser.parse_args(argv)
    try:
        loads = tuple(float(f) for f in args.loads.split(",") if f)
    except ValueError:
        parser.error(f"--loads takes fractions separated by commas, got {args.loads!r}")
    if not loads or min(loads) <= 0:
        parser.error(f"--loads takes fractions above 0, got {args.loads!r}")
    try:
        return run(args.dir, args.seconds, args.baseline_threads, args.out, loads)
    except FileNotFoundError as exc:  # not a folder the demo wrote
        print(f"error: {exc}", file=sys.stderr)
        return 2


def run(folder: Path, seconds: float = SECONDS, baseline_threads: int | None = None, out: Path | None = None,
        loads: Sequence[float] = LOADS) -> int:
    """Serves the sliced model in `folder` (a model folder, or the demo's repository) beside
    ZeroBatch and runs `side_by_side`, its plot in `out` (default DEFAULT_OUT/MODEL); 1 if any
    query failed, else 0."""
    import onnx

    from perf.baselines import zero_batch
    from slicer.triton_files import add_model_copy
    from slicer.profiler import int_bounds

    model_dir = demo_model_dir(folder) if not (folder / "config.pbtxt").is_file() else folder
    version_dir = (model_dir / "1").resolve()
    manifest = Manifest.load(version_dir / "manifest.json")
    dva_name = manifest.name
    full = onnx.load(str(version_dir / (manifest.full_model or "model.onnx")), load_external_data=False)
    int_high = int_bounds(full)
    zero_name = f"{dva_name}_zerobatch"
    with tempfile.TemporaryDirectory(prefix="dvabatch-side-by-side-") as tmp:
        scratch = Path(tmp)
        add_model_copy(scratch, model_dir, dva_name)
        zero_batch(scratch, version_dir, zero_name, threads=baseline_threads or available_cores(),
                   bs_max=manifest.max_batch_size)
        with TritonServer(scratch) as server:
            print(f"tritonserver up (gRPC {server.grpc_url}); loading {dva_name} and {zero_name}...", flush=True)
            for name in (dva_name, zero_name):
                server.wait_model_ready(name, timeout=300)
            failed = side_by_side(server, dva_name, zero_name, manifest, int_high, seconds=seconds, loads=loads,
                                  plot_to=(out or DEFAULT_OUT / dva_name) / FILE_NAME)
    return 1 if failed else 0


def demo_model_dir(repo: Path) -> Path:
    """The model folder the demo served in its repository (`dvabatch demo --out DIR`: DIR/demo.json)."""
    return repo / read_record(repo)["served"]


def side_by_side(server: TritonServer, dva_name: str, zero_name: str, manifest: Manifest,
                 int_high: Mapping[str, int], seconds: float = SECONDS, loads: Sequence[float] = LOADS,
                 seed: int = 0, timeout: float = QUERY_TIMEOUT_S, plot_to: Path | None = None) -> int:
    """Both served models under the same open-loop Poisson load at each fraction of ZeroBatch's
    peak, within about `seconds` in all; prints a table, draws it into the PNG `plot_to` (if
    given) and returns how many queries failed (an error, or no answer). Its steps' progress, with
    the time left, goes to stderr."""
    # every step is known before the first: the peak, each system's lone queries, each load for each
    # system; each is told as it begins
    systems = len((dva_name, zero_name))
    progress = StepProgress("compare", sys.stderr, total=1 + systems + len(loads) * systems)
    try:
        return _side_by_side(server, dva_name, zero_name, manifest, int_high, seconds, loads, seed, timeout,
                             plot_to, progress)
    finally:
        progress.close()


def _side_by_side(server: TritonServer, dva_name: str, zero_name: str, manifest: Manifest,
                  int_high: Mapping[str, int], seconds: float, loads: Sequence[float], seed: int, timeout: float,
                  plot_to: Path | None, progress: Callable[[str], None]) -> int:
    began = time.perf_counter()
    bs_max = manifest.max_batch_size
    labels = {dva_name: "DVABatch", zero_name: "ZeroBatch"}
    print(f"\nside by side with ZeroBatch ({zero_name}: the unsliced model behind Triton's dynamic batcher, "
          f"no queue delay, bs_max {bs_max}), the same queries at the same times; about {seconds:.0f} s",
          flush=True)
    # the peak takes a fifteenth of the budget (3 s by default): the open-loop runs need the rest
    progress(f"warm-up, then ZeroBatch's peak (closed loop, {bs_max} clients)")
    peak_qps = warm_up_and_peak(server.grpc_url, (dva_name, zero_name), manifest, int_high,
                                peak_seconds=min(3.0, max(0.5, seconds / 15)), seed=seed, timeout=timeout)
    rates = [fraction * peak_qps for fraction in loads]
    n = queries_per_run(rates, seconds - (time.perf_counter() - began))
    print(f"ZeroBatch peak {peak_qps:.1f} qps (closed loop, {bs_max} clients); "
          f"{n} queries per run, RTE-like lengths up to {manifest.max_length} tokens", flush=True)
    lone = lone_latency(server.grpc_url, (dva_name, zero_name), manifest, int_high, seed, timeout,
                        begin=lambda model: progress(f"{labels[model]}: {LONE_QUERIES} lone queries (concurrency 1)"))
    rows = []
    for k, (fraction, rate) in enumerate(zip(loads, rates)):
        offsets = poisson(rate, n, rng=seed + 100 + k)
        queries, lengths = sample_queries(manifest, int_high, n, seed + 200 + k)
        results = {}
        for model in alternating((dva_name, zero_name), k):
            progress(f"{labels[model]} at {fraction:g}x ({rate:.1f} qps, open loop)")
            results[model] = run_open_loop(server.grpc_url, model, queries, offsets, timeout=timeout, lengths=lengths)
        rows.append(Row(fraction, rate, results[dva_name], results[zero_name]))
    for line in table(rows):
        print(line)
    dva_mean, zero_mean = (lone[m].summary()["latency_mean_ms"] for m in (dva_name, zero_name))
    print(f"concurrency 1 ({LONE_QUERIES} queries each): mean DVABatch {dva_mean:.2f} ms, ZeroBatch "
          f"{zero_mean:.2f} ms ({dva_mean - zero_mean:+.2f} ms)")
    if plot_to is not None:
        written = plot_latency(curves(rows, lone, dva_name, zero_name), plot_to,
                               x_label="offered load: Poisson arrivals, queries/s (below: the fraction of "
                                       "ZeroBatch's closed-loop peak)",
                               title=f"{dva_name}: DVABatch beside ZeroBatch (no queue delay), our own "
                                     "open-loop driver")
        print(written_line(written, plot_to), flush=True)
    failed = sum(len(failures(row.dva)) + len(failures(row.zero)) for row in rows)
    failed += sum(len(failures(result)) for result in lone.values())
    for line in error_lines(rows):
        print(line)
    print(f"side by side took {time.perf_counter() - began:.1f} s", flush=True)
    return failed


def warm_up_and_peak(url: str, models: Sequence[str], manifest: Manifest, int_high: Mapping[str, int],
                     peak_seconds: float, seed: int, timeout: float) -> float:
    """Warms every model up (a short closed loop each, as perf.paper.experiments.figure14 does), then
    measures ZeroBatch's (the last model's) peak throughput closed loop at bs_max clients."""
    bs_max = manifest.max_batch_size
    pool, _ = sample_queries(manifest, int_high, max(4 * bs_max, 32), seed + 1)
    for model in models:
        warm = run_closed_loop(url, model, pool, concurrency=bs_max, n=2 * bs_max, timeout=timeout)
        if warm.errors():
            raise RuntimeError(f"{model}: warm-up failed: {warm.errors()[0].error}")
    peak = run_closed_loop(url, models[-1], pool, concurrency=bs_max, duration=peak_seconds, timeout=timeout)
    peak_qps = peak.throughput()
    if peak.errors() or not peak_qps > 0:
        first = peak.errors()[0].error if peak.errors() else "no query answered"
        raise RuntimeError(f"{models[-1]}: peak measurement failed ({len(peak.errors())} errors, "
                           f"{peak_qps:.1f} qps): {first}")
    return peak_qps


def lone_latency(url: str, models: Sequence[str], manifest: Manifest, int_high: Mapping[str, int], seed: int,
                 timeout: float, begin: Callable[[str], None] | None = None) -> dict[str, LoadResult]:
    """`LONE_QUERIES` queries to each model one at a time, in two halves with the order reversed;
    `begin(model)` as a model's first half begins."""
    queries, _ = sample_queries(manifest, int_high, LONE_QUERIES, seed + 300)
    half = LONE_QUERIES // 2
    runs: dict[str, list[LoadResult]] = {m: [] for m in models}
    for turn, part in enumerate((queries[:half], queries[half:])):
        for model in alternating(models, turn):
            if begin is not None and turn == 0:
                begin(model)
            runs[model].append(run_closed_loop(url, model, part, concurrency=1, n=len(part), timeout=timeout))
    return {m: dataclasses.replace(r[0], records=[rec for result in r for rec in result.records])
            for m, r in runs.items()}


def queries_per_run(rates: Sequence[float], seconds_left: float) -> int:
    """Queries per open-loop run so that every run (each load, both systems) fits in
    `seconds_left`: a run of n queries at rate r lasts about n / r seconds. A margin of 20 % is
    kept for the drain of the last answers and the serialization before each run."""
    n = int(0.8 * max(seconds_left, 0.0) / (2 * sum(1.0 / rate for rate in rates)))
    return max(MIN_QUERIES_PER_RUN, min(MAX_QUERIES_PER_RUN, n))


class Row:
    """One load level: both systems' runs and their summaries."""

    def __init__(self, fraction: float, rate: float, dva: LoadResult, zero: LoadResult) -> None:
        self.fraction, self.rate, self.dva, self.zero = fraction, rate, dva, zero
        self.dva_summary, self.zero_summary = dva.summary(), zero.summary()
        both = ratios({DVA: self.dva_summary, ZERO: self.zero_summary}, subject=DVA)
        self.mean_ratio = both["dvabatch_vs_zerobatch_mean"]
        self.p99_ratio = both["dvabatch_vs_zerobatch_p99"]


def table(rows: Sequence[Row]) -> list[str]:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    def ratio(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    def system(s: Mapping[str, Any]) -> str:
        return f"{ms(s['latency_mean_ms']):>8} {ms(s['latency_p99_ms']):>8} {s['answered']:>4}/{s['queries']:<4}"

    header = f"{'mean ms':>8} {'p99 ms':>8} {'answered':>9}"
    lines = [f"{'':>14} | {'DVABatch':^27} | {'ZeroBatch':^27} | {'DVABatch/ZeroBatch':^18}",
             f"{'load':>5} {'rate qps':>8} | {header} | {header} | {'mean':>8} {'p99':>8}"]
    for row in rows:
        lines.append(f"{row.fraction:>4g}x {row.rate:>8.1f} | {system(row.dva_summary)} | {system(row.zero_summary)} "
                     f"| {ratio(row.mean_ratio):>8} {ratio(row.p99_ratio):>8}")
    lines.append("ratios below 1: DVABatch answers faster than ZeroBatch at that load")
    return lines


def curves(rows: Sequence[Row], lone: Mapping[str, LoadResult], dva_name: str, zero_name: str) -> list[Curve]:
    """The figures of the table and of the concurrency-1 line, as `perf.compare.plot` draws them:
    each system's mean and p99 at each load's rate (queries/s), and its lone query."""
    out = []
    for label, model, summary_of in (("DVABatch", dva_name, lambda row: row.dva_summary),
                                     ("ZeroBatch", zero_name, lambda row: row.zero_summary)):
        alone = lone[model].summary()
        out.append(Curve(label, [LoadPoint(row.rate, summary_of(row)["latency_mean_ms"],
                                           summary_of(row)["latency_p99_ms"], row.fraction) for row in rows],
                         lone_mean_ms=alone["latency_mean_ms"], lone_p99_ms=alone["latency_p99_ms"]))
    return out


# how the model words a refusal under overload (admission.py): the system's answer to more than it
# serves, not a failure of the comparison
REFUSAL = "Exceeds maximum queue size"


def failures(result: Any) -> list[Any]:
    """`result`'s queries that failed or were not answered, the model's refusals left out."""
    return [r for r in result.errors() if REFUSAL not in str(r.error)]


def error_lines(rows: Sequence[Row]) -> list[str]:
    """One line per system and load with failed queries, with its first distinct messages, and
    one with the queries it refused as overload."""
    lines = []
    for row in rows:
        for label, result in (("DVABatch", row.dva), ("ZeroBatch", row.zero)):
            errors, refused = failures(result), len(result.errors()) - len(failures(result))
            if errors:
                messages = "; ".join(sorted({str(r.error) for r in errors})[:3])
                lines.append(f"ERROR {label} at {row.fraction:g}x: {len(errors)} of {len(result.records)} "
                             f"queries failed or were not answered: {messages}")
            if refused:
                lines.append(f"{label} at {row.fraction:g}x refused {refused} of {len(result.records)} queries "
                             f"as overload (UNAVAILABLE \"{REFUSAL}\"): more than it serves")
    return lines


if __name__ == "__main__":
    sys.exit(main())
