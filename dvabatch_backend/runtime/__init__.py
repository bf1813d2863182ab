"""The runtime core: multi-entry multi-exit batching over a model sliced into stages.

A plain library: it imports neither Triton, the slicer, the policies nor perf.
"""
from .batch_table import BatchInfo, BatchItem, BatchQueue, BatchTable
from .buffers import BufferPool, BufferState, StageBuffer
from .decisions import ArrivalPlan, BatchTableView, New, Policy, PolicyContext, QueryInfo, Split, Stretch
from .engine import OrtStageEngine, StageEngine
from .errors import BadInputError, ManifestError, QueryError, ShuttingDownError, StageFailedError
from .executor import ExecutorState, StageExecutor
from .manifest import Manifest, StageSpec, TensorSpec
from .query import Answer, Query
from .scheduler import RuntimeSettings, Scheduler, load_scheduler

__all__ = [
    "Answer", "ArrivalPlan", "BadInputError", "BatchInfo", "BatchItem", "BatchQueue", "BatchTable",
    "BatchTableView", "BufferPool", "BufferState", "ExecutorState", "Manifest", "ManifestError", "New",
    "OrtStageEngine", "Policy", "PolicyContext", "Query", "QueryError", "QueryInfo", "RuntimeSettings",
    "Scheduler", "ShuttingDownError", "Split", "StageBuffer", "StageEngine", "StageExecutor",
    "StageFailedError", "StageSpec", "Stretch", "TensorSpec", "load_scheduler",
]
