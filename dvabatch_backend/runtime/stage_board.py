"""The stages' side of the pipeline: each stage's batch queue, the buffer pairs between stages,
each stage's `ExecutorState`, and whom to wake (the `WorkListener`: the engine loop).

Owned by the scheduler and used under its lock; `states` is read without it (a list element: a
stale value only makes the loop ask once more).
"""
from __future__ import annotations

from .batch_table import BatchItem, BatchQueue, BatchTable
from .buffers import BufferPool, BufferState
from .stats import RuntimeStats, Trace
from .work import ExecutorState, WorkListener


class StageBoard:
    def __init__(self, num_stages: int, table: BatchTable, buffers: BufferPool, stats: RuntimeStats,
                 trace: Trace) -> None:
        self.queues = [BatchQueue() for _ in range(num_stages)]
        self.buffers = buffers
        self.states = [ExecutorState.INACTIVE] * num_stages
        self.listener = WorkListener()  # the engine loop puts itself here
        self._table = table  # read only: a batch's buffer pair
        self._stats = stats
        self._trace = trace

    # -- what each stage can run ------------------------------------------------------------

    def ready_pair(self, stage: int) -> int | None:
        """The buffer pair of `stage`'s next item when that pair is legitimate (the stage can run it
        now), else None. A new batch takes the first legitimate pair at stage 0."""
        item = self.queues[stage].head()
        if item is None:
            return None
        owned = self._table.get(item.batch_id).pair
        pair = owned if owned >= 0 else self.buffers.first_legitimate(stage)
        return pair if pair is not None and self.buffers.is_legitimate(stage, pair) else None

    def settle(self, stage: int) -> None:
        """`stage` runs nothing now: it holds no usable pair, or waits for an item, or has an item
        whose pair is not legitimate yet."""
        if not self.buffers.is_active(stage):
            self.states[stage] = ExecutorState.INACTIVE
        elif self.queues[stage].head() is None or self.ready_pair(stage) is not None:
            self.states[stage] = ExecutorState.ACTIVE
        else:
            self.states[stage] = ExecutorState.CHECKING

    def push(self, stage: int, item: BatchItem, now: float) -> None:
        self.queues[stage].push(item)
        self._stats.handoffs += 1
        self._trace.record("push", now, stage, item)
        self.signal(stage)

    def pairs_returned(self, stage: int) -> None:
        """`stage` finished with a pair: wake each stage upstream that got one back and has an item."""
        for upstream in self.buffers.legitimate_upstream(stage):
            if len(self.queues[upstream]):
                self.signal(upstream)
            elif self.states[upstream] is ExecutorState.INACTIVE and self.buffers.is_active(upstream):
                self.states[upstream] = ExecutorState.ACTIVE  # waits for an item either way

    # -- wake-ups ---------------------------------------------------------------------------

    def signal(self, stage: int) -> None:
        """`stage` may have work: tell the listener."""
        self.listener.stage_ready(stage)

    def signal_ready(self) -> None:
        """Wake every stage that can run its next item now."""
        for stage in range(len(self.queues)):
            if self.ready_pair(stage) is not None:
                self.signal(stage)

    def free_batch(self, batch_id: int, pair: int, rows: range) -> None:
        """A failed batch: its queue items go, and its rows past stage 0 in its pair are discarded."""
        for queue in self.queues:
            queue.remove_batch(batch_id)
        for boundary in range(1, len(self.queues)):
            self.buffers.discard(boundary, pair, rows)

    def recover(self, failed: int) -> None:
        """After a failed item at stage `failed`: pairs returned upstream, each stage not working (and
        `failed`) settled, and every stage that can run woken."""
        for stage in range(len(self.queues)):
            self.pairs_returned(stage)
            if self.states[stage] is not ExecutorState.WORKING or stage == failed:
                self.settle(stage)
        self.signal_ready()

    # -- the end ----------------------------------------------------------------------------

    def stop(self) -> None:
        for queue in self.queues:
            queue.clear()
        self.states = [ExecutorState.STOPPED] * len(self.states)
        self.listener.stopping()

    def buffer_states(self) -> list[list[BufferState]]:
        return [[b.state for b in boundary] for boundary in self.buffers.buffers]
