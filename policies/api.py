"""Everything a policy author needs, in one module.

    from policies.api import ArrivalPlan, BatchInfo, BatchTableView, New, Policy, QueryInfo, Split, Stretch

A policy subclasses `Policy` and answers the runtime with plain frozen decisions (`New`,
`Stretch` in an `ArrivalPlan`; `Split`), reading the batch table through a read-only
`BatchTableView` of `BatchInfo` rows. The runtime defines these types (it calls policies and
carries out their decisions); this module is where a policy imports them from.
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

__all__ = ["ArrivalPlan", "BatchInfo", "BatchTableView", "New", "Policy", "PolicyContext", "QueryInfo", "Split", "Stretch"]
