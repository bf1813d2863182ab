"""What the scheduler checks of a policy's decisions before it carries any out.

A policy is other people's code: its plan is checked whole before anything changes, and a plan
that cannot be carried out is refused with a reason (`PolicyError` for its queries, or the batch
going on whole for a `Split`). The checks are plain functions of the decision and what it names.
"""
from __future__ import annotations

import logging
from typing import Sequence, TypeVar

import numpy as np

from .decisions import ArrivalPlan, New, Split, Stretch
from .manifest import Manifest
from .query import Query, QueryInfo
from .query_table import QueryTable

log = logging.getLogger(__name__)
_Row = TypeVar("_Row", Query, QueryInfo)  # a query, or what a policy sees of one


def is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_plan(plan: object) -> None:
    """Raise TypeError unless `plan` is an ArrivalPlan of well-typed decisions."""
    if not isinstance(plan, ArrivalPlan):
        raise TypeError(f"on_arrival returned {type(plan).__name__}, not an ArrivalPlan")
    if not isinstance(plan.decisions, (tuple, list)):
        raise TypeError(f"ArrivalPlan.decisions must be a tuple of New/Stretch, got {type(plan.decisions).__name__}")
    if plan.wake_at is not None and not isinstance(plan.wake_at, (int, float)):
        raise TypeError(f"ArrivalPlan.wake_at must be a number or None, got {plan.wake_at!r}")
    for d in plan.decisions:
        if not isinstance(d, (New, Stretch)):
            raise TypeError(f"{d!r} is not a New or Stretch decision")
        if not isinstance(d.query_ids, (tuple, list)) or not all(is_int(q) for q in d.query_ids):
            raise TypeError(f"{d}: query_ids must be a tuple of ints")
        if isinstance(d, New) and d.pad_length is not None and not is_int(d.pad_length):
            raise TypeError(f"{d}: pad_length must be an int or None")
        if isinstance(d, Stretch) and not is_int(d.batch_id):
            raise TypeError(f"{d}: batch_id must be an int")


def arrival_refusal(decision: New | Stretch, queries: QueryTable, bs_max: int, max_length: int) -> str | None:
    """Why an arrival decision cannot be carried out (it names a query twice, or one not waiting:
    the guard against a double answer; too many queries; a pad length out of range), or None."""
    ids = decision.query_ids
    if not ids or len(set(ids)) != len(ids) or not all(queries.is_waiting(q) for q in ids):
        return f"{decision} names queries that are not all distinct and waiting"
    if len(ids) > bs_max:
        return f"{decision} has more than bs_max={bs_max} queries"
    if isinstance(decision, New) and decision.pad_length is not None:
        longest = max(q.length for q in (queries.get(i) for i in ids) if q is not None)
        if not longest <= decision.pad_length <= max_length:
            return f"{decision}: pad length outside [{longest}, {max_length}]"
    return None


def split_refusal(decision: Split, policy_name: str, manifest: Manifest, stage: int) -> str | None:
    """A policy's bug in a `Split` after `stage` (sizes that are not ints, exit flags that do not
    match, an exit output that stage's outputs cannot give), or None. The batch table checks the
    sizes against the batch (`BatchTable.split_refusal`)."""
    sizes = decision.sizes
    if not isinstance(sizes, (tuple, list)) or not all(is_int(n) for n in sizes):
        return f"policy {policy_name}: {decision} has sizes that are not ints"
    if decision.exit:
        if len(decision.exit) != len(sizes):
            return f"policy {policy_name}: {decision} has {len(decision.exit)} exit flags for {len(sizes)} parts"
        at_stage = {t.name: t for t in manifest.boundary(stage + 1)}
        for spec in manifest.outputs:
            source = at_stage.get(decision.exit_outputs.get(spec.name, ""))
            if source is None or source.dtype != spec.dtype or source.dims != spec.dims:
                return (f"policy {policy_name}: exit output {spec.name!r} must come from a tensor of stage "
                        f"{stage}'s output with dims {list(spec.dims)}; got {decision.exit_outputs.get(spec.name)!r}")
    return None


def by_length(decision: New, rows: Sequence[_Row]) -> tuple[list[list[_Row]], bool]:
    """A model that is not pad-safe: the `New`'s rows as one batch per length (in order of first
    appearance), each at its own length, and whether that changed what the policy asked for."""
    groups: dict[int, list[_Row]] = {}
    for q in rows:
        groups.setdefault(q.length, []).append(q)
    reshaped = len(groups) > 1 or (decision.pad_length is not None and decision.pad_length != rows[0].length)
    return list(groups.values()), reshaped


def pad_unsafe_stretch(batch_id: int, pad_length: int, queries: Sequence[Query]) -> str | None:
    """A model that is not pad-safe: why these queries may not join the batch (a length other than
    its pad length), or None."""
    other = sorted({q.length for q in queries if q.length != pad_length})
    if not other:
        return None
    return f"the model is not pad-safe: queries of lengths {other} cannot join batch {batch_id} of length {pad_length}"
