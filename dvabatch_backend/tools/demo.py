"""The main job: slice a zoo model, serve it from the real tritonserver, send a burst of
mixed-length queries with tritonclient, and show each answer's latency and what the backend did.

With MiniLM (the default) the queries are real sentences, tokenized with the model's own
tokenizer; every answer is checked against the unsliced model run on the query alone.

`--out DIR` keeps the model repository (the sliced model in DIR/.sliced/MODEL/1, the served
variant in DIR/MODEL_POLICY, and `demo.json`, which names them); `python -m perf.compare.by_own_driver DIR`
then serves it beside ZeroBatch under the same load.
"""
from __future__ import annotations

import argparse
import json
import re
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

SENTENCES = [
    "Hi.",
    "Batching helps.",
    "Short queries should not wait.",
    "A serving system batches queries to use the hardware well.",
    "The cat sat on the mat and looked at the garden for a while.",
    "Late queries can join a batch that is already running, and catch up stage by stage.",
    "DVABatch slices a model into stages and runs batches through them like a software pipeline, "
    "so that batches can enter and leave at any stage instead of waiting for one another.",
    "When a large batch reaches operators that prefer small batches, it can be split into smaller "
    "batches that run one after another and leave the pipeline independently, so that the first "
    "queries are answered before the whole batch has finished its work, which lowers the mean latency.",
    "Input diversity means queries of very different lengths arrive together: padding every query "
    "to the longest one wastes computation, so queries of similar length are batched together and the "
    "batches run in parallel in the pipeline, and short queries leave early while long ones still run "
    "through the later stages of the model, which is exactly what a multi-exit scheme allows.",
    "Yes.",
    "Operators differ.",
    "Load changes all the time, from a trickle of queries at night to bursts during the day.",
]

RECORD = "demo.json"  # in the repository: what the demo served, for perf.compare.by_own_driver


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from slicer.zoo import ZOO

    parser.add_argument("--model", default="minilm", choices=sorted(ZOO),
                        help="zoo model (default: MiniLM with its real weights)")
    parser.add_argument("--stages", type=int, default=3, help="stages the model is cut into")
    from policies import BUILTIN

    parser.add_argument("--policy", default="auto", choices=["auto", *sorted(BUILTIN)],
                        help="batching policy of the served model (default: the slicer's choice, as it writes it)")
    parser.add_argument("--window", type=float, default=None,
                        help="input policy: a fixed batch window, seconds (default: the adaptive one)")
    parser.add_argument("--rounds", type=int, default=2, help="bursts to send")
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help="keep the model repository there (default: a temporary one, removed at the end)")


def run(args: argparse.Namespace) -> int:
    from slicer.profiler import int_bounds
    from slicer.slice_model import SliceOptions, slice_model
    from slicer.triton_files import add_model_variant
    from slicer.zoo import ZOO, build

    from .serve import TritonServer

    with tempfile.TemporaryDirectory() as tmp:
        repo = args.out or Path(tmp) / "repository"
        model = build(args.model, "test")
        max_length = ZOO[args.model].max_length.get("real", 0)
        print(f"slicing {args.model} into {args.stages} stages (profiling, balancing, verifying)...", flush=True)
        report = slice_model(model, repo / ".sliced" / args.model, SliceOptions(
            stages=args.stages, max_batch_size=16, max_length=max_length or 128, repeats=5,
            batch_sizes=(1, 2, 4, 8, 16), calibration_rounds=2, force=True))
        print(report.summary())
        # the served config is the one the slicer writes, with no tuning, unless told otherwise
        policy = report.manifest.extra.get("policy", {}).get("choice", "pipelined") if args.policy == "auto" else args.policy
        name = f"{args.model}_{policy}"
        params = {"window": args.window} if policy == "input" and args.window is not None else {}
        add_model_variant(repo, report.out_dir / "1", name, policy=policy, policy_params=params)
        write_record(repo, args.model, name, report.out_dir / "1")
        queries = _queries(args.model, report.manifest, int_bounds(model), max_length)
        with TritonServer(repo) as server:
            print(f"\ntritonserver up (HTTP {server.http_url}, gRPC {server.grpc_url}); loading {name}...", flush=True)
            server.wait_model_ready(name, timeout=300)
            failures = 0
            for round_ in range(args.rounds):
                failures += _burst(server, name, queries, report.out_dir / "1" / "model.onnx", round_)
            print("\nmeta operations done by the backend (Triton metrics endpoint):")
            for line in _meta_operations(server.metrics_url, name):
                print(f"  {line}")
        if args.out:
            print(f"\nthe model repository is in {repo}: python -m perf.compare.by_own_driver {repo} serves it beside ZeroBatch")
    return 1 if failures else 0


def _queries(model: str, manifest, int_high: dict[str, int], max_length: int) -> list[dict[str, np.ndarray]]:
    if model == "minilm":
        from slicer.zoo.transformer import tokenize

        return tokenize(SENTENCES, max_length=max_length)
    from slicer.profiler import random_inputs

    rng = np.random.default_rng(0)
    lengths = [int(n) for n in rng.integers(1, max(max_length, 1) + 1, size=len(SENTENCES))] if max_length else [0] * 12
    return [{k: v[0] for k, v in random_inputs(manifest.inputs, 1, n, rng, int_high).items()} for n in lengths]


def _burst(server, name: str, queries: list[dict[str, np.ndarray]], full_model: Path, round_: int) -> int:
    import onnxruntime as ort
    import tritonclient.grpc as grpcclient

    from .serve import infer_inputs

    client = grpcclient.InferenceServerClient(server.grpc_url)
    requests = [infer_inputs(grpcclient, q) for q in queries]
    client.infer(name, requests[0])  # a warm channel
    done = [threading.Event() for _ in queries]
    answers: list = [None] * len(queries)
    start = time.perf_counter()

    def callback(i: int):
        def on_answer(result, error) -> None:
            answers[i] = (time.perf_counter() - start, result, error)
            done[i].set()
        return on_answer

    for i, tensors in enumerate(requests):
        client.async_infer(name, tensors, callback(i), client_timeout=120)
    for event in done:
        event.wait(120)
    full = ort.InferenceSession(str(full_model), providers=["CPUExecutionProvider"])
    output = full.get_outputs()[-1].name
    print(f"\nburst {round_ + 1}: {len(queries)} queries sent at once, in this order")
    print(f"{'query':>5} {'tokens':>6} {'answered after':>15}  {'|error| vs unsliced':>20}")
    failures = 0
    for i, (q, answer) in enumerate(zip(queries, answers)):
        length = len(next(iter(q.values())))
        if answer is None or answer[2] is not None:
            failures += 1
            print(f"{i:>5} {length:>6} {'-':>15}  {answer[2] if answer else 'no answer'}")
            continue
        got = answer[1].as_numpy(output)[0]
        ref = full.run([output], {k: v[None] for k, v in q.items()})[0][0]
        err = float(np.max(np.abs(got - ref)))
        failures += err > 1e-4
        print(f"{i:>5} {length:>6} {answer[0] * 1e3:>12.1f} ms  {err:>20.1e}")
    return failures


def _meta_operations(metrics_url: str, model: str) -> list[str]:
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    lines = []
    for line in text.splitlines():
        found = re.match(r'(dvabatch_\w+)\{(.*)\} ([0-9.e+-]+)$', line)
        if found and f'model="{model}"' in found.group(2):
            labels = ", ".join(x for x in found.group(2).split(",") if not x.startswith("model="))
            lines.append(f"{found.group(1)}[{labels}] = {float(found.group(3)):g}")
    return sorted(lines)


def write_record(repo: Path, zoo_model: str, served: str, version_dir: Path) -> Path:
    """repo/demo.json: the zoo model, the served model's name and its version folder (relative to
    the repository)."""
    record = {"zoo_model": zoo_model, "served": served,
              "version_dir": str(version_dir.resolve().relative_to(repo.resolve()))}
    path = repo / RECORD
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def read_record(repo: Path) -> dict[str, str]:
    """What `write_record` wrote; FileNotFoundError (with a hint) when `repo` holds no demo."""
    path = Path(repo) / RECORD
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found; write the repository first with dvabatch demo --out {repo}")
    return dict(json.loads(path.read_text()))
