"""DVABatch beside Triton's batcher on a GPU, or on the GPU stand-in, served as a user serves it:

    python -m perf.compare --model-dir DIR --device cuda
    python -m perf.compare --model-dir DIR --device simulated --device-profile FILE

The sliced model with the GPU config the Docker image writes (`docker/gpu_config.py`: KIND_GPU,
engine torch, device cuda, one CPU thread, the buffer pairs the manifest chose or the GPU default);
on the stand-in the same config with `engine: simulated`, its `device_profile` and a CPU instance
(there is no GPU to place it on). Beside it, in one tritonserver, ZeroBatch and one DelayBatch per
delay in `DELAYS_US` (0.1 to 2 ms) over the unsliced model on the same engine: the torch engine
capturing the same CUDA-graph buckets, or the stand-in charged at them (perf/baselines/model.py).

Our own open-loop generator drives it (`perf.load.drivers`; perf_analyzer does not go to the GPU
machine). Measured: each system's lone-query mean; ZeroBatch's closed-loop peak (bs_max clients),
which sets the loads (`LOADS`: fractions of it); then at each load the same seeded Poisson
schedule of RTE-like queries (at least `--queries`) to every system, in `--rounds` rounds, the
order alternating; each figure is the median of the rounds. A refusal or an error is an
unanswered query. Prints the table (mean / p99 ms per system and load, DVABatch's ratios to
ZeroBatch and to the better baseline) and writes OUT/on_device.json. `--sustained LABEL,...` also
finds those systems' sustained rates (`sustained_fraction`: the highest Poisson rate, in steps of 0.1x
ZeroBatch's peak, with p99 within 5x ZeroBatch's lone-query mean and every query answered).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from dvabatch_backend.runtime.manifest import Manifest
from dvabatch_backend.tools.serve import TritonServer
from perf.baselines import add_baseline
from perf.baselines.bench import sample_queries
from perf.compare.by_own_driver import lone_latency, warm_up_and_peak
from perf.compare.served_metrics import ADAPTER_SAMPLE_S, batch_reports, scrape
from perf.compare.stub_profile import profiled_stubs
from perf.load.arrivals import poisson
from perf.load.drivers import alternating, run_closed_loop, run_open_loop
from slicer import model_config
from slicer.triton_files import add_model_copy

REPO = Path(__file__).resolve().parents[2]
DEVICES = ("cuda", "simulated")
LOADS = (0.25, 0.6, 0.9, 1.1)  # fractions of ZeroBatch's closed-loop peak
DELAYS_US = (100, 250, 500, 1000, 2000)  # DelayBatch's queue delays, swept
QUERIES = 1000  # per system, load and round
ROUNDS = 2
PEAK_SECONDS = 4.0
TIMEOUT_S = 30.0
DVA = "DVABatch"
SPIED_LONE = 300  # queries one at a time to each system under py-spy (--py-spy)
# the sustained rate (--sustained): the highest Poisson rate, in steps of 10 % of ZeroBatch's peak,
# whose p99 is within SUSTAINED_P99_LONE x ZeroBatch's lone-query mean with every query answered
SUSTAINED_START, SUSTAINED_STEP, SUSTAINED_STOP = 0.5, 0.1, 2.5
SUSTAINED_P99_LONE = 5.0


def gpu_config_module() -> Any:
    """docker/gpu_config.py, the file the Docker image runs (not a package: loaded by path)."""
    spec = importlib.util.spec_from_file_location("gpu_config", REPO / "docker" / "gpu_config.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def device_config(text: str, manifest: Mapping[str, Any], device: str, device_profile: str | None) -> str:
    """config.pbtxt for serving on `device`: the Docker image's GPU config; on the stand-in, that
    config on its engine, with a CPU instance."""
    gpu = gpu_config_module().gpu_config(text, 1, manifest)
    if device == "cuda":
        return gpu
    config = model_config.parse(gpu)
    del config.instance_group[:]
    config.instance_group.add(kind=model_config.pb.ModelInstanceGroup.KIND_CPU, count=1)
    return model_config.dump(model_config.set_parameters(
        config, {"engine": "simulated", "device": "cpu", "device_profile": str(device_profile)}))


def build_repository(scratch: Path, model_dir: Path, device: str, device_profile: str | None,
                     delays_us: Sequence[int] = DELAYS_US, variants: Mapping[str, Mapping[str, str]] | None = None
                     ) -> dict[str, str]:
    """The scratch repository: the sliced model on the device config, ZeroBatch and the DelayBatches
    on the same engine; each of `variants` ({label: parameters}) the device config with those
    parameters set, as a system of its own. {system: model name}, DVABatch first."""
    version_dir = (model_dir / "1").resolve()
    manifest = json.loads((version_dir / "manifest.json").read_text())
    name = manifest["name"]
    add_model_copy(scratch, model_dir, name)
    config = scratch / name / "config.pbtxt"
    text = device_config(config.read_text(), manifest, device, device_profile)
    config.write_text(text)
    engine = ("torch", "cuda") if device == "cuda" else ("simulated", "cpu")
    systems = {DVA: name}
    for label, values in (variants or {}).items():
        systems[label] = f"{name}_{label.lower().replace('-', '_')}"
        add_model_copy(scratch, model_dir, systems[label])
        (scratch / systems[label] / "config.pbtxt").write_text(model_config.with_parameters(text, values,
                                                                                           systems[label]))
    for delay in (0, *delays_us):
        label = "ZeroBatch" if delay == 0 else f"DelayBatch-{delay / 1000:g}ms"
        systems[label] = f"{name}_{'zerobatch' if delay == 0 else f'delay{delay}'}"
        add_baseline(scratch, version_dir, systems[label], delay, threads=1, engine=engine[0], device=engine[1],
                     device_profile=device_profile)
    return systems


def measure(url: str, systems: Mapping[str, str], manifest: Manifest, int_high: Mapping[str, int], queries: int,
            rounds: int, loads: Sequence[float], seed: int = 0, metrics_url: str | None = None,
            partial: Callable[[dict[str, Any]], None] = lambda result: None, spy_out: Path | None = None,
            spied: Sequence[str] = (), sustained: Sequence[str] = ()) -> dict[str, Any]:
    """c1, ZeroBatch's peak, then every load's rounds (module docstring), each load's batch sizes
    from the server's metrics where `metrics_url` is given; `partial` gets the result so far after
    each part, so a run stopped at its time limit keeps what it measured. With `spy_out`, the
    `spied` systems' stubs under py-spy (perf/compare/stub_profile.py): `SPIED_LONE` more queries
    one at a time, and each of their open-loop runs."""
    unknown = [label for label in sustained if label not in systems]
    if unknown:  # before any measuring: a misspelt label would cost the whole run
        raise ValueError(f"--sustained: no system {unknown}; the systems are {list(systems)}")
    names = list(systems.values())
    labels = {model: label for label, model in systems.items()}
    zero = systems["ZeroBatch"]
    peak = warm_up_and_peak(url, [m for m in names if m != zero] + [zero], manifest, int_high, PEAK_SECONDS, seed,
                            TIMEOUT_S)
    print(f"ZeroBatch peak {peak:.1f} qps (closed loop, {manifest.max_batch_size} clients)", flush=True)
    lone = {labels[m]: r.summary() for m, r in lone_latency(url, names, manifest, int_high, seed, TIMEOUT_S).items()}
    print("concurrency 1, mean ms: " + ", ".join(f"{k} {v['latency_mean_ms']:.2f}" for k, v in lone.items()), flush=True)
    result: dict[str, Any] = {"zerobatch_peak_qps": peak, "lone": lone, "loads": []}
    if spy_out is not None:
        queries_c1, _ = sample_queries(manifest, int_high, SPIED_LONE, seed + 400)
        for label in spied:
            with profiled_stubs({label: systems[label]}, spy_out, "c1"):
                run = run_closed_loop(url, systems[label], queries_c1, concurrency=1, n=SPIED_LONE, timeout=TIMEOUT_S)
            result.setdefault("lone_spied", {})[label] = run.summary()
        print("concurrency 1 under py-spy, mean ms: " + ", ".join(
            f"{k} {v['latency_mean_ms']:.2f}" for k, v in result.get("lone_spied", {}).items()), flush=True)
    partial(result)
    for k, fraction in enumerate(loads):
        before = scrape(metrics_url) if metrics_url else None
        rate = fraction * peak
        sample, lengths, offsets = poisson_schedule(manifest, int_high, rate, queries, seed + 200 + k, seed + 100 + k)
        n = len(sample)
        per_round: dict[str, list[dict[str, Any]]] = {label: [] for label in systems}
        for turn in range(rounds):
            for model in alternating(names, k + turn):
                spy = {labels[model]: model} if labels[model] in spied else {}
                with profiled_stubs(spy, spy_out, f"load{fraction:g}-r{turn}"):
                    run = run_open_loop(url, model, sample, offsets, timeout=TIMEOUT_S, lengths=lengths)
                per_round[labels[model]].append(run.summary())
        load = {"fraction": fraction, "rate_qps": rate, "queries": n,
                "systems": {label: median_summary(runs) for label, runs in per_round.items()}}
        if before is not None:
            time.sleep(2 * ADAPTER_SAMPLE_S)  # the adapter's last counts reach the server
            load["batches"] = batch_reports(before, scrape(metrics_url), systems)
        result["loads"].append(load)
        print(row_line(load), flush=True)
        for label, report in load.get("batches", {}).items():
            print(f"  {label} batches: {json.dumps(report)}", flush=True)
        partial(result)
    if sustained:
        result["sustained"] = {}  # filled system by system: a run stopped at its limit keeps those found
        sustained_rates(url, systems, sustained, manifest, int_high, peak, lone["ZeroBatch"]["latency_mean_ms"],
                        queries, seed, result["sustained"], lambda: partial(result))
    return result


def sustained_rates(url: str, systems: Mapping[str, str], labels: Sequence[str], manifest: Manifest,
                    int_high: Mapping[str, int], peak: float, zero_lone_ms: float, queries: int,
                    seed: int, out: dict[str, Any], found: Callable[[], None] = lambda: None) -> None:
    """Each of `labels`' sustained rate (`SUSTAINED_*`) into `out`, `found()` after each: one round a
    rate, the same seeded Poisson schedule of RTE-like queries at a rate for every system; every rate
    tried is kept."""
    bound_ms = SUSTAINED_P99_LONE * zero_lone_ms
    out.update({"p99_bound_ms": bound_ms, "systems": {}})
    for label in labels:
        tried: dict[str, Any] = {}

        def passes(fraction: float) -> bool:
            rate = fraction * peak
            k = round(fraction * 100)
            sample, lengths, offsets = poisson_schedule(manifest, int_high, rate, queries, seed + 500 + k, seed + 600 + k)
            summary = run_open_loop(url, systems[label], sample, offsets, timeout=TIMEOUT_S, lengths=lengths).summary()
            ok = summary["answered"] == summary["queries"] and (summary.get("latency_p99_ms") or 1e18) <= bound_ms
            tried[f"{fraction:g}"] = {"rate_qps": rate, "p99_ms": summary.get("latency_p99_ms"),
                                      "mean_ms": summary.get("latency_mean_ms"), "answered": summary["answered"],
                                      "queries": summary["queries"], "passed": ok}
            return ok

        fraction = sustained_fraction(passes)
        out["systems"][label] = {"fraction": fraction, "rate_qps": fraction * peak, "tried": tried}
        print(f"sustained {label}: {fraction * peak:.0f} qps ({fraction:g}x ZeroBatch's peak; p99 within "
              f"{bound_ms:.1f} ms, every query answered)", flush=True)
        zero = out["systems"].get("ZeroBatch", {}).get("rate_qps")
        for figure in out["systems"].values():
            figure["over_zerobatch"] = figure["rate_qps"] / zero if zero else None
        found()


def sustained_fraction(passes: Callable[[float], bool], start: float = SUSTAINED_START, step: float = SUSTAINED_STEP,
                       stop: float = SUSTAINED_STOP) -> float:
    """The highest load (a fraction of ZeroBatch's peak, on the grid start + k * step) that `passes`:
    from `start` up while each passes, or down from it until one does; 0 where none does."""
    def grid(k: int) -> float:  # the grid's k-th point, free of float drift
        return round(start + k * step, 6)

    k = 0
    if not passes(grid(0)):
        while grid(k - 1) > 0:
            k -= 1
            if passes(grid(k)):
                return grid(k)
        return 0.0
    while grid(k + 1) <= stop + 1e-9 and passes(grid(k + 1)):
        k += 1
    return grid(k)


def poisson_schedule(manifest: Manifest, int_high: Mapping[str, int], rate: float, queries: int, sample_seed: int,
                     arrival_seed: int) -> tuple[list[dict], list[int] | None, Any]:
    """A seeded Poisson schedule at `rate` of RTE-like queries, at least `queries` and 2 s of them:
    (queries, their lengths, send offsets), the same for every system given the same seeds."""
    n = max(queries, int(rate * 2))
    sample, lengths = sample_queries(manifest, int_high, n, sample_seed)
    return sample, lengths, poisson(rate, n, rng=arrival_seed)


def median_summary(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The rounds' median mean and p99, the fewest answered, and every round's figures."""
    def med(key: str) -> float | None:
        values = [r[key] for r in runs if r.get(key) is not None]
        return statistics.median(values) if values else None

    return {"mean_ms": med("latency_mean_ms"), "p99_ms": med("latency_p99_ms"),
            "answered": min(r["answered"] for r in runs), "queries": runs[0]["queries"],
            # the load as sent: the achieved send rate against the scheduled one, and the client's CPU
            "scheduled_qps": med("offered_qps"), "sent_qps": med("send_rate_qps"),
            "client_cpu_cores": med("client_cpu_cores"),
            "rounds": [{"mean_ms": r.get("latency_mean_ms"), "p99_ms": r.get("latency_p99_ms"),
                        "answered": r["answered"]} for r in runs]}


def is_baseline(label: str) -> bool:
    return label.startswith(("ZeroBatch", "DelayBatch"))


def better_baseline(systems: Mapping[str, Mapping[str, Any]], key: str) -> tuple[str, float | None]:
    """The baseline with the lowest `key` among those that answered every query."""
    whole = {k: v[key] for k, v in systems.items()
             if is_baseline(k) and v[key] is not None and v["answered"] == v["queries"]}
    if not whole:
        return "-", None
    best = min(whole, key=whole.__getitem__)
    return best, whole[best]


def row_line(load: Mapping[str, Any]) -> str:
    systems = load["systems"]
    dva, zero = systems[DVA], systems["ZeroBatch"]
    best_name, best_mean = better_baseline(systems, "mean_ms")
    _, best_p99 = better_baseline(systems, "p99_ms")

    def ratio(a: float | None, b: float | None) -> str:
        return f"{a / b:.2f}x" if a is not None and b else "-"

    cells = "; ".join(f"{k} {v['mean_ms'] or float('nan'):.2f}/{v['p99_ms'] or float('nan'):.1f} "
                      f"({v['answered']}/{v['queries']})" for k, v in systems.items())
    sent = "; ".join(f"{k} {v['sent_qps'] or float('nan'):.0f}/{v['scheduled_qps'] or float('nan'):.0f} qps, "
                     f"client {v['client_cpu_cores'] or float('nan'):.2f} cores"
                     for k, v in systems.items() if v.get("scheduled_qps") is not None)
    return (f"{load['fraction']:g}x ({load['rate_qps']:.0f} qps), mean/p99 ms: {cells}\n"
            + (f"  sent/scheduled: {sent}\n" if sent else "")
            + f"  DVABatch / ZeroBatch: mean {ratio(dva['mean_ms'], zero['mean_ms'])}, p99 "
            f"{ratio(dva['p99_ms'], zero['p99_ms'])}; / the better baseline ({best_name}): mean "
            f"{ratio(dva['mean_ms'], best_mean)}, p99 {ratio(dva['p99_ms'], best_p99)}")


def run(model_dir: Path, device: str, device_profile: str | None, out: Path, queries: int = QUERIES,
        rounds: int = ROUNDS, loads: Sequence[float] = LOADS, delays_us: Sequence[int] = DELAYS_US,
        variants: Mapping[str, Mapping[str, str]] | None = None, spied: Sequence[str] = (),
        stub_site: Path | None = None, sustained: Sequence[str] = ()) -> int:
    """`stub_site`: a folder the backend stubs import from first, holding another numpy than this
    process's: numpy 2 on the stand-in, as the GPU machine's stubs served until they were given the
    package's numpy 1 (under numpy 2 every answer crosses by DLPack, about 110 us a response tensor
    in the stub against 4 us by numpy); numpy 1 on the GPU machine, as a user's install serves
    (`perf.gpu.run_device.STUB_SITE`)."""
    import onnx

    from slicer.profiler import int_bounds

    version_dir = (model_dir / "1").resolve()
    manifest = Manifest.load(version_dir / "manifest.json")
    full = onnx.load(str(version_dir / (manifest.full_model or "model.onnx")), load_external_data=False)
    began = time.perf_counter()
    if stub_site is not None:  # the server hands this process's sys.path to the stubs, first (tools/serve.py)
        sys.path.insert(0, str(stub_site.resolve()))
    with tempfile.TemporaryDirectory(prefix="dvabatch-on-device-") as tmp:
        systems = build_repository(Path(tmp), model_dir, device, device_profile, delays_us, variants)
        with TritonServer(Path(tmp)) as server:
            print(f"tritonserver up; {len(systems)} models on {device}"
                  + (f" (the GPU stand-in, {device_profile})" if device == "simulated" else "")
                  + "; driven by our own open-loop generator (perf_analyzer does not go to the GPU machine)", flush=True)
            for name in systems.values():
                server.wait_model_ready(name, timeout=600)
            print(f"every model ready {time.perf_counter() - began:.0f} s after the start (the server's start, the "
                  "stages re-profiled on the device, the graphs captured)", flush=True)
            header = {"device": device, "device_profile": device_profile, "model": manifest.name, "systems": systems,
                      "queries_per_load": queries, "rounds": rounds,
                      "stub_site": str(stub_site) if stub_site is not None else None}
            out.mkdir(parents=True, exist_ok=True)

            def write(result: dict[str, Any]) -> None:
                result.update(header, seconds=time.perf_counter() - began)
                (out / "on_device.json").write_text(json.dumps(result, indent=1))

            result = measure(server.grpc_url, systems, manifest, int_bounds(full), queries, rounds, loads,
                             metrics_url=server.metrics_url, partial=write, spy_out=out / "py-spy" if spied else None,
                             spied=spied, sustained=sustained)
    write(result)
    print(f"wrote {out / 'on_device.json'} ({result['seconds']:.0f} s)")
    unanswered = sum(v["queries"] - v["answered"] for load in result["loads"] for v in load["systems"].values())
    return 1 if unanswered else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.compare --device", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, required=True, help="a sliced model folder (config.pbtxt and 1/)")
    parser.add_argument("--device", choices=DEVICES, required=True)
    parser.add_argument("--device-profile", type=Path, help="the stand-in's device profile (--device simulated)")
    parser.add_argument("--queries", type=int, default=QUERIES, help="queries per system, load and round")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--loads", default=",".join(f"{f:g}" for f in LOADS), help="fractions of ZeroBatch's peak")
    parser.add_argument("--delays", default=",".join(str(d) for d in DELAYS_US),
                        help="DelayBatch's queue delays (us), comma-separated ('' for ZeroBatch alone)")
    parser.add_argument("--variant", action="append", default=[], metavar="LABEL:KEY=VALUE,...",
                        help="also serve the model with these config parameters set, as the system LABEL")
    parser.add_argument("--py-spy", default="", metavar="LABEL,...",
                        help="profile these systems' backend stubs with py-spy (OUT/MODEL/py-spy/PHASE.LABEL.txt)")
    parser.add_argument("--sustained", default="", metavar="LABEL,...",
                        help="also each of these systems' sustained rate (ZeroBatch's among them for the ratio): "
                             "the highest Poisson rate, in steps of 0.1x ZeroBatch's peak, with p99 within 5x "
                             "ZeroBatch's lone-query mean and every query answered")
    parser.add_argument("--stub-site", type=Path, metavar="DIR",
                        help="a folder the backend stubs import from first: another numpy unpacked there "
                             "(pip download numpy==2.2.6, unzip: the GPU machine's own numpy; the GPU steps "
                             "give its stubs the package's numpy 1)")
    parser.add_argument("--out", type=Path, default=REPO / "work" / "perf" / "on_device")
    args = parser.parse_args(argv)
    variants = {}
    for spec in args.variant:
        label, _, pairs = spec.partition(":")
        variants[label] = dict(pair.split("=", 1) for pair in pairs.split(",") if pair)
    if args.device == "simulated" and args.device_profile is None:
        parser.error("--device simulated needs --device-profile")
    profile = str(args.device_profile.resolve()) if args.device_profile else None
    return run(args.model_dir, args.device, profile, args.out / args.model_dir.name, args.queries, args.rounds,
               tuple(float(f) for f in args.loads.split(",")), tuple(int(d) for d in args.delays.split(",") if d),
               variants, tuple(label for label in args.py_spy.split(",") if label), args.stub_site,
               tuple(label for label in args.sustained.split(",") if label))


if __name__ == "__main__":
    sys.exit(main())
