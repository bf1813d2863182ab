"""A sliced model's config.pbtxt for serving on GPUs (the slicer writes one CPU instance, onnxruntime):

- `instance_group` KIND_GPU: one instance per GPU listed (Triton sets the device the instance
  runs on; the torch engine uses CUDA's current device);
- `engine: torch`, `device: cuda`: each stage a `TorchStageEngine` on its own CUDA stream;
- `FORCE_CPU_ONLY_INPUT_TENSORS: yes`: the Python backend hands requests' tensors over in host
  memory, which the runtime's buffers are (the engine copies each batch to the GPU once);
- `num_buffer_pairs`: the count the manifest records as chosen on the device
  (`slicing.buffer_pairs`, where the stages were profiled there), else the CPU's count the slicer
  wrote (1: each stage in turn on every core) is dropped, and the adapter's GPU default applies
  (`default_buffer_pairs`: 1, the stages share the device: a batch at a time grows with the load);
- `threads_per_stage: 1`: a stage's work is the GPU's; torch's CPU threads (one process-wide
  setting) stay at one, not every core as on the CPU.

Parameters already set are replaced, the others kept. `dvabatch slice --device cuda` writes it;
docker/gpu_config.py applies it to every model at the Docker image's build.
"""
from __future__ import annotations

from typing import Any, Mapping

from . import model_config

GPU_PARAMETERS = {"engine": "torch", "device": "cuda", "FORCE_CPU_ONLY_INPUT_TENSORS": "yes", "threads_per_stage": "1"}


def device_buffer_pairs(manifest: Mapping[str, Any] | None) -> int | None:
    """The buffer pairs the slicer chose on the device (the manifest's `slicing.buffer_pairs`), if it did."""
    chosen = ((manifest or {}).get("slicing") or {}).get("buffer_pairs")
    return int(chosen["chosen"]) if isinstance(chosen, dict) and "chosen" in chosen else None


def gpu_config(text: str, gpus: int = 1, manifest: Mapping[str, Any] | None = None) -> str:
    """`text` (a config.pbtxt) with a GPU instance group and the GPU parameters; the buffer pairs
    the `manifest` (its JSON) records as chosen on the device, else the adapter's GPU default."""
    config = model_config.parse(text)
    if not config.instance_group:
        raise ValueError("config.pbtxt has no instance_group to replace")
    del config.instance_group[:]
    config.instance_group.add(kind=model_config.pb.ModelInstanceGroup.KIND_GPU, count=1, gpus=range(gpus))
    pairs = device_buffer_pairs(manifest)
    if pairs is None:
        config.parameters.pop("num_buffer_pairs", None)  # the CPU's choice: the adapter's GPU default instead
    return model_config.dump(model_config.set_parameters(config, {**GPU_PARAMETERS, **(
        {"num_buffer_pairs": pairs} if pairs is not None else {})}))
