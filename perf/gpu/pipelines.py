"""Sliced toy models sized for a GPU, torch engines over their stages, and pipelines on CUDA streams.

    model_dir, manifest = sliced_token_mlp(tmp, hidden=512, layers=8, stages=4, bs_max=16, max_length=128)
    engines = torch_engines(model_dir, manifest, "cuda")          # TorchStageEngine per stage
    pipeline = cuda_pipeline(manifest, engines, create_policy("pipelined"), RuntimeSettings())

`cuda_pipeline` gives every buffer a `CudaEventFence` on the stages' streams (runtime/fences.py):
that is the fence plumbing the GPU runs exercise. The engine is the runtime's
`TorchStageEngine` (runtime/torch_engine.py: `TorchStageEngine(path, device, threads)`, `.stream`,
`.capture(batch_size, length)`); this module uses only those names.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping, Sequence

from dvabatch_backend.runtime.decisions import Policy
from dvabatch_backend.runtime.device_memory import place_on_streams
from dvabatch_backend.runtime.device_times import serving_device, time_engines, with_stage_times
from dvabatch_backend.runtime.fences import cuda_fences, install_fences
from dvabatch_backend.runtime.loading import make_engine, wait_at_entry
from dvabatch_backend.runtime.manifest import Manifest
from dvabatch_backend.runtime.pipeline import Pipeline
from dvabatch_backend.runtime.scheduler import Scheduler
from dvabatch_backend.runtime.settings import SIMULATED, RuntimeSettings
from slicer import cut, toy
from slicer.profiler import int_bounds, random_input

# the tensors that end each layer of the GPU zoo models (the cuts are spread evenly over them: a cut
# by count, these models' layers are alike in cost)
ZOO_LAYERS = {"bert": re.compile(r"layer\d+_out"), "resnet152": re.compile(r"block\d+")}


def sliced_token_mlp(out_dir: Path, hidden: int, layers: int, stages: int, bs_max: int,
                     max_length: int) -> tuple[Path, Manifest]:
    """toy.token_mlp(hidden, layers) cut into `stages` stages after evenly spread layers."""
    model = toy.token_mlp(hidden=hidden, layers=layers)
    layer_names = [f"h{k}" for k in range(1, layers)]
    positions = cut.cut_positions_after(model, cut.even_cuts(layer_names, stages))
    manifest = cut.cut_model(model, positions, out_dir, "token_mlp_gpu", bs_max, max_length)
    return out_dir, manifest


DEVICES = ("cuda", "cpu", SIMULATED)  # the torch engine on CUDA or the CPU, or the GPU stand-in


def engine_settings(device: str, cuda_graphs: bool = False, bs_max: int | None = None,
                    device_profile: str | None = None) -> RuntimeSettings:
    """The runtime's engine settings for `device`: the torch engine on "cuda" or "cpu" (CUDA graphs
    only on CUDA), or the GPU stand-in ("simulated", charged from `device_profile`), which stands
    for the torch engine replaying graphs."""
    if device == SIMULATED:
        return RuntimeSettings(engine=SIMULATED, device_profile=device_profile, bs_max=bs_max)
    return RuntimeSettings(engine="torch", device=device, cuda_graphs=cuda_graphs and device == "cuda", bs_max=bs_max)


def torch_engines(model_dir: Path, manifest: Manifest, device: str, cuda_graphs: bool = False,
                  bs_max: int | None = None, device_profile: str | None = None) -> list[Any]:
    """One engine per stage, loaded as the runtime loads them (`loading.make_engine`): a
    `TorchStageEngine` (with `cuda_graphs` on CUDA, each captures its graphs per batch-size and
    length bucket), or on device "simulated" the GPU stand-in's."""
    settings = engine_settings(device, cuda_graphs, bs_max, device_profile)
    return [make_engine(model_dir / s.file, settings, manifest) for s in manifest.stages]


def stream_of(engine: Any) -> Any:
    """The CUDA stream an engine (or a wrapper of one) runs on; None for a host engine."""
    return getattr(engine, "stream", None)


def cuda_pipeline(manifest: Manifest, engines: Sequence[Any], policy: Policy, settings: RuntimeSettings,
                  whole_model: Any = None) -> Pipeline:
    """A pipeline (not started) whose buffers carry `CudaEventFence`s on the engines' streams, its
    middle boundaries in device memory (`settings.device_buffers`, as `loading.load_pipeline`
    serves, the first stage waiting for the device: `loading.wait_at_entry`) or in host memory
    (each stage copying in and out). `whole_model`: the unsliced model's engine, which then runs
    the fast path (as served where the manifest's `fast_path_engine` is "model")."""
    pipeline = Pipeline(Scheduler(manifest, policy, settings), engines, whole_model)
    streams = [stream_of(e) for e in engines]
    if settings.device_buffers:
        place_on_streams(pipeline, streams)
        wait_at_entry(pipeline, engines, settings)
    else:
        install_fences(pipeline, cuda_fences(streams))
    return pipeline


def build_zoo_model(name: str, size: str = "gpu") -> Any:
    """At size "gpu", the models of the paper's GPU experiments: BERT-base (12 layers, hidden 768)
    or ResNet-152 at ImageNet's size (224x224, width 64, 1000 classes); else the zoo's size."""
    from slicer import zoo

    if name not in ZOO_LAYERS:
        raise ValueError(f"no GPU zoo model {name!r}; there are {sorted(ZOO_LAYERS)}")
    return zoo.build(name, "full" if size == "gpu" else size)


def layer_outputs(model: Any, pattern: re.Pattern[str]) -> list[str]:
    """The node outputs whose names match `pattern`, in graph order."""
    return [out for node in model.graph.node for out in node.output if pattern.fullmatch(out)]


def sliced_zoo_model(name: str, out_dir: Path, stages: int, bs_max: int, max_length: int,
                     size: str = "gpu") -> tuple[Path, Manifest, dict[str, int]]:
    """A zoo model cut into `stages` stages evenly over its layers; also its integer inputs' bounds."""
    model = build_zoo_model(name, size)
    positions = cut.cut_positions_after(model, cut.even_cuts(layer_outputs(model, ZOO_LAYERS[name]), stages))
    manifest = cut.cut_model(model, positions, out_dir, f"{name}_gpu", bs_max, max_length)
    return out_dir, manifest, int_bounds(model)


def profile_on_device(model_dir: Path, manifest: Manifest, engines: Sequence[Any], batch_sizes: Sequence[int],
                      lengths: Sequence[int], int_high: Mapping[str, int], repeats: int = 3) -> Manifest:
    """Each stage engine timed where it serves (its `run`: inputs in, compute, outputs out) at every
    batch size and length (`device_times.time_engines`, on random queries); the times go into the
    manifest as the slicer's `stage_times` (at the longest length) and `stage_times_by_length`,
    recorded as measured on the engines' device, so the policies plan with the device's costs.
    Rewrites model_dir/manifest.json and returns that manifest."""
    by_length = time_engines(manifest.stages, engines, batch_sizes, lengths, random_input(int_high), repeats)
    manifest = with_stage_times(manifest, by_length, serving_device(engines) or "cpu")
    doc = manifest.to_json()
    doc["input_bounds"] = {k: v for k, v in int_high.items() if k in {t.name for t in manifest.inputs}}
    manifest = Manifest.from_json(doc)
    manifest.dump(model_dir / "manifest.json")
    return manifest
