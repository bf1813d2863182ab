"""Buffer pairs between stages (paper §6.1–6.2) and their legitimacy rules.

Boundary k (0..N) sits before stage k: boundary 0 holds the padded model inputs, boundary N
the model outputs. Each boundary has `num_pairs` `StageBuffer`s, one per buffer pair, each a
set of preallocated tensors sized for `bs_max` rows padded to the largest input length.
Executor i with pair j reads `buffers[i][j]` and writes `buffers[i + 1][j]`; tensors move
between stages as views of these buffers, never by copy.

A buffer's `state` is its state as the input of the stage after it:

- AVAILABLE: that stage may run a batch with this pair;
- INREADING / INWRITING: the stage after / before it is executing with it;
- INVALID: the stage after it has handed its output on and may not use this pair until the
  stage after *that* has taken the output (the legitimation below).

A pair is legitimate for executor i when its input is AVAILABLE and its output is AVAILABLE or
INVALID. When executor i finishes with pair j its input becomes INVALID if it handed rows on
(AVAILABLE if it holds them back to merge with stretched rows that are still catching up:
the paper's rule would deadlock there), and its output returns to its previous state. Once
executor i has no unread rows left in `buffers[i][j]` and is active (holds some AVAILABLE
input), it legitimates pair j for executor i - 1 again: `buffers[i - 1][j]` INVALID ->
AVAILABLE. With one pair this makes the pipeline run serially; with two, stages overlap.

Where the tensors live: a buffer's `BufferMemory` allocates them. `HOST_MEMORY` (numpy, the
default) for CPU engines and for the boundaries the host reads or writes (0: gather; N: answers);
engines on a GPU keep the boundaries between two of their stages in device memory
(`device_memory.place_on_streams`), so a batch crosses them without a host round trip. A host
reader of such a buffer (an early exit, a policy looking at a stage's outputs) takes
`host_rows`, which waits for the writer's fence and copies.

Row bookkeeping (`unread`) backs the self-checks: an executor never reads rows nobody wrote,
never overwrites rows not yet read, and never mixes two batches' data in one buffer. A check
that fires is logged and kept in `violations` (as `BufferStateError`s): it means the runtime
has a bug. The executors carry on, so that every query still gets its one answer.

Not thread-safe by itself: the `Scheduler` owns the pool and changes it under its lock.
"""
from __future__ import annotations

import enum
import logging
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol

import numpy as np

from .errors import BufferStateError
from .fences import Fence, FenceFactory, HostFence, host_fences
from .manifest import Manifest, TensorSpec

__all__ = ["BufferMemory", "BufferPool", "BufferState", "HOST_MEMORY", "HostFence", "HostMemory", "MemoryFactory",
           "PairUse", "StageBuffer", "host_memory", "row_mask"]

log = logging.getLogger(__name__)


class BufferState(enum.Enum):
    AVAILABLE = "available"
    INVALID = "invalid"
    INREADING = "inreading"
    INWRITING = "inwriting"


class BufferMemory(Protocol):
    """Where a buffer's tensors live: `zeros` makes one flat tensor (sliced and reshaped as numpy
    arrays are), `to_host` gives a view's data as a numpy array (its writer's work complete)."""

    on_device: bool

    def zeros(self, size: int, dtype: np.dtype) -> Any: ...

    def to_host(self, view: Any) -> np.ndarray: ...


class HostMemory:
    """Buffers in host memory, as numpy arrays (CPU engines; the boundaries the host touches)."""

    on_device = False

    def zeros(self, size: int, dtype: np.dtype) -> np.ndarray:
        return np.zeros(size, dtype)

    def to_host(self, view: Any) -> np.ndarray:
        return view


HOST_MEMORY = HostMemory()
MemoryFactory = Callable[[int, int], BufferMemory]  # (boundary, pair) -> where that buffer lives


def host_memory(boundary: int, pair: int) -> HostMemory:
    """The default `MemoryFactory`: every buffer in host memory."""
    return HOST_MEMORY


class StageBuffer:
    """The tensors at one boundary for one buffer pair."""

    _CACHED_VIEWS = 256

    def __init__(self, boundary: int, pair: int, specs: tuple[TensorSpec, ...], bs_max: int, max_length: int,
                 fence: Fence | None = None, memory: BufferMemory = HOST_MEMORY) -> None:
        self.boundary = boundary
        self.pair = pair
        self.specs = specs
        self.bs_max = bs_max
        self.max_length = max_length
        self.allocate(memory)
        self.state = BufferState.AVAILABLE
        self.state_before_write = BufferState.AVAILABLE
        self.unread = 0  # bit r set: row r was written and its reader has not run it yet
        self.unread_batch_group: int | None = None
        self.fence: Fence = HostFence() if fence is None else fence

    def allocate(self, memory: BufferMemory) -> None:
        """(Re)make the tensors in `memory` (zeros); only while the buffer holds nothing."""
        self.memory = memory
        self._flat = {s.name: memory.zeros(math.prod(s.shape(self.bs_max, max(self.max_length, 1))), s.np_dtype)
                      for s in self.specs}
        self._row_views: OrderedDict[tuple[int, int, int], dict[str, Any]] = OrderedDict()

    def views(self, length: int) -> dict[str, np.ndarray]:
        """All `bs_max` rows laid out contiguously for batches padded to `length`."""
        out = {}
        for spec in self.specs:
            shape = spec.shape(self.bs_max, length)
            out[spec.name] = self._flat[spec.name][: math.prod(shape)].reshape(shape)
        return out

    def rows(self, length: int, rows: range) -> dict[str, np.ndarray]:
        """Contiguous views of `rows`, padded to `length`.

        The same (length, rows) gives the same dict object back, so engines can cache what
        they bind to it; callers must not modify the dict.
        """
        key = (length, rows.start, rows.stop)
        views = self._row_views.get(key)
        if views is None:
            views = {name: view[rows.start:rows.stop] for name, view in self.views(length).items()}
            self._row_views[key] = views
            if len(self._row_views) > self._CACHED_VIEWS:
                self._row_views.popitem(last=False)
        return views

    def host_rows(self, length: int, rows: range) -> Mapping[str, np.ndarray]:
        """`rows` as numpy arrays for a host reader: the views themselves in host memory; from
        device memory, copies made once the writer's fence completed."""
        views = self.rows(length, rows)
        if not self.memory.on_device:
            return views
        self.fence.synchronize()
        return {name: self.memory.to_host(view) for name, view in views.items()}

    def __repr__(self) -> str:
        return f"StageBuffer(boundary={self.boundary}, pair={self.pair}, state={self.state.value})"


def row_mask(rows: range) -> int:
    return ((1 << len(rows)) - 1) << rows.start


@dataclass(frozen=True)
class PairUse:
    """One executor's use of one buffer pair for one batch item."""

    stage: int
    pair: int
    rows: range
    group: int  # the batch whose buffer rows these are (the root of a split)


class BufferPool:
    """All boundaries' buffers, and the legitimation between adjacent executors.

    `fence_factory(boundary, pair)` makes each buffer's completion fence (runtime/fences.py):
    `HostFence`s by default (CPU engines), `fences.cuda_fences(streams)` for engines on CUDA streams.
    """

    def __init__(self, manifest: Manifest, num_pairs: int, bs_max: int, fence_factory: FenceFactory = host_fences) -> None:
        if num_pairs < 1:
            raise ValueError(f"num_buffer_pairs must be >= 1, got {num_pairs}")
        self.num_stages = manifest.num_stages
        self.num_pairs = num_pairs
        length = manifest.max_length
        self.buffers = [
            [StageBuffer(k, j, manifest.boundary(k), bs_max, length, fence_factory(k, j)) for j in range(num_pairs)]
            for k in range(self.num_stages + 1)
        ]
        # owed[i]: pairs executor i has finished reading and must legitimate for executor i-1
        self._owed: list[set[int]] = [set() for _ in range(self.num_stages)]
        self.violations: list[BufferStateError] = []

    def install_fences(self, fence_factory: FenceFactory, memory_factory: MemoryFactory | None = None) -> None:
        """Give every buffer a fence from `fence_factory` (and, given `memory_factory`, tensors in
        the memory it names), before any work: the `Scheduler` makes its pool with host fences in
        host memory, and a pipeline on CUDA streams swaps them (`device_memory.place_on_streams`)."""
        busy = [b for row in self.buffers for b in row if b.state is not BufferState.AVAILABLE or b.unread]
        if busy:
            raise RuntimeError(f"fences can only be installed before any work; in use: {busy}")
        for row in self.buffers:
            for buf in row:
                buf.fence = fence_factory(buf.boundary, buf.pair)
                if memory_factory is not None:
                    buf.allocate(memory_factory(buf.boundary, buf.pair))

    def _violate(self, message: str) -> None:
        log.error("buffer-pair rule broken: %s", message)
        self.violations.append(BufferStateError(message))

    def pair(self, stage: int, pair: int) -> tuple[StageBuffer, StageBuffer]:
        return self.buffers[stage][pair], self.buffers[stage + 1][pair]

    def is_legitimate(self, stage: int, pair: int) -> bool:
        inp, out = self.pair(stage, pair)
        return inp.state is BufferState.AVAILABLE and out.state in (BufferState.AVAILABLE, BufferState.INVALID)

    def first_legitimate(self, stage: int) -> int | None:
        return next((j for j in range(self.num_pairs) if self.is_legitimate(stage, j)), None)

    def is_active(self, stage: int) -> bool:
        """An executor is active while it holds some pair whose input is AVAILABLE."""
        return any(b.state is BufferState.AVAILABLE for b in self.buffers[stage])

    def begin(self, use: PairUse) -> None:
        """Executor `use.stage` starts working with its pair: check the rules, then take it."""
        inp, out = self.pair(use.stage, use.pair)
        if not self.is_legitimate(use.stage, use.pair):
            self._violate(f"stage {use.stage} started on pair {use.pair} that is not legitimate: {inp}, {out}")
        mask = row_mask(use.rows)
        if use.stage == 0:
            inp.fence.wait_read()  # the host gathers into it: its last reader must be done
        if use.stage > 0:
            if inp.unread & mask != mask or inp.unread_batch_group != use.group:
                self._violate(f"stage {use.stage} would read rows {use.rows} of {inp} that hold no data for it")
            if not inp.fence.wait():
                self._violate(f"stage {use.stage} would read {inp} before its writer's fence completed")
        if use.stage < self.num_stages - 1:
            if out.unread & mask:
                self._violate(f"stage {use.stage} would overwrite unread rows {use.rows} of {out}")
            if out.unread and out.unread_batch_group != use.group:
                self._violate(f"stage {use.stage} would mix two batches' rows in {out}")
        inp.state = BufferState.INREADING
        out.state_before_write, out.state = out.state, BufferState.INWRITING
        out.fence.reset()

    def finish(self, use: PairUse, handed_on: bool) -> None:
        """Executor `use.stage` finished with its pair; rows it wrote are now unread downstream."""
        inp, out = self.pair(use.stage, use.pair)
        if inp.state is not BufferState.INREADING or out.state is not BufferState.INWRITING:
            self._violate(f"stage {use.stage} finished on pair {use.pair} it was not using: {inp}, {out}")
        out.fence.record()
        inp.fence.record_read()
        inp.state = BufferState.INVALID if handed_on else BufferState.AVAILABLE
        out.state = out.state_before_write
        mask = row_mask(use.rows)
        if use.stage > 0:
            inp.unread &= ~mask
            if not inp.unread:
                self._owed[use.stage].add(use.pair)
        if use.stage < self.num_stages - 1:
            out.unread |= mask
            out.unread_batch_group = use.group

    def discard(self, boundary: int, pair: int, rows: range) -> None:
        """Rows written at `boundary` that will never be read (their queries exited early)."""
        buf = self.buffers[boundary][pair]
        buf.unread &= ~row_mask(rows)

    def legitimate_upstream(self, stage: int) -> list[int]:
        """Hand back pairs to the executors before `stage` while they re-enter active.

        Returns the stages that got a pair back (to be woken).
        """
        woken = []
        while stage > 0 and self._owed[stage] and self.is_active(stage):
            for j in sorted(self._owed[stage]):
                upstream, mine = self.buffers[stage - 1][j], self.buffers[stage][j]
                mine.fence.wait_read()  # stage - 1 may overwrite `mine` once stage has read it
                if mine.unread:
                    self._violate(f"stage {stage} legitimated pair {j} while {mine} still holds unread rows")
                if upstream.state is BufferState.INVALID:
                    upstream.state = BufferState.AVAILABLE
                elif upstream.state is BufferState.INWRITING and upstream.state_before_write is BufferState.INVALID:
                    # the stage before is writing into it: legitimate the state it returns to
                    upstream.state_before_write = BufferState.AVAILABLE
                else:
                    self._violate(f"stage {stage} legitimated pair {j} for stage {stage - 1}, which was not waiting: {upstream}")
            self._owed[stage].clear()
            woken.append(stage - 1)
            stage -= 1
        return woken
