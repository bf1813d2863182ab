"""The overlap check as a figure: each stage's runs on the GPU timeline with 1 and 2 buffer pairs.

    python -m perf.gpu.overlap --out DIR

A token MLP sized for a GPU, cut into 3 stages, each a `TorchStageEngine` on CUDA timed with CUDA
events on its own stream (perf.gpu.timeline); 48 queries submitted at once. Writes
DIR/overlap.json (every interval, the overlapping pairs, the time two stages ran at once) and
DIR/overlap.png (one lane per stage, one panel per pair count). Exit 1 when the check fails: with
one pair two stages overlapped, or with two none did. tests/gpu/test_gpu.py asserts the same.
"""
from __future__ import annotations

import argparse
import json
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from dvabatch_backend.runtime.settings import RuntimeSettings
from perf.gpu.pipelines import cuda_pipeline, sliced_token_mlp
from perf.gpu.timeline import EventTimedEngine, Interval, Timeline, busy_overlap_ms, overlapping_pairs

HIDDEN, LAYERS, STAGES, BS_MAX, LENGTH, QUERIES = 512, 6, 3, 8, 128, 48


def stage_timeline(work_dir: Path, pairs: int, queries: int = QUERIES) -> list[Interval]:
    """Every stage run's GPU interval, serving `queries` queries submitted at once with `pairs` pairs."""
    from dvabatch_backend.runtime.torch_engine import TorchStageEngine  # the torch engine's API: (path, device)
    from policies import create_policy

    model_dir, manifest = sliced_token_mlp(work_dir / f"pairs{pairs}", HIDDEN, LAYERS, STAGES, BS_MAX, LENGTH)
    timeline = Timeline()
    engines = [EventTimedEngine(i, TorchStageEngine(model_dir / s.file, device="cuda"), timeline)
               for i, s in enumerate(manifest.stages)]
    pipeline = cuda_pipeline(manifest, engines, create_policy("pipelined"),
                             RuntimeSettings(num_buffer_pairs=pairs, engine="torch", device="cuda"))
    rng = np.random.default_rng(pairs)
    batch = [{"x": rng.standard_normal((LENGTH, HIDDEN)).astype(np.float32), "mask": np.ones(LENGTH, np.float32)}
             for _ in range(queries)]
    answered: list[Any] = []
    all_answered = threading.Event()

    def reply(answer: Any) -> None:
        answered.append(answer)
        if len(answered) == len(batch):
            all_answered.set()

    with pipeline:
        pipeline.submit_many([(q, reply) for q in batch])
        if not all_answered.wait(timeout=120):
            raise RuntimeError(f"{len(batch) - len(answered)} queries unanswered after 120 s")
    errors = [a.error for a in answered if a.error is not None]
    if errors or pipeline.buffer_violations:
        raise RuntimeError(f"errors {errors[:3]}, buffer-rule violations {pipeline.buffer_violations[:3]}")
    return timeline.intervals()


def check(by_pairs: dict[int, list[Interval]]) -> list[str]:
    problems = []
    if overlapping_pairs(by_pairs[1]):
        problems.append("with 1 buffer pair two stages overlapped on the GPU timeline")
    if not overlapping_pairs(by_pairs[2]):
        problems.append("with 2 buffer pairs no two stages overlapped on the GPU timeline")
    return problems


def plot(by_pairs: dict[int, list[Interval]], path: Path) -> None:
    from matplotlib.figure import Figure  # a Figure of its own: no backend chosen, no pyplot figure kept open

    fig = Figure(figsize=(9, 2.2 * len(by_pairs)))
    axes = fig.subplots(len(by_pairs), 1, squeeze=False)
    for ax, (pairs, intervals) in zip(axes[:, 0], sorted(by_pairs.items())):
        for i in intervals:
            ax.broken_barh([(i.start_ms, i.end_ms - i.start_ms)], (i.stage - 0.4, 0.8), color=f"C{i.stage}")
        ax.set_yticks(range(STAGES), [f"stage {s}" for s in range(STAGES)])
        ax.set_title(f"{pairs} buffer pair(s): {busy_overlap_ms(intervals):.2f} ms with two stages at once")
        ax.set_xlabel("GPU time (ms, CUDA events)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    by_pairs = {pairs: stage_timeline(args.out / "models", pairs) for pairs in (1, 2)}
    problems = check(by_pairs)
    (args.out / "overlap.json").write_text(json.dumps({
        "intervals": {p: [asdict(i) for i in v] for p, v in by_pairs.items()},
        "overlapping_pairs": {p: len(overlapping_pairs(v)) for p, v in by_pairs.items()},
        "two_stages_at_once_ms": {p: busy_overlap_ms(v) for p, v in by_pairs.items()},
        "problems": problems,
    }, indent=1))
    plot(by_pairs, args.out / "overlap.png")
    for pairs, intervals in sorted(by_pairs.items()):
        print(f"{pairs} pair(s): {len(intervals)} stage runs, {len(overlapping_pairs(intervals))} overlapping pairs, "
              f"{busy_overlap_ms(intervals):.2f} ms with two stages at once")
    print("\n".join(problems) or "overlap check: OK")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
