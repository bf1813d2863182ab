"""A model over protobuf's 2 GB limit, sliced and served: the slicer's peak memory and time.

    python -m perf.costs.large_model [--gib 2.25] [--stages 3] [--out work/perf]

Builds a residual MLP (`slicer.toy.residual_mlp`'s blocks at width 4096) whose weights take
`--gib` GiB, written with external data as every model over 2 GB must be (one weight at a time:
the builder never holds them all), then runs `dvabatch slice` on it in a child process and reads
the peak resident memory of that process and of every process it started (`getrusage`'s
`RUSAGE_CHILDREN`: the largest peak among them), against the weights' size; then serves the
sliced model from the real tritonserver and checks a few requests against onnxruntime running the
original by path. Results: OUT/large_model/results.json. Takes a few minutes and about 3x the
weights in memory at its peak (the server's stub holds the stages and the unsliced model).
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

DEFAULT_OUT = Path(__file__).resolve().parents[2] / "work" / "perf"
WIDTH = 4096
WEIGHTS_FILE = "model.weights"


def build_large_mlp(path: Path, gib: float, width: int = WIDTH, seed: int = 0) -> int:
    """Write the model at `path` with its weights in `WEIGHTS_FILE` beside it; returns their bytes."""
    per_matrix = width * width * 4
    blocks = max(1, round(gib * 2**30 / (2 * per_matrix)))
    rng = np.random.default_rng(seed)
    scale = np.float32(1.0 / np.sqrt(width))
    inits = [numpy_helper.from_array(np.array(0.5, np.float32), "half")]
    nodes = []
    offset = 0
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / WEIGHTS_FILE, "wb") as data:
        def external(name: str, array: np.ndarray) -> None:
            nonlocal offset
            raw = np.ascontiguousarray(array).tobytes()
            data.write(raw)
            tensor = onnx.TensorProto(name=name, data_type=onnx.TensorProto.FLOAT, dims=list(array.shape),
                                      data_location=onnx.TensorProto.EXTERNAL)
            for key, value in (("location", WEIGHTS_FILE), ("offset", str(offset)), ("length", str(len(raw)))):
                tensor.external_data.add(key=key, value=value)
            offset += len(raw)
            inits.append(tensor)

        prev = "x"
        for k in range(1, blocks + 1):
            for j, (src, dst) in enumerate(((prev, f"in{k}"), (f"act{k}", f"out{k}"))):
                w, b = f"w{k}_{j}", f"b{k}_{j}"
                external(w, rng.standard_normal((width, width), dtype=np.float32) * scale)
                external(b, np.zeros(width, np.float32))
                nodes += [helper.make_node("MatMul", [src, w], [f"{dst}_mm"], name=f"matmul{k}_{j}"),
                          helper.make_node("Add", [f"{dst}_mm", b], [dst], name=f"bias{k}_{j}")]
                if j == 0:
                    nodes.append(helper.make_node("Relu", [f"in{k}"], [f"act{k}"], name=f"relu{k}"))
            nodes.append(helper.make_node("Mul", [f"out{k}", "half"], [f"scaled{k}"], name=f"scale{k}"))
            out = "y" if k == blocks else f"r{k}"
            nodes.append(helper.make_node("Add", [prev, f"scaled{k}"], [out], name=f"residual{k}"))
            prev = out
    graph = helper.make_graph(nodes, "large_mlp", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", width])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["batch", width])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return offset


def slice_in_child(model: Path, out: Path, stages: str, bs_max: int) -> dict[str, Any]:
    """`dvabatch slice` in a child process: its wall time and the largest peak RSS among it and its
    children (the first child this process waits for: no earlier one can have set the figure)."""
    began = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "dvabatch_backend.tools.cli", "slice", str(model), "--stages", stages,
                           "--bs-max", str(bs_max), "--out", str(out), "--force"], capture_output=True, text=True)
    wall = time.perf_counter() - began
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if proc.returncode != 0:
        raise RuntimeError(f"dvabatch slice failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return {"wall_s": round(wall, 1), "peak_rss_gib": round(peak_kib / 2**20, 2),
            "summary": proc.stdout.strip().splitlines()[-12:]}


def serve_and_compare(repo: Path, name: str, model: Path, queries: int = 6) -> dict[str, Any]:
    """Serve the slice from the real tritonserver; each answer against the original run by path."""
    import onnxruntime as ort
    import tritonclient.http as httpclient

    from dvabatch_backend.tools.serve import TritonServer, infer_inputs

    original = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    worst = 0.0
    with TritonServer(repo) as server:
        server.wait_model_ready(name, timeout=600)
        client = httpclient.InferenceServerClient(server.http_url, network_timeout=300.0)
        for i in range(queries):
            x = rng.standard_normal((1 + i % 3, WIDTH)).astype(np.float32)
            got = client.infer(name, infer_inputs(httpclient, {"x": x}, add_batch_dim=False)).as_numpy("y")
            want = original.run(None, {"x": x})[0]
            if got.shape != want.shape:
                raise AssertionError(f"query {i}: shape {got.shape} != {want.shape}")
            worst = max(worst, float(np.max(np.abs(got - want))))
        client.close()
    return {"queries": queries, "max_abs_error": worst}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.costs.large_model", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=2.25, help="the weights' size (default: %(default)s GiB)")
    parser.add_argument("--stages", default="3")
    parser.add_argument("--bs-max", type=int, default=4)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--no-serve", action="store_true")
    args = parser.parse_args(argv)
    root = args.out / "large_model"
    model = root / "src" / "model.onnx"
    began = time.perf_counter()
    weights = build_large_mlp(model, args.gib)
    print(f"built {model}: weights {weights / 2**30:.2f} GiB in {time.perf_counter() - began:.0f} s", flush=True)
    sliced = slice_in_child(model, root / "repo" / "large_mlp", args.stages, args.bs_max)
    ratio = sliced["peak_rss_gib"] / (weights / 2**30)
    print(f"dvabatch slice: {sliced['wall_s']} s, peak RSS {sliced['peak_rss_gib']} GiB = {ratio:.2f}x the weights",
          flush=True)
    result: dict[str, Any] = {"weights_gib": round(weights / 2**30, 3), "slice": sliced, "peak_over_weights": round(ratio, 2)}
    if not args.no_serve:
        result["served"] = serve_and_compare(root / "repo", "large_mlp", model)
        print(f"served: {result['served']}", flush=True)
    (root / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    ok = ratio < 2.0 and (args.no_serve or result["served"]["max_abs_error"] <= 1e-3)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
