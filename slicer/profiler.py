"""Measure costs: per node (onnxruntime's profiler) and per stage (timed runs).

Node costs come from `SessionOptions.enable_profiling` with graph optimizations off, so
every profiled kernel maps back to a node of the graph by name; thread settings are fixed
so that costs compare across nodes. Stage times are measured on the stage engines as the
runtime builds them (same session options), median of repeated runs.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np
import onnx
import onnxruntime as ort

from dvabatch_backend.runtime.engine import ort_session_options
from dvabatch_backend.runtime.manifest import TensorSpec

from .sessions import proto_session

Progress = Callable[[str], None]

INT_HIGH_KEY = "dvabatch.int_high."  # model metadata: exclusive upper bound of an int input's values


@dataclass(frozen=True)
class Setting:
    batch: int
    length: int


def random_input(int_high: Mapping[str, int], seed: int = 0) -> Callable[[TensorSpec, int, int], np.ndarray]:
    """One input's `random_inputs` at (spec, batch, length), from one seeded generator: the
    `make_input` that `device_times.time_engines` takes."""
    rng, bounds = np.random.default_rng(seed), dict(int_high)
    return lambda spec, bs, length: random_inputs([spec], bs, length, rng, bounds)[spec.name]


def random_inputs(specs: Sequence[TensorSpec], batch: int, length: int, rng: np.random.Generator,
                  int_high: Mapping[str, int] | None = None) -> dict[str, np.ndarray]:
    """Inputs for measuring and verifying: floats normal; ints below their bound; masks with padding.

    An int input named like a mask gets ones with a zero tail on random rows, so padding is
    exercised; other ints are uniform in [0, int_high) (default 2).
    """
    feeds: dict[str, np.ndarray] = {}
    lengths = rng.integers(1, length + 1, size=batch) if length > 1 else np.ones(batch, dtype=int)
    lengths[0] = max(length, 1)
    for spec in specs:
        shape = spec.shape(batch, length)
        if np.issubdtype(spec.np_dtype, np.floating) and "mask" not in spec.name:
            feeds[spec.name] = rng.standard_normal(shape).astype(spec.np_dtype)
        elif "mask" in spec.name and spec.has_seq:
            mask = np.zeros(shape, dtype=spec.np_dtype)
            for r, n in enumerate(lengths):
                mask[r, :n] = 1
            feeds[spec.name] = mask
        else:
            high = (int_high or {}).get(spec.name, 2)
            feeds[spec.name] = rng.integers(0, high, size=shape).astype(spec.np_dtype)
    return feeds


def int_bounds(model: onnx.ModelProto) -> dict[str, int]:
    """Exclusive upper bounds of integer inputs: the model's metadata (the zoo writes them), else the
    table an input indexes (`Gather` of an initializer's rows by the input, as embeddings do)."""
    found = {p.key[len(INT_HIGH_KEY):]: int(p.value) for p in model.metadata_props if p.key.startswith(INT_HIGH_KEY)}
    tables = {t.name: t.dims[0] for t in model.graph.initializer if t.dims}
    inputs = {vi.name for vi in model.graph.input if vi.name not in tables}
    for node in model.graph.node:
        if node.op_type != "Gather" or len(node.input) < 2 or node.input[1] not in inputs:
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        if axis == 0 and node.input[0] in tables:
            found.setdefault(node.input[1], int(tables[node.input[0]]))
    return found


def node_costs(model: onnx.ModelProto, inputs: Sequence[TensorSpec], settings: Sequence[Setting],
               threads: int = 1, repeats: int = 5, progress: Progress | None = None) -> dict[Setting, np.ndarray]:
    """Seconds per run of every node (in graph order) at each setting, from onnxruntime's profiler."""
    index = {node.name: i for i, node in enumerate(model.graph.node)}
    if len(index) != len(model.graph.node):
        raise ValueError("node names must be unique to map profiles back to nodes (see analysis.name_nodes)")
    bounds = int_bounds(model)
    rng = np.random.default_rng(0)
    costs: dict[Setting, np.ndarray] = {}
    for setting in settings:
        if progress:
            progress(f"profiling nodes at batch {setting.batch}, length {setting.length}")
        feeds = random_inputs(inputs, setting.batch, setting.length, rng, bounds)
        costs[setting] = _profile_once(model, feeds, index, threads, repeats)
    return costs


def _profile_once(model: onnx.ModelProto, feeds: dict[str, np.ndarray], index: dict[str, int], threads: int,
                  repeats: int) -> np.ndarray:
    """Median kernel time of each node over `repeats` runs (a warm-up run makes the first sample)."""
    options = ort_session_options(threads)
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    with tempfile.TemporaryDirectory() as tmp:
        options.enable_profiling = True
        options.profile_file_prefix = os.path.join(tmp, "profile")
        session = proto_session(model, options)
        for _ in range(repeats + 1):
            session.run(None, feeds)
        events = json.loads(Path(session.end_profiling()).read_text())
    samples: dict[int, list[float]] = {}
    for ev in events:
        name = ev.get("name", "")
        if ev.get("cat") == "Node" and name.endswith("_kernel_time") and name[: -len("_kernel_time")] in index:
            samples.setdefault(index[name[: -len("_kernel_time")]], []).append(ev["dur"] * 1e-6)
    costs = np.zeros(len(index))
    for i, durations in samples.items():
        costs[i] = statistics.median(durations[1:] or durations)
    return costs


def time_stage(path: Path, inputs: Sequence[TensorSpec], setting: Setting, threads: int = 1, repeats: int = 20,
               int_high: Mapping[str, int] | None = None, min_seconds: float = 0.05) -> float:
    """Median seconds of one run of the stage at `setting`, with the runtime's session options."""
    options = ort_session_options(threads)
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    feeds = random_inputs(inputs, setting.batch, setting.length, np.random.default_rng(1), int_high)
    return time_session(session, feeds, repeats, min_seconds)


def time_stages(paths: Sequence[Path], inputs: Sequence[Sequence[TensorSpec]], setting: Setting, threads: int = 1,
                repeats: int = 20, int_high: Mapping[str, int] | None = None, min_seconds: float = 0.1) -> list[float]:
    """Seconds per run of each stage (20th percentile of its runs), the stages timed in turns so
    that machine noise falls on all of them alike: their balance is what these times are for,
    and interference only ever adds time, so a low percentile is the stage's own cost."""
    rng = np.random.default_rng(1)
    sessions = [ort.InferenceSession(str(p), ort_session_options(threads), providers=["CPUExecutionProvider"])
                for p in paths]
    feeds = [random_inputs(specs, setting.batch, setting.length, rng, int_high) for specs in inputs]
    for session, feed in zip(sessions, feeds):
        session.run(None, feed)
    samples: list[list[float]] = [[] for _ in sessions]
    start = time.perf_counter()
    while len(samples[0]) < repeats or (time.perf_counter() - start < min_seconds and len(samples[0]) < 50 * repeats):
        for session, feed, times in zip(sessions, feeds, samples):
            t0 = time.perf_counter()
            session.run(None, feed)
            times.append(time.perf_counter() - t0)
    return [float(np.percentile(times, 20)) for times in samples]


SPIN_SETTLE = 0.1  # after a candidate's sessions are gone: their threads' spinning has ended


def time_after_gaps(candidates: Sequence[Sequence[tuple[Path, str]]], inputs: Sequence[Sequence[Sequence[TensorSpec]]],
                    setting: Setting, threads: int, gap: float, repeats: int = 15,
                    int_high: Mapping[str, int] | None = None) -> list[float]:
    """Seconds a lone query takes on each candidate (its sessions, (file, spinning), run in a row:
    `ort_session_options(threads, spinning=...)`), each query `gap` seconds after the last one ended
    (median of `repeats`): what a light load meets. Back-to-back runs find every thread awake;
    between queries spread out in time the threads sleep unless they spin, and a sleeping core (a
    virtual one all the more) takes long to wake. One candidate at a time, its sessions made for
    it and gone before the next: threads left spinning by one would slow the other's runs."""
    rng = np.random.default_rng(1)
    medians = []
    for sessions, specs in zip(candidates, inputs):
        run = [(ort.InferenceSession(str(path), ort_session_options(threads, spinning=spin),
                                     providers=["CPUExecutionProvider"]),
                random_inputs(spec, setting.batch, setting.length, rng, int_high))
               for (path, spin), spec in zip(sessions, specs)]
        for session, feed in run:
            session.run(None, feed)
        times = []
        for _ in range(repeats):
            time.sleep(gap)
            t0 = time.perf_counter()
            for session, feed in run:
                session.run(None, feed)
            times.append(time.perf_counter() - t0)
        medians.append(statistics.median(times))
        del run
        time.sleep(SPIN_SETTLE)
    return medians


def time_session(session: ort.InferenceSession, feeds: dict[str, np.ndarray], repeats: int,
                 min_seconds: float = 0.05) -> float:
    session.run(None, feeds)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < repeats or (time.perf_counter() - start < min_seconds and len(times) < 50 * repeats):
        t0 = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
