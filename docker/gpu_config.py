"""Turn a sliced model's config.pbtxt (the slicer writes one CPU instance, onnxruntime) into the GPU one.

    python docker/gpu_config.py MODEL_DIR/config.pbtxt [--gpus 1]

What changes, and why: slicer/gpu_config.py. Used by docker/Dockerfile at image build.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from slicer.gpu_config import GPU_PARAMETERS, device_buffer_pairs, gpu_config

__all__ = ["GPU_PARAMETERS", "device_buffer_pairs", "gpu_config", "main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--gpus", type=int, default=1, help="GPUs of the node (one instance on each)")
    args = parser.parse_args(argv)
    manifest_file = args.config.parent / "1" / "manifest.json"
    manifest = json.loads(manifest_file.read_text()) if manifest_file.is_file() else None
    args.config.write_text(gpu_config(args.config.read_text(), args.gpus, manifest))
    pairs = device_buffer_pairs(manifest)
    print(f"{args.config}: KIND_GPU, " + ", ".join(f"{k}={v}" for k, v in GPU_PARAMETERS.items())
          + (f", num_buffer_pairs={pairs} (chosen on the device)" if pairs else ", num_buffer_pairs: the GPU default"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
