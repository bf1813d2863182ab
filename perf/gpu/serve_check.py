"""A sliced model served on the GPU through the real tritonserver, answering tritonclient requests.

    python -m perf.gpu.serve_check --out DIR

The zoo BERT (test size) is sliced here (onnxruntime on the CPU profiles it), its config switched to
the GPU by docker/gpu_config.py exactly as the Docker image does it (KIND_GPU, engine torch, device
cuda, the GPU's default buffer pairs), and served by the pytriton wheel's tritonserver. Queries of mixed lengths go
through tritonclient's gRPC client, in a burst and then one at a time; each answer is compared with
the unsliced model run alone on onnxruntime (CPU). Writes DIR/serve_check.json (every answer's error
and latency, the dvabatch_* metrics) and DIR/tritonserver.log. If the server does not start or the
model does not load, the exact error and the server log's tail are what it writes.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Sequence

import numpy as np

REPO = Path(__file__).resolve().parents[2]
NAME = "bert_gpu"
TOLERANCE = 1e-4


def prepare(repo: Path, instance: str = "gpu") -> tuple[Path, list[dict[str, np.ndarray]]]:
    """The sliced model in `repo` with the GPU config (with `instance` "cpu", its instance group
    on Triton's KIND_CPU); queries of lengths 1..32."""
    from perf.baselines.bench import query_maker
    from slicer.profiler import int_bounds
    from slicer.slice_model import SliceOptions, slice_model
    from slicer.triton_files import add_model_variant
    from slicer.zoo import build

    model = build("bert", "test")
    report = slice_model(model, repo / ".sliced" / "bert", SliceOptions(
        stages=3, max_batch_size=16, max_length=32, repeats=3, batch_sizes=(1, 4, 16), calibration_rounds=1,
        force=True))
    version = report.out_dir / "1"
    add_model_variant(repo, version, NAME, policy="input")
    config = repo / NAME / "config.pbtxt"
    subprocess.run([sys.executable, str(REPO / "docker" / "gpu_config.py"), str(config)], check=True)
    if instance == "cpu":  # the stub's instance on Triton's CPU kind; the engine still on CUDA
        text = config.read_text()
        config.write_text(re.sub(r"instance_group\s*\[\s*\{.*?\}\s*\]", "instance_group [ { kind: KIND_CPU count: 1 } ]",
                                 text, flags=re.S))
    rng = np.random.default_rng(0)
    query = query_maker(report.manifest, int_bounds(model))
    queries = [query(rng, int(n)) for n in rng.integers(1, 33, size=24)]
    return version / "model.onnx", queries


def ask(client: Any, grpcclient: Any, queries: Sequence[dict[str, np.ndarray]], burst: bool) -> list[tuple]:
    """(seconds, result, error) per query: all sent at once (`burst`) or one after another."""
    from dvabatch_backend.tools.serve import infer_inputs

    answers: list[Any] = [None] * len(queries)
    done = [threading.Event() for _ in queries]

    def callback(i: int, start: float):
        def on_answer(result, error) -> None:
            answers[i] = (time.perf_counter() - start, result, error)
            done[i].set()
        return on_answer

    for i, q in enumerate(queries):
        client.async_infer(NAME, infer_inputs(grpcclient, q), callback(i, time.perf_counter()), client_timeout=120)
        if not burst:
            done[i].wait(120)
    for event in done:
        event.wait(120)
    return answers


def check(full_model: Path, queries: Sequence[dict[str, np.ndarray]], answers: Sequence[Any]) -> list[dict]:
    import onnxruntime as ort

    session = ort.InferenceSession(str(full_model), providers=["CPUExecutionProvider"])
    outputs = [o.name for o in session.get_outputs()]
    rows = []
    for q, answer in zip(queries, answers):
        length = int(len(next(iter(q.values()))))
        if answer is None or answer[2] is not None:
            rows.append({"length": length, "error": str(answer[2]) if answer else "no answer in 120 s"})
            continue
        want = session.run(outputs, {k: v[None] for k, v in q.items()})
        try:
            err = max(float(np.max(np.abs(answer[1].as_numpy(name)[0] - ref[0]))) for name, ref in zip(outputs, want))
        except ValueError as exc:  # an answer the client cannot read: what the response held
            response = answer[1].get_response()
            rows.append({"length": length, "error": f"{exc}; response outputs "
                         f"{[(o.name, o.datatype, list(o.shape)) for o in response.outputs]}, raw bytes "
                         f"{[len(r) for r in response.raw_output_contents]}"})
            continue
        rows.append({"length": length, "ms": answer[0] * 1e3, "max_abs_error": err})
    return rows


def metrics(url: str, answered: int = 0, timeout: float = 5.0) -> list[str]:
    """The model's dvabatch_* lines, once the goodput counter shows `answered` queries (the sampler
    publishes every 0.25 s, and the queries may all be answered in less) or `timeout` has passed."""
    deadline = time.monotonic() + timeout
    while True:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        lines = [line for line in text.splitlines() if line.startswith("dvabatch_") and f'model="{NAME}"' in line]
        goodput = [float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("dvabatch_goodput_queries_total")]
        if (goodput and goodput[0] >= answered) or time.monotonic() > deadline:
            return lines
        time.sleep(0.1)


def run(out: Path, instance: str = "gpu") -> dict[str, Any]:
    from dvabatch_backend.tools.serve import TritonServer

    out.mkdir(parents=True, exist_ok=True)
    repo = out / "repository"
    full_model, queries = prepare(repo, instance)
    result: dict[str, Any] = {"config": (repo / NAME / "config.pbtxt").read_text()}
    server = TritonServer(repo, log_path=out / "tritonserver.log")
    try:
        with server:
            server.wait_model_ready(NAME, timeout=45)
            import tritonclient.grpc as grpcclient

            client = grpcclient.InferenceServerClient(server.grpc_url)
            result["burst"] = check(full_model, queries, ask(client, grpcclient, queries, burst=True))
            result["one_by_one"] = check(full_model, queries, ask(client, grpcclient, queries, burst=False))
            answered = sum("error" not in r for r in result["burst"] + result["one_by_one"])
            result["metrics"] = metrics(server.metrics_url, answered)
    except Exception as exc:  # the exact error is the finding: kept with the log's tail
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["log_tail"] = server.log_tail(60)
    rows = result.get("burst", []) + result.get("one_by_one", [])
    result["ok"] = bool(rows) and all("error" not in r and r["max_abs_error"] <= TOLERANCE for r in rows)
    (out / "serve_check.json").write_text(json.dumps(result, indent=2))
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--instance", default="gpu", choices=("gpu", "cpu"),
                        help="Triton's instance kind (the engine is on CUDA either way)")
    args = parser.parse_args(argv)
    result = run(args.out, args.instance)
    for key in ("burst", "one_by_one"):
        rows = result.get(key, [])
        ok = [r for r in rows if "error" not in r]
        if rows:
            print(f"{key}: {len(ok)}/{len(rows)} answered, max |error| "
                  f"{max((r['max_abs_error'] for r in ok), default=float('nan')):.2e}, mean "
                  f"{np.mean([r['ms'] for r in ok]) if ok else float('nan'):.2f} ms")
    if "error" in result:
        print(f"FAILED: {result['error']}\n{result['log_tail']}")
    failed = [r for r in result.get("burst", []) + result.get("one_by_one", []) if "error" in r]
    print("\n".join(f"  length {r['length']}: {r['error']}" for r in failed[:3]))
    print("\n".join(result.get("metrics", [])))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
