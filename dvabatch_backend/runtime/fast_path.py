"""The fast path: a batch that meets nobody runs at once, on the caller's thread.

A pipeline pays for what it overlaps: a batch table, queues, buffer-pair hand-offs, a thread per
stage and the wake-ups between them. A query that arrives at an empty pipeline overlaps with
nothing, so it gets none of that: `FastPath.run` checks the rows are well-formed and fit one batch
(at most bs_max rows of one length), asks the scheduler to hold the pipeline
(`Scheduler.reserve_inline`, granted only while it holds nothing: no query unanswered, no batch,
no stage working), runs the stages in a row into scratch buffers of its own, and returns the model's
outputs to the caller, which answers them itself (the Triton adapter returns them from `execute`).

The switch, and why it never reorders or loses an answer: the reservation is taken and given back
under the scheduler's lock. While it is held, queries submitted by other callers are admitted and
batched as usual but no stage starts work, so none of them overtakes the run, and `release_inline`
signals the stages that have some. A run that fails (an engine raises, or anything else) answers
nothing: the caller sends the same rows the usual way (`None`), where a failing row is answered
with its own error naming the stage, and the others are not touched. Under Triton one model
instance calls `execute` one call at a time, so a request that arrives during a run waits in
Triton's queue until it ends, as it would behind ZeroBatch's batch: at most one run's time.

Rows on the fast path run at their own length (one length per run: no padding), so their answers
are the unsliced model's, as on the pipeline. A policy whose splits may answer early (an exit head)
turns the fast path off (`Policy.allows_inline`).
"""
from __future__ import annotations

import logging
import time
from typing import Mapping, Sequence

import numpy as np

from .buffers import StageBuffer
from .engine import StageEngine
from .manifest import BATCH, SEQ, Manifest, TensorSpec, dim_size, is_length_dim
from .query import batch_shape
from .scheduler import Scheduler

log = logging.getLogger(__name__)

# requests of several lengths make one padded batch when the longest is within this of the shortest:
# the input policy's default clustering (policies/input_diversity.py, pad_tolerance)
PAD_TOLERANCE = 0.25


def pad_to(rows: np.ndarray, spec: TensorSpec, length: int) -> np.ndarray:
    """`rows` (batch axis first) zero-padded along the sequence axis to `length` (as the runtime
    pads a batch: past a query's end every input, its mask included, is zero)."""
    if not spec.has_seq or rows.shape[spec.dims.index(SEQ)] == length:
        return rows
    axis = spec.dims.index(SEQ)
    padded = np.zeros(rows.shape[:axis] + (length,) + rows.shape[axis + 1:], rows.dtype)
    padded[tuple(slice(0, n) for n in rows.shape)] = rows
    return padded


def cut_to(rows: np.ndarray, spec: TensorSpec, length: int) -> np.ndarray:
    """Output rows of a padded batch cut back to one request's `length` on every length dim."""
    if not spec.has_seq:
        return rows
    cut = tuple(slice(None) if d == BATCH or not is_length_dim(d) else slice(0, dim_size(d, length))
                for d in spec.dims)
    return np.ascontiguousarray(rows[cut])


class FastPath:
    """Runs a batch that meets nobody through every stage on the caller's thread (module docstring).

    Its scratch buffers (one per stage boundary, bs_max rows at the longest length) are used by one
    run at a time: the scheduler's reservation admits one run at a time.
    """

    def __init__(self, scheduler: Scheduler, engines: Sequence[StageEngine],
                 whole_model: StageEngine | None = None) -> None:
        """Runs `engines` (the stages) in a row, or `whole_model` (the unsliced model) when given."""
        manifest: Manifest = scheduler.manifest
        self._scheduler = scheduler
        self._manifest = manifest
        self._input_names = [t.name for t in manifest.inputs]
        self._specs = {t.name: t for t in manifest.inputs}
        n = manifest.num_stages
        self._engines = list(engines) if whole_model is None else [whole_model]
        boundaries = range(n + 1) if whole_model is None else (0, n)
        self._buffers = [StageBuffer(k, -1, manifest.boundary(k), scheduler.bs_max, manifest.max_length)
                         for k in boundaries]
        self.engine = "stages" if whole_model is None else "model"

    def run_requests(self, requests: Sequence[Mapping[str, np.ndarray]]) -> list[dict[str, np.ndarray]] | None:
        """Several requests' rows (each input [rows, ...]) as one batch: of one shape, or, for a
        pad-safe model, of lengths within `PAD_TOLERANCE` of the shortest (as the input policy
        clusters them), zero-padded to the longest. Each request's outputs (cut back to its own
        length), or None as `run`."""
        if len(requests) == 1:
            outputs = self.run(requests[0])
            return None if outputs is None else [outputs]
        lengths = [self._length(r) for r in requests]
        if None in lengths:
            return None
        longest, shortest = max(lengths), min(lengths)  # type: ignore[type-var]
        if longest != shortest and not (self._manifest.pad_safe and longest <= (1 + PAD_TOLERANCE) * shortest):
            return None
        try:
            batch = {name: np.concatenate([pad_to(r[name], spec, longest) for r in requests])
                     for name, spec in self._specs.items()}
        except ValueError:  # shapes that do not stack: the usual way answers each
            return None
        outputs = self.run(batch)
        if outputs is None:
            return None
        answers, start = [], 0
        for request, length in zip(requests, lengths):
            stop = start + next(iter(request.values())).shape[0]
            answers.append({spec.name: cut_to(outputs[spec.name][start:stop], spec, length)  # type: ignore[arg-type]
                            for spec in self._manifest.outputs})
            start = stop
        return answers

    def _length(self, request: Mapping[str, np.ndarray]) -> int | None:
        """The request's length (0 without a sequence axis), or None if its inputs are not arrays of
        the model's ranks."""
        for name, spec in self._specs.items():
            arr = request.get(name)
            if not isinstance(arr, np.ndarray) or arr.ndim != len(spec.dims):
                return None
            if spec.has_seq:
                return int(arr.shape[spec.dims.index(SEQ)])
        return 0

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        """The model's outputs for `inputs` (every input [rows, ...], batch axis first), or None when
        the rows must go the usual way: not well-formed or not one batch, the pipeline not empty, or
        the run failed."""
        shape = batch_shape(inputs, self._manifest, self._scheduler.bs_max)
        if shape is None or not self._scheduler.reserve_inline(shape[0]):
            return None
        began = time.perf_counter()
        outputs = None
        try:
            outputs = self._run(inputs, *shape)
        except Exception as exc:  # noqa: BLE001 - the rows are sent the usual way, which answers each one
            log.debug("fast path failed, the rows go through the pipeline: %s", exc)
        finally:
            self._scheduler.release_inline(shape[0], None if outputs is None else time.perf_counter() - began)
        return outputs

    def _run(self, inputs: Mapping[str, np.ndarray], rows: int, length: int) -> dict[str, np.ndarray]:
        used = range(rows)
        views = [b.rows(length, used) for b in self._buffers]
        for name in self._input_names:
            np.copyto(views[0][name], inputs[name])
        for stage, engine in enumerate(self._engines):
            engine.run(views[stage], views[stage + 1])
        # owned copies: the scratch buffers serve the next run
        return {spec.name: np.array(views[-1][spec.name]) for spec in self._manifest.outputs}
