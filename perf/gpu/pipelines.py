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

from pathlib import Path
from typing import Any, Sequence

from dvabatch_backend.runtime.decisions import Policy
from dvabatch_backend.runtime.fences import cuda_fences, install_fences
from dvabatch_backend.runtime.manifest import Manifest
from dvabatch_backend.runtime.pipeline import Pipeline
from dvabatch_backend.runtime.scheduler import RuntimeSettings, Scheduler
from slicer import cut, toy


def sliced_token_mlp(out_dir: Path, hidden: int, layers: int, stages: int, bs_max: int,
                     max_length: int) -> tuple[Path, Manifest]:
    """toy.token_mlp(hidden, layers) cut into `stages` stages after evenly spread layers."""
    model = toy.token_mlp(hidden=hidden, layers=layers)
    layer_names = [f"h{k}" for k in range(1, layers)]
    positions = cut.cut_positions_after(model, cut.even_cuts(layer_names, stages))
    manifest = cut.cut_model(model, positions, out_dir, "token_mlp_gpu", bs_max, max_length)
    return out_dir, manifest


def torch_engines(model_dir: Path, manifest: Manifest, device: str) -> list[Any]:
    """One `TorchStageEngine` per stage (the other engineer's runtime/torch_engine.py)."""
    from dvabatch_backend.runtime.torch_engine import TorchStageEngine  # torch_engine API: (path, device, threads)

    return [TorchStageEngine(model_dir / s.file, device=device) for s in manifest.stages]


def stream_of(engine: Any) -> Any:
    """The CUDA stream an engine (or a wrapper of one) runs on; None for a host engine."""
    return getattr(engine, "stream", None)


def cuda_pipeline(manifest: Manifest, engines: Sequence[Any], policy: Policy, settings: RuntimeSettings) -> Pipeline:
    """A pipeline (not started) whose buffers carry `CudaEventFence`s on the engines' streams."""
    pipeline = Pipeline(Scheduler(manifest, policy, settings), engines)
    install_fences(pipeline, cuda_fences([stream_of(e) for e in engines]))
    return pipeline
