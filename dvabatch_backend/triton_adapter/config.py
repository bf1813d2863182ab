"""The dvabatch model's `config.pbtxt` parameters, each declared once: its parser, its default (or the
rule that derives it) and its meaning (`PARAMETERS`), and `parse_parameters`, which resolves a
config into the adapter's settings. The docs' configuration page is generated from this table
(`dvabatch_backend/tools/config_reference.py`), so a parameter added here is documented there.

No Triton import: the settings are read and checked outside a server too (tests, the docs).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from ..runtime.admission import QUEUE_BATCHES
from ..runtime.engine import SPINNING
from ..runtime.settings import (ENGINES, EVERY_CORE, SIMULATED, QueuePolicy, RuntimeSettings, SloPolicy,
                                default_buffer_pairs, runs_on_device)
from . import parameters


@dataclass(frozen=True)
class AdapterSettings:
    manifest: Path
    policy: str
    policy_params: dict[str, str]
    runtime: RuntimeSettings
    engine_wrapper: str | None = None  # "file.py:name" or "module:name": wraps each stage's engine
    hand_off_calls: bool = False  # execute may hand calls to the engine loop (`Pipeline.hands_over`)


@dataclass(frozen=True)
class Parameter:
    """One config.pbtxt parameter: how it is parsed, its default in words, what it means, and where
    its resolved value lands in the settings (`value`)."""

    parse: parameters.Parser
    default: str
    meaning: str
    value: Callable[[AdapterSettings], Any]
    group: str = "runtime"


def _runtime(name: str) -> Callable[[AdapterSettings], Any]:
    return lambda settings: getattr(settings.runtime, name)


def _queue(name: str) -> Callable[[AdapterSettings], Any]:
    return lambda settings: getattr(settings.runtime.queue, name)


# Triton's default_queue_policy, under the names its config uses, and the latency target
_QUEUE = "queue and overload"
_DEVICE = "GPU"

PARAMETERS: dict[str, Parameter] = {
    "policy": Parameter(
        parameters.text, "`pipelined`; the slicer writes its choice",
        "The batching policy: `pipelined`, `input` (I), `operator` (II), `load` (III), `hybrid` (II+III), "
        "`random`, `auto` (picked from the model's diversity, `policies/auto.py`), or your own class as "
        "`file.py:Class` (in the version folder) or `module:Class`. Its own parameters are `policy.NAME`.",
        lambda s: s.policy, "model"),
    "manifest": Parameter(
        parameters.text, "`manifest.json`", "The manifest the slicer wrote, in the version folder.",
        lambda s: s.manifest.name, "model"),
    "bs_max": Parameter(
        parameters.integer(1), "the manifest's `max_batch_size`", "The largest batch the runtime forms.",
        _runtime("bs_max"), "model"),
    "engine_wrapper": Parameter(
        parameters.text, "none",
        "`file.py:name` (in the version folder) or `module:name`: `name(stage, engine)` wraps each stage's "
        "engine, for instrumentation or fault injection.",
        lambda s: s.engine_wrapper, "model"),
    "num_buffer_pairs": Parameter(
        parameters.integer(1), "1 where each stage runs on every core (the served default) or on a device; else 2",
        "Buffer pairs between stages. One runs each batch through the stages in a row while the next "
        "gathers; two let stages overlap, which pays only where each stage has cores of its own "
        "(`default_buffer_pairs` says why).",
        _runtime("num_buffer_pairs")),
    "thread_pool": Parameter(
        parameters.choice("global", "per_stage"), "`per_stage`",
        "onnxruntime: an intra-op pool per stage, or `global`, one pool shared by every stage. The global "
        "pool spin-waits after each run and cannot be told not to, taking cores from the server.",
        _runtime("thread_pool")),
    "threads_per_stage": Parameter(
        parameters.integer(0), "0: every available core",
        "With `per_stage` pools: onnxruntime (or torch) threads per stage; 0 runs each stage on every core.",
        _runtime("threads_per_stage")),
    "spinning": Parameter(
        parameters.choice(*SPINNING), "the unsliced model `on`, the stages `in_run`",
        "onnxruntime's threads spin-wait for work: `on` (before, within and after a run), `in_run` (within "
        "a run only), `off`. Set, it applies to every session.",
        _runtime("spinning")),
    "fast_path": Parameter(
        parameters.boolean, "`true`",
        "While the engine loop is idle, an `execute` call runs the loop's steps that answer its requests on "
        "its own thread, and a batch that meets nobody may run the unsliced model; `false` leaves every "
        "step to the loop's thread and every batch to the stages.",
        _runtime("fast_path")),
    "engine": Parameter(
        parameters.choice(*ENGINES), "`onnxruntime`",
        "`onnxruntime`; `torch` runs each stage as a torch module (on CUDA with `device: cuda`); "
        "`simulated` is the GPU stand-in, timed by a `device_profile`.",
        _runtime("engine"), _DEVICE),
    "device": Parameter(
        parameters.choice("cpu", "cuda"), "`cpu`", "Where the torch engine runs.", _runtime("device"), _DEVICE),
    "device_profile": Parameter(
        parameters.text, "none",
        "The stand-in's device profile: a file in the version folder or an absolute path "
        "(`python -m perf.gpu.device_profile` writes one on a GPU host).",
        _runtime("device_profile"), _DEVICE),
    "cuda_graphs": Parameter(
        parameters.boolean, "`true`",
        "The torch engine on CUDA captures a CUDA graph per batch-size and length bucket at load and "
        "replays it: eagerly a stage is one Python call per node.",
        _runtime("cuda_graphs"), _DEVICE),
    "device_buffers": Parameter(
        parameters.boolean, "`true`",
        "Stages on CUDA streams keep the boundaries between them in device memory, ordered by CUDA events; "
        "`false` copies each boundary through host memory.",
        _runtime("device_buffers"), _DEVICE),
    "entry_waits_for_device": Parameter(
        parameters.boolean, "`true`",
        "With device buffers, stage 0's executor waits for its batch to finish on the device before it "
        "takes another, so arrivals meanwhile join the next batch instead of each starting one.",
        _runtime("entry_waits_for_device"), _DEVICE),
    "hand_off_calls": Parameter(
        parameters.boolean, "`true` where the model runs on a device (torch on CUDA, or the stand-in); else `false`",
        "`execute` hands a call to the engine loop and returns, so Triton's next call is read while the "
        "device runs, where work is in flight or the call's requests met each other and their batch runs "
        "longer than a hand-over costs (measured); a lone request at an idle loop runs on `execute`'s thread.",
        lambda s: s.hand_off_calls, _DEVICE),
    "max_queue_size": Parameter(
        parameters.integer(0), "Triton's `default_queue_policy`, else a bound in seconds derived from "
        f"the model's measured service: the time {QUEUE_BATCHES} bs_max batches at the longest length take to enter the "
        "pipeline (each request's rows reckoned at their length)",
        "The bound on queries admitted and not yet taken by stage 0, in rows; a request that would take the "
        "queue past it is refused at arrival, `UNAVAILABLE` (HTTP 503) \"Exceeds maximum queue size\", as "
        "Triton refuses. 0 is unbounded.",
        _queue("max_queue_size"), _QUEUE),
    "default_timeout_microseconds": Parameter(
        parameters.integer(0), "Triton's `default_queue_policy`, else 0 (none)",
        "A query still queued at its deadline is answered `UNAVAILABLE` \"Request timeout expired\" and never "
        "runs; one the queue ahead would keep past it is answered so at arrival.",
        _queue("default_timeout_us"), _QUEUE),
    "allow_timeout_override": Parameter(
        parameters.boolean, "Triton's `default_queue_policy`, else `true`",
        "A request's own timeout (tritonclient's `timeout=`, in microseconds) replaces the default.",
        _queue("allow_timeout_override"), _QUEUE),
    "timeout_action": Parameter(
        parameters.choice("reject", "delay"), "Triton's `default_queue_policy`, else `reject`",
        "At a query's deadline: `reject` answers it, `delay` runs it anyway.",
        _queue("timeout_action"), _QUEUE),
    "slo_ms": Parameter(
        parameters.positive_float, "none",
        "A latency target in milliseconds, split into per-stage budgets from the profile: a query that can "
        "no longer meet it is answered `UNAVAILABLE` \"overloaded: cannot meet N ms\" at arrival or before stage 0.",
        lambda s: s.runtime.slo.slo_ms, _QUEUE),
    "slo_action": Parameter(
        parameters.choice("reject", "serve_late"), "`reject`",
        "For a query past its latency target: `reject`, or `serve_late` (it does not count as goodput).",
        lambda s: s.runtime.slo.action, _QUEUE),
}

# the stub process is ours alone: each stage in turn on a pool of every core of its own
SERVED_THREAD_POOL, SERVED_THREADS_PER_STAGE = "per_stage", EVERY_CORE

# Why the served defaults differ from `RuntimeSettings()`'s, stated once (the docs' configuration page
# prints it beside the fields that differ).
SERVED_DEFAULTS_WHY = (
    "`RuntimeSettings()` is the runtime as a library: one thread per stage and two buffer pairs, so that "
    "stages overlap and a test or an embedding process keeps its other cores. A served model owns its "
    "stub process, so the adapter runs each stage on every core, one stage at a time: with every core "
    "per stage, a second buffer pair would only split the cores between two stages "
    "(`default_buffer_pairs`).")

# parameters earlier releases read, and why they went: a config that still sets one fails to load saying so
REMOVED_PARAMETERS = {
    "run_on": "the engine loop runs a quiet pipeline's stages on one thread itself",
    "lone_calls": "on a device, a lone request at an idle engine loop runs on execute's thread by rule (docs/gpu.md)",
}

# parameters Triton's Python backend reads itself (the GPU config sets the first)
TRITON_PARAMETERS = frozenset({"FORCE_CPU_ONLY_INPUT_TENSORS", "EXECUTION_ENV_PATH"})
POLICY_PREFIX = "policy."


def parse_parameters(params: Mapping[str, str], model_dir: Path,
                     queue_defaults: QueuePolicy | None = None, check_files: bool = True) -> AdapterSettings:
    """Read and check the config.pbtxt parameters; a ValueError names the bad one. `queue_defaults`:
    the queue policy where no parameter sets one (`parameters.triton_queue_policy`). `check_files`
    False skips the checks that the manifest and device profile exist (the docs' generator)."""
    removed = [f"{name!r} ({REMOVED_PARAMETERS[name]})" for name in params if name in REMOVED_PARAMETERS]
    if removed:
        raise ValueError(f"parameter(s) no longer read; remove them from config.pbtxt: {', '.join(removed)}")
    parsers = {name: parameter.parse for name, parameter in PARAMETERS.items()}
    values = parameters.read(params, parsers, also=TRITON_PARAMETERS, prefixes=(POLICY_PREFIX,))
    manifest = model_dir / values.get("manifest", "manifest.json")
    if check_files and not manifest.is_file():
        raise ValueError(f"parameter 'manifest': {manifest} not found")
    defaults = RuntimeSettings()
    queue_defaults = queue_defaults or defaults.queue
    device = values.get("device", defaults.device)
    engine = values.get("engine", defaults.engine)
    thread_pool = values.get("thread_pool", SERVED_THREAD_POOL)
    threads = values.get("threads_per_stage", SERVED_THREADS_PER_STAGE)
    profile = values.get("device_profile")
    if profile is not None:  # relative to the version folder, or absolute
        profile = str(model_dir / profile)
        if check_files and not Path(profile).is_file():
            raise ValueError(f"parameter 'device_profile': {profile} not found")
    # the GPU stand-in's stages run on (simulated) streams of their own, as a GPU's do
    pairs_device = "cuda" if engine == SIMULATED else device
    runtime = RuntimeSettings(
        num_buffer_pairs=values.get("num_buffer_pairs", default_buffer_pairs(pairs_device, thread_pool, threads)),
        bs_max=values.get("bs_max"),
        threads_per_stage=threads,
        engine=engine,
        device=device,
        device_profile=profile,
        thread_pool=thread_pool,
        spinning=values.get("spinning", defaults.spinning),
        fast_path=values.get("fast_path", defaults.fast_path),
        cuda_graphs=values.get("cuda_graphs", defaults.cuda_graphs),
        device_buffers=values.get("device_buffers", defaults.device_buffers),
        entry_waits_for_device=values.get("entry_waits_for_device", defaults.entry_waits_for_device),
        queue=QueuePolicy(
            max_queue_size=values.get("max_queue_size", queue_defaults.max_queue_size),
            default_timeout_us=values.get("default_timeout_microseconds", queue_defaults.default_timeout_us),
            allow_timeout_override=values.get("allow_timeout_override", queue_defaults.allow_timeout_override),
            timeout_action=values.get("timeout_action", queue_defaults.timeout_action),
        ),
        slo=SloPolicy(slo_ms=values.get("slo_ms"), action=values.get("slo_action", defaults.slo.action)),
    )
    policy_params = {k[len(POLICY_PREFIX):]: v for k, v in params.items() if k.startswith(POLICY_PREFIX)}
    return AdapterSettings(manifest, values.get("policy", "pipelined"), policy_params, runtime,
                           values.get("engine_wrapper"), values.get("hand_off_calls", runs_on_device(runtime)))
