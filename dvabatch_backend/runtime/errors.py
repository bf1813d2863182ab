"""Errors of the runtime. A query's error names the query, the stage and the cause."""
from __future__ import annotations


class QueryError(Exception):
    """An error answered to one query instead of its result."""

    def __init__(self, query_id: int, cause: str, stage: int | None = None) -> None:
        self.query_id = query_id
        self.stage = stage
        self.cause = cause
        where = f" at stage {stage}" if stage is not None else ""
        super().__init__(f"query {query_id}{where}: {cause}")


class BadInputError(QueryError):
    """The query's input tensors do not match the model's input specification."""


class ShuttingDownError(QueryError):
    """The runtime stopped before the query could be answered."""

    def __init__(self, query_id: int, stage: int | None = None) -> None:
        super().__init__(query_id, "shutting down", stage)


class RefusedError(QueryError):
    """The query was not run: the runtime is over its bounds (Triton's UNAVAILABLE)."""


class QueueFullError(RefusedError):
    """Admitting the query would take the queue past `max_queue_size` (Triton's wording)."""


class TimeoutExpiredError(RefusedError):
    """The query's timeout passed before a stage took it, or would pass before one could (Triton's
    wording, then why: refused at arrival)."""

    def __init__(self, query_id: int, why: str = "") -> None:
        super().__init__(query_id, "Request timeout expired" + (f": {why}" if why else ""))


class OverloadedError(RefusedError):
    """The query can no longer meet the model's latency target (`slo_ms`)."""


class CancelledError(QueryError):
    """The client cancelled the request (or went away) before a stage took the query."""

    def __init__(self, query_id: int) -> None:
        super().__init__(query_id, "cancelled by the client before it ran")


class StageFailedError(QueryError):
    """A stage engine raised while running the query's rows."""


class EngineLoopDiedError(QueryError):
    """The engine loop ended on a fault of its own: nothing can run the query (Triton's INTERNAL)."""


class PolicyError(QueryError):
    """The policy made a decision the runtime cannot carry out for this query."""


class BufferStateError(RuntimeError):
    """An executor found a buffer in a state that the buffer-pair rules forbid.

    This is an internal invariant check: it never fires unless the runtime has a bug.
    """


class ManifestError(ValueError):
    """A model manifest is missing, malformed or inconsistent; `field` names where."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")
