"""Turn a sliced model's config.pbtxt (the slicer writes one CPU instance, onnxruntime) into the GPU one.

    python docker/gpu_config.py MODEL_DIR/config.pbtxt [--gpus 1]

- `instance_group` KIND_GPU: one instance per GPU listed (Triton sets the device the instance
  runs on; the torch engine uses CUDA's current device);
- `engine: torch`, `device: cuda`: each stage a `TorchStageEngine` on its own CUDA stream;
- `FORCE_CPU_ONLY_INPUT_TENSORS: yes`: the Python backend hands requests' tensors over in host
  memory, which the runtime's buffers are (the engine copies each batch to the GPU once);
- `num_buffer_pairs: 2`: stages on their own streams overlap (the slicer writes 1 for the CPU,
  where each stage in turn runs on every core);
- `threads_per_stage: 1`: a stage's work is the GPU's; torch's CPU threads (one process-wide
  setting) stay at one, not every core as on the CPU.

Parameters already set are replaced, the others kept. Used by docker/Dockerfile at image build.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from slicer import model_config

GPU_PARAMETERS = {"engine": "torch", "device": "cuda", "FORCE_CPU_ONLY_INPUT_TENSORS": "yes", "num_buffer_pairs": "2",
                  "threads_per_stage": "1"}


def gpu_config(text: str, gpus: int = 1) -> str:
    """`text` (a config.pbtxt) with a GPU instance group and the GPU parameters."""
    config = model_config.parse(text)
    if not config.instance_group:
        raise ValueError("config.pbtxt has no instance_group to replace")
    del config.instance_group[:]
    config.instance_group.add(kind=model_config.pb.ModelInstanceGroup.KIND_GPU, count=1, gpus=range(gpus))
    return model_config.dump(model_config.set_parameters(config, GPU_PARAMETERS))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--gpus", type=int, default=1, help="GPUs of the node (one instance on each)")
    args = parser.parse_args(argv)
    args.config.write_text(gpu_config(args.config.read_text(), args.gpus))
    print(f"{args.config}: KIND_GPU, " + ", ".join(f"{k}={v}" for k, v in GPU_PARAMETERS.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
