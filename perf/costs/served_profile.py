"""Where the served path spends its CPU, per query: py-spy on the stub under closed-loop load.

    python -m perf.costs.served_profile MODEL_DIR [--clients 8 | --rate 1200] [--seconds 8] [--lengths sst2]
        [--param fast_path=false] [--out work/profile]

One tritonserver serves the sliced model folder (its config.pbtxt as written, plus any `--param`)
beside its ZeroBatch, twice: onnxruntime's threads asleep between runs, and spinning as they do by
default (`ZeroBatch-spin`: a user's own model; spinning costs CPU between queries that the first
does not spend); perf_analyzer drives each in turn at `--clients` (closed loop), or with
`--rate` at that many Poisson arrivals a second (open loop), while py-spy
samples that model's stub (every thread; a thread waiting in a lock, event or queue is idle and left
out). Each sample is charged to one part of
the path, the first of `PARTS` found walking its stack from the innermost frame out; the report
gives each part's CPU in microseconds per answered query, and the stub's whole CPU per query (from
/proc, which also counts what py-spy cannot see: onnxruntime's own threads). OUT gets the raw
stacks and a flame graph (SVG) per system; they are not committed.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Sequence

DEFAULT_OUT = Path(__file__).resolve().parents[2] / "work" / "profile"
SAMPLE_RATE = 250  # py-spy samples a second
# (part, function names): a sample is charged to the first part one of its frames names, leaf first
PARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("engine (onnxruntime)", ("run_with_iobinding", "InferenceSession.run", "OrtRunner.run", "OrtStageEngine.run")),
    ("answers: build and send", ("_RequestAnswer.send", "_RequestAnswer.response", "TritonPythonModel._send",
                                 "TritonPythonModel._release", "_batched", "split_outputs", "_send", "_Responder._loop")),
    ("copies in and out of batches", ("gather_rows", "gather_inputs", "scatter_outputs", "cut_to", "pad_batch",
                                      "_rows_alone", "_split_rows")),
    ("batching: policy and scheduler", ("on_arrival", "Scheduler.", "QueryTable.", "BatchTable.",
                                        "StageBoard.", "SplitStep.", "Admission.", "check_plan", "arrival_refusal",
                                        "EngineLoop.", "Pipeline.")),
    ("reading requests", ("TritonPythonModel._inputs", "TritonPythonModel._rows", "_read", "parse_request",
                          "read_query", "validate_inputs")),
    ("cancel watch, metrics", ("_CancelWatch", "StageMetrics")),
    ("execute, other", ("execute",)),
)


# a thread whose innermost Python frame is one of these waits (py-spy counts a timed wait as running)
IDLE_LEAVES = ("Condition.wait", "Event.wait", "SimpleQueue.get", "Queue.get", "Thread.join", "Semaphore.acquire")


def part_of(frames: Sequence[str]) -> str:
    """The part a sample's stack (root first) is charged to; "idle" for a thread that waits."""
    if frames and frames[-1].split(" (")[0] in IDLE_LEAVES:
        return "idle"
    for frame in reversed(frames):
        name = frame.split(" (")[0]
        for part, markers in PARTS:
            if any(name == m or name.startswith(m) or name.endswith("." + m) or m in name for m in markers):
                return part
    return "other"


def charge(raw: Path) -> Counter[str]:
    """Samples per part from py-spy's raw (collapsed) output."""
    parts: Counter[str] = Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            parts[part_of(stack.split(";")[1:])] += int(count)
    return parts


def cpu_seconds(pid: int) -> float:
    """The process's CPU time so far (user and system, every thread)."""
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def profile(model_dir: Path, clients: int, seconds: float, preset: str, params: dict[str, str],
            out: Path, rate: float | None = None) -> dict[str, dict]:
    from dvabatch_backend.tools.serve import TritonServer
    from perf.load.perf_analyzer import ensure_system_deps, run_perf_analyzer
    from slicer.model_config import with_parameters
    from perf.compare.by_perf_analyzer import (DVA, build_repository, failure_counts, stub_pid,
                                                 write_queries)

    ensure_system_deps()
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, dict] = {}
    load: dict = ({"request_rate_range": (rate,), "request_distribution": "poisson", "async_mode": True}
                  if rate else {"concurrency_range": (clients,)})
    with tempfile.TemporaryDirectory(prefix="dvabatch-served-profile-") as tmp:
        scratch = Path(tmp)
        names = build_repository(scratch / "repo", model_dir, delay_batch_too=False, spinning=True)
        config = scratch / "repo" / names[DVA] / "config.pbtxt"
        config.write_text(with_parameters(config.read_text(), params))
        data = write_queries(scratch / "input_data.json", model_dir, {}, preset)
        with TritonServer(scratch / "repo") as server:
            for name in names.values():
                server.wait_model_ready(name, timeout=300)
            for label, model in names.items():
                run_perf_analyzer(model, server.grpc_url, protocol="grpc", input_data=data,
                                  **load, measurement_interval_ms=500,
                                  stability_percentage=1000.0, max_trials=3)  # warm-up
                pid = stub_pid(server, model)
                raw, svg = out / f"{label}.txt", out / f"{label}.svg"
                before, cpu0 = failure_counts(server.http_url, model)[0], cpu_seconds(pid)
                window_ms = int(seconds * 1000 / 3)
                spy = [sys.executable, "-m", "py_spy"] if _has_module("py_spy") else ["py-spy"]
                recorders = [subprocess.Popen([*spy, "record", "-p", str(pid), "-d", str(int(seconds) + 2), "-r",
                                               str(SAMPLE_RATE), "--nonblocking", "--threads", "-f", fmt, "-o", str(path)],
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                             for fmt, path in (("raw", raw), ("flamegraph", svg))]
                began = time.perf_counter()
                result = run_perf_analyzer(model, server.grpc_url, protocol="grpc", input_data=data,
                                           **load, measurement_interval_ms=window_ms,
                                           stability_percentage=1000.0, max_trials=3)
                for recorder in recorders:
                    recorder.wait(timeout=seconds + 30)
                elapsed = time.perf_counter() - began
                answered = failure_counts(server.http_url, model)[0] - before
                stub_cpu = cpu_seconds(pid) - cpu0
                parts = charge(raw) if raw.is_file() else Counter()
                # py-spy saw (seconds + 2) s of the run's `elapsed`: the queries answered meanwhile
                seen = max(answered, 1) * min(1.0, (seconds + 2) / elapsed)
                per_query = {part: round(n / SAMPLE_RATE / seen * 1e6, 1) for part, n in parts.most_common()
                             if part != "idle"}
                report[label] = {"model": model, "clients": None if rate else clients, "rate": rate,
                                 "answered": answered,
                                 "throughput": result.rows[0].throughput if result.rows else None,
                                 "stub_cpu_us_per_query": round(stub_cpu / max(answered, 1) * 1e6, 1),
                                 "python_us_per_query_by_part": per_query, "raw": str(raw), "flamegraph": str(svg)}
    return report


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.costs.served_profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", type=Path, help="a sliced model folder (config.pbtxt and 1/)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rate", type=float, default=None, help="Poisson arrivals a second instead of --clients")
    parser.add_argument("--seconds", type=float, default=8.0, help="the profiled window")
    parser.add_argument("--lengths", default="sst2", help="perf.load.lengths preset (default: %(default)s)")
    parser.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                        help="a config.pbtxt parameter for the dvabatch model (e.g. fast_path=false)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    params = dict(p.split("=", 1) for p in args.param)
    report = profile(args.model_dir, args.clients, args.seconds, args.lengths, params, args.out, args.rate)
    for label, r in report.items():
        load = f"Poisson {r['rate']:g}/s" if r["rate"] else f"{r['clients']} clients"
        print(f"{label} ({r['model']}, {load}): {r['throughput'] or 0:.0f}/s, stub CPU "
              f"{r['stub_cpu_us_per_query']:.0f} us a query (every thread, onnxruntime's included); Python stacks:")
        for part, us in r["python_us_per_query_by_part"].items():
            print(f"  {part:<34} {us:8.1f} us")
        print(f"  flame graph: {r['flamegraph']}")
    (args.out / "served_profile.json").write_text(json.dumps({"params": params, **report}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
