"""One zoo model served side by side in several configurations by ONE tritonserver: the setup every
experiment in `perf.paper.experiments` shares.

    systems = [System("ZeroBatch", "zerobatch"), System("DelayBatch", "delaybatch"),
               System("DVABatch", "dvabatch", {"policy": "input"})]
    with Bench("bert", "bench", out_dir, systems) as bench:      # slice, register, serve, warm up
        queries, lengths = bench.queries(200, seed=1)
        run = bench.open_loop("DVABatch", queries, perf.load.arrivals.poisson(50.0, 200), lengths)

A `System` is a label and how it is served: `dvabatch` (a variant of the sliced model with its
settings: policy, buffer pairs, ...; `stages` asks for its own slicing into that many stages),
`zerobatch`, or `delaybatch` (the queue delay of peak closed-loop throughput among the candidate
delays, tuned when the server is up; the tuning is recorded in `Bench.delay_tuning`).
Slices are kept in OUT/sliced/SIZE/MODEL[-sN] and reused by later runs.

Threads: a dvabatch stage runs with `threads` onnxruntime threads (default 0, every core: the
served default, the stages in turn); the baselines run the whole model with `baseline_threads`
(default: every core), so that each system may use the whole machine.
"""
from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dvabatch_backend.runtime.settings import EVERY_CORE

__all__ = ["Bench", "LENGTH_PRESET", "System", "query_maker", "sample_queries", "slice_options", "sliced", "slug"]

LENGTH_PRESET = "rte"  # GLUE-like: most queries short, a tail past 100 tokens
KINDS = ("dvabatch", "zerobatch", "delaybatch")


@dataclass(frozen=True)
class System:
    label: str
    kind: str
    settings: Mapping[str, Any] = field(default_factory=dict)  # dvabatch: add_model_variant settings
    stages: int | None = None  # dvabatch: its own slicing into this many stages

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"system {self.label!r}: kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind != "dvabatch" and (self.settings or self.stages):
            raise ValueError(f"system {self.label!r}: settings and stages are for dvabatch systems")


# ----------------------------------------------------------------------------------------------
# slicing and queries


def slice_options(zoo_name: str, size: str, stages: int | None = None) -> Any:
    """SliceOptions sized for the zoo preset: small and quick for "test", fuller otherwise."""
    from slicer.slice_model import SliceOptions
    from slicer.zoo import entry

    max_length = entry(zoo_name).max_length.get(size, 0)
    if size == "test":
        return SliceOptions(stages=stages or 3, max_batch_size=8, max_length=max_length or 128, repeats=3,
                            batch_sizes=(1, 2, 4, 8), lengths=(max_length,) if max_length else None,
                            calibration_rounds=1)
    lengths = tuple(n for n in (16, 32, 64, 128) if n <= max_length) if max_length else None
    return SliceOptions(stages=stages or 3, max_batch_size=16, max_length=max_length or 128, repeats=3,
                        batch_sizes=(1, 2, 4, 8, 16), lengths=lengths, calibration_rounds=2)


def sliced(zoo_name: str, size: str, out_dir: Path, stages: int | None = None,
           progress: Callable[[str], None] = lambda _: None) -> tuple[Path, Any, dict[str, int], bool]:
    """(version dir, manifest, int input bounds, reused?): slices into OUT/sliced/SIZE/MODEL[-sN]
    unless a finished slice is there."""
    from dvabatch_backend.runtime.manifest import Manifest
    from slicer.profiler import int_bounds
    from slicer.slice_model import slice_model
    from slicer.zoo import build

    model = build(zoo_name, size)
    target = Path(out_dir) / "sliced" / size / (zoo_name if stages is None else f"{zoo_name}-s{stages}")
    version_dir = target / "1"
    if (version_dir / "manifest.json").is_file() and (version_dir / "model.onnx").is_file():
        return version_dir, Manifest.load(version_dir / "manifest.json"), int_bounds(model), True
    if target.exists():
        shutil.rmtree(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    report = slice_model(model, target, slice_options(zoo_name, size, stages), progress=progress)
    return report.out_dir / "1", report.manifest, int_bounds(model), False


def query_maker(manifest: Any, int_high: Mapping[str, int]) -> Callable[[np.random.Generator, int], dict]:
    """query(rng, length) -> one query's arrays without the batch dim: random ids, mask all ones."""
    from slicer.profiler import random_inputs

    def query(rng: np.random.Generator, length: int) -> dict[str, np.ndarray]:
        feeds = random_inputs(manifest.inputs, 1, length, rng, dict(int_high))
        for name, arr in feeds.items():
            if "mask" in name:
                arr[:] = 1
        return {k: np.ascontiguousarray(v[0]) for k, v in feeds.items()}

    return query


def sample_queries(manifest: Any, int_high: Mapping[str, int], n: int, seed: int,
                   preset: str = LENGTH_PRESET) -> tuple[list[dict], list[int] | None]:
    """n seeded queries, lengths from the preset (clipped to the model's max length); lengths is
    None for a model without a sequence axis."""
    from perf.load.lengths import sample_lengths

    rng = np.random.default_rng(seed)
    make = query_maker(manifest, int_high)
    if manifest.has_seq:
        lengths = [int(x) for x in sample_lengths(preset, n, manifest.max_length, rng)]
        return [make(rng, length) for length in lengths], lengths
    return [make(rng, 0) for _ in range(n)], None


# ----------------------------------------------------------------------------------------------
# the bench


class Bench:
    """Slices, registers every system in OUT/repository/MODEL, serves them from one tritonserver
    and warms each up (`__enter__`); then measures them (`open_loop`, `closed_loop`)."""

    def __init__(self, zoo_name: str, size: str, out_dir: Path, systems: Sequence[System], *,
                 threads: int = EVERY_CORE, baseline_threads: int | None = None,
                 delays_us: Sequence[int] = (0, 1000, 2000, 5000), tune_seconds: float = 2.0,
                 seed: int = 0, timeout: float = 60.0, progress: Callable[[str], None] = lambda _: None) -> None:
        labels = [s.label for s in systems]
        if len(set(labels)) != len(labels):
            raise ValueError(f"system labels must be distinct, got {labels}")
        self.zoo_name, self.size, self.out_dir = zoo_name, size, Path(out_dir)
        self.systems = {s.label: s for s in systems}
        self.threads = threads
        self.baseline_threads = baseline_threads or os.cpu_count() or 1
        self.delays_us = [int(d) for d in delays_us]
        self.tune_seconds, self.seed, self.timeout = tune_seconds, seed, timeout
        self._progress = progress
        self.names: dict[str, str] = {}  # label -> Triton model name
        self.delay_tuning: dict[str, Any] | None = None
        self.slices: dict[int | None, tuple[Path, Any, bool]] = {}  # stages -> (version dir, manifest, reused)
        self._server: Any = None
        self.info: dict[str, Any] = {}

    # -- setup

    def __enter__(self) -> Bench:
        from dvabatch_backend.tools.serve import TritonServer

        repo = self.out_dir / "repository" / self.zoo_name
        if repo.exists():
            shutil.rmtree(repo)
        repo.mkdir(parents=True)
        for stages in sorted({s.stages for s in self.systems.values()}, key=lambda s: s or 0):
            self._progress(f"{self.zoo_name}: slicing" + (f" into {stages} stages" if stages else ""))
            version_dir, manifest, self.int_high, reused = sliced(self.zoo_name, self.size, self.out_dir, stages,
                                                                  self._progress)
            self.slices[stages] = (version_dir, manifest, reused)
        candidates = self._register(repo)
        self._server = TritonServer(repo).__enter__()
        try:
            for name in [*self.names.values(), *candidates.values()]:
                self._server.wait_model_ready(name, timeout=300)
            if candidates:
                self._tune(candidates)
            self._warm_up()
        except BaseException:
            self._server.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.__exit__(*exc)
            self._server = None

    @property
    def manifest(self) -> Any:
        """The manifest of the default slicing (the first one when every system has its own)."""
        return self.slices.get(None, next(iter(self.slices.values())))[1]

    @property
    def bs_max(self) -> int:
        return int(self.manifest.max_batch_size)

    @property
    def url(self) -> str:
        return str(self._server.grpc_url)

    def _register(self, repo: Path) -> dict[int, str]:
        from perf.baselines import delay_candidates, zero_batch
        from slicer.triton_files import add_model_variant

        candidates: dict[int, str] = {}
        prefix = self.zoo_name
        for label, system in self.systems.items():
            version_dir, manifest, _ = self.slices[system.stages]
            name = f"{prefix}_{slug(label)}"
            if system.kind == "dvabatch":
                settings = {"threads_per_stage": self.threads, **system.settings}
                add_model_variant(repo, version_dir, name, **settings)
            elif system.kind == "zerobatch":
                zero_batch(repo, version_dir, name, self.baseline_threads, manifest.max_batch_size)
            else:
                if not candidates:
                    candidates = delay_candidates(repo, version_dir, self.delays_us, prefix=prefix,
                                                  threads=self.baseline_threads, bs_max=manifest.max_batch_size)
                continue  # named once tuned
            self.names[label] = name
        manifest = self.manifest
        self.info = {"bs_max": self.bs_max, "stages": len(manifest.stages),
                     "max_length": manifest.max_length if manifest.has_seq else None,
                     "threads_per_stage": self.threads, "baseline_threads": self.baseline_threads,
                     "slices": {str(k or "default"): {"dir": str(v[0]), "stages": len(v[1].stages), "reused": v[2]}
                                for k, v in self.slices.items()},
                     "repository": str(repo)}
        return candidates

    def _tune(self, candidates: Mapping[int, str]) -> None:
        """DelayBatch: the candidate delay of peak closed-loop throughput at bs_max clients."""
        from perf.baselines import tune_delay
        from perf.load.lengths import sample_lengths

        self._progress(f"{self.zoo_name}: tuning DelayBatch's delay")
        manifest, make = self.manifest, query_maker(self.manifest, self.int_high)

        def tune_query(rng: np.random.Generator) -> dict[str, np.ndarray]:
            length = int(sample_lengths(LENGTH_PRESET, 1, manifest.max_length, rng)[0]) if manifest.has_seq else 0
            return {k: v[None] for k, v in make(rng, length).items()}

        best, qps = tune_delay(self.url, candidates, tune_query, concurrency=self.bs_max, seconds=self.tune_seconds)
        for label, system in self.systems.items():
            if system.kind == "delaybatch":
                self.names[label] = candidates[best]
        self.delay_tuning = {"best_delay_us": best, "qps_by_delay_us": {str(d): q for d, q in qps.items()},
                             "concurrency": self.bs_max, "seconds": self.tune_seconds}

    def _warm_up(self) -> None:
        from perf.load.drivers import run_closed_loop

        pool = self.pool()
        for label, name in self.names.items():
            self._progress(f"{self.zoo_name}: warming up {label}")
            warm = run_closed_loop(self.url, name, pool, concurrency=self.bs_max, n=3 * self.bs_max,
                                   timeout=self.timeout)
            if warm.errors():
                raise RuntimeError(f"{label} ({name}): warm-up failed: {warm.errors()[0].error}")

    # -- measurements

    def pool(self, n: int | None = None, seed_offset: int = 1) -> list[dict]:
        """Seeded queries to cycle through in closed loops."""
        return sample_queries(self.manifest, self.int_high, n or max(4 * self.bs_max, 32), self.seed + seed_offset)[0]

    def queries(self, n: int, seed: int) -> tuple[list[dict], list[int] | None]:
        return sample_queries(self.manifest, self.int_high, n, seed)

    def closed_loop(self, label: str, concurrency: int, seconds: float, pool: Sequence[dict] | None = None) -> Any:
        from perf.load.drivers import run_closed_loop

        return run_closed_loop(self.url, self.names[label], list(pool or self.pool()), concurrency=concurrency,
                               duration=seconds, timeout=self.timeout, params={"system": label})

    def open_loop(self, label: str, queries: Sequence[dict], offsets: Any, lengths: Sequence[int] | None = None,
                  **params: Any) -> Any:
        from perf.load.drivers import run_open_loop

        return run_open_loop(self.url, self.names[label], queries, offsets, timeout=self.timeout, lengths=lengths,
                             params={"system": label, **params})


def slug(label: str) -> str:
    """A label as a model-name part: "DVABatch-split" -> "dvabatch_split"."""
    return "".join(c if c.isalnum() else "_" for c in label.lower()).strip("_")
