"""The runtime's settings: plain data, read from config.pbtxt parameters by the adapter."""
from __future__ import annotations

from dataclasses import dataclass

SIMULATED = "simulated"  # the GPU stand-in engine kind (runtime/simulated.py)
MIN_WAKE_DELAY = 1e-4  # seconds: the earliest a wake-up asked for "now or before" comes (never at once, forever)


@dataclass(frozen=True)
class QueuePolicy:
    """Triton's `default_queue_policy`, honoured by the runtime (a Python backend's own queue is
    its business): a bound on the queries waiting to run, and a per-query timeout.

    With neither a bound nor a timeout set, the runtime derives its bound, in seconds of the stages'
    measured service (`admission.QUEUE_BATCHES`); `max_queue_size` 0 is unbounded.
    `default_timeout_us` 0 is no timeout; a request's own timeout replaces it only with
    `allow_timeout_override`. A query still waiting at its deadline is answered "Request timeout
    expired" (`timeout_action` "reject") or left to run ("delay").
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
    """How the runtime runs a sliced model. These defaults are the library's (two buffer pairs, one
    thread per stage: stages overlap and the host keeps its other cores); a served model resolves its
    own from config.pbtxt (`triton_adapter/config.py`, `SERVED_DEFAULTS_WHY` says why they differ),
    and docs/configuration.md lists both."""

    num_buffer_pairs: int = 2
    bs_max: int | None = None  # None: the manifest's max_batch_size
    threads_per_stage: int = 1  # EVERY_CORE (0): each stage on every available core
    record_trace: bool = False
    engine: str = "onnxruntime"  # ENGINES: "onnxruntime" | "torch" | "simulated" (a GPU stand-in, runtime/simulated.py)
    device: str = "cpu"  # "cpu" | "cuda"
    # the simulated engine's device profile (a JSON file of stage times and device parameters)
    device_profile: str | None = None
    # the torch engine on CUDA replays CUDA graphs captured at load, per batch-size and length bucket
    # (runtime/torch_engine.py): eagerly, a stage is one Python call per node, which bounds a GPU
    cuda_graphs: bool = True
    # stages on CUDA streams keep the boundaries between them in device memory, ordered by CUDA
    # events (runtime/device_memory.py): no host round trip per stage; false: host memory, each
    # stage copying its batch in and out and waiting for it
    device_buffers: bool = True
    # with device buffers the first stage's engine waits for its batch to finish on the device before
    # its executor takes the next one: otherwise `run` returns once the work is queued, stage 0 looks
    # free at once, and each arrival starts a batch of its own queued behind the others on the GPU
    # (batches of a row or two, where a graph replay costs about the same for a few rows as for
    # one); waiting, the queries that arrive meanwhile join the batch that waits for stage 0 (the
    # load policy's stretch), as they do on a CPU. Later stages still queue their work ahead
    entry_waits_for_device: bool = True
    # onnxruntime: "per_stage" threads, or one "global" pool for all stages. The served default (the
    # adapter's, and what the slicer writes) is "per_stage" with EVERY_CORE threads and one buffer
    # pair (`default_buffer_pairs`): each stage in turn on a pool of every core of its own, which
    # sleeps between runs; the global pool spin-waits after each run (its spin setting cannot be
    # set), which on a few cores takes them from the server and the clients and lengthens the tail
    thread_pool: str = "per_stage"
    # onnxruntime's threads spin-wait for work "in_run" (within a run, stopping when it returns),
    # "off" or "on" (onnxruntime's default, after runs too); None: the unsliced model's "on", the
    # stages' "in_run" (`loading.MODEL_SPINNING`, runtime/engine.py says why)
    spinning: str | None = None
    # while the engine loop is idle, a caller runs the steps that answer its requests on its own
    # thread (`EngineLoop.serve_here`), and a batch that meets nobody may run the unsliced model
    # (`Scheduler.serve_whole_model`), unless the policy may answer early (`Policy.allows_inline`)
    fast_path: bool = True
    queue: QueuePolicy = QueuePolicy()
    slo: SloPolicy = SloPolicy()


ENGINES = ("onnxruntime", "torch", SIMULATED)

EVERY_CORE = 0  # threads_per_stage: each stage on every available core (the served default)


def stages_share_cores(thread_pool: str, threads_per_stage: int) -> bool:
    """Whether each stage runs on every core: the global pool, or per-stage pools of EVERY_CORE."""
    return thread_pool == "global" or threads_per_stage == EVERY_CORE


def default_buffer_pairs(device: str, thread_pool: str, threads_per_stage: int = EVERY_CORE) -> int:
    """The buffer pairs a served model gets unless its config says otherwise.

    On the CPU where each stage runs on every core (`stages_share_cores`: the served default), a
    stage alone already uses the machine: two stages at once only split the cores between them,
    and contend for them, so overlapping batches buys nothing and costs latency. One pair runs the
    batches through the stages one at a time, each stage on every core, while later queries gather
    for the next batch. Stages with cores of their own (per-stage threads of a few cores each)
    overlap: 2 pairs.

    On a GPU the stages' streams share one device, which runs one stage's graph at a time until
    two streams at once are measured (runtime/simulated.py): a second pair overlaps only the host
    with the device, and it lets stage 0 start a new batch of a query or two behind the later
    stages' work, so batches never grow and each pays every stage's fixed cost. One pair runs what
    queued as one batch, stages in a row, as Triton's batcher runs the unsliced model
    (docs/gpu.md)."""
    return 1 if device != "cpu" or stages_share_cores(thread_pool, threads_per_stage) else 2


def runs_on_device(settings: RuntimeSettings) -> bool:
    """Whether the model's work runs on a device beside the host (a GPU, or its stand-in), where a
    batch leaves the host free while it runs (the adapter's `hand_off_calls` default)."""
    return settings.engine == SIMULATED or (settings.engine == "torch" and settings.device == "cuda")


def replays_graphs(settings: RuntimeSettings) -> bool:
    """Whether the stages replay CUDA graphs captured per batch-size and length bucket (the
    simulated engine stands for such stages, and is charged at their buckets)."""
    return (settings.engine == "torch" and settings.device == "cuda" and settings.cuda_graphs
            or settings.engine == SIMULATED)


def graph_buckets(bs_max: int, max_length: int, has_seq: bool) -> tuple[list[int], list[int]]:
    """The (batch sizes, lengths) a stage's CUDA graphs are captured at: powers of two up to
    bs_max and bs_max itself; lengths the same from 16 up to max_length ([0] without a length)."""
    sizes = sorted({*(1 << k for k in range(bs_max.bit_length()) if 1 << k < bs_max), bs_max})
    return sizes, _length_buckets(max_length) if has_seq else [0]


def _length_buckets(max_length: int) -> list[int]:
    return sorted({*(1 << k for k in range(4, max_length.bit_length()) if 1 << k < max_length), max_length})


def graph_length(length: int, max_length: int) -> int:
    """The smallest length bucket (`graph_buckets`) that holds `length`: what a batch is padded to
    where the stages replay graphs, so that every stage's inputs have a bucket's length exactly.
    Only the model's own inputs can be zero-padded safely (a mask of zeros hides the padding); a
    later stage's inputs cannot (an additive mask of zeros attends to the padding), so the runtime
    pads the batch before stage 0 and every boundary after it has the bucket's length."""
    return next(n for n in _length_buckets(max_length) if n >= min(length, max_length))
