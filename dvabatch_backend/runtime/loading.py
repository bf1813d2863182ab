"""Loading a sliced model folder: its manifest, one onnxruntime engine per stage, the pipeline."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

from .decisions import Policy
from .device_times import on_serving_device
from .engine import IN_RUN, ON, PER_STAGE, OrtStageEngine, StageEngine, available_cores
from .manifest import Manifest
from .pipeline import Pipeline
from .settings import ENGINES, SIMULATED, RuntimeSettings, graph_buckets


def find_version_dir(model_dir: str | Path, manifest_file: str = "manifest.json") -> Path:
    """`model_dir` holds the manifest, or is a Triton model folder whose version folder `1/` does."""
    model_dir = Path(model_dir)
    if not (model_dir / manifest_file).exists() and (model_dir / "1" / manifest_file).exists():
        return model_dir / "1"
    return model_dir


EngineWrapper = Callable[[int, StageEngine], StageEngine]

# onnxruntime's threads, unless `RuntimeSettings.spinning` says otherwise (runtime/engine.py): the
# unsliced model runs the batches that no other could overlap (the one-stage route, most often a
# lone query), and spins as onnxruntime does by default, as a user's own model would (a light load's next query
# finds its threads awake, where each stage's threads would be asleep by then); the stages spin
# only within a run, so that one stage's threads never spin through the next stage's run. A
# one-stage model's only stage spins within a run too, though it runs every lone query: it also
# runs every batch under load, where threads spinning between runs take the cores the server's
# request handling needs
MODEL_SPINNING, STAGE_SPINNING = ON, IN_RUN


def make_engine(path: Path, settings: RuntimeSettings, manifest: Manifest | None = None,
                spinning: str = STAGE_SPINNING) -> StageEngine:
    """An engine over one ONNX file (a stage, or the unsliced model), of the kind `settings` names;
    onnxruntime's threads spin as `settings.spinning` says, else as `spinning` does.
    A torch engine on CUDA, given the `manifest`, captures its CUDA graphs at load
    (`settings.cuda_graphs`): one per batch-size and length bucket, so a batch's kernels are one
    replay instead of one Python call per node."""
    threads = settings.threads_per_stage or available_cores()  # EVERY_CORE (0): every available core
    if settings.engine not in ENGINES:
        raise ValueError(f"engine {settings.engine!r} is not one this runtime knows: {', '.join(ENGINES)}")
    if settings.engine == SIMULATED:  # a GPU stand-in, for measuring (runtime/simulated.py)
        from .simulated import simulated_engine

        if manifest is None:
            raise ValueError("engine 'simulated' needs the model's manifest (its stages and graph buckets)")
        return simulated_engine(path, settings.device_profile, manifest, engine_buckets(settings, manifest),
                                manifest.pad_safe and reads_model_inputs(path, manifest))
    if settings.engine == "torch":  # imported only here: the runtime runs without torch
        from .torch_engine import TorchStageEngine

        engine = TorchStageEngine(path, settings.device, threads)
        if settings.device == "cuda" and settings.cuda_graphs and manifest is not None:
            sizes, lengths = engine_buckets(settings, manifest)
            # zero-padding the length is safe only on the model's own inputs (a mask of zeros hides
            # it); a later stage's (an additive mask) is not: the scheduler pads a batch to a bucket
            # before stage 0 instead (`graph_length`), so that later stages meet their lengths exactly
            engine.capture_buckets(sizes, lengths, pad_length=manifest.pad_safe and reads_model_inputs(path, manifest))
        return engine
    # per_stage: `threads` each; global: one pool of every available core (0)
    return OrtStageEngine(path, threads if settings.thread_pool == PER_STAGE else 0, thread_pool=settings.thread_pool,
                          spinning=settings.spinning or spinning)


def engine_buckets(settings: RuntimeSettings, manifest: Manifest) -> tuple[list[int], list[int]]:
    """The (batch sizes, lengths) a model's engines capture CUDA graphs at (`graph_buckets`): the
    same for the stages, the unsliced model and the baselines beside them."""
    return graph_buckets(settings.bs_max or manifest.max_batch_size, manifest.max_length, manifest.has_seq)


def reads_model_inputs(path: Path, manifest: Manifest) -> bool:
    """Whether the ONNX file at `path` takes the model's own inputs: the first stage, or the whole model."""
    return path.name in (manifest.stages[0].file, manifest.full_model)


def make_engines(version_dir: Path, manifest: Manifest, settings: RuntimeSettings) -> list[StageEngine]:
    """One engine per stage, of the kind `settings` names."""
    return [make_engine(version_dir / s.file, settings, manifest) for s in manifest.stages]


def load_pipeline(model_dir: str | Path, policy: Policy, settings: RuntimeSettings = RuntimeSettings(),
                  manifest_file: str = "manifest.json", wrap: EngineWrapper | None = None) -> Pipeline:
    """A pipeline (not started) over a sliced model folder, one engine per stage; `wrap(stage,
    engine)`, when given, replaces each engine (instrumentation, fault injection).

    The unsliced model, where the slicer found it faster than the stages in a row
    (`Manifest.fast_path_engine`), is loaded for the one-stage route; not with `wrap`, so that what
    the wrapper injects or records covers every query."""
    version_dir = find_version_dir(model_dir, manifest_file)
    manifest = Manifest.load(version_dir / manifest_file)
    engines = make_engines(version_dir, manifest, settings)
    # policies and admission plan with the serving device's stage times (runtime/device_times.py)
    manifest = on_serving_device(version_dir, manifest, engines, engine_buckets(settings, manifest))
    if wrap is not None:
        engines = [wrap(stage, engine) for stage, engine in enumerate(engines)]
    whole = None
    if (wrap is None and settings.fast_path and manifest.fast_path_engine == "model" and manifest.num_stages > 1
            and type(policy).allows_inline()):
        whole = make_engine(version_dir / str(manifest.full_model), settings, manifest, MODEL_SPINNING)
    pipeline = Pipeline.create(manifest, engines, policy, settings, whole_model=whole)
    streams = [getattr(e, "stream", None) for e in engines]  # a torch engine on CUDA runs on its own stream
    if settings.device_buffers and any(s is not None for s in streams):
        from .device_memory import place_on_streams  # imports torch: only where a stage has a stream

        place_on_streams(pipeline, streams)
        wait_at_entry(pipeline, engines, settings)
    return pipeline


def wait_at_entry(pipeline: Pipeline, engines: Sequence[StageEngine], settings: RuntimeSettings) -> bool:
    """With `settings.entry_waits_for_device`, have the executor that runs a batch at stage 0 wait
    for it to finish on the device (`wait_for_device` of the first stage's engine, where it has one)
    before it takes more work, so that the queries arriving meanwhile join the batch that waits for
    stage 0 (`RuntimeSettings.entry_waits_for_device`); whether it will. For pipelines whose
    boundaries are in device memory: with host memory every stage waits for its copy out anyway."""
    wait = getattr(engines[0], "wait_for_device", None) if engines else None
    if not settings.entry_waits_for_device or wait is None:
        return False
    pipeline.wait_at_entry(wait)
    return True


# the name earlier releases used; it returns a Pipeline (which has the old Scheduler's methods)
load_scheduler = load_pipeline
