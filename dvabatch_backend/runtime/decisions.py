"""The policy interface (paper §7.2, `Schedule(inBatch, outBatches)`) and its decisions.

A policy is asked at two moments and answers with plain, frozen decisions that the
`Scheduler` carries out:

- `on_arrival(waiting, table, now)`: queries are waiting to be batched. Return an
  `ArrivalPlan` of `New` and `Stretch` decisions over any subset of them; the rest keep
  waiting. `wake_at` asks to be called again at that time (a batch window). The scheduler
  also calls again whenever queries leave the pipeline.
- `on_stage_done(stage, batch, table, now)`: `stage` finished the whole of `batch`, which
  is about to go to the next stage. Return a `Split` to cut it into sub-batches that run and
  exit independently, or None to hand it on unchanged.

A decision the runtime cannot carry out is refused, never half-done: a refused `Stretch`
becomes a `New` of the same queries, a refused `Split` leaves the batch whole, and both are
counted in the scheduler's stats. Policies are called under the scheduler's lock, from
executor threads and the caller's thread: they must be quick and must not block.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Callable, Iterator, Mapping, Sequence

import numpy as np

from .batch_table import BatchInfo, BatchTable
from .query import QueryInfo

if TYPE_CHECKING:
    from .manifest import Manifest


@dataclass(frozen=True)
class New:
    """Start a new batch from these waiting queries."""

    query_ids: tuple[int, ...]
    pad_length: int | None = None  # None: the longest of the queries
    no_stretch: bool = False  # a split is planned for this batch: never stretch it


@dataclass(frozen=True)
class Stretch:
    """Let these waiting queries join the latest batch, catching it up stage by stage."""

    batch_id: int
    query_ids: tuple[int, ...]


@dataclass(frozen=True)
class Split:
    """Cut the batch just finished into consecutive sub-batches of these sizes.

    Early exit: parts whose `exit` flag is set are answered at once instead of going on, each
    model output taken from the tensor of this stage's output that `exit_outputs` names for it
    (model output name -> tensor name); `exit_outputs` must cover every model output.
    """

    sizes: tuple[int, ...]
    exit: tuple[bool, ...] = ()
    exit_outputs: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ArrivalPlan:
    decisions: tuple[New | Stretch, ...] = ()
    wake_at: float | None = None


@dataclass(frozen=True)
class PolicyContext:
    """Fixed facts about the served model, given to a policy once before any query."""

    num_stages: int
    bs_max: int
    max_length: int
    num_buffer_pairs: int
    # profiled seconds per stage, keyed by batch size; empty when the model has no profile
    stage_times: tuple[dict[int, float], ...] = field(default_factory=tuple)
    # the same per profiled sequence length (models with a sequence axis): {length: per stage {bs: s}}
    stage_times_by_length: Mapping[int, tuple[dict[int, float], ...]] = field(default_factory=dict)
    output_names: tuple[str, ...] = ()  # the model's outputs, which an early exit must answer
    # zero-padding a query to a longer length leaves its answer unchanged (the manifest's pad_safe);
    # when False the runtime carries out only same-length batches, whatever the policy decides
    pad_safe: bool = True
    # the longest an admitted query is expected to wait for stage 0 (s, the profile's: admission.py's
    # bound); None where a queue policy is configured instead. A policy that reorders a backlog
    # keeps each query's wait near it, or queries admitted within it starve
    wait_bound: float | None = None

    @classmethod
    def for_model(cls, manifest: Manifest, bs_max: int, num_buffer_pairs: int,
                  wait_bound: float | None = None) -> PolicyContext:
        return cls(num_stages=manifest.num_stages, bs_max=bs_max, max_length=manifest.max_length,
                   num_buffer_pairs=num_buffer_pairs, stage_times=manifest.stage_times(),
                   stage_times_by_length=manifest.stage_times_by_length(),
                   output_names=tuple(t.name for t in manifest.outputs), pad_safe=manifest.pad_safe,
                   wait_bound=wait_bound)


class BatchTableView:
    """Read-only access to the batch table for policies.

    The view handed to `on_stage_done` also shows the finished stage's output tensors for the
    batch's rows (`stage_outputs`); the scheduler makes that view for the call.
    """

    def __init__(self, table: BatchTable,
                 stage_outputs: Callable[[], Mapping[str, np.ndarray]] | Mapping[str, np.ndarray] | None = None) -> None:
        """`stage_outputs`: the arrays, or a function giving them, called at most once and only if
        the policy asks (the outputs of a stage on a GPU are copied to the host for it)."""
        self._table = table
        self._source = stage_outputs
        self._stage_outputs: Mapping[str, np.ndarray] | None = None

    def stage_outputs(self) -> Mapping[str, np.ndarray]:
        """In `on_stage_done`: the finished stage's output tensors for the batch's rows (read-only).

        Empty at any other time; the arrays are only valid during the call.
        """
        if self._stage_outputs is None:
            source = self._source() if callable(self._source) else self._source
            self._stage_outputs = MappingProxyType({name: _readonly(arr) for name, arr in (source or {}).items()})
        return self._stage_outputs

    def __iter__(self) -> Iterator[BatchInfo]:
        return (self._table.info(r) for r in self._table)

    def __len__(self) -> int:
        return len(self._table)

    def get(self, batch_id: int) -> BatchInfo | None:
        return self._table.info(self._table.get(batch_id)) if batch_id in self._table else None

    def latest(self) -> BatchInfo | None:
        row = self._table.latest()
        return None if row is None else self._table.info(row)

    def queries_in_flight(self) -> int:
        return sum(r.bs - r.status_map[-1] for r in self._table)


class Policy(ABC):
    """Base class of batching policies; subclasses name themselves with `name`.

    `runs_inline` says whether a batch that meets nobody may run the unsliced model, a one-stage
    route with no boundary to split at (`Scheduler.serve_whole_model`). None (the default) allows
    it unless the policy overrides `on_stage_done`, whose splits may answer early from an exit
    head; a policy whose splits never change an answer sets True.
    """

    name: str = "policy"
    runs_inline: bool | None = None

    @classmethod
    def allows_inline(cls) -> bool:
        """Whether a batch may run the unsliced model under this policy (see `runs_inline`)."""
        if cls.runs_inline is not None:
            return cls.runs_inline
        return cls.on_stage_done is Policy.on_stage_done

    def bind(self, context: PolicyContext) -> None:
        """Called once, before any query: `self.context` holds the model's fixed facts."""
        self.context = context

    @abstractmethod
    def on_arrival(self, waiting: Sequence[QueryInfo], table: BatchTableView, now: float) -> ArrivalPlan:
        """Queries arrived, a batch window (`ArrivalPlan.wake_at`) passed, or a batch left: decide
        what to do with the queries not yet batched.

        `waiting`: those queries in arrival order (id, length, arrival time); `table`: the batches
        in flight, read-only; `now`: the scheduler's clock. Return an `ArrivalPlan` of `New` (a new
        batch of some of them, padded to `pad_length` or their longest) and `Stretch` (append some
        to a batch not yet past stage 0) decisions, and `wake_at` to be called again then. Queries
        left out wait and are offered again. The contract, checked before anything is carried out:
        each decision names distinct waiting queries, at most bs_max; a query at most once in the
        plan; a pad length between the longest query's and the model's max_length. A decision that
        breaks it is refused and its queries answered with a policy error; a policy that raises is
        treated as having decided nothing (logged, counted in `policy_errors`): a policy's bug never
        loses a query. Called under the scheduler's lock: keep it quick, never block.
        """

    def on_stage_done(self, stage: int, batch: BatchInfo, table: BatchTableView, now: float) -> Split | None:
        """`stage` finished every row of `batch`: return None to let it go on whole, or `Split(sizes)`
        to cut it into sub-batches over consecutive rows that go on (and exit) independently; with
        `exit` flags and `exit_outputs` some parts leave now, answered from this stage's outputs
        (`table.stage_outputs()`, read-only, valid during the call). A split the batch cannot take
        (sizes not summing to its rows, an exit output the stage does not give) is refused and the
        batch goes on whole. Overriding it keeps batches off the unsliced model unless `runs_inline` is True."""
        return None


def _readonly(arr: np.ndarray) -> np.ndarray:
    view = arr.view()
    view.flags.writeable = False
    return view
