"""Stages in a row against the unsliced model, per-stage threads against one global pool:

    python -m perf.costs.thread_pool [DIR] [--zoo bert --size bench] [--lengths 16,64,128] [--rounds 5]

DIR is a sliced model (its version folder, or the Triton model folder above it); without it the
zoo model is sliced into 3 stages in a scratch folder first. In this one process, one query at a
time (batch 1), blocks interleaved in shuffled order (`perf.costs.inprocess.run_interleaved`):

- the unsliced model on every available core, its own pool of that many threads, no spin-waiting:
  the baselines' engine (`perf.baselines.model`), the reference;
- its stages run one after another, 1 onnxruntime thread per stage (`thread_pool per_stage`);
- the same with as many threads per stage as cores (per-stage pools: the served default,
  `threads_per_stage 0`, where the stages run one at a time);
- its stages run one after another on onnxruntime's global pool of every core (`thread_pool
  global`), and the unsliced model on that pool too.

Printed per length: each one's median latency and the ratio to the reference. With one thread per
stage a lone stage uses one core of several; with the global pool it uses them all, so its ratio is
about the cost of the slicing alone (boundary copies, lost fusion). The global pool spin-waits for
work after a run (onnxruntime's Python API sets its sizes only), which per-session pools here do not.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dvabatch_backend.runtime.engine import GLOBAL, PER_STAGE, available_cores
from dvabatch_backend.runtime.loading import find_version_dir
from dvabatch_backend.runtime.manifest import Manifest
from perf.baselines.bench import query_maker
from perf.costs.inprocess import DirectRunner, Runner, StagesRunner, run_interleaved

UNSLICED = "unsliced, own pool"
PER_STAGE_1 = "stages, 1 thread each"
PER_STAGE_ALL = "stages, own pools"
GLOBAL_POOL = "stages, global pool"
UNSLICED_GLOBAL = "unsliced, global pool"
SHOWN = (PER_STAGE_1, PER_STAGE_ALL, GLOBAL_POOL, UNSLICED_GLOBAL)


def runners(version_dir: Path, cores: int) -> dict[str, Runner]:
    manifest = Manifest.load(version_dir / "manifest.json")
    return {
        UNSLICED: DirectRunner(version_dir / (manifest.full_model or "model.onnx"), cores),
        PER_STAGE_1: StagesRunner(version_dir, 1, PER_STAGE),
        PER_STAGE_ALL: StagesRunner(version_dir, cores, PER_STAGE),
        GLOBAL_POOL: StagesRunner(version_dir, cores, GLOBAL),
        UNSLICED_GLOBAL: DirectRunner(version_dir / (manifest.full_model or "model.onnx"), cores, GLOBAL),
    }


def measure(version_dir: Path, lengths: Sequence[int], rounds: int, block: int, seed: int = 0) -> dict[int, dict[str, float]]:
    """Per length: each runner's median latency in ms."""
    from slicer.profiler import int_bounds
    import onnx

    manifest = Manifest.load(version_dir / "manifest.json")
    full = onnx.load(str(version_dir / (manifest.full_model or "model.onnx")), load_external_data=False)
    make = query_maker(manifest, int_bounds(full))
    rng = np.random.default_rng(seed)
    by_name = runners(version_dir, available_cores())
    out: dict[int, dict[str, float]] = {}
    for length in lengths:
        queries = [make(rng, length) for _ in range(4)]
        samples = run_interleaved(by_name, queries, rounds, block, warmup=8, seed=seed + length)
        out[length] = {label: float(np.median([s.latency for s in runs])) * 1e3 for label, runs in samples.items()}
    return out


def report(results: dict[int, dict[str, float]], cores: int) -> list[str]:
    """A table of median ms and ratios to the reference (the unsliced model on its own pool)."""
    lines = [f"{'length':>6} | {UNSLICED:>18} | " + " | ".join(f"{label:>22} {'ratio':>5}" for label in SHOWN)]
    for length, ms in results.items():
        base = ms[UNSLICED]
        cells = " | ".join(f"{ms[label]:>19.3f} ms {ms[label] / base:>5.2f}" for label in SHOWN)
        lines.append(f"{length:>6} | {base:>15.3f} ms | {cells}")

    def span(label: str) -> str:
        ratios = [ms[label] / ms[UNSLICED] for ms in results.values()]
        return f"{min(ratios):.2f}-{max(ratios):.2f}x"

    lines.append(f"stages in a row / unsliced ({cores} cores): 1 thread per stage {span(PER_STAGE_1)}, "
                 f"{cores} threads per stage {span(PER_STAGE_ALL)}, global pool of {cores} {span(GLOBAL_POOL)}")
    return lines


def slice_zoo(name: str, size: str, out: Path) -> Path:
    """The zoo model sliced into 3 stages under `out`; its version folder."""
    from slicer.slice_model import SliceOptions, slice_model
    from slicer.zoo import build, entry

    max_length = entry(name).max_length.get(size, 0) or 128
    options = SliceOptions(stages=3, max_batch_size=4, max_length=max_length, repeats=3, batch_sizes=(1, 2, 4))
    print(f"slicing zoo {name} ({size}) into 3 stages...", flush=True)
    return slice_model(build(name, size), out / name, options).chosen.dir


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.costs.thread_pool", description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path, nargs="?", help="a sliced model folder (default: slice --zoo)")
    parser.add_argument("--zoo", default="bert", help="zoo model sliced when no DIR is given (default: bert)")
    parser.add_argument("--size", default="bench", help="its size preset (default: bench)")
    parser.add_argument("--lengths", default="16,64,128", help="query lengths (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default: %(default)s)")
    parser.add_argument("--block", type=int, default=10, help="queries per runner per round (default: %(default)s)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="dvabatch-thread-pool-") as tmp:
        version_dir = find_version_dir(args.dir) if args.dir else slice_zoo(args.zoo, args.size, Path(tmp))
        manifest = Manifest.load(version_dir / "manifest.json")
        lengths = [min(int(x), manifest.max_length) for x in args.lengths.split(",")] if manifest.has_seq else [0]
        cores = available_cores()
        print(f"{manifest.name}: {manifest.num_stages} stages, batch 1, {cores} cores", flush=True)
        for line in report(measure(version_dir, lengths, args.rounds, args.block), cores):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
