"""Overload is refused and good load is not: a sliced model served with the config the slicer wrote
(its policy, the fast path on), and the same with the pipeline forced (`fast_path: false`), in one
server, one after the other:

    python -m perf.reliability.refusals MODEL_DIR [--factor 3] [--seconds 15] [--seed 0]

For each system:
  1. the sustained rate: a closed loop of `--clients` clients (16) for 5 s;
  2. a lone query's time: `LONE` queries one at a time (mean and the longest);
  3. good load, which nothing may refuse: Poisson at 0.5x and 0.9x the sustained rate, and bursts
     (Gamma, CV 4) at 0.5x, `--seconds` each;
  4. overload: Poisson at `--factor` x the sustained rate for `--seconds`, every request over gRPC
     with a `--deadline` (20 s) client deadline: answered, refused (503 / UNAVAILABLE), past the
     deadline, other errors; the answered p99 against the longest lone query; the answered rate
     against the sustained rate; then, 5 s after the load stopped, lone queries again, each against
     the usual lone time.

Exits 1 if any query got an error other than a refusal or a deadline. The figures are the check's;
nothing here is asserted (the targets are in the issue this answers, reported beside them).
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from dvabatch_backend.runtime.manifest import Manifest
from dvabatch_backend.tools.serve import TritonServer
from perf.load.arrivals import gamma, poisson
from perf.load.drivers import run_closed_loop, run_open_loop
from perf.load.stats import LoadResult

LONE = 20  # lone queries, one at a time, for the usual time
CALM_SECONDS = 5.0  # after the overload, before the lone queries
GOOD_LOADS = (("poisson", 0.5), ("poisson", 0.9), ("gamma-cv4", 0.5))


def is_refusal(error: str | None) -> bool:
    return bool(error) and ("UNAVAILABLE" in error or "503" in error)  # type: ignore[operator]


# what each refusal says, in the order tried: the first phrase found names its cause
REFUSAL_CAUSES = (("calls have come full", "Triton's queue"), ("Exceeds maximum queue size", "the bound"),
                  ("Request timeout expired", "timeout"), ("cannot meet", "latency target"))


def refusal_cause(error: str) -> str:
    return next((cause for phrase, cause in REFUSAL_CAUSES if phrase in error), "other")


def is_past_deadline(error: str | None) -> bool:
    return bool(error) and "DEADLINE_EXCEEDED" in error  # type: ignore[operator]


@dataclass(frozen=True)
class LoadFigures:
    """One open-loop run: what came back."""

    label: str
    rate: float
    sent: int
    ok: int
    refused: int
    past_deadline: int
    other: int
    p99_ms: float
    mean_ms: float
    answered_qps: float  # answers given while the load lasted, per second of it
    causes: dict[str, int]  # refusals by cause (`refusal_cause`)

    @classmethod
    def of(cls, label: str, rate: float, result: LoadResult, last_send: float) -> "LoadFigures":
        records = result.records
        ok = [r for r in records if r.ok]
        latencies = np.array([r.latency for r in ok if r.latency is not None]) * 1e3
        refused = sum(1 for r in records if not r.ok and is_refusal(r.error))
        late = sum(1 for r in records if not r.ok and is_past_deadline(r.error))
        during = sum(1 for r in ok if r.answer is not None and r.answer <= last_send)
        causes = Counter(refusal_cause(r.error or "") for r in records if not r.ok and is_refusal(r.error))
        return cls(label, rate, len(records), len(ok), refused, late, len(records) - len(ok) - refused - late,
                   float(np.percentile(latencies, 99)) if len(latencies) else float("nan"),
                   float(latencies.mean()) if len(latencies) else float("nan"), during / max(last_send, 1e-9),
                   dict(causes))

    def line(self) -> str:
        return (f"  {self.label:<16} {self.rate:7.1f} qps | sent {self.sent:5d} | ok {self.ok:5d} | refused {self.refused:5d} "
                f"| past deadline {self.past_deadline:4d} | other errors {self.other:3d} | answered mean {self.mean_ms:8.1f} ms, "
                f"p99 {self.p99_ms:8.1f} ms | answered {self.answered_qps:6.1f} qps while it lasted"
                + ("".join(f" | {cause}: {n}" for cause, n in sorted(self.causes.items()))))


def lone_times(url: str, model: str, queries: Sequence[dict], n: int, timeout: float) -> list[float]:
    result = run_closed_loop(url, model, list(queries[:n]), concurrency=1, n=n, timeout=timeout)
    failed = [r.error for r in result.records if not r.ok]
    if failed:
        raise RuntimeError(f"{model}: a lone query failed: {failed[0]}")
    return [r.latency for r in result.records if r.latency is not None]


def open_loop(url: str, model: str, queries: Sequence[dict], lengths: Sequence[int] | None, offsets: np.ndarray,
              seed: int, timeout: float) -> LoadResult:
    rng = np.random.default_rng(seed)
    pick = rng.integers(0, len(queries), size=len(offsets))
    return run_open_loop(url, model, [queries[i] for i in pick], offsets, timeout=timeout,
                         lengths=None if lengths is None else [lengths[i] for i in pick])


def measure(server: TritonServer, model: str, manifest: Manifest, queries: list[dict], lengths: list[int] | None,
            args: argparse.Namespace) -> list[LoadFigures]:
    url = server.grpc_url
    run_closed_loop(url, model, queries, concurrency=args.clients, n=4 * args.clients, timeout=args.deadline)  # warm up
    sustained = args.sustained or run_closed_loop(url, model, queries, concurrency=args.clients, duration=5.0,
                                                  timeout=args.deadline).throughput()
    lone = lone_times(url, model, queries, LONE, args.deadline)
    usual, longest = float(np.mean(lone)), float(np.max(lone))
    how = "given" if args.sustained else f"closed loop, {args.clients} clients, 5 s"
    print(f"{model}: sustained {sustained:.1f} qps ({how}); lone query mean "
          f"{usual * 1e3:.1f} ms, longest {longest * 1e3:.1f} ms", flush=True)
    figures = []
    for k, (kind, factor) in enumerate(() if args.overload_only else GOOD_LOADS):
        rate = factor * sustained
        n = max(30, int(rate * args.seconds))
        offsets = poisson(rate, n, rng=args.seed + k) if kind == "poisson" else gamma(rate, 4.0, n, rng=args.seed + k)
        f = LoadFigures.of(f"{kind} {factor:g}x", rate, open_loop(url, model, queries, lengths, offsets,
                                                                  args.seed + 10 + k, args.deadline), float(offsets[-1]))
        print(f.line(), flush=True)
        figures.append(f)
    if args.no_overload:
        return figures
    rate = args.factor * sustained
    offsets = poisson(rate, int(rate * args.seconds), rng=args.seed + 20)
    heavy = LoadFigures.of(f"poisson {args.factor:g}x", rate, open_loop(url, model, queries, lengths, offsets,
                                                                         args.seed + 30, args.deadline), float(offsets[-1]))
    print(heavy.line(), flush=True)
    time.sleep(CALM_SECONDS)
    after = lone_times(url, model, queries[LONE:], 5, args.deadline)
    print(f"  overload: answered p99 {heavy.p99_ms:.0f} ms = the longest lone query + "
          f"{(heavy.p99_ms - longest * 1e3) / 1e3:.2f} s; answered {heavy.answered_qps / sustained:.0%} of the "
          f"sustained rate; {CALM_SECONDS:g} s after it, lone queries took "
          + ", ".join(f"{t * 1e3:.1f}" for t in after) + f" ms ({max(after) / usual:.2f}x the usual {usual * 1e3:.1f} ms)",
          flush=True)
    figures.append(heavy)
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.reliability.refusals", description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", type=Path, help="a model folder as `dvabatch slice` wrote it")
    parser.add_argument("--factor", type=float, default=3.0, help="overload, x the sustained rate (default: %(default)s)")
    parser.add_argument("--seconds", type=float, default=15.0, help="each open-loop load (default: %(default)s)")
    parser.add_argument("--deadline", type=float, default=20.0, help="client deadline, s (default: %(default)s)")
    parser.add_argument("--clients", type=int, default=16, help="closed-loop clients (default: %(default)s)")
    parser.add_argument("--systems", default="slicer,pipeline",
                        help="slicer (its config as written), pipeline (the same, fast_path false) (default: %(default)s)")
    parser.add_argument("--sustained", type=float, default=None,
                        help="the sustained rate (qps) the loads are scaled to, instead of measuring it: runs compare")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-overload", action="store_true", help="the good loads only (a before/after of their speed)")
    parser.add_argument("--overload-only", action="store_true", help="the overload only (a before/after of it)")
    args = parser.parse_args(argv)
    return run(args)


def run(args: argparse.Namespace) -> int:
    import onnx

    from perf.baselines.bench import sample_queries
    from slicer.profiler import int_bounds
    from slicer.triton_files import add_model_copy

    model_dir = args.model_dir
    version_dir = (model_dir / "1").resolve()
    manifest = Manifest.load(version_dir / "manifest.json")
    full = onnx.load(str(version_dir / (manifest.full_model or "model.onnx")), load_external_data=False)
    int_high = {**int_bounds(full), **manifest.input_bounds}
    queries, lengths = sample_queries(manifest, int_high, 512, args.seed)
    variants = {"slicer": ({}, manifest.name), "pipeline": ({"fast_path": "false"}, f"{manifest.name}_pipeline")}
    chosen = [variants[s] for s in args.systems.split(",")]
    repo = Path(tempfile.mkdtemp(prefix="dvabatch-refusals-"))
    other = 0
    try:
        for values, name in chosen:
            add_model_copy(repo, model_dir, name, values)
        with TritonServer(repo) as server:
            for _, name in chosen:
                server.wait_model_ready(name, timeout=600)
            for _, name in chosen:
                other += sum(f.other for f in measure(server, name, manifest, queries, lengths, args))
    finally:
        shutil.rmtree(repo, ignore_errors=True)
    return 1 if other else 0


if __name__ == "__main__":
    sys.exit(main())
