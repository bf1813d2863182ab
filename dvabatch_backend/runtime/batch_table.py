"""The batch table and batch queues (paper §5.2), and the meta operations new, stretch and split.

One row per ongoing batch: its size `bs`, creation time, and `status_map[stage]`, the number
of its queries each stage has completed. A batch queue between stages holds items
`(batch id, start, num)`: the rows of that batch the stage is to run next.

A batch owns a contiguous range of rows in one buffer pair's tensors (`row_start`, `bs`).
`new` gives it rows from 0; `stretch` appends rows after the last one, so the new queries run
through the earlier stages into the same buffer rows and are merged with the original rows
where they catch up; `split` cuts a batch into children over consecutive row ranges.

Not thread-safe by itself: the `Scheduler` owns the table and mutates it under its lock.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from .query import Query


@dataclass(frozen=True)
class BatchItem:
    """An entry of a batch queue: run rows [start, start + num) of batch `batch_id`."""

    batch_id: int
    start: int
    num: int


@dataclass
class BatchRow:
    id: int
    pair: int  # index of the buffer pair the batch's rows live in
    row_start: int  # first buffer row of the batch
    pad_length: int  # every query of the batch is padded to this length
    created: float
    queries: list[Query]
    status_map: list[int]  # per stage: queries completed
    pushed: list[int]  # per stage: queries handed on to the next stage (a prefix of the rows)
    no_stretch: bool = False
    started: bool = False  # an executor has taken one of its items (a split child: its parent had)
    parent: int | None = None  # set on the children of a split
    group: int = -1  # the batch created by `new` whose buffer rows these are
    whole: bool = False  # runs the one-stage route: the unsliced model (`Scheduler.runs_whole`)

    def __post_init__(self) -> None:
        if self.group < 0:
            self.group = self.id

    @property
    def bs(self) -> int:
        return len(self.queries)

    def rows(self, item: BatchItem) -> range:
        return range(self.row_start + item.start, self.row_start + item.start + item.num)


@dataclass(frozen=True)
class BatchInfo:
    """A read-only snapshot of a batch-table row, as policies see it."""

    id: int
    bs: int
    created: float
    pad_length: int
    status_map: tuple[int, ...]
    no_stretch: bool
    is_split: bool
    query_ids: tuple[int, ...]
    started: bool = False  # a stage has begun running it: before that, joining it costs no wait
    whole: bool = False  # it runs the unsliced model, a one-stage route: no stage boundary to join or split at


class BatchTable:
    """Rows of the ongoing batches, keyed by id, in creation order."""

    def __init__(self, num_stages: int, bs_max: int) -> None:
        self.num_stages = num_stages
        self.bs_max = bs_max
        self._rows: dict[int, BatchRow] = {}
        self._ids = itertools.count()
        self._latest_new: int | None = None  # the batch `stretch` may target

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self) -> Iterator[BatchRow]:
        return iter(self._rows.values())

    def __contains__(self, batch_id: int) -> bool:
        return batch_id in self._rows

    def get(self, batch_id: int) -> BatchRow:
        return self._rows[batch_id]

    def info(self, row: BatchRow) -> BatchInfo:
        return BatchInfo(
            row.id, row.bs, row.created, row.pad_length, tuple(row.status_map),
            row.no_stretch, row.parent is not None, tuple(q.id for q in row.queries), row.started, row.whole,
        )

    def latest(self) -> BatchRow | None:
        """The most recently created batch, if it is still in the table and not split."""
        if self._latest_new is None:
            return None
        return self._rows.get(self._latest_new)

    # -- meta operations --------------------------------------------------------------

    def new(self, queries: Sequence[Query], pad_length: int, pair: int, now: float, no_stretch: bool) -> BatchItem:
        """Create a batch from `queries`; returns the item for the first stage's queue."""
        row = BatchRow(
            id=next(self._ids), pair=pair, row_start=0, pad_length=pad_length, created=now,
            queries=list(queries), status_map=[0] * self.num_stages, pushed=[0] * self.num_stages,
            no_stretch=no_stretch,
        )
        self._rows[row.id] = row
        self._latest_new = row.id
        return BatchItem(row.id, 0, row.bs)

    def stretch_refusal(self, batch_id: int, lengths: Sequence[int]) -> str | None:
        """Why stretching `batch_id` with queries of these lengths cannot be done, or None."""
        row = self._rows.get(batch_id)
        if row is None:
            return f"batch {batch_id} is not in the batch table"
        if batch_id != self._latest_new:
            return f"batch {batch_id} is not the latest batch"
        if row.no_stretch:
            return f"batch {batch_id} has stretch disabled (a split is planned or done)"
        if row.bs + len(lengths) > self.bs_max:
            return f"batch {batch_id} would grow to {row.bs + len(lengths)} > bs_max {self.bs_max}"
        longest = max(lengths, default=0)
        if longest > row.pad_length:
            return f"a query of length {longest} cannot join batch {batch_id} padded to {row.pad_length}"
        return None

    def stretch(self, batch_id: int, queries: Sequence[Query]) -> BatchItem:
        """Append `queries` to the latest batch; returns the item for the first stage's queue.

        The caller checks `stretch_refusal` first.
        """
        row = self._rows[batch_id]
        item = BatchItem(batch_id, row.bs, len(queries))
        row.queries.extend(queries)
        return item

    def split_refusal(self, handed_on: BatchItem, stage: int, sizes: Sequence[int], min_parts: int = 2) -> str | None:
        """Why the batch being handed on from `stage` as `handed_on` cannot be split, or None.

        `min_parts` is 1 for an early exit of the whole batch."""
        row = self._rows.get(handed_on.batch_id)
        if row is None:
            return f"batch {handed_on.batch_id} is not in the batch table"
        if stage >= self.num_stages - 1:
            return "cannot split after the last stage"
        if len(sizes) < min_parts or any(s < 1 for s in sizes) or sum(sizes) != row.bs:
            return f"sizes {list(sizes)} do not partition batch {row.id} of {row.bs} queries"
        if handed_on.start != 0 or handed_on.num != row.bs:
            return f"batch {row.id} is not wholly at stage {stage}"
        return None

    def split(self, batch_id: int, stage: int, sizes: Sequence[int]) -> list[BatchItem]:
        """Replace a batch that has wholly completed `stage` by children over its row ranges.

        Returns the children's items for the next stage's queue. The caller checks
        `split_refusal` first. Children inherit the parent's status and have stretch disabled.
        """
        parent = self._rows[batch_id]
        items, offset, children = [], 0, []
        for size in sizes:
            done = [size if s <= stage else 0 for s in range(self.num_stages)]
            child = BatchRow(
                id=next(self._ids), pair=parent.pair, row_start=parent.row_start + offset,
                pad_length=parent.pad_length, created=parent.created,
                queries=parent.queries[offset:offset + size], status_map=done, pushed=list(done),
                no_stretch=True, started=True, parent=parent.id, group=parent.group,
            )
            children.append(child)
            items.append(BatchItem(child.id, 0, size))
            offset += size
        del self._rows[batch_id]
        self._rows.update((c.id, c) for c in children)
        return items

    # -- progress ---------------------------------------------------------------------

    def complete(self, item: BatchItem, stage: int) -> BatchItem | None:
        """Record that `stage` ran `item`; return what to hand to the next stage, if anything.

        Rows wait (nothing is returned) while stretched rows are still catching up through
        earlier stages; the item that completes the batch at this stage carries every row
        not yet handed on: the merge. At the last stage nothing is handed on, nor after a row of
        the one-stage route (`whole`), whose rows have then passed every stage.
        """
        row = self._rows[item.batch_id]
        for k in range(stage, self.num_stages if row.whole else stage + 1):
            row.status_map[k] += item.num
        if stage == self.num_stages - 1 or row.whole or row.status_map[stage] < row.bs:
            return None
        start = row.pushed[stage]
        row.pushed[stage] = row.bs
        return BatchItem(row.id, start, row.bs - start)

    def retire_if_done(self, batch_id: int) -> bool:
        """Remove a batch whose every query has left the last stage."""
        row = self._rows[batch_id]
        if row.status_map[-1] < row.bs:
            return False
        del self._rows[batch_id]
        return True

    def drop(self, batch_id: int) -> None:
        """Remove a batch whose queries have all been answered early."""
        del self._rows[batch_id]

    def clear(self) -> list[BatchRow]:
        rows = list(self._rows.values())
        self._rows.clear()
        self._latest_new = None
        return rows


class BatchQueue:
    """FIFO of batch items between two adjacent stages."""

    def __init__(self) -> None:
        self._items: deque[BatchItem] = deque()

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[BatchItem]:
        return iter(self._items)

    def push(self, item: BatchItem) -> None:
        self._items.append(item)

    def push_front(self, item: BatchItem) -> None:
        self._items.appendleft(item)

    def remove_batch(self, batch_id: int) -> None:
        """Take every item of `batch_id` off the queue."""
        self._items = deque(i for i in self._items if i.batch_id != batch_id)

    def head(self) -> BatchItem | None:
        return self._items[0] if self._items else None

    def pop_coalesced(self) -> BatchItem:
        """The head, joined with the items right behind it that continue its rows (the same batch,
        the next rows: a stretch's catch-up rows queued before the stage took the originals), so
        the stage runs them as one batch."""
        item = self._items.popleft()
        while self._items and self._items[0].batch_id == item.batch_id \
                and self._items[0].start == item.start + item.num:
            item = BatchItem(item.batch_id, item.start, item.num + self._items.popleft().num)
        return item

    def clear(self) -> None:
        self._items.clear()


@dataclass
class TableSnapshot:
    """What tests and the demo read: batch rows and queue items at one moment."""

    rows: list[BatchInfo] = field(default_factory=list)
    queues: list[list[BatchItem]] = field(default_factory=list)
