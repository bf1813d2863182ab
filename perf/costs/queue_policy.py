"""What a queue policy on Triton's own queue costs a light load:

    python -m perf.costs.queue_policy MODEL_DIR [--rate QPS] [--timeout-us US | --queue-size N] [--rounds 6]

Serves the sliced model twice in one tritonserver, its config as written and the same with a
`dynamic_batching.default_queue_policy` (a `default_timeout_microseconds`, or a `max_queue_size`),
and sends both the same Poisson load (`--rate`, about half the sustained rate is a light load) in
alternating rounds of `--seconds`. Prints each round's mean and p99 and the median of the paired
differences of the means. Triton turns off its batcher's prefetching (forming the next batch while
the instance runs) under any such policy; this measures what that costs the model's answers.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Sequence

import numpy as np

from dvabatch_backend.runtime.manifest import Manifest
from dvabatch_backend.tools.serve import TritonServer
from perf.load.arrivals import poisson
from perf.load.drivers import run_closed_loop, run_open_loop

SYSTEMS = ("as written", "with the policy")


def policy_text(timeout_us: int, queue_size: int) -> str:
    """The `default_queue_policy` block's body."""
    if queue_size:
        return f"    max_queue_size: {queue_size}\n"
    return f"    default_timeout_microseconds: {timeout_us}\n    allow_timeout_override: true\n"


def with_policy(config: str, body: str) -> str:
    """`config` (config.pbtxt) with the queue policy `body` in its `dynamic_batching` block."""
    start = config.index("dynamic_batching {")
    return config[:start] + "dynamic_batching {\n  default_queue_policy {\n" + body + "  }\n" + config[start + len("dynamic_batching {"):]


def main(argv: Sequence[str] | None = None) -> int:
    from perf.baselines.bench import sample_queries
    from slicer.triton_files import add_model_copy

    parser = argparse.ArgumentParser(prog="python -m perf.costs.queue_policy", description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", type=Path, help="a model folder as `dvabatch slice` wrote it")
    parser.add_argument("--rate", type=float, default=60.0, help="Poisson arrivals, queries/s (default: %(default)s)")
    parser.add_argument("--timeout-us", type=int, default=500_000,
                        help="the policy's default_timeout_microseconds (default: %(default)s)")
    parser.add_argument("--queue-size", type=int, default=0, help="a max_queue_size policy instead of the timeout")
    parser.add_argument("--rounds", type=int, default=6, help="alternating rounds (default: %(default)s)")
    parser.add_argument("--seconds", type=float, default=10.0, help="each round's load (default: %(default)s)")
    args = parser.parse_args(argv)

    manifest = Manifest.load((args.model_dir / "1").resolve() / "manifest.json")
    queries, _ = sample_queries(manifest, dict(manifest.input_bounds), 512, 0)
    repo = Path(tempfile.mkdtemp(prefix="dvabatch-queue-policy-"))
    names = {"as written": "written", "with the policy": "policy"}
    means: dict[str, list[float]] = {system: [] for system in SYSTEMS}
    try:
        for name in names.values():
            add_model_copy(repo, args.model_dir, name, {})
        config = repo / names["with the policy"] / "config.pbtxt"
        config.write_text(with_policy(config.read_text(), policy_text(args.timeout_us, args.queue_size)))
        with TritonServer(repo) as server:
            for name in names.values():
                server.wait_model_ready(name, timeout=600)
                run_closed_loop(server.grpc_url, name, queries, concurrency=8, n=64, timeout=20)  # warm up
            for r in range(args.rounds):
                offsets = poisson(args.rate, int(args.rate * args.seconds), rng=100 + r)
                pick = np.random.default_rng(r).integers(0, len(queries), size=len(offsets))
                for system in SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]:
                    result = run_open_loop(server.grpc_url, names[system], [queries[i] for i in pick], offsets, timeout=20)
                    latencies = np.array([q.latency for q in result.records if q.ok]) * 1e3
                    errors = len(result.records) - len(latencies)
                    means[system].append(float(latencies.mean()))
                    print(f"round {r} {system:<16} mean {latencies.mean():7.1f} ms, p99 "
                          f"{np.percentile(latencies, 99):7.1f} ms, errors {errors}", flush=True)
    finally:
        shutil.rmtree(repo, ignore_errors=True)
    diffs = [b - a for a, b in zip(means["as written"], means["with the policy"])]
    print(f"with the policy - as written, mean: median of paired differences {np.median(diffs):+.1f} ms "
          f"(rounds: {', '.join(f'{d:+.1f}' for d in diffs)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
