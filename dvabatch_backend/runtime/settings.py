"""The runtime's settings: plain data, read from config.pbtxt parameters by the adapter."""
from __future__ import annotations

from dataclasses import dataclass

MIN_WAKE_DELAY = 1e-4  # seconds: the earliest a wake-up asked for "now or before" comes (never at once, forever)


@dataclass(frozen=True)
class QueuePolicy:
    """Triton's `default_queue_policy`, honoured by the runtime (a Python backend's own queue is
    its business): a bound on the queries waiting to run, and a per-query timeout.

    `max_queue_size` None derives a bound from bs_max and the stage times (about a second of work
    at the pipeline's peak); 0 is unbounded. `default_timeout_us` 0 is no timeout; a request's own
    timeout replaces it only with `allow_timeout_override`. A query still waiting at its deadline
    is answered "Request timeout expired" (`timeout_action` "reject") or left to run ("delay").
    """

    max_queue_size: int | None = None
    default_timeout_us: int = 0
    allow_timeout_override: bool = True
    timeout_action: str = "reject"  # "reject" | "delay"


@dataclass(frozen=True)
class SloPolicy:
    """A latency target (NeuStream-style admission): `slo_ms` None is none. A query that can no
    longer meet it is answered "overloaded" at once (`action` "reject") or served late ("serve_late")."""

    slo_ms: float | None = None
    action: str = "reject"  # "reject" | "serve_late"


@dataclass(frozen=True)
class RuntimeSettings:
    num_buffer_pairs: int = 2
    bs_max: int | None = None  # None: the manifest's max_batch_size
    threads_per_stage: int = 1
    record_trace: bool = False
    engine: str = "onnxruntime"  # "onnxruntime" | "torch"
    device: str = "cpu"  # "cpu" | "cuda"
    # the torch engine on CUDA replays CUDA graphs captured at load, per batch-size and length bucket
    # (runtime/torch_engine.py): eagerly, a stage is one Python call per node, which bounds a GPU
    cuda_graphs: bool = True
    # onnxruntime: "per_stage" threads, or one "global" pool for all stages. The served default is
    # "global" (the adapter's, and what the slicer writes); in-process the default stays "per_stage":
    # once a process has the global pool, onnxruntime refuses every session with threads of its own
    thread_pool: str = "per_stage"
    # the executor that finishes an item at stage k runs it at k+1 itself when k has nothing to run
    # and k+1's executor is idle (the two swap stages): no thread wake-up on a quiet pipeline
    run_on: bool = True
    # a batch that meets nobody (the pipeline empty) runs its stages in a row on the caller's thread
    # (runtime/fast_path.py), unless the policy may answer early (`Policy.allows_inline`)
    fast_path: bool = True
    queue: QueuePolicy = QueuePolicy()
    slo: SloPolicy = SloPolicy()


def default_buffer_pairs(device: str, thread_pool: str) -> int:
    """The buffer pairs a served model gets unless its config says otherwise.

    On the CPU with one pool of every core for all stages (`thread_pool` "global", the served
    default), a stage alone already runs on every core: two stages at once only split the cores
    between them, and contend for them, so overlapping batches buys nothing and costs latency.
    One pair runs the batches through the stages one at a time, each stage on every core, while
    later queries gather for the next batch (measured on MiniLM, 2 cores, perf_analyzer: lower
    latency at concurrency 1, at 0.5x and 0.9x load, and a higher closed-loop peak than 2 pairs).
    Stages with cores or a device stream of their own (`per_stage`, a GPU) overlap: 2 pairs."""
    return 1 if device == "cpu" and thread_pool == "global" else 2

