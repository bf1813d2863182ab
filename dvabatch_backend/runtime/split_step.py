"""`Schedule()` after a stage (paper §6): the policy may split the batch a stage just finished
whole, so part of it goes on and part waits, or leaves early answered from that stage's outputs.

`SplitStep.after` asks the policy (`Policy.on_stage_done`), checks the split (`plan_checks`, then
the batch table), carries it out, and says which items go to the next stage and which exit;
`exit_early` answers the exiting rows and frees them. A policy that fails, or asks for a split
that cannot be carried out, leaves the batch going on whole. Owned by the scheduler, used under
its lock.
"""
from __future__ import annotations

import logging

from .batch_table import BatchItem, BatchTable
from .buffers import BufferPool
from .decisions import BatchTableView, Policy, Split
from .manifest import Manifest
from .plan_checks import split_refusal
from .query import scatter_outputs
from .query_table import Delivery, QueryTable
from .stats import RuntimeStats, Trace
from .work import EarlyExit

log = logging.getLogger(__name__)


class SplitStep:
    def __init__(self, policy: Policy, manifest: Manifest, table: BatchTable, buffers: BufferPool,
                 queries: QueryTable, stats: RuntimeStats, trace: Trace) -> None:
        self._policy = policy
        self._manifest = manifest
        self._table = table
        self._buffers = buffers
        self._queries = queries
        self._stats = stats
        self._trace = trace
        self.enabled = type(policy).on_stage_done is not Policy.on_stage_done  # the policy ever splits

    def after(self, stage: int, nxt: BatchItem, now: float) -> tuple[list[BatchItem], EarlyExit | None]:
        """`nxt`, handed on by `stage`: the items for the next stage, and the sub-batches that exit."""
        row = self._table.get(nxt.batch_id)
        if not self.enabled or nxt.start != 0 or nxt.num != row.bs:
            return [nxt], None
        out = self._buffers.pair(stage, row.pair)[1]
        view = BatchTableView(self._table, stage_outputs=lambda: out.host_rows(row.pad_length, row.rows(nxt)))
        try:
            decision = self._policy.on_stage_done(stage, self._table.info(row), view, now)
        except Exception:  # the batch goes on whole
            log.exception("policy %s failed in on_stage_done", self._policy.name)
            self._stats.policy_errors += 1
            return [nxt], None
        if not isinstance(decision, Split):
            return [nxt], None
        why = split_refusal(decision, self._policy.name, self._manifest, stage)
        self._stats.policy_errors += why is not None
        if why is None:
            whole_exit = len(decision.sizes) == 1 and bool(decision.exit) and decision.exit[0]
            why = self._table.split_refusal(nxt, stage, [int(n) for n in decision.sizes],
                                            min_parts=1 if whole_exit else 2)
        if why is not None:
            self._stats.split_refused += 1
            log.log(logging.ERROR if why.startswith("policy") else logging.DEBUG, "split refused: %s", why)
            return [nxt], None
        children = self._table.split(nxt.batch_id, stage, [int(n) for n in decision.sizes])
        self._stats.split += 1
        self._trace.record("split", now, stage, nxt,
                           f"into {list(decision.sizes)} -> ids {[c.batch_id for c in children]}")
        flags = decision.exit or (False,) * len(children)
        going = [c for c, leaves in zip(children, flags) if not leaves]
        leaving = [c for c, leaves in zip(children, flags) if leaves]
        return going, (EarlyExit(leaving, dict(decision.exit_outputs)) if leaving else None)

    def exit_early(self, stage: int, pair: int, exiting: EarlyExit, now: float) -> list[Delivery]:
        """Answer the sub-batches that leave after `stage` from its output, and free their rows."""
        out = self._buffers.pair(stage, pair)[1]
        deliveries = []
        for child in exiting.leaving:
            row = self._table.get(child.batch_id)
            rows = row.rows(child)
            views = out.host_rows(row.pad_length, rows)
            results = scatter_outputs(row.queries, {name: views[src] for name, src in exiting.sources.items()},
                                      self._manifest.outputs)
            deliveries += self._queries.results(row.queries, results)
            self._buffers.discard(stage + 1, pair, rows)
            self._table.drop(child.batch_id)
            self._stats.early_exits += child.num
            self._trace.record("exit", now, stage, child, "early")
        return deliveries
