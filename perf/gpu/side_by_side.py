"""DVABatch beside ZeroBatch and DelayBatch in one process, all on the torch engine (CUDA on the device machine).

    python -m perf.gpu.side_by_side --out DIR [--device cuda] [--model token_mlp|bert|resnet152] [--quick]

No tritonserver (the GPU machine has none): both systems are driven in this process.

- DVABatch: the runtime's `Pipeline` over the sliced stages, one `TorchStageEngine` per stage on
  its own CUDA stream, `CudaEventFence`s between them (perf.gpu.pipelines.cuda_pipeline), for each
  policy asked for.
- ZeroBatch: the unsliced model.onnx as one `TorchStageEngine`, behind a batcher with no queue
  delay: whatever queued while the last batch ran (at most bs_max) runs next, zero-padded to its
  longest query. This is Triton's dynamic batcher with max_queue_delay 0, in process.
- DelayBatch-Dms: the same batcher and engine with a queue delay of D ms (Triton's
  max_queue_delay_microseconds): a batch starts once bs_max queries wait or its oldest query has
  waited D ms. The setup's delays are all run; the better at each load is the one to beat.

Models: `token_mlp` (a toy sized for a GPU), or the paper's GPU models, `bert` (BERT-base, GLUE-like
lengths, policy `input`) and `resnet152` (224x224, policy `load`), cut evenly over their layers and
profiled on the device with the torch engine (perf.gpu.pipelines.profile_on_device), so the
policies plan with the device's costs. Every system replays CUDA graphs captured per batch-size and
length bucket (the runtime's default on CUDA), or with --eager none does: the same setting for all.

Measured, in this order: each system's latency at concurrency 1 (rounds taken in turn; DVABatch's
overhead = its mean minus ZeroBatch's); ZeroBatch's closed-loop peak (bs_max clients), which sets the
loads; then at each fraction of it the same seeded Poisson schedule (perf.load.arrivals) and the same
queries to every system, the order rotating per load. Latency = submit -> answer callback. The
sustained rate of a system is the highest load it served with its p99 within the target (a multiple
of ZeroBatch's mean at concurrency 1) and every query answered. On CUDA, the device memory each
system's engines hold and the peak each adds while serving. Writes DIR/side_by_side.json and
DIR/side_by_side.png (mean solid, p99 dashed, per system).
"""
from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from dvabatch_backend.runtime.manifest import Manifest
from dvabatch_backend.runtime.pipeline import CallRoute
from dvabatch_backend.runtime.loading import make_engine
from dvabatch_backend.runtime.query import validate_inputs
from perf.load.arrivals import paced, poisson
from perf.load.stats import latency_stats
from perf.baselines.bench import sample_queries
from perf.gpu.pipelines import (DEVICES, cuda_pipeline, engine_settings, profile_on_device, sliced_token_mlp,
                                sliced_zoo_model, torch_engines)

Inputs = Mapping[str, np.ndarray]
Done = Callable[[bool], None]  # called once per query: True with its result, False with an error
Submit = Callable[[Inputs, Done], None]


@dataclass(frozen=True)
class Setup:
    model: str = "token_mlp"  # or a GPU zoo model: "bert", "resnet152"
    size: str = "gpu"  # a zoo model's size: "gpu" (the paper's), or a zoo size ("test": the smoke runs here)
    hidden: int = 1024
    layers: int = 8
    stages: int = 4
    bs_max: int = 16
    max_length: int = 128
    preset: str = "sst2"
    fractions: tuple[float, ...] = (0.25, 0.6, 0.9)
    seconds_per_load: float = 6.0
    max_queries: int = 3000
    peak_seconds: float = 4.0
    policies: tuple[str, ...] = ("pipelined", "input")
    # DVABatch's buffer pairs: 2 (the GPU default: stages overlap, several requests go to the
    # pipeline) and 1 (stages in turn, and the fast path takes several requests too), each a system
    pairs: tuple[int, ...] = (2,)
    # policies also served with every boundary in host memory (`device_buffers` off: each stage
    # copies its batch in and out and waits), as a system of its own ("-host"): the runtime's
    # default keeps the boundaries between GPU stages in device memory (runtime/device_memory.py)
    host_buffers: tuple[str, ...] = ()
    # policies also served with the first stage running ahead of the device (`entry_waits_for_device`
    # off: its executor takes the next batch once the last one is queued), as a system ("-ahead")
    run_ahead: tuple[str, ...] = ()
    # each DVABatch system also served with the unsliced model on its fast path ("-model": what the
    # served path runs where the manifest's `fast_path_engine` is "model"), beside the stages in a row
    fast_path_model: bool = False
    delays_ms: tuple[float, ...] = (1.0, 4.0)  # DelayBatch's queue delays
    c1_queries: int = 90  # queries at concurrency 1, per system
    p99_target_factor: float = 5.0  # the sustained rate's p99 target: this many times ZeroBatch's c1 mean
    cuda_graphs: bool = True  # every system's engines replay CUDA graphs (on CUDA), or none do
    device_profile: str = ""  # the GPU stand-in's (device "simulated"): a device profile file
    # the loads are fractions of this rate, not of the peak measured here (0: the peak measured here):
    # a replay of another machine's run at its rates, where the two closed-loop peaks differ
    loads_peak_qps: float = 0.0


QUICK = Setup(hidden=64, layers=4, stages=2, bs_max=4, max_length=16, fractions=(0.5,), seconds_per_load=0.5,
              max_queries=60, peak_seconds=0.5, policies=("pipelined",), delays_ms=(1.0,), c1_queries=6)
SETUPS = {
    "token_mlp": Setup(),
    "bert": Setup(model="bert", stages=4, bs_max=16, max_length=128, preset="rte", policies=("input", "load"), pairs=(2,),
                  host_buffers=("input", "load"), fractions=(0.25, 0.6, 0.9, 1.1), seconds_per_load=4.0, max_queries=2500),
    "resnet152": Setup(model="resnet152", stages=4, bs_max=16, max_length=0, preset="", policies=("load",), pairs=(2,),
                       host_buffers=("load",), fractions=(0.25, 0.6, 0.9, 1.1), seconds_per_load=4.0, max_queries=2500),
}


@dataclass(frozen=True)
class Variant:
    """One DVABatch system of a run: a policy and how it is served; `name` says how it differs
    from the default (2 pairs, device buffers, the entry waiting, the stages on the fast path)."""

    policy: str
    pairs: int = 2
    device_buffers: bool = True
    entry_waits: bool = True
    fast_path_model: bool = False

    @property
    def name(self) -> str:
        return (f"DVABatch-{self.policy}" + ("" if self.pairs == 2 else f"-{self.pairs}pair")
                + ("" if self.device_buffers else "-host") + ("" if self.entry_waits else "-ahead")
                + ("-model" if self.fast_path_model else ""))


def variants(setup: Setup) -> list[Variant]:
    """The DVABatch systems `setup` asks for, in the order they are served."""
    found = [Variant(policy, pairs) for policy in setup.policies for pairs in setup.pairs]
    found += [Variant(policy, device_buffers=False) for policy in setup.host_buffers]
    found += [Variant(policy, entry_waits=False) for policy in setup.run_ahead]
    if setup.fast_path_model:
        found += [replace(v, fast_path_model=True) for v in found]
    return found


class DynamicBatcher:
    """The unsliced model behind Triton's dynamic batcher, in process: one thread runs what has
    queued, at most bs_max queries; with `delay_s` > 0 (DelayBatch) a batch starts only once bs_max
    queries wait or the oldest has waited `delay_s`; with 0 (ZeroBatch) at once."""

    def __init__(self, engine: Any, manifest: Manifest, bs_max: int, delay_s: float = 0.0,
                 thread_name: str = "zerobatch") -> None:
        self._engine, self._manifest, self._bs_max, self._delay_s = engine, manifest, bs_max, delay_s
        self._queue: list[tuple[Inputs, Done, float]] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name=thread_name, daemon=True)

    def start(self) -> DynamicBatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(30)

    def submit(self, inputs: Inputs, done: Done) -> None:
        with self._cond:
            self._queue.append((inputs, done, time.perf_counter()))
            self._cond.notify()

    def _ready(self) -> bool:
        if self._stopping or len(self._queue) >= self._bs_max:
            return True
        return bool(self._queue) and time.perf_counter() >= self._queue[0][2] + self._delay_s

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._ready():
                    wait = self._queue[0][2] + self._delay_s - time.perf_counter() if self._queue else None
                    self._cond.wait(wait)
                if self._stopping and not self._queue:
                    return
                batch, self._queue = self._queue[: self._bs_max], self._queue[self._bs_max:]
            self._run([(q, done) for q, done, _ in batch])

    def _run(self, batch: list[tuple[Inputs, Done]]) -> None:
        length = max(query_length(self._manifest, q) for q, _ in batch)
        inputs = {}
        for spec in self._manifest.inputs:
            array = np.zeros(spec.shape(len(batch), length), spec.np_dtype)
            for row, (query, _) in enumerate(batch):
                value = query[spec.name]
                array[row][tuple(slice(0, n) for n in value.shape)] = value
            inputs[spec.name] = array
        outputs = {s.name: np.empty(s.shape(len(batch), length), s.np_dtype) for s in self._manifest.outputs}
        self._engine.run(inputs, outputs)
        for _, done in batch:
            done(True)


class DvaBatch(DynamicBatcher):
    """The runtime's pipeline behind the served adapter's entry (`TritonPythonModel.execute`): the
    batcher's thread with no delay takes what queued while its last call ran, at most bs_max
    queries (what Triton's dynamic batcher with no queue delay hands `execute`, one request per
    query); instead of running the unsliced model it routes the call as `execute` does
    (`Pipeline.route_call`: with `hand_off`, to the loop where the hand-over rule says so) and
    submits it, running the loop's steps here while the loop is idle (`Pipeline.serve_here`);
    answers through the same `done` callbacks, an error as not answered."""

    def __init__(self, pipeline: Any, hand_off: bool = False) -> None:
        super().__init__(None, pipeline.manifest, pipeline.bs_max, thread_name="dvabatch-execute")
        self._pipeline = pipeline
        self._hand_off = hand_off  # the adapter's `hand_off_calls` (on by default on a device)

    def start(self) -> DvaBatch:
        self._pipeline.start()
        super().start()
        return self

    def stop(self) -> None:
        super().stop()
        self._pipeline.stop()

    def counts(self) -> tuple[int, int, int, int]:
        """(stage batches, their queries, unsliced-model batches, their queries) so far (stage 0's)."""
        stats = self._pipeline.stats
        return stats.stages[0].batches, stats.stages[0].rows, stats.whole_runs, stats.whole_rows

    def _run(self, batch: list[tuple[Inputs, Done]]) -> None:
        """One `execute` call: each query a request of one row."""
        pipeline, ids, answered = self._pipeline, [], set()

        def reply(done: Done) -> Callable[[Any], None]:
            return lambda answer: (answered.add(answer.query_id), done(answer.error is None))

        def submit(_: bool = False) -> None:
            ids.extend(pipeline.submit_many([(query, reply(done)) for query, done in batch]))

        if pipeline.route_call(len(batch), len(batch), self._hand_off) is CallRoute.HERE:
            pipeline.serve_here(submit, lambda: answered.issuperset(ids))
        else:
            submit()


def batch_summary(before: Sequence[int], after: Sequence[int]) -> dict[str, float | int]:
    """A load's batches from two `DvaBatch.counts`: how many ran through the stages and through the
    unsliced model (the one-stage route), their mean sizes, and the share of queries the latter took."""
    batches, rows, whole_runs, whole_rows = (b - a for a, b in zip(before, after))
    return {"pipeline_batches": batches, "pipeline_mean_bs": rows / batches if batches else 0.0,
            "whole_batches": whole_runs, "whole_mean_bs": whole_rows / whole_runs if whole_runs else 0.0,
            "whole_share": whole_rows / (rows + whole_rows) if rows + whole_rows else 0.0}


def query_length(manifest: Manifest, query: Inputs) -> int:
    """A query's length as the runtime reads it (`validate_inputs`; 0 for a fixed-shape model)."""
    return validate_inputs(0, query, manifest)[1]


def make_queries(setup: Setup, manifest: Manifest, int_high: Mapping[str, int], n: int,
                 seed: int) -> list[dict[str, np.ndarray]]:
    """n seeded queries: lengths from the setup's preset (GLUE-like), random values, masks of ones."""
    queries, _ = sample_queries(manifest, int_high, n, seed, setup.preset or "sst2")
    return queries


def closed_loop_qps(submit: Submit, queries: Sequence[Inputs], clients: int, seconds: float) -> float:
    """Answers per second with `clients` clients each sending its next query when answered."""
    answered = 0
    lock = threading.Lock()
    deadline = time.perf_counter() + seconds

    def client(k: int) -> None:
        nonlocal answered
        i = k
        while time.perf_counter() < deadline:
            event = threading.Event()
            submit(queries[i % len(queries)], lambda ok: event.set())
            event.wait(60)
            with lock:
                answered += 1
            i += clients

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answered / (time.perf_counter() - t0)


def open_loop(submit: Submit, queries: Sequence[Inputs], offsets: np.ndarray) -> list[float]:
    """Send query i at offsets[i] (seconds); every answer's latency (s); NaN for an error or none in 60 s."""
    sent = [0.0] * len(queries)
    latency = [float("nan")] * len(queries)
    remaining = threading.Semaphore(0)

    def done_for(i: int) -> Done:
        def done(ok: bool) -> None:
            if ok:
                latency[i] = time.perf_counter() - sent[i]
            remaining.release()
        return done

    for i in paced(offsets[:len(queries)]):
        sent[i] = time.perf_counter()
        submit(queries[i], done_for(i))
    deadline = time.perf_counter() + 60
    for _ in queries:
        if not remaining.acquire(timeout=max(0.0, deadline - time.perf_counter())):
            break
    return latency


def summary_ms(latencies: Sequence[float]) -> dict[str, float | int | None]:
    """The answered latencies' `latency_stats` (ms; an unanswered query is NaN), answered and sent."""
    a = np.asarray(latencies, dtype=float)
    ok = a[~np.isnan(a)]
    return {**latency_stats(ok), "answered": int(ok.size), "sent": int(a.size)}


def prepare(out_dir: Path, setup: Setup, device: str) -> tuple[Path, Manifest, dict[str, int]]:
    """The sliced model; a zoo model's stages are profiled here, on `device`."""
    if setup.model == "token_mlp":
        model_dir, manifest = sliced_token_mlp(out_dir / "model", setup.hidden, setup.layers, setup.stages,
                                               setup.bs_max, setup.max_length)
        return model_dir, manifest, {}
    model_dir, manifest, int_high = sliced_zoo_model(setup.model, out_dir / "model", setup.stages, setup.bs_max,
                                                     setup.max_length, setup.size)
    lengths = [n for n in (16, 32, 64, 128) if n <= setup.max_length] or [0]
    batch_sizes = [bs for bs in (1, 2, 4, 8, 16, 32) if bs <= setup.bs_max]
    engines = torch_engines(model_dir, manifest, device, setup.cuda_graphs, setup.bs_max, setup.device_profile)
    manifest = profile_on_device(model_dir, manifest, engines, batch_sizes,
                                 lengths, int_high)
    return model_dir, manifest, int_high


def device_mib(device: str) -> float:
    if device != "cuda":
        return 0.0
    import torch

    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() / 2**20


def lone_latencies(systems: Mapping[str, Any], queries: Sequence[Inputs], rounds: int = 3) -> dict[str, Any]:
    """Each system's latency at concurrency 1, the systems taking turns in `rounds` blocks."""
    samples: dict[str, list[float]] = {name: [] for name in systems}
    block = max(1, len(queries) // rounds)
    for r in range(rounds):
        for name, system in systems.items():
            samples[name] += open_loop_serial(system.submit, queries[r * block:(r + 1) * block])
    return {name: summary_ms(values) for name, values in samples.items()}


def open_loop_serial(submit: Submit, queries: Sequence[Inputs]) -> list[float]:
    """Latencies of queries sent one at a time, each when the last was answered (NaN: an error or none in 60 s)."""
    out = []
    for query in queries:
        event = threading.Event()
        t0 = time.perf_counter()
        answered: list[bool] = []
        submit(query, lambda ok: (answered.append(ok), event.set()))
        out.append(time.perf_counter() - t0 if event.wait(60) and answered[0] else float("nan"))
    return out


def sustained(loads: Sequence[Mapping[str, Any]], name: str, target_ms: float) -> float:
    """The highest offered rate at which `name` answered every query with p99 within the target."""
    served = [load["rate_qps"] for load in loads
              if load["systems"][name].get("answered") == load["systems"][name]["sent"]
              and load["systems"][name].get("p99", float("inf")) <= target_ms]
    return max(served, default=0.0)


def run(out_dir: Path, setup: Setup, device: str) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    from policies import create_policy

    started = time.perf_counter()
    model_dir, manifest, int_high = prepare(out_dir, setup, device)
    memory: dict[str, Any] = {"before_mib": device_mib(device)}
    graphs = setup.cuda_graphs and device == "cuda"
    engine = engine_settings(device, setup.cuda_graphs, setup.bs_max, setup.device_profile)
    whole = make_engine(model_dir / "model.onnx", engine, manifest)
    memory["unsliced_engine_mib"] = device_mib(device) - memory["before_mib"]
    zero = DynamicBatcher(whole, manifest, setup.bs_max).start()
    systems: dict[str, Any] = {"ZeroBatch": zero}
    for delay in setup.delays_ms:  # one engine for every batcher: they never run at once
        systems[f"DelayBatch-{delay:g}ms"] = DynamicBatcher(whole, manifest, setup.bs_max, delay / 1e3).start()
    for variant in variants(setup):
        name = variant.name
        settings = replace(engine, num_buffer_pairs=variant.pairs, device_buffers=variant.device_buffers,
                           entry_waits_for_device=variant.entry_waits)
        fast_whole = whole if variant.fast_path_model else None
        before = device_mib(device)
        engines = torch_engines(model_dir, manifest, device, graphs, setup.bs_max, setup.device_profile)
        memory[f"{name}_engines_mib"] = device_mib(device) - before
        before = device_mib(device)
        pipeline = (cuda_pipeline(manifest, engines, create_policy(variant.policy), settings, fast_whole)
                    if device != "cpu" else None)
        memory[f"{name}_buffers_mib"] = device_mib(device) - before  # the middle boundaries, where on the device
        if pipeline is None:  # the CPU (the smoke run here): host fences, same runtime
            from dvabatch_backend.runtime.pipeline import Pipeline

            pipeline = Pipeline.create(manifest, engines, create_policy(variant.policy), settings, whole_model=fast_whole)
        systems[name] = DvaBatch(pipeline).start()
    peaks: dict[str, float] = {name: 0.0 for name in systems}
    try:
        warm = make_queries(setup, manifest, int_high, 4 * setup.bs_max, seed=99)
        for system in systems.values():
            open_loop(system.submit, warm, np.zeros(len(warm)))
        lone = lone_latencies(systems, make_queries(setup, manifest, int_high, setup.c1_queries, seed=7))
        print(f"prepared in {time.perf_counter() - started:.0f} s; concurrency 1: {json.dumps(lone)}", flush=True)
        target_ms = setup.p99_target_factor * lone["ZeroBatch"].get("mean", float("nan"))
        peak = closed_loop_qps(zero.submit, make_queries(setup, manifest, int_high, 512, seed=1), setup.bs_max,
                               setup.peak_seconds)
        print(f"ZeroBatch closed-loop peak {peak:.0f} qps", flush=True)
        loads = []
        for k, fraction in enumerate(setup.fractions):
            rate = (setup.loads_peak_qps or peak) * fraction
            n = int(min(setup.max_queries, max(20, rate * setup.seconds_per_load)))
            queries, offsets = make_queries(setup, manifest, int_high, n, seed=10 + k), poisson(rate, n, rng=10 + k)
            names = list(systems)
            names = names[k % len(names):] + names[: k % len(names)]  # rotate who goes first
            results = {}
            for name in names:
                base = device_mib(device)
                if device == "cuda":
                    import torch

                    torch.cuda.reset_peak_memory_stats()
                before_counts = systems[name].counts() if isinstance(systems[name], DvaBatch) else None
                results[name] = summary_ms(open_loop(systems[name].submit, queries, offsets))
                if before_counts is not None:
                    results[name]["batches"] = batch_summary(before_counts, systems[name].counts())
                if device == "cuda":
                    peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated() / 2**20 - base)
            loads.append({"fraction": fraction, "rate_qps": rate, "queries": n, "systems": results})
            print(f"{fraction:.2f} of peak: " + json.dumps(results), flush=True)  # kept in the log if cut short
    finally:
        for system in systems.values():
            system.stop()
    memory["serving_peak_above_resident_mib"] = peaks
    result = {"device": device, "gpu": _gpu_name(device, whole), "setup": setup.__dict__, "zerobatch_peak_qps": peak,
              "lone": lone, "overhead_c1_ms": {name: s.get("mean", float("nan")) - lone["ZeroBatch"].get("mean", 0.0)
                                               for name, s in lone.items()},
              "p99_target_ms": target_ms, "sustained_qps": {name: sustained(loads, name, target_ms) for name in systems},
              "device_memory": memory, "loads": loads}
    (out_dir / "side_by_side.json").write_text(json.dumps(result, indent=2))
    plot(result, out_dir / "side_by_side.png")
    return result


def _gpu_name(device: str, engine: Any = None) -> str | None:
    if device == "simulated":
        return str(engine.device.name)
    if device != "cuda":
        return None
    import torch

    return str(torch.cuda.get_device_name(0))


def plot(result: Mapping[str, Any], path: Path) -> None:
    """Each system's mean and p99 against the offered load (`perf.compare.plot`)."""
    from perf.compare.plot import Curve, LoadPoint, plot_latency

    loads = result["loads"]
    curves = [Curve(name, [LoadPoint(load["rate_qps"], load["systems"][name].get("mean"), load["systems"][name].get("p99"))
                           for load in loads])
              for name in sorted(loads[0]["systems"] if loads else [])]
    plot_latency(curves, path, x_label="offered load (queries/s)",
                 title=f"{result['setup']['model']}: DVABatch vs Triton's batcher, torch on {result['device']}")


def _batches_cell(batches: Mapping[str, Any] | None) -> str:
    if not batches:
        return ""
    return (f"; batches of {batches['pipeline_mean_bs']:.1f} through the stages, {batches['whole_mean_bs']:.1f} through "
            f"the unsliced model, {100 * batches['whole_share']:.0f} % of queries there")


def _names(text: str) -> tuple[str, ...]:
    """A comma-separated option's names ('' for none)."""
    return tuple(name for name in text.split(",") if name)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda", choices=DEVICES,
                        help="cuda; cpu (a smoke run); simulated: the GPU stand-in, with --device-profile")
    parser.add_argument("--device-profile", type=Path,
                        help="the stand-in's device profile (stage times as ../shared/gpu-profiles/ holds them)")
    parser.add_argument("--model", default="token_mlp", choices=sorted(SETUPS))
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs for any system (default: all replay them)")
    parser.add_argument("--quick", action="store_true", help="a tiny model and one short load (a smoke run)")
    parser.add_argument("--policies", help="DVABatch's policies, comma-separated (default: the model's setup)")
    parser.add_argument("--fractions", help="the loads, fractions of ZeroBatch's peak, comma-separated (default: the setup's)")
    parser.add_argument("--loads-peak", type=float, default=0.0,
                        help="the loads are fractions of this rate (qps) instead of the peak measured here: a replay of "
                        "another machine's run at its rates (its zerobatch_peak_qps); the peak measured here is still reported")
    parser.add_argument("--pairs", help="DVABatch's buffer pairs, each a system (e.g. 2,1; default: the model's setup)")
    parser.add_argument("--host-buffers", help="policies also served with host-memory boundaries, comma-separated "
                        "('' for none; default: the model's setup)")
    parser.add_argument("--fast-path-model", action="store_true",
                        help="each DVABatch system also with the unsliced model on its fast path (\"-model\")")
    parser.add_argument("--run-ahead", help="policies also served with the first stage running ahead of the device "
                        "(entry_waits_for_device off), comma-separated (default: the model's setup)")
    args = parser.parse_args(argv)
    setup = SETUPS[args.model]
    if args.quick:  # the tiny model, or the zoo model at its test size, and one short load
        setup = QUICK if args.model == "token_mlp" else replace(
            QUICK, model=args.model, size="test", max_length=min(setup.max_length, 32), preset=setup.preset,
            stages=2, policies=setup.policies)
    if args.policies:
        setup = replace(setup, policies=tuple(args.policies.split(",")))
    if args.fractions:
        setup = replace(setup, fractions=tuple(float(f) for f in args.fractions.split(",")))
    if args.loads_peak:
        setup = replace(setup, loads_peak_qps=args.loads_peak)
    if args.pairs:
        setup = replace(setup, pairs=tuple(int(p) for p in args.pairs.split(",")))
    if args.host_buffers is not None:
        setup = replace(setup, host_buffers=_names(args.host_buffers))
    if args.fast_path_model:
        setup = replace(setup, fast_path_model=True)
    if args.run_ahead is not None:
        setup = replace(setup, run_ahead=_names(args.run_ahead))
    if args.device == "simulated":
        if args.device_profile is None:
            parser.error("--device simulated needs --device-profile")
        setup = replace(setup, device_profile=str(args.device_profile.resolve()))
    result = run(args.out, replace(setup, cuda_graphs=not args.eager), args.device)
    print(f"{result['setup']['model']} on {result['gpu'] or result['device']} (CUDA graphs "
          f"{'on' if result['setup']['cuda_graphs'] else 'off'}): ZeroBatch peak "
          f"{result['zerobatch_peak_qps']:.1f} qps; p99 target {result['p99_target_ms']:.2f} ms")
    for name, s in result["lone"].items():
        print(f"  concurrency 1, {name}: mean {s.get('mean', float('nan')):.3f} ms "
              f"(overhead {result['overhead_c1_ms'][name]:+.3f} ms); sustained {result['sustained_qps'][name]:.0f} qps")
    print(f"  device memory (MiB): {json.dumps(result['device_memory'])}")
    for load in result["loads"]:
        cells = ", ".join(f"{name}: mean {s.get('mean', float('nan')):.2f} ms p99 {s.get('p99', float('nan')):.2f} ms "
                          f"({s['answered']}/{s['sent']}{_batches_cell(s.get('batches'))})"
                          for name, s in load["systems"].items())
        print(f"{load['fraction']:.2f} of peak ({load['rate_qps']:.0f} qps): {cells}")
    failed = sum(s["sent"] - s["answered"] for load in result["loads"] for s in load["systems"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
