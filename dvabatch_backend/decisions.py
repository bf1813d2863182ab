"""Kept for policies written against `dvabatch_backend.decisions`; new code imports `policies.api`."""
from .runtime.decisions import *  # noqa: F401,F403
from .runtime.decisions import ArrivalPlan, BatchTableView, New, Policy, PolicyContext, QueryInfo, Split, Stretch  # noqa: F401
