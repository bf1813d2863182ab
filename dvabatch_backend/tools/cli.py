"""The `dvabatch` command."""
from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..runtime.query import Answer
from ..runtime.loading import load_pipeline
from ..runtime.settings import RuntimeSettings

if TYPE_CHECKING:
    from .serve import TritonServer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dvabatch", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="slice a zoo model, serve it from the real tritonserver, send a burst")
    from .demo import add_arguments

    add_arguments(demo)
    runtime = sub.add_parser("demo-runtime", help="the runtime alone (no server) on a small toy model")
    runtime.add_argument("--stages", type=int, default=4)
    runtime.add_argument("--queries", type=int, default=40)
    runtime.add_argument("--rate", type=float, default=400.0, help="Poisson arrival rate, queries per second")
    runtime.add_argument("--policy", action="append", help="policy name (repeatable); default: pipelined and random")
    runtime.add_argument("--pairs", type=int, default=2, help="buffer pairs between stages")
    runtime.add_argument("--hidden", type=int, default=128)
    runtime.add_argument("--layers", type=int, default=8)
    runtime.add_argument("--max-length", type=int, default=64)
    runtime.add_argument("--bs-max", type=int, default=16)
    runtime.add_argument("--threads", type=int, default=1, help="onnxruntime threads per stage")
    runtime.add_argument("--out", type=Path, help="model directory to write (default: a temporary one)")
    slice_ = sub.add_parser("slice", help="cut an ONNX model into time-balanced, verified stages")
    slice_.add_argument("model", type=Path, help="the ONNX model")
    slice_.add_argument("--stages", default="auto", help="number of stages, or 'auto' to choose by measurement")
    slice_.add_argument("--candidates", default="1,2,3,4",
                        help="stage counts tried by --stages auto (1, the whole model, for fixed-shape models only)")
    slice_.add_argument("--out", type=Path, required=True, help="model directory to write (NAME/, for a model repository)")
    slice_.add_argument("--name", help="model name (default: the --out folder's name)")
    slice_.add_argument("--bs-max", type=int, default=64)
    slice_.add_argument("--max-length", type=int, default=128, help="longest input, for models with a 'seq' dim")
    slice_.add_argument("--threads", type=int, default=1, help="onnxruntime threads per stage")
    slice_.add_argument("--repeats", type=int, default=10, help="timed runs per measurement")
    slice_.add_argument("--operator-diversity-cuts", action="store_true",
                        help="move cuts to where the preferred batch size changes")
    slice_.add_argument("--force", action="store_true", help="replace an existing output directory")
    slice_.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the model will serve, and where its stages are timed (cuda: on this GPU, with "
                             "the torch engine and its CUDA graphs; the GPU config written)")
    slice_.add_argument("--engine", choices=("onnxruntime", "torch"),
                        help="the engine that will serve and times the stages (default: onnxruntime on the CPU, "
                             "torch on cuda)")
    slice_.add_argument("-v", "--verbose", action="store_true", help="on an error, print its traceback too")
    slice_.add_argument("--batch-axis", action="append", default=[], metavar="INPUT:AXIS",
                        help="the batch axis of an input, where discovery gets it wrong (must be 0)")
    slice_.add_argument("--variable-axis", action="append", default=[], metavar="INPUT:AXIS",
                        help="the variable axis (length, width, frames) of an input with several dynamic dims")
    slice_.add_argument("--fixed", action="append", default=[], metavar="DIM=VALUE",
                        help="a dim that is dynamic in the graph but fixed in use (a dim name, or INPUT:AXIS)")
    serve = sub.add_parser("serve", help="run the real tritonserver over a model repository until interrupted",
                           description="Serve until SIGINT or SIGTERM, then unload every model (what is in "
                                       "flight is answered), stop the server and exit 0.")
    serve.add_argument("--model-repository", type=Path, required=True)
    serve.add_argument("--host", default="127.0.0.1",
                       help="address HTTP, gRPC and metrics listen on (default 127.0.0.1; in a container, 0.0.0.0)")
    serve.add_argument("--http-port", type=int, default=8000)
    serve.add_argument("--grpc-port", type=int, default=8001)
    serve.add_argument("--metrics-port", type=int, default=8002)
    serve.add_argument("--explicit", action="store_true", help="model control mode explicit")
    serve.add_argument("--load", action="append", default=[], help="with --explicit: a model to load at start")
    serve.add_argument("--no-stub-watchdog", dest="watch_stubs", action="store_false",
                       help="do not restart a model whose Python-backend stub process died")
    zoo = sub.add_parser("zoo", help="build a model of the zoo as ONNX")
    zoo.add_argument("name", help="model name; 'list' lists them")
    zoo.add_argument("--out", type=Path, help="the .onnx file to write")
    zoo.add_argument("--size", default="test",
                     help="a preset: test (small, for tests), bench (what perf/ runs), real (full depth; "
                          "vision models at width 16 and 64-128 pixels) or full (the paper's size: what a GPU serves)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "demo":
        from .demo import run

        return run(args)
    if args.command == "demo-runtime":
        return run_demo(args)
    if args.command == "slice":
        return run_slice(args)
    if args.command == "zoo":
        return run_zoo(args)
    if args.command == "serve":
        return run_serve(args)
    return 2


def run_serve(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM; then `TritonServer.stop` (every model unloaded once what it
    holds is answered, then the server, its stubs, shared memory and work folder gone) and exit 0.
    A signal while the server starts stops it too; a server that dies by itself exits 1."""
    import signal

    from .serve import ServerError, StartCancelled, TritonServer

    server = TritonServer(args.model_repository, http_port=args.http_port, grpc_port=args.grpc_port,
                          metrics_port=args.metrics_port, explicit=args.explicit, load=args.load,
                          host=args.host, watch_stubs=args.watch_stubs)
    stop = threading.Event()
    # installed before the start: a signal only sets the event, the main thread does the stopping
    previous = {sig: signal.signal(sig, lambda signum, _frame: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _serve_until_stopped(server, stop)
    except StartCancelled:
        print("dvabatch serve: stopped while starting", flush=True)
        return 0
    except ServerError as exc:
        print(f"dvabatch serve: {exc}", file=sys.stderr)
        return 1
    finally:
        code = server.stop()
        print(f"tritonserver stopped (exit code {code})", flush=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _serve_until_stopped(server: "TritonServer", stop: threading.Event) -> int:
    server.start(cancel=stop)
    watchdog = "on" if server.watchdog is not None else "off"
    print(f"tritonserver is up: HTTP {server.http_url}, gRPC {server.grpc_url}, metrics {server.metrics_url} "
          f"(listening on {server.host}); stub watchdog {watchdog}; log {server.log_path}. "
          f"Ctrl-C or SIGTERM stops it.", flush=True)
    while not stop.wait(0.5):
        if server.exited():
            print(f"dvabatch serve: tritonserver exited:\n{server.log_tail()}", file=sys.stderr)
            return 1
    print("dvabatch serve: stopping (unloading models, answering what is in flight)", flush=True)
    return 0


def run_slice(args: argparse.Namespace) -> int:
    """Slice; any failure is one line on stderr (the traceback too with --verbose): a SliceError, the
    model's problem, exits 1; anything else 2."""
    import traceback

    from slicer.axes import AxisOverrides
    from slicer.errors import one_line
    from slicer.serving_engine import ServingEngine
    from slicer.slice_model import SliceError, SliceOptions, slice_model

    try:
        stages = None if args.stages == "auto" else int(args.stages)
        candidates = tuple(int(n) for n in args.candidates.split(","))
    except ValueError:
        print(f"dvabatch slice: --stages must be a number or 'auto' and --candidates numbers separated by commas, "
              f"got {args.stages!r} and {args.candidates!r}", file=sys.stderr)
        return 2
    try:
        axes = AxisOverrides.parse(args.batch_axis, args.variable_axis, args.fixed)
    except ValueError as exc:
        print(f"dvabatch slice: {exc}", file=sys.stderr)
        return 2
    options = SliceOptions(
        stages=stages, candidates=candidates, name=args.name,
        max_batch_size=args.bs_max, max_length=args.max_length, threads=args.threads, repeats=args.repeats,
        operator_diversity_cuts=args.operator_diversity_cuts, force=args.force,
        axes=axes, serving=ServingEngine(args.engine or ("onnxruntime" if args.device == "cpu" else "torch"), args.device),
    )
    if options.serving.engine == "onnxruntime" and options.serving.device != "cpu":
        print("dvabatch slice: --device cuda serves on the torch engine (--engine torch)", file=sys.stderr)
        return 2
    if not args.verbose:  # onnxruntime's own log lines around a failure: the one line below says it
        import onnxruntime as ort

        ort.set_default_logger_severity(4)
    steps = SliceProgress(sys.stderr)
    try:
        report = slice_model(args.model, args.out, options, steps)
    except KeyboardInterrupt:
        steps.close()
        print("dvabatch slice: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        steps.close()
        if args.verbose:
            traceback.print_exc()
        if isinstance(exc, SliceError):
            print(f"dvabatch slice: {one_line(exc)}", file=sys.stderr)
            return 1
        print(f"dvabatch slice: error: {one_line(exc)}", file=sys.stderr)
        return 2
    steps.close()
    print(report.summary())
    return 0


class SliceProgress:
    """The slicer's steps: a bar on a terminal; elsewhere (CI logs, pipes) one line per step."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.steps = 0
        self.start = time.perf_counter()
        self.bar = None
        if getattr(stream, "isatty", lambda: False)():
            from tqdm import tqdm

            self.bar = tqdm(desc="slicing", unit="step", bar_format="{desc}: {n} steps [{elapsed}]", file=stream)

    def __call__(self, message: str) -> None:
        self.steps += 1
        if self.bar is not None:
            self.bar.set_description(message)
            self.bar.update()
        else:
            elapsed = time.perf_counter() - self.start
            print(f"slicing: step {self.steps} ({elapsed:.1f} s): {message}", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def run_zoo(args: argparse.Namespace) -> int:
    from slicer.zoo import ZOO, build

    if args.name == "list":
        for name, entry in ZOO.items():
            print(f"{name:<10} {entry.description}")
        return 0
    if args.out is None:
        print("dvabatch zoo: --out FILE.onnx is required", file=sys.stderr)
        return 2
    try:
        model = build(args.name, args.size)
    except ValueError as exc:
        print(f"dvabatch zoo: {exc}", file=sys.stderr)
        return 1
    import onnx

    args.out.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(args.out))
    print(f"wrote {args.name} ({args.size}) to {args.out}: {len(model.graph.node)} nodes")
    return 0


def run_demo(args: argparse.Namespace) -> int:
    from slicer import cut, toy

    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp) / "token_mlp"
        model = toy.token_mlp(hidden=args.hidden, layers=args.layers)
        layers = [f"h{k}" for k in range(1, args.layers + 1)]
        at = cut.even_cuts(layers, args.stages)
        manifest = cut.cut_model(model, cut.cut_positions_after(model, at), out, "token_mlp", args.bs_max, args.max_length)
        print(f"sliced token_mlp (hidden {args.hidden}, {args.layers} layers) into {manifest.num_stages} stages "
              f"after {at}: {out}")
        queries = _workload(args, np.random.default_rng(0))
        reference = _reference(out / "model.onnx", queries)
        failures = 0
        for name in args.policy or ["pipelined", "random"]:
            failures += _serve(out, name, args, queries, reference)
    return 1 if failures else 0


def _workload(args: argparse.Namespace, rng: np.random.Generator) -> list[tuple[float, dict[str, np.ndarray]]]:
    """Poisson arrivals; lengths mostly 5-20 tokens with a tail up to the maximum."""
    t, queries = 0.0, []
    for _ in range(args.queries):
        t += rng.exponential(1.0 / args.rate)
        short = rng.random() < 0.8
        length = int(rng.integers(5, 21) if short else rng.integers(21, args.max_length + 1))
        x = rng.standard_normal((length, args.hidden)).astype(np.float32)
        queries.append((t, {"x": x, "mask": np.ones(length, np.float32)}))
    return queries


def _reference(path: Path, queries: list[tuple[float, dict[str, np.ndarray]]]) -> list[dict[str, np.ndarray]]:
    """The unsliced model run on each query alone."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return [dict(zip(names, (r[0] for r in session.run(None, {k: v[None] for k, v in q.items()})))) for _, q in queries]


def _serve(model_dir: Path, policy_name: str, args: argparse.Namespace,
           queries: list[tuple[float, dict[str, np.ndarray]]], reference: list[dict[str, np.ndarray]]) -> int:
    from policies import create_policy

    settings = RuntimeSettings(num_buffer_pairs=args.pairs, bs_max=args.bs_max, threads_per_stage=args.threads,
                               record_trace=True)
    scheduler = load_pipeline(model_dir, create_policy(policy_name), settings)
    answers: dict[int, tuple[float, Answer]] = {}
    all_done = threading.Event()

    def reply(answer: Answer) -> None:
        answers[answer.query_id] = (time.perf_counter(), answer)
        if len(answers) == len(queries):
            all_done.set()

    sent: dict[int, tuple[int, float]] = {}
    with scheduler:
        t0 = time.perf_counter()
        for i, (at, inputs) in enumerate(queries):
            time.sleep(max(0.0, t0 + at - time.perf_counter()))
            now = time.perf_counter()
            sent[scheduler.submit(inputs, reply)] = (i, now)
        finished = all_done.wait(60)
        trace = list(scheduler.trace)
        stats = scheduler.stats
    print(f"\n== policy {policy_name}: {len(queries)} queries at {args.rate:.0f}/s, {args.pairs} buffer pairs ==")
    print(f"{'query':>5} {'len':>4} {'latency ms':>10} {'max |err|':>10}")
    latencies, failures = [], 0
    for qid, (i, t_sent) in sent.items():
        t_done, answer = answers.get(qid, (float("nan"), None))
        length = len(queries[i][1]["mask"])
        if answer is None or answer.error is not None:
            failures += 1
            print(f"{qid:>5} {length:>4} {'-':>10} {answer.error if answer else 'no answer'}")
            continue
        err = max(float(np.max(np.abs(answer.outputs[k] - v))) for k, v in reference[i].items())
        failures += err > 1e-4
        latencies.append((t_done - t_sent) * 1e3)
        print(f"{qid:>5} {length:>4} {latencies[-1]:>10.2f} {err:>10.1e}")
    print("batch decisions:")
    for ev in trace:
        if ev.kind in ("new", "stretch", "split"):
            where = "arrival" if ev.stage is None else f"after stage {ev.stage}"
            print(f"  {ev.kind:<7} batch {ev.batch_id:>3} rows [{ev.start}, {ev.start + ev.num}) at {where} {ev.detail}")
    if latencies:
        lat = np.array(latencies)
        print(f"latency ms: mean {lat.mean():.2f}  p50 {np.percentile(lat, 50):.2f}  p99 {np.percentile(lat, 99):.2f}")
    print(f"meta operations: new {stats.new}, stretch {stats.stretch}, split {stats.split}; "
          f"answered {stats.answered_ok} ok / {stats.answered_error} errors; all answered: {finished}")
    return failures + (not finished)


if __name__ == "__main__":
    sys.exit(main())
