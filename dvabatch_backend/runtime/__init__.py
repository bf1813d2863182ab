"""The runtime core: multi-entry multi-exit batching over a model sliced into stages.

A plain library: it imports neither Triton, the slicer, the policies nor perf.
"""
from .batch_table import BatchInfo, BatchItem, BatchQueue, BatchTable
from .buffers import BufferPool, BufferState, StageBuffer
from .decisions import ArrivalPlan, BatchTableView, New, Policy, PolicyContext, Split, Stretch
from .engine import OrtStageEngine, StageEngine
from .errors import BadInputError, ManifestError, QueryError, ShuttingDownError, StageFailedError
from .engine_loop import EngineLoop
from .executor import run_until_idle, run_work
from .loading import load_pipeline, load_scheduler
from .manifest import Manifest, StageSpec, TensorSpec
from .pipeline import Pipeline
from .query import Answer, Query, QueryInfo, QueryState
from .scheduler import Scheduler
from .settings import RuntimeSettings
from .work import EarlyExit, ExecutorState, Work, WorkListener, WorkResult

__all__ = [
    "Answer", "ArrivalPlan", "BadInputError", "BatchInfo", "BatchItem", "BatchQueue", "BatchTable",
    "BatchTableView", "BufferPool", "BufferState", "EarlyExit", "EngineLoop", "ExecutorState", "Manifest",
    "ManifestError", "New", "OrtStageEngine", "Pipeline", "Policy", "PolicyContext", "Query", "QueryError",
    "QueryInfo", "QueryState", "RuntimeSettings", "Scheduler", "ShuttingDownError", "Split", "StageBuffer",
    "StageEngine", "StageFailedError", "StageSpec", "Stretch", "TensorSpec", "Work",
    "WorkListener", "WorkResult", "load_pipeline", "load_scheduler", "run_until_idle", "run_work",
]
