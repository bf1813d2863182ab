"""Overload and admission, measured: what each system sustains, what it does past that, and the
goodput latency-target admission buys. One command, every run side by side in one server:

    python -m perf.reliability.overload                       # zoo BERT at bench size, target 100 ms
    python -m perf.reliability.overload --model minilm --factor 2 --seconds 20
    python -m perf.reliability.overload --size test --seconds 1 --quick   # a smoke run: every part, briefly

Systems (the same sliced model, the same queries at the same times):
  - `dvabatch`: the config the slicer writes (its default queue bound, no latency target);
  - `dvabatch_unbounded`: max_queue_size 0 (no bound: admission off);
  - `dvabatch_slo`: slo_ms = the target (admission on);
  - `zerobatch`: the unsliced model behind Triton's dynamic batcher, no queue delay.

1. Sustained rate of each of `dvabatch` and `zerobatch`: a stepping Poisson load (as Figure 15)
   from 0.3x to 1.5x a closed-loop estimate; the highest step whose every query was answered with
   p99 within the target.
2. Overload: open-loop Poisson at `factor` x each system's sustained rate for `seconds`, then
   0.3x for 8 s. Reported: answered throughput during the overload against the sustained rate,
   refusals, the answered p99, the longest time any query took to get its answer (result or
   error), stub RSS, how long after the load dropped latency was back to its low-load value
   (every later query within 2x the low-load p99), and a lone query's time once it is over.
3. Goodput (answers within the target per second) at 1.5x dvabatch's sustained rate: admission
   on (`dvabatch_slo`) against off (`dvabatch_unbounded`), and the default.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from dvabatch_backend.runtime.engine import available_cores
from dvabatch_backend.tools.serve import TritonServer
from perf.load.arrivals import poisson, stepping, stepping_rates
from perf.load.drivers import run_closed_loop, run_open_loop
from perf.load.stats import LoadResult, peak_load

TIMEOUT_S = 60.0
LOW_LOAD = 0.3


@dataclass(frozen=True)
class Plan:
    """How long each part runs besides the overload itself (`--seconds`)."""

    peak_seconds: float = 4.0  # the closed-loop estimate the stepping load is scaled to
    steps: int = 12  # the stepping load, 0.3x to 1.5x the estimate
    step_seconds: float = 1.5  # each step lasts about this long ...
    step_min_queries: int = 60  # ... with at least this many queries
    low_seconds: float = 5.0  # the low-load latency measured before the overload
    recovery_seconds: float = 8.0  # the low load after the overload, to see latency come back


QUICK = Plan(peak_seconds=1.0, steps=5, step_seconds=0.5, step_min_queries=20, low_seconds=1.0, recovery_seconds=2.0)


@dataclass
class Setup:
    server: TritonServer
    manifest: Any
    queries: list[dict]
    lengths: list[int] | None
    names: dict[str, str]  # system -> served model name


def serve(out: Path, zoo_name: str, size: str, target_ms: float):
    """Slices the zoo model (reused when already there) and returns the repository of the four systems."""
    from perf.baselines import zero_batch
    from perf.baselines.bench import sliced
    from slicer.triton_files import add_model_variant

    version_dir, manifest, int_high, _ = sliced(zoo_name, size, out)
    repo = Path(tempfile.mkdtemp(prefix="dvabatch-overload-"))
    names = {"dvabatch": f"{zoo_name}_dva", "dvabatch_unbounded": f"{zoo_name}_dva_unbounded",
             "dvabatch_slo": f"{zoo_name}_dva_slo", "zerobatch": f"{zoo_name}_zerobatch"}
    add_model_variant(repo, version_dir, names["dvabatch"])
    add_model_variant(repo, version_dir, names["dvabatch_unbounded"], extra={"max_queue_size": 0})
    add_model_variant(repo, version_dir, names["dvabatch_slo"], extra={"slo_ms": target_ms})
    zero_batch(repo, version_dir, names["zerobatch"], threads=available_cores(), bs_max=manifest.max_batch_size)
    return repo, manifest, int_high, names


def closed_loop_peak(setup: Setup, system: str, seconds: float) -> float:
    bs_max = setup.manifest.max_batch_size
    name = setup.names[system]
    run_closed_loop(setup.server.grpc_url, name, setup.queries, concurrency=bs_max, n=4 * bs_max, timeout=TIMEOUT_S)
    return run_closed_loop(setup.server.grpc_url, name, setup.queries, concurrency=bs_max, duration=seconds,
                           timeout=TIMEOUT_S).throughput()


def sustained_rate(setup: Setup, system: str, target: float, estimate: float, seed: int,
                   plan: Plan) -> tuple[float, list]:
    """The highest step of a stepping Poisson load answered whole with p99 within `target`."""
    steps, per_step = plan.steps, max(plan.step_min_queries, int(estimate * plan.step_seconds))
    start, step = LOW_LOAD * estimate, (1.5 - LOW_LOAD) * estimate / (steps - 1)
    n = steps * per_step
    rates = stepping_rates(start, step, per_step, n)
    offsets = stepping(start, step, per_step, n, rng=seed)
    result = _open(setup, system, offsets, seed)
    peak = peak_load(result, rates, target)
    return (peak or 0.0), [(float(r), part) for r, part in _steps(result, rates)]


def _steps(result: LoadResult, rates: np.ndarray):
    from perf.load.stats import step_summaries

    return [(s["rate_qps"], s) for s in step_summaries(result, rates)]


def _open(setup: Setup, system: str, offsets: np.ndarray, seed: int) -> LoadResult:
    rng = np.random.default_rng(seed)
    pick = rng.integers(0, len(setup.queries), size=len(offsets))
    queries = [setup.queries[i] for i in pick]
    lengths = None if setup.lengths is None else [setup.lengths[i] for i in pick]
    return run_open_loop(setup.server.grpc_url, setup.names[system], queries, offsets, timeout=TIMEOUT_S,
                         lengths=lengths)


@dataclass
class OverloadFigures:
    system: str
    sustained: float
    offered: float
    answered_qps: float
    refused: int
    other_errors: int
    longest_s: float
    answered_p99_ms: float  # of the overload's queries answered with their result
    low_p99_ms: float
    recovered_after_s: float | None
    lone_after_ms: float  # one query alone, once the run (overload, then the low load) is over
    rss_mb: tuple[float, float]

    def line(self) -> str:
        recovered = "never" if self.recovered_after_s is None else f"{self.recovered_after_s:.1f} s"
        return (f"{self.system:<20} sustained {self.sustained:7.1f} qps | offered {self.offered:7.1f} | answered "
                f"{self.answered_qps:7.1f} qps ({self.answered_qps / self.sustained:4.0%} of sustained) | refused "
                f"{self.refused:5d}, other errors {self.other_errors} | answered p99 {self.answered_p99_ms:.0f} ms, "
                f"longest answer {self.longest_s:5.2f} s | back to low-load latency (p99 {self.low_p99_ms:.1f} ms) "
                f"{recovered} after the drop; a lone query then {self.lone_after_ms:.1f} ms | stub RSS "
                f"{self.rss_mb[0]:.0f} -> {self.rss_mb[1]:.0f} MB")


def overload(setup: Setup, system: str, sustained: float, factor: float, seconds: float, seed: int,
             stub_pids: Sequence[int], plan: Plan) -> OverloadFigures:
    from perf.reliability.soak import RssSampler

    low = LOW_LOAD * sustained
    baseline = _open(setup, system, poisson(low, max(30, int(low * plan.low_seconds)), rng=seed), seed)
    low_p99 = float(np.percentile(baseline.latencies(), 99))
    heavy = poisson(factor * sustained, int(factor * sustained * seconds), rng=seed + 1)
    drop = float(heavy[-1]) if len(heavy) else 0.0
    calm = drop + poisson(low, max(20, int(low * plan.recovery_seconds)), rng=seed + 2)
    offsets = np.concatenate([heavy, calm])
    sampler = RssSampler(stub_pids, every=1.0).start()
    result = _open(setup, system, offsets, seed + 3)
    sampler.stop()
    records = sorted(result.records, key=lambda r: r.id)
    # answers that came while the overload lasted (not those of its queries answered later)
    answered_qps = sum(1 for r in records if r.ok and r.answer is not None and r.answer <= drop) / max(drop, 1e-9)
    refused = sum(1 for r in records if not r.ok and r.error and ("503" in r.error or "UNAVAILABLE" in r.error
                                                                   or "queue size" in r.error or "overloaded" in r.error))
    other = sum(1 for r in records if not r.ok) - refused
    longest = max((r.latency for r in records if r.latency is not None), default=float("nan"))
    answered = [r.latency for r in records[:len(heavy)] if r.ok and r.latency is not None]
    answered_p99 = float(np.percentile(answered, 99)) * 1e3 if answered else float("nan")
    after = [r for r in records[len(heavy):] if r.ok]
    recovered = _recovered_after(after, drop, 2 * low_p99)
    lone = run_closed_loop(setup.server.grpc_url, setup.names[system], setup.queries[:1], concurrency=1, n=1,
                           timeout=TIMEOUT_S)
    lone_ms = lone.records[0].latency * 1e3 if lone.records and lone.records[0].ok else float("nan")
    rss = (sampler.samples[0][1], sampler.samples[-1][1]) if sampler.samples else (0.0, 0.0)
    return OverloadFigures(system, sustained, factor * sustained, answered_qps, refused, other, longest,
                           answered_p99, low_p99 * 1e3, recovered, lone_ms, rss)


def _recovered_after(after: list, drop: float, bound: float) -> float | None:
    """Seconds after the drop from which every query answered was within `bound` (its send time)."""
    last_slow = None
    for r in after:
        if r.latency is not None and r.latency > bound:
            last_slow = r
    if last_slow is None:
        return 0.0
    later = [r for r in after if r.send > last_slow.send]
    return None if not later else max(0.0, later[0].send - drop)


def goodput(setup: Setup, rate: float, target: float, seconds: float, seed: int) -> dict[str, dict[str, float]]:
    offsets = poisson(rate, int(rate * seconds), rng=seed)
    out = {}
    for system in ("dvabatch_unbounded", "dvabatch", "dvabatch_slo"):
        result = _open(setup, system, offsets, seed + 1)
        summary = result.summary(latency_target=target)
        out[system] = {"goodput_qps": summary["goodput_qps"], "answered": summary["answered"],
                       "errors": summary["errors"], "p99_ms": summary.get("latency_p99_ms") or float("nan")}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.reliability.overload", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bert", help="zoo model (default: %(default)s)")
    parser.add_argument("--size", default="bench", help="zoo size preset (default: %(default)s)")
    parser.add_argument("--target-ms", type=float, default=100.0, help="p99 latency target (default: %(default)s)")
    parser.add_argument("--factor", type=float, default=3.0, help="overload, x the sustained rate (default: %(default)s)")
    parser.add_argument("--seconds", type=float, default=20.0, help="overload duration (default: %(default)s)")
    parser.add_argument("--goodput-factor", type=float, default=1.5, help="(default: %(default)s)")
    parser.add_argument("--systems", default="dvabatch,zerobatch", help="systems overloaded (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("work/perf"), help="where slices are kept (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: a 1-s closed-loop estimate, 5 short steps, 1 s of low load before the "
                             "overload and 2 s after")
    args = parser.parse_args(argv)
    return run(args)


def run(args: argparse.Namespace) -> int:
    import shutil

    from perf.baselines.bench import sample_queries

    target = args.target_ms / 1000.0
    repo, manifest, int_high, names = serve(args.out, args.model, args.size, args.target_ms)
    try:
        with TritonServer(repo) as server:
            for name in names.values():
                server.wait_model_ready(name, timeout=600)
            queries, lengths = sample_queries(manifest, int_high, 256, args.seed)
            setup = Setup(server, manifest, queries, lengths, names)
            try:
                measure(setup, args, target)
            except Exception:
                print(f"failed; the server's log ends:\n{server.log_tail(60)}", file=sys.stderr)
                raise
    finally:
        shutil.rmtree(repo, ignore_errors=True)
    return 0


def measure(setup: Setup, args: argparse.Namespace, target: float) -> None:
    from perf.reliability.soak import stub_pids

    server, manifest, names = setup.server, setup.manifest, setup.names
    plan = QUICK if args.quick else Plan()
    print(f"{args.model} ({args.size}), {manifest.num_stages} stages, bs_max {manifest.max_batch_size}, "
          f"target p99 {args.target_ms:g} ms", flush=True)
    sustained = {}
    for system in args.systems.split(","):
        estimate = closed_loop_peak(setup, system, plan.peak_seconds)
        sustained[system], steps = sustained_rate(setup, system, target, estimate, args.seed + 10, plan)
        print(f"{system}: closed-loop peak {estimate:.1f} qps; sustained {sustained[system]:.1f} qps "
              f"(steps: " + ", ".join(f"{r:.0f}:{s.get('latency_p99_ms') or 0:.0f}ms"
                                      + ("!" if s['errors'] else "") for r, s in steps) + ")", flush=True)
    if len(sustained) > 1:
        base = sustained.get("zerobatch") or 0.0
        if base:
            print(f"sustained rate ratio dvabatch / zerobatch: {sustained.get('dvabatch', 0.0) / base:.2f}")
    print(f"\noverload at {args.factor:g}x each system's sustained rate for {args.seconds:g} s, "
          f"then {LOW_LOAD:g}x for {plan.recovery_seconds:g} s:", flush=True)
    for system, rate in sustained.items():
        if rate <= 0:
            print(f"{system}: no sustained rate under the target; skipped")
            continue
        figures = overload(setup, system, rate, args.factor, args.seconds, args.seed + 20,
                           stub_pids(server, [names[system]]), plan)
        print(figures.line(), flush=True)
    rate = args.goodput_factor * sustained.get("dvabatch", 0.0)
    if rate > 0:
        print(f"\ngoodput (answers within {args.target_ms:g} ms per second) at {args.goodput_factor:g}x "
              f"dvabatch's sustained rate ({rate:.1f} qps), {args.seconds:g} s each:", flush=True)
        figures = goodput(setup, rate, target, args.seconds, args.seed + 30)
        for system, f in figures.items():
            print(f"  {system:<20} goodput {f['goodput_qps']:7.1f} qps, answered {f['answered']}, "
                  f"refused/failed {f['errors']}, p99 of answered {f['p99_ms']:.0f} ms")
        off = figures["dvabatch_unbounded"]["goodput_qps"]
        on = figures["dvabatch_slo"]["goodput_qps"]
        print(f"  admission on / off: {on / off:.2f}x" if off > 0 else "  admission off: no goodput at all")


if __name__ == "__main__":
    sys.exit(main())
