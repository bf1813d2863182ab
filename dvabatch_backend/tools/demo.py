"""The main job: slice a zoo model, serve it from the real tritonserver, send a burst of
mixed-length queries with tritonclient, and show each answer's latency and what the backend did.

With MiniLM (the default) the queries are real sentences, tokenized with the model's own
tokenizer; every answer is checked against the unsliced model run on the query alone.

The demo ends with a short side-by-side run (`_side_by_side`) against ZeroBatch, the unsliced
model behind Triton's own dynamic batcher with no queue delay (`perf.baselines.zero_batch`),
served by the same server: ZeroBatch's peak throughput is measured closed loop, then the same
seeded Poisson schedule and variable-length queries go open loop to both systems at two fractions
of that peak, and the latency ratios DVABatch/ZeroBatch are printed (< 1: DVABatch is faster).
"""
from __future__ import annotations

import argparse
import re
import tempfile
import threading
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from dvabatch_backend.runtime.manifest import Manifest
    from dvabatch_backend.tools.serve import TritonServer
    from perf.stats import LoadResult

SENTENCES = [
    "Hi.",
    "Batching helps.",
    "Short queries should not wait.",
    "A serving system batches queries to use the hardware well.",
    "The cat sat on the mat and looked at the garden for a while.",
    "Late queries can join a batch that is already running, and catch up stage by stage.",
    "DVABatch slices a model into stages and runs batches through them like a software pipeline, "
    "so that batches can enter and leave at any stage instead of waiting for one another.",
    "When a large batch reaches operators that prefer small batches, it can be split into smaller "
    "batches that run one after another and leave the pipeline independently, so that the first "
    "queries are answered before the whole batch has finished its work, which lowers the mean latency.",
    "Input diversity means queries of very different lengths arrive together: padding every query "
    "to the longest one wastes computation, so queries of similar length are batched together and the "
    "batches run in parallel in the pipeline, and short queries leave early while long ones still run "
    "through the later stages of the model, which is exactly what a multi-exit scheme allows.",
    "Yes.",
    "Operators differ.",
    "Load changes all the time, from a trickle of queries at night to bursts during the day.",
]

# the side-by-side run: fractions of ZeroBatch's peak, and bounds on the queries of one open-loop
# run (enough for a p99 to mean something, few enough to stay within the time budget)
SIDE_BY_SIDE_LOADS = (0.3, 0.8)
SIDE_BY_SIDE_SECONDS = 45.0
MIN_QUERIES_PER_RUN = 30
MAX_QUERIES_PER_RUN = 150
QUERY_TIMEOUT_S = 30.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="minilm", help="zoo model (default: MiniLM with its real weights)")
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--policy", default="input", help="batching policy of the served model")
    parser.add_argument("--window", type=float, default=0.0,
                        help="input policy: batch window, seconds (0: none; on a CPU a window costs more than it buys)")
    parser.add_argument("--rounds", type=int, default=2, help="bursts to send")
    parser.add_argument("--out", type=Path, help="model repository to write (default: a temporary one)")
    parser.add_argument("--side-by-side-seconds", type=float, default=SIDE_BY_SIDE_SECONDS, metavar="SECONDS",
                        help="time budget of the closing side-by-side run against ZeroBatch (0: skip it)")
    # one thread by default, as each dvabatch stage: on a small machine the load generator shares
    # the cores, and ZeroBatch measured a higher peak with one thread than with every core
    parser.add_argument("--baseline-threads", type=int, default=1, metavar="N",
                        help="onnxruntime threads of ZeroBatch's unsliced model (default: 1)")
    # same destination: --no-side-by-side is the readable spelling of --side-by-side-seconds 0
    parser.add_argument("--no-side-by-side", dest="side_by_side_seconds", action="store_const", const=0.0,
                        help="skip the side-by-side run against ZeroBatch")


def run(args: argparse.Namespace) -> int:
    from slicer.profiler import int_bounds
    from slicer.slice_model import SliceOptions, slice_model
    from slicer.triton_files import add_model_variant
    from slicer.zoo import ZOO, build

    from .serve import TritonServer

    with tempfile.TemporaryDirectory() as tmp:
        repo = args.out or Path(tmp) / "repository"
        model = build(args.model, "test")
        max_length = ZOO[args.model].max_length.get("real", 0)
        print(f"slicing {args.model} into {args.stages} stages (profiling, balancing, verifying)...", flush=True)
        report = slice_model(model, repo / ".sliced" / args.model, SliceOptions(
            stages=args.stages, max_batch_size=16, max_length=max_length or 128, repeats=5,
            batch_sizes=(1, 2, 4, 8, 16), calibration_rounds=2, force=True))
        print(report.summary())
        name = f"{args.model}_{args.policy}"
        params = {"window": args.window} if args.policy == "input" else {}
        add_model_variant(repo, report.out_dir / "1", name, policy=args.policy, policy_params=params)
        side_by_side = args.side_by_side_seconds > 0
        zero_name = f"{args.model}_zerobatch"
        if side_by_side:
            from perf.baselines import zero_batch

            zero_batch(repo, report.out_dir / "1", zero_name, threads=args.baseline_threads,
                       bs_max=report.manifest.max_batch_size)
        int_high = int_bounds(model)
        queries = _queries(args.model, report.manifest, int_high, max_length)
        with TritonServer(repo) as server:
            names = [name, zero_name] if side_by_side else [name]
            print(f"\ntritonserver up (HTTP {server.http_url}, gRPC {server.grpc_url}); "
                  f"loading {', '.join(names)}...", flush=True)
            for served in names:
                server.wait_model_ready(served, timeout=300)
            failures = 0
            for round_ in range(args.rounds):
                failures += _burst(server, name, queries, report.out_dir / "1" / "model.onnx", round_)
            print("\nmeta operations done by the backend (Triton metrics endpoint):")
            for line in _meta_operations(server.metrics_url, name):
                print(f"  {line}")
            if side_by_side:
                failures += _side_by_side(server, name, zero_name, report.manifest, int_high,
                                          seconds=args.side_by_side_seconds)
    return 1 if failures else 0


def _queries(model: str, manifest, int_high: dict[str, int], max_length: int) -> list[dict[str, np.ndarray]]:
    if model == "minilm":
        from slicer.zoo.transformer import tokenize

        return tokenize(SENTENCES, max_length=max_length)
    from slicer.profiler import random_inputs

    rng = np.random.default_rng(0)
    lengths = [int(n) for n in rng.integers(1, max(max_length, 1) + 1, size=len(SENTENCES))] if max_length else [0] * 12
    return [{k: v[0] for k, v in random_inputs(manifest.inputs, 1, n, rng, int_high).items()} for n in lengths]


def _burst(server, name: str, queries: list[dict[str, np.ndarray]], full_model: Path, round_: int) -> int:
    import onnxruntime as ort
    import tritonclient.grpc as grpcclient

    from .serve import infer_inputs

    client = grpcclient.InferenceServerClient(server.grpc_url)
    requests = [infer_inputs(grpcclient, q) for q in queries]
    client.infer(name, requests[0])  # a warm channel
    done = [threading.Event() for _ in queries]
    answers: list = [None] * len(queries)
    start = time.perf_counter()

    def callback(i: int):
        def on_answer(result, error) -> None:
            answers[i] = (time.perf_counter() - start, result, error)
            done[i].set()
        return on_answer

    for i, tensors in enumerate(requests):
        client.async_infer(name, tensors, callback(i), client_timeout=120)
    for event in done:
        event.wait(120)
    full = ort.InferenceSession(str(full_model), providers=["CPUExecutionProvider"])
    output = full.get_outputs()[-1].name
    print(f"\nburst {round_ + 1}: {len(queries)} queries sent at once, in this order")
    print(f"{'query':>5} {'tokens':>6} {'answered after':>15}  {'|error| vs unsliced':>20}")
    failures = 0
    for i, (q, answer) in enumerate(zip(queries, answers)):
        length = len(next(iter(q.values())))
        if answer is None or answer[2] is not None:
            failures += 1
            print(f"{i:>5} {length:>6} {'-':>15}  {answer[2] if answer else 'no answer'}")
            continue
        got = answer[1].as_numpy(output)[0]
        ref = full.run([output], {k: v[None] for k, v in q.items()})[0][0]
        err = float(np.max(np.abs(got - ref)))
        failures += err > 1e-4
        print(f"{i:>5} {length:>6} {answer[0] * 1e3:>12.1f} ms  {err:>20.1e}")
    return failures


def _meta_operations(metrics_url: str, model: str) -> list[str]:
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    lines = []
    for line in text.splitlines():
        found = re.match(r'(dvabatch_\w+)\{(.*)\} ([0-9.e+-]+)$', line)
        if found and f'model="{model}"' in found.group(2):
            labels = ", ".join(x for x in found.group(2).split(",") if not x.startswith("model="))
            lines.append(f"{found.group(1)}[{labels}] = {float(found.group(3)):g}")
    return sorted(lines)


# ----------------------------------------------------------------------------------------------
# the side-by-side run against ZeroBatch


def _side_by_side(server: TritonServer, dva_name: str, zero_name: str, manifest: Manifest,
                  int_high: Mapping[str, int], seconds: float = SIDE_BY_SIDE_SECONDS,
                  loads: Sequence[float] = SIDE_BY_SIDE_LOADS, seed: int = 0,
                  timeout: float = QUERY_TIMEOUT_S) -> int:
    """Both served models under the same open-loop Poisson load at each fraction of ZeroBatch's
    peak, within about `seconds` in all; prints a table and returns how many queries failed
    (an error, or no answer)."""
    from perf.bench import sample_queries
    from perf.arrivals import poisson
    from perf.drivers import run_open_loop

    began = time.perf_counter()
    bs_max = manifest.max_batch_size
    print(f"\nside by side with ZeroBatch ({zero_name}: the unsliced model behind Triton's dynamic batcher, "
          f"no queue delay, bs_max {bs_max}), the same queries at the same times; about {seconds:.0f} s",
          flush=True)
    # the peak takes a fifteenth of the budget (3 s by default): the open-loop runs need the rest
    peak_qps = _warm_up_and_peak(server.grpc_url, (dva_name, zero_name), manifest, int_high,
                                 peak_seconds=min(3.0, max(0.5, seconds / 15)), seed=seed, timeout=timeout)
    rates = [fraction * peak_qps for fraction in loads]
    n = _queries_per_run(rates, seconds - (time.perf_counter() - began))
    print(f"ZeroBatch peak {peak_qps:.1f} qps (closed loop, {bs_max} clients); "
          f"{n} queries per run, RTE-like lengths up to {manifest.max_length} tokens", flush=True)
    rows = []
    for k, (fraction, rate) in enumerate(zip(loads, rates)):
        offsets = poisson(rate, n, rng=seed + 100 + k)
        queries, lengths = sample_queries(manifest, int_high, n, seed + 200 + k)
        # alternate which system goes first, so neither always meets a server warmed by the other
        order = [(dva_name, zero_name), (zero_name, dva_name)][k % 2]
        results = {model: run_open_loop(server.grpc_url, model, queries, offsets, timeout=timeout, lengths=lengths)
                   for model in order}
        rows.append(_Row(fraction, rate, results[dva_name], results[zero_name]))
    for line in _side_by_side_table(rows):
        print(line)
    failed = sum(len(row.dva.errors()) + len(row.zero.errors()) for row in rows)
    for line in _error_lines(rows):
        print(line)
    print(f"side by side took {time.perf_counter() - began:.1f} s", flush=True)
    return failed


def _warm_up_and_peak(url: str, models: Sequence[str], manifest: Manifest, int_high: Mapping[str, int],
                      peak_seconds: float, seed: int, timeout: float) -> float:
    """Warms every model up (a short closed loop each, as perf.experiments.figure14 does), then
    measures ZeroBatch's (the last model's) peak throughput closed loop at bs_max clients."""
    from perf.bench import sample_queries
    from perf.drivers import run_closed_loop

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


def _queries_per_run(rates: Sequence[float], seconds_left: float) -> int:
    """Queries per open-loop run so that every run (each load, both systems) fits in
    `seconds_left`: a run of n queries at rate r lasts about n / r seconds. A margin of 20 % is
    kept for the drain of the last answers and the serialization before each run."""
    n = int(0.8 * max(seconds_left, 0.0) / (2 * sum(1.0 / rate for rate in rates)))
    return max(MIN_QUERIES_PER_RUN, min(MAX_QUERIES_PER_RUN, n))


class _Row:
    """One load level: both systems' runs and their summaries."""

    def __init__(self, fraction: float, rate: float, dva: LoadResult, zero: LoadResult) -> None:
        from perf.experiments import DVA, ZERO, ratios

        self.fraction, self.rate, self.dva, self.zero = fraction, rate, dva, zero
        self.dva_summary, self.zero_summary = dva.summary(), zero.summary()
        both = ratios({DVA: self.dva_summary, ZERO: self.zero_summary}, subject=DVA)
        self.mean_ratio = both["dvabatch_vs_zerobatch_mean"]
        self.p99_ratio = both["dvabatch_vs_zerobatch_p99"]


def _side_by_side_table(rows: Sequence[_Row]) -> list[str]:
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


def _error_lines(rows: Sequence[_Row]) -> list[str]:
    """One line per system and load with failed queries, with its first distinct messages."""
    lines = []
    for row in rows:
        for label, result in (("DVABatch", row.dva), ("ZeroBatch", row.zero)):
            errors = result.errors()
            if errors:
                messages = "; ".join(sorted({str(r.error) for r in errors})[:3])
                lines.append(f"ERROR {label} at {row.fraction:g}x: {len(errors)} of {len(result.records)} "
                             f"queries failed or were not answered: {messages}")
    return lines
