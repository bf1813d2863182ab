"""Kept for policies written against `dvabatch_backend.batch_table`; new code imports `policies.api`."""
from .runtime.batch_table import BatchInfo  # noqa: F401
