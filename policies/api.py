"""Everything a policy author needs, in one module.

    from policies.api import ArrivalPlan, BatchInfo, BatchTableView, New, Policy, QueryInfo, Split, Stretch

A policy subclasses `Policy` and answers the runtime with plain frozen decisions (`New`,
`Stretch` in an `ArrivalPlan`; `Split`), reading the batch table through a read-only
`BatchTableView` of `BatchInfo` rows; `Policy.on_arrival` and `Policy.on_stage_done` state the
contract. The runtime defines these types (it calls policies and carries out their decisions);
this module is where a policy imports them from, with what the built-in policies build on:

- `StageProfile`, `BatchCost`: the slicer's profile read by the runtime's one rule (admission
  reads it the same way), per stage by batch size, and per batch by size and padded length;
- `length_clusters`: waiting queries grouped by length, merged where the profile says padding pays;
- `AdaptiveWindow`: a batch window that follows the arrival rate.
"""
from dvabatch_backend.runtime.batch_table import BatchInfo
from dvabatch_backend.runtime.decisions import (
    ArrivalPlan,
    BatchTableView,
    New,
    Policy,
    PolicyContext,
    QueryInfo,
    Split,
    Stretch,
)

from ._profile import BatchCost, StageProfile  # noqa: E402 - after the types the helpers import
from .clusters import length_clusters  # noqa: E402
from .window import AdaptiveWindow  # noqa: E402

__all__ = ["AdaptiveWindow", "ArrivalPlan", "BatchCost", "BatchInfo", "BatchTableView", "New", "Policy", "PolicyContext",
           "QueryInfo", "Split", "StageProfile", "Stretch", "length_clusters"]
