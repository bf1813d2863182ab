"""Is dvabatch faster than Triton's own batcher on my model? One command for any sliced model:

    python -m perf.compare --model-dir model_repository/my_model [--driver perf_analyzer|own] [OPTIONS]
    python -m perf.compare --model bert [--size bench] [OPTIONS]       (a zoo model, sliced first)
    python -m perf.compare --demo work/demo                             (the folder `dvabatch demo --out` wrote)

The model as the slicer wrote it (its config.pbtxt untouched) is served by one tritonserver beside
ZeroBatch (Triton's dynamic batcher, no queue delay) and DelayBatch (with a queue delay) over the
unsliced model, the same onnxruntime threads for all. Two drivers send the load:

- `perf_analyzer` (the default; `perf.compare.by_perf_analyzer`): NVIDIA's perf_analyzer, the
  tool Triton users measure with. One table: concurrency 1, the closed-loop peak, the sustained
  rate under a p99 target (every system stepped over one grid of Poisson rates), Poisson at 0.5x
  and 0.9x of the better baseline's sustained rate and bursty arrivals at 0.5x; DVABatch's ratio to
  the better baseline for each figure. OPTIONS are that tool's (`--quick`, `--delays 500,1000,...`,
  `--latency-target-ms`, `--sliced DIR`, `--overhead`, ...; `--help` lists them);
- `own` (the default for `--demo`; `perf.compare.by_own_driver`): our own open-loop generator
  (`perf.load.drivers`), DVABatch beside ZeroBatch at 0.5x and 0.9x of ZeroBatch's peak with every
  answer checked for errors, in about `--seconds`. OPTIONS: `--seconds`, `--baseline-threads`,
  `--out DIR` (the plot of mean and p99 latency against the load, DIR/latency.png; default
  work/compare/MODEL).

`--device cuda|simulated` (`perf.compare.on_device`) serves the model with the GPU config the Docker
image writes, on a GPU or on the GPU stand-in (`--device-profile FILE`), beside ZeroBatch and
DelayBatch on the same engine, driven by our own open-loop generator.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

DRIVERS = ("perf_analyzer", "own")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.compare", description=__doc__.split("\n\n")[0],
                                     epilog="Other options go to the driver's own command.")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--model-dir", type=Path, help="a sliced model folder (config.pbtxt and 1/)")
    which.add_argument("--model", help="a zoo model, sliced with its bench-size defaults (perf_analyzer driver)")
    which.add_argument("--demo", type=Path, help="the model repository `dvabatch demo --out DIR` wrote")
    parser.add_argument("--driver", choices=DRIVERS, default=None,
                        help="perf_analyzer (default) or our own load generator (the default for --demo)")
    parser.add_argument("--device", choices=("cuda", "simulated"),
                        help="serve on a GPU (the Docker image's GPU config) or on the GPU stand-in "
                             "(with --device-profile FILE), beside ZeroBatch and DelayBatch on the same engine "
                             "(perf.compare.on_device)")
    args, rest = parser.parse_known_args(argv)
    if args.device:
        from perf.compare import on_device

        if not args.model_dir:
            parser.error("--device takes --model-dir")
        return on_device.main(["--model-dir", str(args.model_dir), "--device", args.device, *rest])
    driver = args.driver or ("own" if args.demo else "perf_analyzer")
    if driver == "own":
        from perf.compare import by_own_driver

        if args.model:
            parser.error("--driver own takes --model-dir or --demo (a zoo model: slice it with dvabatch zoo and slice)")
        return by_own_driver.main([str(args.demo or args.model_dir), *rest])
    from perf.compare import by_perf_analyzer

    if args.demo:
        from perf.compare.by_own_driver import demo_model_dir

        return by_perf_analyzer.main(["--model-dir", str(demo_model_dir(args.demo)), *rest])
    where = ["--model-dir", str(args.model_dir)] if args.model_dir else ["--model", args.model]
    return by_perf_analyzer.main([*where, *rest])


if __name__ == "__main__":
    sys.exit(main())
