"""DVABatch beside ZeroBatch in one process, both on the torch engine (CUDA on the device machine).

    python -m perf.gpu.side_by_side --out DIR [--device cuda] [--quick]

No tritonserver (the GPU machine has none): both systems are driven in this process.

- DVABatch: the runtime's `Pipeline` over the sliced stages, one `TorchStageEngine` per stage on
  its own CUDA stream, `CudaEventFence`s between them (perf.gpu.pipelines.cuda_pipeline), for each
  policy asked for.
- ZeroBatch: the unsliced model.onnx as one `TorchStageEngine`, behind a batcher with no queue
  delay: whatever queued while the last batch ran (at most bs_max) runs next, zero-padded to its
  longest query. This is Triton's dynamic batcher with max_queue_delay 0, in process.

ZeroBatch's closed-loop peak (bs_max clients) sets the loads; then, at each fraction of it, the same
seeded Poisson schedule (perf.arrivals) and the same queries (lengths from perf.lengths' preset) go
to every system, the order rotating per load. Latency = submit -> answer callback. Writes
DIR/side_by_side.json and DIR/side_by_side.png (mean solid, p99 dashed, per system).
"""
from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dvabatch_backend.runtime.manifest import Manifest
from dvabatch_backend.runtime.scheduler import RuntimeSettings
from perf.arrivals import poisson
from perf.gpu.pipelines import cuda_pipeline, sliced_token_mlp, torch_engines
from perf.lengths import sample_lengths

Inputs = Mapping[str, np.ndarray]
Done = Callable[[], None]
Submit = Callable[[Inputs, Done], None]


@dataclass(frozen=True)
class Setup:
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


QUICK = Setup(hidden=64, layers=4, stages=2, bs_max=4, max_length=16, fractions=(0.5,), seconds_per_load=0.5,
              max_queries=60, peak_seconds=0.5, policies=("pipelined",))


class ZeroBatch:
    """The unsliced model behind a no-delay batcher: one thread runs whatever has queued."""

    def __init__(self, engine: Any, manifest: Manifest, bs_max: int) -> None:
        self._engine, self._manifest, self._bs_max = engine, manifest, bs_max
        self._queue: list[tuple[Inputs, Done]] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="zerobatch", daemon=True)

    def start(self) -> ZeroBatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(30)

    def submit(self, inputs: Inputs, done: Done) -> None:
        with self._cond:
            self._queue.append((inputs, done))
            self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._stopping)
                if self._stopping and not self._queue:
                    return
                batch, self._queue = self._queue[: self._bs_max], self._queue[self._bs_max:]
            self._run(batch)

    def _run(self, batch: list[tuple[Inputs, Done]]) -> None:
        length = max(_length(q) for q, _ in batch)
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
            done()


class DvaBatch:
    """The runtime's pipeline, answering through the same `done` callbacks."""

    def __init__(self, pipeline: Any) -> None:
        self._pipeline = pipeline

    def start(self) -> DvaBatch:
        self._pipeline.start()
        return self

    def stop(self) -> None:
        self._pipeline.stop()

    def submit(self, inputs: Inputs, done: Done) -> None:
        self._pipeline.submit(inputs, lambda answer: done())


def _length(query: Inputs) -> int:
    return int(query["x"].shape[0]) if query["x"].ndim > 1 else 1


def make_queries(setup: Setup, n: int, seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    lengths = sample_lengths(setup.preset, n, setup.max_length, rng)
    return [{"x": rng.standard_normal((int(L), setup.hidden)).astype(np.float32), "mask": np.ones(int(L), np.float32)}
            for L in lengths]


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
            submit(queries[i % len(queries)], event.set)
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
    """Send query i at offsets[i] (seconds); every answer's latency (s); NaN for none in 60 s."""
    sent = [0.0] * len(queries)
    latency = [float("nan")] * len(queries)
    remaining = threading.Semaphore(0)

    def done_for(i: int) -> Done:
        def done() -> None:
            latency[i] = time.perf_counter() - sent[i]
            remaining.release()
        return done

    t0 = time.perf_counter()
    for i, (query, offset) in enumerate(zip(queries, offsets)):
        delay = t0 + offset - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        sent[i] = time.perf_counter()
        submit(query, done_for(i))
    deadline = time.perf_counter() + 60
    for _ in queries:
        if not remaining.acquire(timeout=max(0.0, deadline - time.perf_counter())):
            break
    return latency


def summary_ms(latencies: Sequence[float]) -> dict[str, float | int]:
    a = np.asarray(latencies, dtype=float)
    ok = a[~np.isnan(a)] * 1e3
    if ok.size == 0:
        return {"answered": 0, "sent": int(a.size)}
    return {"mean": float(ok.mean()), "p50": float(np.median(ok)), "p99": float(np.percentile(ok, 99)),
            "answered": int(ok.size), "sent": int(a.size)}


def run(out_dir: Path, setup: Setup, device: str) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    model_dir, manifest = sliced_token_mlp(out_dir / "model", setup.hidden, setup.layers, setup.stages, setup.bs_max,
                                           setup.max_length)
    from dvabatch_backend.runtime.torch_engine import TorchStageEngine  # the torch engine's API: (path, device)

    zero = ZeroBatch(TorchStageEngine(model_dir / "model.onnx", device=device), manifest, setup.bs_max).start()
    systems: dict[str, Any] = {"ZeroBatch": zero}
    for policy in setup.policies:
        from policies import create_policy

        settings = RuntimeSettings(num_buffer_pairs=2, bs_max=setup.bs_max, engine="torch", device=device)
        engines = torch_engines(model_dir, manifest, device)
        pipeline = cuda_pipeline(manifest, engines, create_policy(policy), settings) if device == "cuda" else None
        if pipeline is None:  # the CPU (the smoke run here): host fences, same runtime
            from dvabatch_backend.runtime.pipeline import Pipeline

            pipeline = Pipeline.create(manifest, engines, create_policy(policy), settings)
        systems[f"DVABatch-{policy}"] = DvaBatch(pipeline).start()
    try:
        warm = make_queries(setup, 4 * setup.bs_max, seed=99)
        for system in systems.values():
            open_loop(system.submit, warm, np.zeros(len(warm)))
        peak = closed_loop_qps(zero.submit, make_queries(setup, 512, seed=1), setup.bs_max, setup.peak_seconds)
        loads = []
        for k, fraction in enumerate(setup.fractions):
            rate = peak * fraction
            n = int(min(setup.max_queries, max(20, rate * setup.seconds_per_load)))
            queries, offsets = make_queries(setup, n, seed=10 + k), poisson(rate, n, rng=10 + k)
            names = list(systems)
            names = names[k % len(names):] + names[: k % len(names)]  # rotate who goes first
            results = {name: summary_ms(open_loop(systems[name].submit, queries, offsets)) for name in names}
            loads.append({"fraction": fraction, "rate_qps": rate, "queries": n, "systems": results})
    finally:
        for system in systems.values():
            system.stop()
    result = {"device": device, "setup": setup.__dict__, "zerobatch_peak_qps": peak, "loads": loads}
    (out_dir / "side_by_side.json").write_text(json.dumps(result, indent=2))
    plot(result, out_dir / "side_by_side.png")
    return result


def plot(result: Mapping[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    names = list(result["loads"][0]["systems"]) if result["loads"] else []
    for name in sorted(names):
        xs = [load["rate_qps"] for load in result["loads"]]
        for key, style in (("mean", "-"), ("p99", "--")):
            ys = [load["systems"][name].get(key, float("nan")) for load in result["loads"]]
            ax.plot(xs, ys, style, marker="o", label=f"{name} {key}")
    ax.set_xlabel("offered load (queries/s)")
    ax.set_ylabel("latency (ms)")
    ax.set_title(f"DVABatch vs ZeroBatch, torch on {result['device']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--quick", action="store_true", help="a tiny model and one short load (a smoke run)")
    args = parser.parse_args(argv)
    result = run(args.out, QUICK if args.quick else Setup(), args.device)
    print(f"ZeroBatch peak {result['zerobatch_peak_qps']:.1f} qps")
    for load in result["loads"]:
        cells = ", ".join(f"{name}: mean {s.get('mean', float('nan')):.2f} ms p99 {s.get('p99', float('nan')):.2f} ms "
                          f"({s['answered']}/{s['sent']})" for name, s in load["systems"].items())
        print(f"{load['fraction']:.2f} of peak ({load['rate_qps']:.0f} qps): {cells}")
    failed = sum(s["sent"] - s["answered"] for load in result["loads"] for s in load["systems"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
