"""Stage times from the device that serves: a manifest profiled elsewhere is re-profiled at load.

The slicer times the stages where it runs (the manifest's `profiled_on`; a manifest without one was
profiled on the CPU). Policies and admission plan with those times (`PolicyContext.for_model`,
`Admission`), so a pipeline whose stages run on a device (a GPU, or the GPU stand-in) of another
name times its stages there at load, each stage's `run` (inputs in, compute, outputs out, as the
slicer's profile is, but reading and writing the boundaries between stages where they serve: in
device memory) at every graph bucket (batch sizes x lengths), and plans with those. The
times are kept by the device's name, and a later load on the same device reads them:

- beside the manifest, `stage_times.<device>.json`, where the version folder is writable;
- else (a read-only model repository: an image, a volume) under `$DVABATCH_PROFILE_CACHE`, or
  `~/.cache/dvabatch/profiles`, in a folder named after the model and its manifest's digest.

Two models over one version folder (variants of one sliced model) load at once in Triton: the
first to load times the stages while holding a lock beside the kept file, the other waits and reads
what it kept, so the device is timed once and never by two at the same time.

What it costs at load: one warm-up and `REPEATS` timed runs per stage and bucket.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import logging
import os
import re
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from .buffers import MemoryFactory
from .manifest import Manifest, StageSpec, TensorSpec

log = logging.getLogger(__name__)

CPU = "cpu"  # what a manifest without `profiled_on` was profiled on
REPEATS = 3
# how the kept times were measured: a kept file of another method is timed again
METHOD = "each stage's run at every graph bucket, its boundaries where they serve, 1 warm-up and 3 timed"
CACHE_ENV = "DVABATCH_PROFILE_CACHE"


def profiled_on(manifest: Manifest) -> str:
    """The device the manifest's stage times were measured on."""
    return str(manifest.extra.get("profiled_on") or CPU)


def serving_device(engines: Sequence[Any]) -> str | None:
    """The name of the device the stage engines run on: the GPU's (torch.cuda's name for it), the
    stand-in's (its profile's device, marked simulated), or None for engines on the CPU."""
    engine = engines[0] if engines else None
    device = getattr(engine, "device", None)
    if device is None:
        return None
    name = getattr(device, "name", None)
    if isinstance(name, str) and name:  # the GPU stand-in's device
        return name
    if getattr(device, "type", None) == "cuda":
        import torch

        return str(torch.cuda.get_device_name(device))
    return None


def served_memory(engines: Sequence[Any]) -> MemoryFactory | None:
    """Where the boundaries between these stage engines live as served: in device memory between
    engines on streams (`device_memory.stream_memory`); None where none has a stream (the host's)."""
    streams = [getattr(e, "stream", None) for e in engines]
    if not any(stream is not None for stream in streams):
        return None
    from .device_memory import stream_memory  # imports torch where the streams are CUDA's

    return stream_memory(streams)


def time_engines(stages: Sequence[StageSpec], engines: Sequence[Any], batch_sizes: Sequence[int], lengths: Sequence[int],
                 make_input: Callable[[TensorSpec, int, int], np.ndarray] | None = None, repeats: int = REPEATS,
                 memory: MemoryFactory | None = None) -> dict[str, list[dict[str, float]]]:
    """Each stage engine's `run` (`stages[i]`'s inputs and outputs: a manifest's stages, or the
    unsliced model as one) at every batch size and length (0: fixed shape), the mean of
    `repeats` after one warm-up, until the device finished them: {str(length): per stage
    {str(batch size): seconds}}. Inputs are `make_input(spec, batch, length)`, zeros by default (a
    valid token id, a mask hiding all). `memory(boundary, pair)`: where each boundary lives as served
    (`device_memory.stream_memory`): a stage reading and writing device memory is timed so, not
    with the copies from and to the host it does not make when it serves."""
    make_input = make_input or (lambda spec, bs, length: np.zeros(spec.shape(bs, length), spec.np_dtype))

    def tensor(boundary: int, spec: TensorSpec, bs: int, length: int, given: bool) -> Any:
        where = memory(boundary, 0) if memory is not None else None
        if where is not None and where.on_device:
            shape = spec.shape(bs, length)
            return where.zeros(math.prod(shape), spec.np_dtype).reshape(shape)
        return make_input(spec, bs, length) if given else np.empty(spec.shape(bs, length), spec.np_dtype)

    by_length: dict[str, list[dict[str, float]]] = {}
    for length in lengths:
        per_stage = []
        for k, (spec, engine) in enumerate(zip(stages, engines)):
            wait = getattr(engine, "wait_for_device", lambda: None)
            row = {}
            for bs in batch_sizes:
                inputs = {t.name: tensor(k, t, bs, length, True) for t in spec.inputs}
                outputs = {t.name: tensor(k + 1, t, bs, length, False) for t in spec.outputs}
                engine.run(inputs, outputs)  # warm-up: kernels chosen, allocations made
                wait()
                t0 = time.perf_counter()
                for _ in range(repeats):
                    engine.run(inputs, outputs)
                wait()  # device outputs: the runs were queued
                row[str(bs)] = (time.perf_counter() - t0) / repeats
            per_stage.append(row)
        by_length[str(length)] = per_stage
    return by_length


def with_stage_times(manifest: Manifest, by_length: Mapping[str, list[dict[str, float]]], device: str) -> Manifest:
    """`manifest` with these stage times (`stage_times` at the longest length, `stage_times_by_length`
    where the model has a length) recorded as measured on `device`."""
    doc = manifest.to_json()
    doc["stage_times"] = by_length[str(max(int(n) for n in by_length))]
    if manifest.has_seq:
        doc["stage_times_by_length"] = dict(by_length)
    doc["profiled_on"] = device
    return Manifest.from_json(doc)


def cache_file(version_dir: Path, manifest: Manifest, device: str) -> Path:
    """Where the stage times measured on `device` are kept (module docstring)."""
    name = f"stage_times.{_slug(device)}.json"
    if os.access(version_dir, os.W_OK):
        return version_dir / name
    digest = hashlib.sha256(json.dumps(manifest.to_json(), sort_keys=True).encode()).hexdigest()[:12]
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "dvabatch" / "profiles")
    return root / f"{_slug(manifest.name)}-{digest}" / name


def on_serving_device(version_dir: Path, manifest: Manifest, engines: Sequence[Any],
                      buckets: tuple[Sequence[int], Sequence[int]]) -> Manifest:
    """The manifest with stage times from the device the engines run on: as it is where it was
    profiled there (or the engines are on the CPU); else read from where an earlier load kept them,
    or timed now at the graph `buckets` and kept (module docstring). Logged either way."""
    device = serving_device(engines)
    if device is None or device == profiled_on(manifest):
        return manifest
    path = cache_file(version_dir, manifest, device)
    with _held(path):
        return _kept_or_timed(path, manifest, engines, buckets, device)


@contextlib.contextmanager
def _held(path: Path) -> Iterator[None]:
    """An exclusive lock beside `path` while the times are read or measured (module docstring);
    none where the folder cannot be written (the times then serve this load only)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path.with_name(path.name + ".lock"), "a")
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _kept_or_timed(path: Path, manifest: Manifest, engines: Sequence[Any],
                   buckets: tuple[Sequence[int], Sequence[int]], device: str) -> Manifest:
    kept = _read_kept(path)
    if kept is not None:
        log.info("%s: stage times profiled on %s, serving on %s: read from %s", manifest.name, profiled_on(manifest),
                 device, path)
        return with_stage_times(manifest, kept, device)
    started = time.perf_counter()
    by_length = time_engines(manifest.stages, engines, buckets[0], buckets[1] if manifest.has_seq else [0],
                             memory=served_memory(engines))
    seconds = time.perf_counter() - started
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"device": device, "method": METHOD, "seconds_to_profile": seconds,
                                    "stage_times_by_length": by_length}, indent=1))
        where = f"kept in {path}"
    except OSError as exc:  # nowhere writable: the times serve this load only
        where = f"not kept ({exc})"
    log.warning("%s: stage times profiled on %s, serving on %s: re-profiled at load in %.1f s, %s",
                manifest.name, profiled_on(manifest), device, seconds, where)
    return with_stage_times(manifest, by_length, device)


def _read_kept(path: Path) -> dict[str, list[dict[str, float]]] | None:
    """The stage times an earlier load kept at `path`, if it measured them as this one would."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc["stage_times_by_length"] if doc.get("method") == METHOD and "stage_times_by_length" in doc else None


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower() or "device"
