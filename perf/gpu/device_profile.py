"""Measure on a GPU what the GPU stand-in assumes, and write it as the stand-in's device profile.

    python -m perf.gpu.device_profile --model bert --out DIR      (on the GPU machine)
    python -m perf.gpu.device_profile --model-dir SLICED --out DIR  (a sliced model, as it serves)

The stand-in (runtime/simulated.py) charges each stage run from a device profile and its
`DeviceParameters`; until a device measured them, the parameters are assumptions with their
sources. This measures, with the runtime's torch engine on CUDA:

- `launch_s`: a CUDA graph's replay of one tiny kernel, from the host's launch to the device's end
  (host clock, synchronized), less the kernel's own time (CUDA events);
- `copy_latency_s`, `copy_bytes_per_s`: copies between pageable host memory and the device (as the
  profile's runs make them), 4 KiB to 16 MiB each way, fitted as latency + bytes / bandwidth;
- `host_run_s`: the torch engine's host time for one run, inputs and outputs in device memory
  (nothing waited for), which the stand-in spends on the host thread that runs it;
- `concurrent_kernels`: two stages' graphs replayed on two streams at once against one after the
  other: 2 where together they take under 75 % of the two apart, else 1;
- the stage times (`run()` at every graph bucket, the boundaries between stages in device memory as
  served: `"boundaries": "device"`) and the unsliced model's (`model_times`), which the stand-in
  otherwise sums from the stages.

Writes DIR/device_profile.json in the format `DeviceProfile.load` reads (measured_on, parameters,
stage_times, stage_times_by_length, model_times), and DIR/device_profile.log.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from dvabatch_backend.runtime.device_times import served_memory, time_engines
from dvabatch_backend.runtime.loading import engine_buckets, find_version_dir, make_engine
from dvabatch_backend.runtime.manifest import Manifest, StageSpec
from dvabatch_backend.runtime.settings import RuntimeSettings
from perf.gpu.pipelines import sliced_zoo_model, torch_engines

COPY_SIZES = tuple(4096 << k for k in range(0, 13, 2))  # 4 KiB .. 16 MiB
REPEATS = 20


def launch_seconds(torch: Any) -> float:
    """A one-kernel graph's replay, launch to end on the host's clock, less the kernel's time."""
    x = torch.zeros(1, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x.add_(1)
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        x.add_(1)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host, kernel = [], []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):
            start.record(stream)
            graph.replay()
            end.record(stream)
        stream.synchronize()
        host.append(time.perf_counter() - t0)
        kernel.append(start.elapsed_time(end) / 1e3)
    return max(0.0, float(np.median(host) - np.median(kernel)))


def copy_fit(torch: Any) -> dict[str, float]:
    """Pageable host <-> device copies fitted as latency + bytes / bandwidth (both ways pooled)."""
    sizes, seconds = [], []
    for nbytes in COPY_SIZES:
        host = np.ones(nbytes // 4, np.float32)
        device = torch.empty(nbytes // 4, device="cuda")
        for to_device in (True, False):
            runs = []
            for _ in range(REPEATS // 4):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                if to_device:
                    device.copy_(torch.from_numpy(host))
                else:
                    torch.from_numpy(host).copy_(device)
                torch.cuda.synchronize()
                runs.append(time.perf_counter() - t0)
            sizes.append(nbytes)
            seconds.append(float(np.median(runs)))
    slope, intercept = np.polyfit(sizes, seconds, 1)
    return {"copy_latency_s": max(0.0, float(intercept)), "copy_bytes_per_s": float(1.0 / slope)}


def _device_feeds(torch: Any, engines: Sequence[Any], manifest: Any, length: int) -> list[tuple[Any, dict, dict]]:
    """Each stage engine with its inputs and outputs at batch 1 in device memory (as served between stages)."""
    feeds = []
    for engine, spec in zip(engines, manifest.stages):
        inputs = {t.name: torch.zeros(t.shape(1, length), dtype=_dtype(torch, t), device="cuda") for t in spec.inputs}
        outputs = {t.name: torch.empty(t.shape(1, length), dtype=_dtype(torch, t), device="cuda") for t in spec.outputs}
        feeds.append((engine, inputs, outputs))
    return feeds


def host_run_seconds(torch: Any, engines: Sequence[Any], manifest: Any, length: int) -> float:
    """The torch engine's host time for one run with device-memory inputs and outputs (queued,
    nothing waited for): each call timed on the host, the median over calls and stages."""
    per_stage = []
    for engine, inputs, outputs in _device_feeds(torch, engines, manifest, length):
        engine.run(inputs, outputs)  # warm-up
        engine.wait_for_device()
        calls = []
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            engine.run(inputs, outputs)
            calls.append(time.perf_counter() - t0)
        engine.wait_for_device()
        per_stage.append(float(np.median(calls)))
    return float(np.median(per_stage))


def concurrent_kernels(torch: Any, engines: Sequence[Any], manifest: Any, length: int) -> dict[str, Any]:
    """Stages 0 and 1 at batch 1 on their own streams together against one after the other."""
    feeds = _device_feeds(torch, engines[:2], manifest, length)

    def timed(together: bool) -> float:
        runs = []
        for _ in range(REPEATS):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for engine, inputs, outputs in feeds:
                engine.run(inputs, outputs)  # device outputs: queued on its own stream
                if not together:
                    engine.wait_for_device()
            torch.cuda.synchronize()
            runs.append(time.perf_counter() - t0)
        return float(np.median(runs))

    apart, together = timed(False), timed(True)
    return {"apart_s": apart, "together_s": together, "concurrent_kernels": 2 if together < 0.75 * apart else 1}


def _dtype(torch: Any, spec: Any) -> Any:
    return torch.from_numpy(np.zeros(0, spec.np_dtype)).dtype


def measure(model: str, out: Path, stages: int = 4, bs_max: int = 16, max_length: int = 128,
            sliced: Path | None = None) -> dict[str, Any]:
    """The profile of the zoo's `model` cut evenly into `stages`, or of the `sliced` model folder
    (its version folder, as the slicer wrote it: the model a side by side serves)."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this measures a GPU (the stand-in's parameters come from it)")
    if sliced is not None:
        model_dir = find_version_dir(sliced)
        manifest = Manifest.load(model_dir / "manifest.json")
        bs_max, model = manifest.max_batch_size, f"{manifest.name} ({sliced})"
    else:
        model_dir, manifest, _ = sliced_zoo_model(model, out / "model", stages, bs_max,
                                                  max_length if model == "bert" else 0)
    settings = RuntimeSettings(engine="torch", device="cuda", bs_max=bs_max)
    sizes, lengths = engine_buckets(settings, manifest)
    lengths = lengths if manifest.has_seq else [0]
    engines = torch_engines(model_dir, manifest, "cuda", True, bs_max)
    # the boundaries between stages in device memory, as served: each run copies only the model's
    # own inputs and outputs, which is what the stand-in subtracts from it ("boundaries": "device")
    stage_times = time_engines(manifest.stages, engines, sizes, lengths, memory=served_memory(engines))
    full = str(manifest.full_model or "model.onnx")
    whole = make_engine(model_dir / full, settings, manifest)
    model_times = time_engines([StageSpec(full, manifest.inputs, manifest.outputs)], [whole], sizes, lengths)
    longest = str(max(lengths))
    longest_length = max(lengths) if manifest.has_seq else 0
    parameters = {"launch_s": launch_seconds(torch), **copy_fit(torch),
                  "host_run_s": host_run_seconds(torch, engines, manifest, longest_length)}
    overlap = concurrent_kernels(torch, engines, manifest, longest_length)
    parameters["concurrent_kernels"] = overlap["concurrent_kernels"]
    doc = {"measured_on": torch.cuda.get_device_name(0),
           "measured": f"{time.strftime('%Y-%m-%d')}, perf.gpu.device_profile --model {model}",
           "model": (f"zoo {model} at the paper's size, {stages} stages, bs_max {bs_max}" if sliced is None else
                     f"{model} as sliced: {manifest.num_stages} stages, bs_max {bs_max}, precision "
                     f"{manifest.extra.get('slicing', {}).get('precision', {}).get('precision', 'fp32')}"),
           "parameters": parameters, "two_streams": overlap, "boundaries": "device",
           "stage_times": stage_times[longest], "model_times": {"stage_times": model_times[longest]}}
    if manifest.has_seq:
        doc["stage_times_by_length"] = stage_times
        doc["model_times"]["by_length"] = model_times
    out.mkdir(parents=True, exist_ok=True)
    (out / "device_profile.json").write_text(json.dumps(doc, indent=1))
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bert", choices=("bert", "resnet152"))
    parser.add_argument("--model-dir", type=Path, help="a sliced model folder to profile instead (as it serves)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    doc = measure(args.model, args.out, sliced=args.model_dir)
    print(json.dumps({k: doc[k] for k in ("measured_on", "parameters", "two_streams")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
