"""The fast path: queries that meet no batch in flight run at once, on the caller's thread.

A pipeline pays for what it overlaps: a batch table, queues, buffer-pair hand-offs, a thread per
stage and the wake-ups between them. Queries that arrive at an empty pipeline overlap with nothing
in flight, so they get none of that. The caller (the Triton adapter, once per `execute` call) asks
the scheduler to hold the pipeline (`InlineHold.reserve`, granted only while it holds
nothing: no query unanswered, no batch, no stage working); then

- a lone request (`run`): its rows, when well-formed and at most bs_max of one length, run as one
  batch, the stages in a row (or the unsliced model) into scratch buffers of this path's own;
- several requests (`run_requests`): the policy batches their rows as it would at an empty
  pipeline (`InlineHold.plan`: the input policy's length clusters, shortest first; the load
  policy's one batch), the batches run one after another, and each request's outputs are handed
  to the caller as soon as its last row is done (the Triton adapter returns them all from `execute`). Only with one buffer pair, where the pipeline runs batches one at a time
  as well; with two or more its stages overlap (per-stage threads, a GPU), and the batches go there.

The switch, and why it never reorders or loses an answer: the reservation is taken and given back
under the scheduler's lock. While it is held, queries submitted by other callers are admitted and
batched as usual but no stage starts work, so none of them overtakes the run, and
`InlineHold.release` signals the stages that have some. A batch that fails answers nothing: its
requests (and those not yet run) go the usual way, where a failing row is answered with its own
error naming the stage and the others are not touched. Under Triton one model instance calls
`execute` one call at a time, so a request that arrives during a run waits in Triton's queue until
the run ends, as it would behind ZeroBatch's batch. On a CPU with one buffer pair (the served
default) the pipeline also runs batches one at a time, so this costs such a request no batching it
would have had, bar joining a batch that waits for stage 0; where stages overlap, only a lone
request takes the fast path.

Rows run at their batch's padded length, cut back to their own, as on the pipeline (a model that
is not pad-safe gets one batch per length). A policy whose splits may answer early (an exit head)
turns the fast path off (`Policy.allows_inline`), and so does a latency target that no query can
meet now (the pipeline refuses it, or serves it late).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .buffers import MemoryFactory, StageBuffer
from .device_timing import device_timers
from .engine import StageEngine
from .work import Launch, launching
from .fences import FenceFactory
from .manifest import Manifest
from .query import BatchCheck, cut_to, gather_rows, output_cuts
from .scheduler import Scheduler

log = logging.getLogger(__name__)


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
        self._check = BatchCheck(manifest)
        self._cuts = output_cuts(manifest.outputs)  # worked out once: every answer cuts its rows
        n = manifest.num_stages
        self._engines = list(engines) if whole_model is None else [whole_model]
        boundaries = range(n + 1) if whole_model is None else (0, n)
        self._buffers = [StageBuffer(k, -1, manifest.boundary(k), scheduler.bs_max, manifest.max_length)
                         for k in boundaries]
        self.engine = "stages" if whole_model is None else "model"
        # the engines' device timers, where they run on a device: read after each run, for the metrics
        self._timers = device_timers(self._engines)

    @property
    def model_timer(self) -> Any:
        """The unsliced model's `DeviceTimer` where this path runs it on a device, else None."""
        return getattr(self._engines[0], "device_timer", None) if self.engine == "model" else None

    def install_buffers(self, fence_factory: FenceFactory, memory_factory: MemoryFactory) -> None:
        """The scratch buffers' fences and memory (`Pipeline.install_buffers`): a middle boundary
        in device memory, its fence ordering the next stage's stream after the one that wrote it.
        The unsliced model's boundaries are the host's (its inputs and outputs): nothing changes."""
        if self.engine == "model":
            return
        for buf in self._buffers:
            buf.fence = fence_factory(buf.boundary, 0)
            buf.allocate(memory_factory(buf.boundary, 0))

    def run_requests(self, requests: Sequence[Mapping[str, np.ndarray]],
                     answer: Callable[[int, dict[str, np.ndarray]], None],
                     cancelled: Callable[[int], bool] | None = None,
                     between_batches: Callable[[], None] | None = None) -> list[int] | None:
        """Several requests' rows (each input [rows, ...]) batched as the policy batches them at an
        empty pipeline (`InlineHold.plan`: the input policy's length clusters, the load
        policy's one batch), the batches run one after another on this thread; `answer(i, outputs)`
        is called for request i as soon as its last row is done (outputs cut back to its length),
        exactly once for each request not left to the caller.

        None: the fast path was not taken (a request not well-formed or over bs_max rows, the
        pipeline not empty) and nothing was answered. Otherwise the requests not answered (a batch
        failed, or `cancelled`), which the caller sends the usual way.

        `cancelled(i)`: whether request i was cancelled. Asked once for each request not in the first
        batch, before the batch it waited for (the first batch's requests were just handed over);
        a cancelled request's rows are left out of the runs, and it is among those returned.
        `between_batches()`: called before each batch after the first (where the answers given so
        far should leave rather than wait for the call's end)."""
        if self._scheduler.settings.num_buffer_pairs > 1:
            return None  # stages overlap in the pipeline (per-stage threads, a GPU): batches belong there
        shapes = [self._check(r, self._scheduler.bs_max) for r in requests]
        if any(shape is None for shape in shapes):
            return None
        rows = [(i, r, length) for i, (k, length) in enumerate(shapes) for r in range(k)]  # type: ignore[misc]
        if not self._scheduler.inline.reserve(len(rows)):
            return None
        began = time.perf_counter()
        missing = [k for k, _ in shapes]  # type: ignore[misc]
        outputs: list[dict[str, np.ndarray] | None] = [None] * len(requests)
        runs = answered = 0
        asked: dict[int, bool] = {}  # request -> cancelled, for those asked
        try:
            for group, pad in self._scheduler.inline.plan([length for _, _, length in rows], self._scheduler.clock()):
                members = [rows[j] for j in group]
                if runs and between_batches is not None:
                    between_batches()
                if runs and cancelled is not None:  # the requests waited for an earlier batch: still wanted?
                    members = [m for m in members if not _ask(asked, cancelled, m[0])]
                    if not members:
                        continue
                views, padded = self._run_rows(requests, members, pad)
                owned: dict[str, np.ndarray] | None = None  # the batch's own copy, for answers that are slices of it
                runs += 1
                pos = 0
                while pos < len(members):
                    i, _, length = members[pos]
                    k = shapes[i][0]  # type: ignore[index]
                    if k == 1 or _whole_request(members, pos, i, k):
                        # all its rows, in order, here (every request of a fixed-shape model, and
                        # most others): one copy per output instead of one per row. Uncut, its
                        # answer is a slice of the batch's copy (made once: the scratch serves the
                        # next run); cut, its answer is a copy already, taken from the scratch
                        source = views
                        if length == padded:
                            if owned is None:
                                owned = {name: np.array(view) for name, view in views.items()}
                            source = owned
                        out, here = self._slice(source, pos, k, length, padded), k
                        outputs[i] = out
                    else:
                        out, here = self._copy_row(views, pos, outputs, shapes, members[pos]), 1
                    pos += here
                    if missing[i] == here:
                        answer(i, out)  # if it raises, this request goes the usual way with the ones not run
                        answered += k
                    missing[i] -= here
        except Exception as exc:  # noqa: BLE001 - the requests not answered go the usual way
            log.debug("fast path failed, the requests left go through the pipeline: %s", exc)
        finally:
            left = [i for i, m in enumerate(missing) if m]
            self._scheduler.inline.release(answered, time.perf_counter() - began if answered else None, runs,
                                           fell_back=any(not asked.get(i) for i in left))
        return left

    def _slice(self, done: Mapping[str, np.ndarray], pos: int, k: int, length: int,
               padded: int) -> dict[str, np.ndarray]:
        """The outputs of one request whose k rows sit at pos.. in the batch `done` (padded to
        `padded`), cut back to its `length`: where nothing is cut, views of `done`, which must then be
        the batch's own copy (C contiguous, as a response takes them); else copies."""
        if length == padded:
            return {name: done[name][pos:pos + k] for name, _ in self._cuts}
        return {name: np.array(cut_to(done[name][pos:pos + k], (None,) + dims if dims else None, length))
                for name, dims in self._cuts}

    def _copy_row(self, done: Mapping[str, np.ndarray], pos: int, outputs: list[dict[str, np.ndarray] | None],
                  shapes: Sequence[tuple[int, int] | None], member: tuple[int, int, int]) -> dict[str, np.ndarray]:
        """Row r of request i (at pos in the batch `done`) copied into its outputs, made at its first
        row; returns them."""
        i, r, length = member
        out = outputs[i]
        if out is None:
            k = shapes[i][0]  # type: ignore[index]
            out = outputs[i] = {spec.name: np.empty(spec.shape(k, length), spec.np_dtype)
                                for spec in self._manifest.outputs}
        for name, dims in self._cuts:
            out[name][r] = cut_to(done[name][pos], dims, length)
        return out

    def _run_rows(self, requests: Sequence[Mapping[str, np.ndarray]], members: list[tuple[int, int, int]],
                  length: int) -> tuple[dict[str, np.ndarray], int]:
        """One batch of rows (request, row, its length), zero-padded to `length` or past it: the last
        boundary's views (valid until the next run), and the length they are padded to."""
        length = self._scheduler.padded_length(length)  # a graph bucket's, where the stages replay graphs
        views = [b.rows(length, range(len(members))) for b in self._buffers]
        sources = [{name: requests[i][name][r] for name in self._input_names} for i, r, _ in members]
        gather_rows(sources, views[0], self._manifest.inputs)
        return self._through_engines(views), length

    def run(self, inputs: Mapping[str, np.ndarray], wait: bool = True) -> dict[str, np.ndarray] | None:
        """The model's outputs for `inputs` (every input [rows, ...], batch axis first), or None when
        the rows must go the usual way: not well-formed or not one batch, the pipeline not empty, or
        the run failed. `wait`: a busy pipeline with one buffer pair is waited for (`InlineHold.reserve`)."""
        shape = self._check(inputs, self._scheduler.bs_max)
        if shape is None or not self._scheduler.inline.reserve(shape[0], wait):
            return None
        began = time.perf_counter()
        outputs = None
        try:
            outputs = self._run(inputs, *shape)
        except Exception as exc:  # noqa: BLE001 - the rows are sent the usual way, which answers each one
            log.debug("fast path failed, the rows go through the pipeline: %s", exc)
        finally:
            self._scheduler.inline.release(shape[0] if outputs is not None else 0,
                                           None if outputs is None else time.perf_counter() - began,
                                           fell_back=outputs is None)
        return outputs

    def _run(self, inputs: Mapping[str, np.ndarray], rows: int, length: int) -> dict[str, np.ndarray]:
        used = range(rows)
        padded = self._scheduler.padded_length(length)  # a graph bucket's, where the stages replay graphs
        views = [b.rows(padded, used) for b in self._buffers]
        if padded == length:
            for name in self._input_names:
                np.copyto(views[0][name], inputs[name])
        else:
            gather_rows([{name: inputs[name][r] for name in self._input_names} for r in used], views[0],
                        self._manifest.inputs)
        last = self._through_engines(views)
        if padded == length:  # owned copies: the scratch buffers serve the next run
            return {spec.name: np.array(last[spec.name]) for spec in self._manifest.outputs}
        return self._slice(last, 0, rows, length, padded)  # cut back: copies

    def _through_engines(self, views: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """Run the engines in a row over the boundaries' views; the last boundary's views (host
        memory: its engine returns when they are written). Each boundary's fence orders its
        reader after its writer, as the pipeline's buffers do; the last engine's wait for its
        outputs covers every earlier stage's work, so the next run may reuse the buffers. The
        reservation holds the engine loop's step (`InlineHold.reserve`)."""
        with launching(Launch(-1, self._scheduler.step.count, True)):
            for stage, engine in enumerate(self._engines):
                inp, out = self._buffers[stage], self._buffers[stage + 1]
                if stage > 0 and not inp.fence.wait():
                    raise RuntimeError(f"fast path: stage {stage} would read boundary {stage} before it was written")
                out.fence.reset()
                engine.run(views[stage], views[stage + 1])
                out.fence.record()
            for timer in self._timers:
                timer.collect()
        return views[-1]


def _ask(asked: dict[int, bool], cancelled: Callable[[int], bool], i: int) -> bool:
    """Whether request i was cancelled, asked at most once."""
    if i not in asked:
        asked[i] = cancelled(i)
    return asked[i]


def _whole_request(members: Sequence[tuple[int, int, int]], pos: int, i: int, k: int) -> bool:
    """Whether members[pos:pos + k] are request i's rows 0..k-1, in order."""
    run = members[pos:pos + k]
    return len(run) == k and all(m[0] == i and m[1] == j for j, m in enumerate(run))
