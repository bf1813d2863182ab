"""The baselines every Triton user has today, served beside dvabatch from the same repository.

**ZeroBatch** and **DelayBatch** serve the UNSLICED `model.onnx` of a sliced model's version folder
with the same engine (onnxruntime CPU, `ort_session_options(threads)`; or, with `engine="torch"`,
the runtime's torch engine on `device` "cpu" or "cuda") in a Python-backend model
(`perf/baselines/model.py`) behind Triton's own dynamic batcher: `max_queue_delay_microseconds` 0
for ZeroBatch, a delay tuned for peak throughput (`tune_delay`) for DelayBatch. Inputs allow ragged
batches, so requests of different lengths share a batch, padded to the longest one.

    python -m perf.baselines VERSION_DIR --repository REPO [--delays 0,500,1000,2000,5000,10000]
        [--concurrency 8] [--seconds 5] [--threads 1] [--bs-max N] [--json tuning.json]
        [--engine onnxruntime|torch] [--device cpu|cuda]

registers one candidate per delay in a scratch repository, starts the real server, measures each
closed loop, records the result as JSON, and adds NAME_zerobatch and NAME_delaybatch (the tuned
delay) to REPO.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

from dvabatch_backend.runtime.manifest import Manifest
from perf.baselines.model import DEVICES, ENGINES, RESPONDS
from slicer.triton_files import VERSION_DIR, python_model_config, stub_entry

DEFAULT_DELAYS_US = (0, 500, 1000, 2000, 5000, 10000)

MakeQuery = Callable[[np.random.Generator], Mapping[str, np.ndarray]]


def config_pbtxt(manifest: Manifest, name: str, delay_us: int, threads: int, bs_max: int,
                 onnx_model: str, manifest_file: str = "manifest.json", engine: str = "onnxruntime",
                 device: str = "cpu", respond: str = "return", spinning: bool = False,
                 device_profile: str | None = None) -> str:
    parameters = {"onnx_model": onnx_model, "manifest": manifest_file, "threads": str(threads), "engine": engine,
                  "device": device, "respond": respond, "spinning": str(spinning).lower(),
                  **({"device_profile": str(device_profile)} if device_profile else {})}
    return python_model_config(manifest, name, parameters, bs_max=bs_max, delay_us=delay_us)


def sliced_engine(manifest: Manifest) -> tuple[str, str]:
    """The engine and device the slicer timed the model on (where it will serve): a baseline's
    default, so that it runs the same engine on the same precision's model (onnxruntime on the CPU
    for a model sliced so)."""
    recorded = manifest.extra.get("slicing", {}).get("engine", {})
    return recorded.get("engine", "onnxruntime"), recorded.get("device", "cpu")


def add_baseline(repository: Path, version_dir: Path, name: str, delay_us: int, threads: int = 1,
                 bs_max: int | None = None, engine: str | None = None, device: str | None = None,
                 respond: str = "return", spinning: bool = False, device_profile: str | None = None) -> Path:
    """repository/name/: config.pbtxt, and 1/ with model.py and links to the version folder's
    unsliced model and manifest. Replaces an earlier baseline of that name. Returns the model dir.
    `engine`/`device`: what runs the model (onnxruntime on the CPU, torch on "cpu"/"cuda", or
    "simulated": the GPU stand-in, charged from `device_profile`, an absolute path; default: the
    engine and device the model was sliced for, `sliced_engine`);
    `respond`: how answers go back (`baseline_model.RESPONDS`; "echo" runs no model); `spinning`:
    onnxruntime's threads spin-wait for work (its default; the runtime's sleep)."""
    version_dir = Path(version_dir).resolve()
    manifest_path = version_dir / "manifest.json"
    manifest = Manifest.from_json(json.loads(manifest_path.read_text()))
    sliced_for = sliced_engine(manifest)
    engine, device = engine or sliced_for[0], device or sliced_for[1]
    onnx_model = manifest.full_model or "model.onnx"
    if not (version_dir / onnx_model).is_file():
        raise FileNotFoundError(f"{version_dir / onnx_model}: the unsliced model is not in the version folder")
    if delay_us < 0:
        raise ValueError(f"delay_us must be >= 0, got {delay_us}")
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if engine not in ENGINES or device not in DEVICES or (device == "cuda" and engine != "torch"):
        raise ValueError(f"engine {engine!r} on device {device!r}: engines are {list(ENGINES)}, devices "
                         f"{list(DEVICES)}, and cuda needs torch")
    if respond not in RESPONDS:
        raise ValueError(f"respond {respond!r} is not one of {list(RESPONDS)}")
    bs_max = manifest.max_batch_size if bs_max is None else bs_max
    if bs_max < 1:
        raise ValueError(f"bs_max must be >= 1, got {bs_max}")
    model_dir = Path(repository) / name
    target = model_dir / VERSION_DIR
    if target.is_symlink() or target.is_file():
        target.unlink()
    elif target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    (target / "model.py").write_text(stub_entry("perf.baselines.model"))
    for file in (onnx_model, "manifest.json"):
        (target / file).symlink_to(version_dir / file)
    (model_dir / "config.pbtxt").write_text(config_pbtxt(manifest, name, delay_us, threads, bs_max, onnx_model,
                                                         engine=engine, device=device, respond=respond,
                                                         spinning=spinning, device_profile=device_profile))
    return model_dir


def zero_batch(repository: Path, version_dir: Path, name: str | None = None, threads: int = 1,
               bs_max: int | None = None, engine: str | None = None, device: str | None = None,
               spinning: bool = False, device_profile: str | None = None) -> Path:
    """ZeroBatch: Triton's dynamic batcher with no queue delay. Default name: MANIFEST_NAME_zerobatch."""
    name = name or f"{_manifest_name(version_dir)}_zerobatch"
    return add_baseline(repository, version_dir, name, 0, threads, bs_max, engine, device, spinning=spinning,
                        device_profile=device_profile)


def delay_batch(repository: Path, version_dir: Path, delay_us: int, name: str | None = None, threads: int = 1,
                bs_max: int | None = None, engine: str | None = None, device: str | None = None,
                spinning: bool = False, device_profile: str | None = None) -> Path:
    """DelayBatch at `delay_us` (tuned by `tune_delay`). Default name: MANIFEST_NAME_delaybatch."""
    name = name or f"{_manifest_name(version_dir)}_delaybatch"
    return add_baseline(repository, version_dir, name, delay_us, threads, bs_max, engine, device, spinning=spinning,
                        device_profile=device_profile)


def delay_candidates(repository: Path, version_dir: Path, delays_us: Sequence[int] = DEFAULT_DELAYS_US,
                     prefix: str | None = None, threads: int = 1, bs_max: int | None = None,
                     engine: str | None = None, device: str | None = None) -> dict[int, str]:
    """One baseline per candidate delay (PREFIX_delayUS), for `tune_delay`; returns {delay: model name}."""
    prefix = prefix or _manifest_name(version_dir)
    names = {int(d): f"{prefix}_delay{int(d)}" for d in delays_us}
    for delay, name in names.items():
        add_baseline(repository, version_dir, name, delay, threads, bs_max, engine, device)
    return names


def _manifest_name(version_dir: Path) -> str:
    return str(json.loads((Path(version_dir) / "manifest.json").read_text())["name"])


def measure_throughput(grpc_url: str, model: str, make_query: MakeQuery, concurrency: int, seconds: float,
                       seed: int = 0, pool: int = 32) -> float:
    """Queries (rows) per second, closed loop: `concurrency` clients, each with its own gRPC client,
    send one request, wait for its answer, send the next, for `seconds` after one warm-up request
    each. Requests come round-robin from `pool` made by `make_query(rng)` per client; a request of
    [k, ...] counts k queries. Any failed request raises."""
    import tritonclient.grpc as grpcclient

    rng = np.random.default_rng(seed)
    requests = [[_request(grpcclient, make_query(rng)) for _ in range(pool)] for _ in range(concurrency)]
    warm = threading.Barrier(concurrency + 1)
    start = threading.Event()
    done = [0] * concurrency
    errors: list[BaseException] = []
    state = {"deadline": 0.0}

    def client(c: int) -> None:
        mine = requests[c]
        try:
            with grpcclient.InferenceServerClient(grpc_url) as conn:
                conn.infer(model, mine[0][0], client_timeout=60)
                warm.wait(60)
                start.wait(60)
                i = 0
                while time.perf_counter() < state["deadline"]:
                    inputs, rows = mine[i % len(mine)]
                    conn.infer(model, inputs, client_timeout=60)
                    done[c] += rows
                    i += 1
        except BaseException as exc:  # reported to the caller below
            errors.append(exc)
            warm.abort()

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(concurrency)]
    for t in threads:
        t.start()
    try:
        warm.wait(120)
    except threading.BrokenBarrierError:
        pass
    began = time.perf_counter()
    state["deadline"] = began + seconds
    start.set()
    for t in threads:
        t.join(seconds + 120)
    elapsed = time.perf_counter() - began
    if errors:
        raise RuntimeError(f"load on {model!r} failed: {errors[0]}") from errors[0]
    return sum(done) / elapsed


def _request(module, query: Mapping[str, np.ndarray]) -> tuple[list, int]:
    """A request of the rows of `query` (batch dim included), and its row count."""
    from dvabatch_backend.tools.serve import infer_inputs

    return infer_inputs(module, query, add_batch_dim=False), len(next(iter(query.values())))


def tune_delay(server_grpc_url: str, model_names_by_delay: Mapping[int, str], make_query: MakeQuery,
               concurrency: int, seconds: float, record: Path | None = None) -> tuple[int, dict[int, float]]:
    """The queue delay (µs) of peak throughput among the candidates (the caller registered one
    baseline per delay, e.g. with `delay_candidates`, before starting the server), and the
    measured queries/s per delay. The same seeded queries go to every candidate; a tie goes to the
    shorter delay. With `record`, the result is also written there as JSON."""
    if not model_names_by_delay:
        raise ValueError("no candidate delays to tune")
    qps = {int(delay): measure_throughput(server_grpc_url, name, make_query, concurrency, seconds)
           for delay, name in sorted(model_names_by_delay.items())}
    best = max(sorted(qps), key=lambda d: qps[d])
    if record is not None:
        save_tuning(record, best, qps, concurrency=concurrency, seconds=seconds,
                    models={str(d): n for d, n in model_names_by_delay.items()})
    return best, qps


def save_tuning(path: Path, best_delay_us: int, qps_by_delay_us: Mapping[int, float], **context: object) -> None:
    doc = {"best_delay_us": best_delay_us,
           "qps_by_delay_us": {str(d): round(q, 3) for d, q in sorted(qps_by_delay_us.items())}, **context}
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")


def load_tuning(path: Path) -> tuple[int, dict[int, float]]:
    doc = json.loads(Path(path).read_text())
    return int(doc["best_delay_us"]), {int(d): float(q) for d, q in doc["qps_by_delay_us"].items()}


def random_query_maker(manifest: Manifest, rows: int = 1) -> MakeQuery:
    """Requests of `rows` rows at a uniform random length in 1..max_length (mask inputs all ones)."""
    from slicer.profiler import random_inputs

    def make(rng: np.random.Generator) -> dict[str, np.ndarray]:
        length = int(rng.integers(1, manifest.max_length + 1)) if manifest.has_seq else 0
        feeds = random_inputs(manifest.inputs, rows, length, rng)
        for spec in manifest.inputs:
            if "mask" in spec.name and spec.has_seq:
                feeds[spec.name][:] = 1
        return feeds

    return make


def main(argv: Sequence[str] | None = None) -> int:
    from dvabatch_backend.tools.serve import TritonServer

    parser = argparse.ArgumentParser(prog="python -m perf.baselines", description=__doc__.split("\n\n")[0])
    parser.add_argument("version_dir", type=Path, help="a sliced model's version folder (NAME/1)")
    parser.add_argument("--repository", type=Path, required=True, help="where to add the two baselines")
    parser.add_argument("--delays", default=",".join(map(str, DEFAULT_DELAYS_US)), help="candidate delays, µs")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--bs-max", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None, help="the tuning record (default REPO/NAME_delaybatch.json)")
    parser.add_argument("--engine", choices=ENGINES,
                        help="what runs the unsliced model (default: the engine the model was sliced for)")
    parser.add_argument("--device", choices=DEVICES, help="cuda: with --engine torch (default: as sliced)")
    args = parser.parse_args(argv)
    manifest = Manifest.from_json(json.loads((args.version_dir / "manifest.json").read_text()))
    delays = [int(d) for d in args.delays.split(",") if d.strip()]
    scratch = Path(tempfile.mkdtemp(prefix="dvabatch-baselines-"))
    try:
        names = delay_candidates(scratch, args.version_dir, delays, threads=args.threads, bs_max=args.bs_max,
                                 engine=args.engine, device=args.device)
        with TritonServer(scratch) as server:
            for name in names.values():
                server.wait_model_ready(name, timeout=180)
            record = args.json or args.repository / f"{manifest.name}_delaybatch.json"
            best, qps = tune_delay(server.grpc_url, names, random_query_maker(manifest), args.concurrency,
                                   args.seconds, record=record)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    for delay, value in sorted(qps.items()):
        print(f"delay {delay:>6} µs: {value:9.1f} queries/s{'  <- best' if delay == best else ''}")
    engine = {"engine": args.engine, "device": args.device}
    zero_batch(args.repository, args.version_dir, threads=args.threads, bs_max=args.bs_max, **engine)
    delay_batch(args.repository, args.version_dir, best, threads=args.threads, bs_max=args.bs_max, **engine)
    print(f"added {manifest.name}_zerobatch and {manifest.name}_delaybatch ({best} µs) to {args.repository}; "
          f"tuning recorded in {record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
