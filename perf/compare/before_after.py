"""The served path before a change against after it, on one model, in one server, rounds alternating:

    python -m perf.compare.before_after --model-dir DIR --before CHECKOUT [--device cpu|simulated] [OPTIONS]

`CHECKOUT` is another checkout of this repository (`git worktree add ../before REV`). One
tritonserver serves the sliced model twice with its config untouched (on `--device simulated`, the
stand-in's config as `perf.compare --device simulated` writes it): `after`, the code this command
runs from, and `before`, whose stub imports the runtime from `CHECKOUT` first; and ZeroBatch over the
unsliced model, whose closed-loop peak sets the loads. Each round sends the same seeded queries to
`before` and `after`, the order alternating: `--queries` one at a time (the lone query), then a
Poisson schedule of at least `--queries` at each of `--loads` (fractions of ZeroBatch's peak).
For each figure: every round's, and the median of the paired differences (after - before). With
`--sustained ROUNDS`, each one's sustained rate on one grid (`on_device.sustained_rates`), in that
many rounds. Writes
OUT/before_after.json and prints the table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dvabatch_backend.runtime.engine import available_cores
from dvabatch_backend.runtime.manifest import Manifest
from dvabatch_backend.tools.serve import TritonServer
from perf.baselines import add_baseline
from perf.baselines.bench import sample_queries
from perf.compare.by_own_driver import warm_up_and_peak
from perf.compare.on_device import TIMEOUT_S, device_config, poisson_schedule, sustained_rates
from perf.compare.served_metrics import ADAPTER_SAMPLE_S, batch_reports, scrape
from perf.load.drivers import alternating, run_closed_loop, run_open_loop
from slicer import model_config
from slicer.triton_files import STUB_PATHS, add_model_copy

REPO = Path(__file__).resolve().parents[2]
LOADS = (0.25, 0.5, 0.9)
QUERIES, ROUNDS = 500, 5
PEAK_SECONDS = 4.0


def before_entry(checkout: Path) -> str:
    """A version folder's `model.py` importing the adapter from `checkout` first."""
    return (f'"""The adapter as {checkout} has it (perf.compare.before_after)."""\n{STUB_PATHS}\n'
            f"sys.path.insert(0, {str(checkout)!r})\n"
            "from dvabatch_backend.triton_adapter.model import TritonPythonModel  # noqa: E402,F401\n")


def build_repository(scratch: Path, model_dir: Path, before: Path, device: str, device_profile: str | None
                     ) -> dict[str, str]:
    """{system: model name}: `before`, `after` and `ZeroBatch` (module docstring)."""
    version_dir = (model_dir / "1").resolve()
    manifest = json.loads((version_dir / "manifest.json").read_text())
    name = manifest["name"]
    text = (model_dir / "config.pbtxt").read_text()
    if device == "simulated":
        text = device_config(text, manifest, device, device_profile)
    systems = {"before": f"{name}_before", "after": f"{name}_after"}
    for label, model in systems.items():
        add_model_copy(scratch, model_dir, model)
        (scratch / model / "config.pbtxt").write_text(model_config.with_parameters(text, {}, model))
    own_entry(scratch / systems["before"] / "1", before_entry(before.resolve()))
    engine, on = ("simulated", "cpu") if device == "simulated" else ("onnxruntime", "cpu")
    systems["ZeroBatch"] = f"{name}_zerobatch"
    threads = 1 if device == "simulated" else available_cores()  # the CPU baseline on every core, as served
    add_baseline(scratch, version_dir, systems["ZeroBatch"], 0, threads=threads, engine=engine, device=on,
                 device_profile=device_profile)
    return systems


def own_entry(version_link: Path, entry: str) -> None:
    """Replace the linked version folder `version_link` by a folder of its own that links each file
    of the shared one but `model.py`, which is `entry`: written through the link, the entry would
    replace the shared folder's own, and every system would run it."""
    shared = version_link.resolve()
    version_link.unlink()
    version_link.mkdir()
    for item in shared.iterdir():
        if item.name not in ("model.py", "__pycache__"):
            (version_link / item.name).symlink_to(item, target_is_directory=item.is_dir())
    (version_link / "model.py").write_text(entry)


def paired(rounds: Mapping[str, Sequence[dict[str, Any]]], key: str) -> dict[str, Any]:
    """Each round's `key` for before and after, and the median of after - before."""
    b = [r.get(key) for r in rounds["before"]]
    a = [r.get(key) for r in rounds["after"]]
    diffs = [y - x for x, y in zip(b, a) if x is not None and y is not None]
    return {"before": b, "after": a, "median_diff": statistics.median(diffs) if diffs else None}


def measure(url: str, systems: Mapping[str, str], manifest: Manifest, int_high: Mapping[str, int], queries: int,
            rounds: int, loads: Sequence[float], sustained: int, seed: int = 0,
            metrics_url: str | None = None) -> dict[str, Any]:
    """The lone query and each load in `rounds` rounds, then `sustained` rounds of the sustained rates
    (the order alternating), each on ZeroBatch's peak (module docstring). With `metrics_url`, each
    load's batches as served (`served_metrics.batch_report`: the batch table's share of the answers,
    the meta operations)."""
    pair = [systems["before"], systems["after"]]
    labels = {model: label for label, model in systems.items()}
    peak = warm_up_and_peak(url, [*pair, systems["ZeroBatch"]], manifest, int_high, PEAK_SECONDS, seed, TIMEOUT_S)
    print(f"ZeroBatch peak {peak:.1f} qps", flush=True)
    result: dict[str, Any] = {"zerobatch_peak_qps": peak, "loads": []}
    lone: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    for turn in range(rounds):
        sample, _ = sample_queries(manifest, int_high, queries, seed + 300 + turn)
        for model in alternating(pair, turn):
            run = run_closed_loop(url, model, sample, concurrency=1, n=len(sample), timeout=TIMEOUT_S)
            lone[labels[model]].append(run.summary())
    result["lone"] = {"mean_ms": paired(lone, "latency_mean_ms"), "p99_ms": paired(lone, "latency_p99_ms"),
                      "answered": {k: [r["answered"] for r in v] for k, v in lone.items()}}
    print(line("lone", result["lone"]), flush=True)
    for k, fraction in enumerate(loads):
        runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
        scraped = scrape(metrics_url) if metrics_url else None
        for turn in range(rounds):
            sample, lengths, offsets = poisson_schedule(manifest, int_high, fraction * peak, queries,
                                                        seed + 200 + 10 * k + turn, seed + 100 + 10 * k + turn)
            for model in alternating(pair, k + turn):
                run = run_open_loop(url, model, sample, offsets, timeout=TIMEOUT_S, lengths=lengths)
                runs[labels[model]].append(run.summary())
        load = {"fraction": fraction, "rate_qps": fraction * peak, "mean_ms": paired(runs, "latency_mean_ms"),
                "p99_ms": paired(runs, "latency_p99_ms"),
                "answered": {k: [r["answered"] for r in v] for k, v in runs.items()},
                "queries": [r["queries"] for r in runs["after"]]}
        if scraped is not None:
            time.sleep(2 * ADAPTER_SAMPLE_S)  # the adapter's last counts reach the server
            load["batches"] = batch_reports(scraped, scrape(metrics_url), {k: systems[k] for k in ("before", "after")})
        result["loads"].append(load)
        print(line(f"{fraction:g}x", load), flush=True)
        for label, report in load.get("batches", {}).items():
            print(f"        {label}: {json.dumps(report)}", flush=True)
    lone_ms = statistics.median(r["latency_mean_ms"] for r in lone["before"]) if lone["before"] else None
    result["sustained"] = []
    for turn in range(sustained if lone_ms else 0):
        found: dict[str, Any] = {}
        sustained_rates(url, systems, alternating(["before", "after"], turn), manifest, int_high, peak, lone_ms,
                        queries, seed + turn, found)
        result["sustained"].append({label: figure["rate_qps"] for label, figure in found["systems"].items()})
    if result["sustained"]:
        rates = {label: [r[label] for r in result["sustained"]] for label in ("before", "after")}
        result["sustained_summary"] = {"before": rates["before"], "after": rates["after"],
                                       "after_median": statistics.median(rates["after"]),
                                       "before_lowest": min(rates["before"])}
        print(f"sustained rounds (qps): before {rates['before']}, after {rates['after']}", flush=True)
    return result


def line(label: str, figure: Mapping[str, Any]) -> str:
    mean = figure["mean_ms"]
    rounds = " ".join(f"{b:.2f}/{a:.2f}" for b, a in zip(mean["before"], mean["after"]) if b is not None and a is not None)
    return (f"{label:>6}: mean after - before, median of pairs {mean['median_diff']:+.3f} ms "
            f"(rounds before/after: {rounds}); p99 {figure['p99_ms']['median_diff']:+.3f} ms; "
            f"answered {figure['answered']}")


def main(argv: Sequence[str] | None = None) -> int:
    import onnx

    from slicer.profiler import int_bounds

    parser = argparse.ArgumentParser(prog="python -m perf.compare.before_after", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, required=True, help="a sliced model folder (config.pbtxt and 1/)")
    parser.add_argument("--before", type=Path, required=True, help="a checkout of the code before the change")
    parser.add_argument("--device", choices=("cpu", "simulated"), default="cpu")
    parser.add_argument("--device-profile", type=Path, help="the stand-in's device profile (--device simulated)")
    parser.add_argument("--queries", type=int, default=QUERIES, help="queries per system, figure and round")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--loads", default=",".join(f"{f:g}" for f in LOADS), help="fractions of ZeroBatch's peak")
    parser.add_argument("--sustained", type=int, default=0, metavar="ROUNDS",
                        help="also each one's sustained rate, in this many rounds")
    parser.add_argument("--out", type=Path, default=REPO / "work" / "perf" / "before_after")
    args = parser.parse_args(argv)
    if args.device == "simulated" and args.device_profile is None:
        parser.error("--device simulated needs --device-profile")
    profile = str(args.device_profile.resolve()) if args.device_profile else None
    version_dir = (args.model_dir / "1").resolve()
    manifest = Manifest.load(version_dir / "manifest.json")
    full = onnx.load(str(version_dir / (manifest.full_model or "model.onnx")), load_external_data=False)
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dvabatch-before-after-") as tmp:
        systems = build_repository(Path(tmp), args.model_dir, args.before, args.device, profile)
        with TritonServer(Path(tmp)) as server:
            for name in systems.values():
                server.wait_model_ready(name, timeout=600)
            result = measure(server.grpc_url, systems, manifest, int_bounds(full), args.queries, args.rounds,
                             tuple(float(f) for f in args.loads.split(",") if f), args.sustained,
                             metrics_url=server.metrics_url)
    result.update(model=manifest.name, device=args.device, device_profile=profile, before=str(args.before),
                  queries=args.queries, rounds=args.rounds, seconds=time.perf_counter() - began)
    out = args.out / args.model_dir.name
    out.mkdir(parents=True, exist_ok=True)
    (out / "before_after.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out / 'before_after.json'} ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
