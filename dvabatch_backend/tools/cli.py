"""The `dvabatch` command: slice, serve, compare, the zoo and the demos (`dvabatch --help`)."""
from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..runtime.query import Answer
from ..runtime.loading import load_pipeline
from ..runtime.settings import RuntimeSettings
from .progress import StepProgress

if TYPE_CHECKING:
    from .serve import TritonServer


DESCRIPTION = ("Serve your own ONNX model through Triton Inference Server with multi-entry multi-exit batching "
               "(DVABatch): slice it into time-balanced stages, serve the stages with the real tritonserver, and "
               "compare the served model with Triton's own dynamic batcher.")
EPILOG = ("A first run: dvabatch zoo bert --size test --out bert.onnx; dvabatch slice bert.onnx --out repo/bert; "
          "dvabatch serve --model-repository repo; dvabatch compare repo/bert. The manual: docs/cli.md.")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default, where it has one to show: not for a switch (off
    unless given), a flag that is unset unless given, a repeatable one, or help that says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help = action.help or ""
        if action.nargs == 0 or action.default in (None, []) or "(default" in help or not action.option_strings:
            return help
        return super()._get_help_string(action)


def _parser(sub: Any, name: str, help: str, description: str | None = None) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=help, description=description or help[:1].upper() + help[1:] + ".",
                          formatter_class=_HelpFormatter)


def version() -> str:
    """The installed package's version (the source tree's, where it runs uninstalled)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("dvabatch")
    except PackageNotFoundError:
        return "0+unknown"


def build_parser() -> argparse.ArgumentParser:
    """The `dvabatch` command's parser: every sub-command and flag, each with its help and default
    (docs/cli.md is generated from it: `python -m dvabatch_backend.tools.cli_reference --write`)."""
    parser = argparse.ArgumentParser(prog="dvabatch", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"dvabatch {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_slice(_parser(sub, "slice", "cut an ONNX model into time-balanced, verified stages, as a Triton model folder"))
    _add_serve(_parser(sub, "serve", "run the real tritonserver over a model repository until interrupted",
                       "Serve until SIGINT or SIGTERM, then unload every model (what is in flight is answered), "
                       "stop the server and exit 0."))
    _add_compare(_parser(sub, "compare", "serve a sliced model beside Triton's own dynamic batcher and compare them",
                         "Serve the sliced model (its config untouched) and the unsliced model behind Triton's "
                         "dynamic batcher (ZeroBatch) in one tritonserver, send each the same load, print the "
                         "table and draw latency against load (a PNG; on the CPU)."))
    _add_zoo(_parser(sub, "zoo", "build a model of the zoo as ONNX, or list them"))
    from .demo import add_arguments

    add_arguments(_parser(sub, "demo", "slice a zoo model, serve it from the real tritonserver, send bursts"))
    _add_demo_runtime(_parser(sub, "demo-runtime", "the runtime alone (no server) on a small toy model"))
    return parser


def _add_slice(slice_: argparse.ArgumentParser) -> None:
    from slicer.precision import PRECISIONS

    slice_.add_argument("model", type=Path, help="the ONNX model")
    slice_.add_argument("--out", type=Path, required=True, help="model directory to write (NAME/, for a model repository)")
    slice_.add_argument("--stages", default="auto", help="number of stages, or 'auto' to choose by measurement")
    slice_.add_argument("--candidates", default="1,2,3,4",
                        help="stage counts tried by --stages auto (1, the whole model, for fixed-shape models only)")
    slice_.add_argument("--name", help="model name (default: the --out folder's name)")
    slice_.add_argument("--bs-max", type=int, default=64,
                        help="the largest batch the model serves: its max_batch_size, the largest size profiled")
    slice_.add_argument("--max-length", type=int, default=128, help="longest input, for models with a 'seq' dim")
    slice_.add_argument("--threads", type=int, default=1,
                        help="onnxruntime threads that time the nodes and stages to balance the cuts (the served "
                             "profile and config use every core)")
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
    slice_.add_argument("--precision", choices=tuple(PRECISIONS), default="fp32",
                        help="the stages' and the unsliced model's floats (inputs and outputs keep their types; "
                             "each output checked against fp32 within 64 unit roundoffs of its largest magnitude; "
                             "bf16 runs on the torch engine)")
    slice_.add_argument("-v", "--verbose", action="store_true", help="on an error, print its traceback too")
    slice_.add_argument("--batch-axis", action="append", default=[], metavar="INPUT:AXIS",
                        help="the batch axis of an input, where discovery gets it wrong (must be 0); repeatable")
    slice_.add_argument("--variable-axis", action="append", default=[], metavar="INPUT:AXIS",
                        help="the variable axis (length, width, frames) of an input with several dynamic dims; "
                             "repeatable")
    slice_.add_argument("--fixed", action="append", default=[], metavar="DIM=VALUE",
                        help="a dim that is dynamic in the graph but fixed in use (a dim name, or INPUT:AXIS); "
                             "repeatable")


def _add_serve(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--model-repository", type=Path, required=True,
                       help="the model repository (folders as `dvabatch slice` writes them, or any Triton model)")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address HTTP, gRPC and metrics listen on (in a container, 0.0.0.0)")
    serve.add_argument("--http-port", type=int, default=8000, help="Triton's HTTP/REST port")
    serve.add_argument("--grpc-port", type=int, default=8001, help="Triton's gRPC port")
    serve.add_argument("--metrics-port", type=int, default=8002, help="Triton's Prometheus metrics port")
    serve.add_argument("--explicit", action="store_true", help="model control mode explicit")
    serve.add_argument("--load", action="append", default=[], help="with --explicit: a model to load at start; repeatable")
    serve.add_argument("--no-stub-watchdog", dest="watch_stubs", action="store_false",
                       help="do not restart a model whose Python-backend stub process died")


COMPARE_DRIVERS = ("own", "perf_analyzer")


def _add_compare(compare: argparse.ArgumentParser) -> None:
    compare.add_argument("model_dir", type=Path, nargs="?", metavar="MODEL_DIR",
                         help="a model folder as `dvabatch slice` wrote it (config.pbtxt and 1/)")
    compare.add_argument("--demo", type=Path, metavar="DIR",
                         help="instead of MODEL_DIR: the model repository `dvabatch demo --out DIR` wrote")
    compare.add_argument("--driver", choices=COMPARE_DRIVERS, default="own",
                         help="our own open-loop load generator (a minute or two), or NVIDIA's perf_analyzer (the "
                              "lone query, the closed-loop peak, the sustained rate, bursts: half an hour)")
    compare.add_argument("--loads",
                         help="offered loads, fractions of ZeroBatch's closed-loop peak, comma separated (default: "
                              "0.5,0.9; on a GPU or the stand-in 0.25,0.6,0.9,1.1; perf_analyzer's are fixed: 0.5x, "
                              "0.9x and bursts at 0.5x of the better baseline's sustained rate)")
    compare.add_argument("--seconds", type=float, help="own driver: about how long its loads take (default: 60)")
    compare.add_argument("--device", choices=("cpu", "cuda", "simulated"), default="cpu",
                         help="where the systems serve: the CPU config as sliced; a GPU or the GPU stand-in with "
                              "the GPU config (then DelayBatch too)")
    compare.add_argument("--device-profile", type=Path,
                         help="with --device simulated: the stand-in's device profile")
    compare.add_argument("--out", type=Path,
                         help="folder for the results and latency.png (default: work/compare/MODEL for the own "
                              "driver, the driver's own folder under work/perf otherwise)")


def _add_zoo(zoo: argparse.ArgumentParser) -> None:
    from slicer.precision import PRECISIONS
    from slicer.zoo import ZOO

    models = zoo.add_subparsers(dest="name", required=True, metavar="MODEL")
    _parser(models, "list", "list the zoo's models and their sizes")
    for name, entry in ZOO.items():
        sizes = sorted(entry.presets)
        model = _parser(models, name, entry.description)
        model.add_argument("--out", type=Path, required=True, help="the .onnx file to write")
        model.add_argument("--size", choices=sizes, default="test" if "test" in sizes else sizes[0],
                           help="a preset: test (small, for tests), bench (what perf/ runs), real (full depth; "
                                "vision models at width 16 and 64-128 pixels) or full (the paper's size: what a "
                                "GPU serves)")
        model.add_argument("--precision", choices=tuple(PRECISIONS), default="fp32",
                           help="its floats (inputs and outputs stay fp32): as `dvabatch slice --precision` "
                                "converts a model")


def _add_demo_runtime(runtime: argparse.ArgumentParser) -> None:
    from policies import BUILTIN

    runtime.add_argument("--stages", type=int, default=4, help="stages the toy model is cut into")
    runtime.add_argument("--queries", type=int, default=40, help="queries sent to each policy")
    runtime.add_argument("--rate", type=float, default=400.0, help="Poisson arrival rate, queries per second")
    runtime.add_argument("--policy", action="append", choices=sorted(BUILTIN),
                         help="policy to run (repeatable; default: pipelined and random)")
    runtime.add_argument("--pairs", type=int, default=2, help="buffer pairs between stages")
    runtime.add_argument("--hidden", type=int, default=128, help="the toy model's hidden width")
    runtime.add_argument("--layers", type=int, default=8, help="the toy model's layers")
    runtime.add_argument("--max-length", type=int, default=64, help="the longest query, in tokens")
    runtime.add_argument("--bs-max", type=int, default=16, help="the largest batch")
    runtime.add_argument("--threads", type=int, default=1, help="onnxruntime threads per stage")
    runtime.add_argument("--out", type=Path, help="model directory to write (default: a temporary one)")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "demo":
        from .demo import run

        return run(args)
    runs = {"demo-runtime": run_demo, "slice": run_slice, "zoo": run_zoo, "serve": run_serve, "compare": run_compare}
    return runs[args.command](args)


def run_compare(args: argparse.Namespace) -> int:
    """`python -m perf.compare` with this command's flags, as a program of its own (the benchmarks
    are the layer above the tools: run, not imported)."""
    import subprocess

    if (args.model_dir is None) == (args.demo is None):
        print("dvabatch compare: give MODEL_DIR or --demo DIR (one of them)", file=sys.stderr)
        return 2
    if args.driver == "perf_analyzer" and (args.loads or args.seconds is not None):
        print("dvabatch compare: perf_analyzer's loads and times are its own (--loads and --seconds are the own "
              "driver's)", file=sys.stderr)
        return 2
    if args.device != "cpu" and args.demo is not None:
        print("dvabatch compare: --device takes MODEL_DIR (a sliced folder), not --demo", file=sys.stderr)
        return 2
    if args.device == "simulated" and args.device_profile is None:
        print("dvabatch compare: --device simulated needs --device-profile FILE", file=sys.stderr)
        return 2
    command = [sys.executable, "-m", "perf.compare", *compare_arguments(args)]
    return subprocess.run(command).returncode


def compare_arguments(args: argparse.Namespace) -> list[str]:
    """`perf.compare`'s arguments for `dvabatch compare`'s flags (those given; the drivers' defaults
    are the rest)."""
    where = ["--demo", str(args.demo)] if args.demo is not None else ["--model-dir", str(args.model_dir)]
    given = [*(["--loads", args.loads] if args.loads else []), *(["--out", str(args.out)] if args.out else [])]
    if args.device != "cpu":
        profile = ["--device-profile", str(args.device_profile)] if args.device_profile is not None else []
        return [*where, "--device", args.device, *profile, *given]
    seconds = ["--seconds", f"{args.seconds:g}"] if args.seconds is not None else []
    return [*where, "--driver", args.driver, *given, *seconds]


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
        precision=args.precision,
    )
    if options.serving.engine == "onnxruntime" and options.serving.device != "cpu":
        print("dvabatch slice: --device cuda serves on the torch engine (--engine torch)", file=sys.stderr)
        return 2
    if not args.verbose:  # onnxruntime's own log lines around a failure: the one line below says it
        import onnxruntime as ort

        ort.set_default_logger_severity(4)
    steps = StepProgress("slicing", sys.stderr)
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


def run_zoo(args: argparse.Namespace) -> int:
    from slicer.zoo import ZOO, build

    if args.name == "list":
        for name, entry in ZOO.items():
            print(f"{name:<10} {entry.description} (sizes: {', '.join(sorted(entry.presets))})")
        return 0
    from slicer.errors import SliceError
    from slicer.precision import convert, precision

    try:
        model = convert(build(args.name, args.size), precision(args.precision))
    except (ValueError, SliceError) as exc:
        print(f"dvabatch zoo: {exc}", file=sys.stderr)
        return 1
    import onnx

    args.out.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(args.out))
    print(f"wrote {args.name} ({args.size}, {args.precision}) to {args.out}: {len(model.graph.node)} nodes")
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
