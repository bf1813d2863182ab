"""Stage times from the engine that will serve, where it will serve (`dvabatch slice --device cuda`).

By default the slicer times its cuts with onnxruntime on the local CPU, the served default. A model
that will serve on a GPU is timed there instead, as the paper profiles each GPU type once: the
torch engine on CUDA with its CUDA graphs (`loading.make_engine`), each stage's `run` at the graph
buckets it will replay (`device_times.time_engines`), its boundaries in device memory where they
serve. The same code times the torch engine on the CPU (`--engine torch --device cpu`), which is
how it is tested on a machine without a GPU.

The calibration rounds that balance the cuts, the stage profile the policies plan with, the fast
path's choice (the unsliced model or the stages in a row, one query at a time) and the candidates
(stage counts, and buffer pairs where the stages share a device) are measured so; the manifest
records the device's name as `profiled_on`, so serving on the same GPU plans with these times and
another GPU re-profiles at load (runtime/device_times.py).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import onnx

from dvabatch_backend.runtime.device_times import CPU, served_memory, serving_device, time_engines
from dvabatch_backend.runtime.loading import engine_buckets, make_engine, make_engines
from dvabatch_backend.runtime.manifest import Manifest, StageSpec
from dvabatch_backend.runtime.settings import RuntimeSettings

from .preflight import full_session
from .profiler import Setting, random_input
from .stage_profile import PROFILE_SCHEMA_VERSION, diversity, preferred_batch_size

ONNXRUNTIME = "onnxruntime"
TORCH = "torch"
# buffer pairs tried where the stages share one device (a GPU): one (a batch at a time, stages in a
# row) or two (stage 0 takes the next batch while the later stages finish this one)
PAIR_CANDIDATES = (1, 2)


@dataclass(frozen=True)
class ServingEngine:
    """The engine kind and device a sliced model will serve on, which times its stages."""

    engine: str = ONNXRUNTIME
    device: str = "cpu"

    @property
    def is_default(self) -> bool:
        """onnxruntime on the CPU: the slicer's own timing (slicer/profiler.py) applies."""
        return self.engine == ONNXRUNTIME and self.device == "cpu"

    @property
    def shares_a_device(self) -> bool:
        """Stages whose work all goes to one device: buffer pairs are a choice to measure."""
        return self.device != "cpu"

    def settings(self, bs_max: int, pairs: int = 1) -> RuntimeSettings:
        """The runtime settings the model serves with on this engine (the GPU config's: one host
        thread per stage, the device does the work)."""
        return RuntimeSettings(engine=self.engine, device=self.device, bs_max=bs_max, num_buffer_pairs=pairs,
                               threads_per_stage=1 if self.device != "cpu" else 0, fast_path=False)

    def stage_engines(self, folder: Path, manifest: Manifest) -> list[Any]:
        return make_engines(folder, manifest, self.settings(manifest.max_batch_size))

    def device_name(self, engines: Sequence[Any]) -> str:
        """The name `profiled_on` records: the GPU's, or "cpu"."""
        return serving_device(engines) or CPU

    def stage_seconds(self, folder: Path, manifest: Manifest, setting: Setting, int_high: Mapping[str, int],
                      repeats: int) -> list[float]:
        """Each stage's run at one batch size and length, as served (boundaries where they live)."""
        # one graph per stage, at the shapes timed: the balancing rounds make engines for every cut
        # they try, and a model's every bucket would be captured for each
        engines = make_engines(folder, manifest, replace(self.settings(manifest.max_batch_size), cuda_graphs=False))
        for engine in engines:
            if getattr(engine, "stream", None) is not None:  # on CUDA
                engine.capture(setting.batch, setting.length)
        times = _timed(manifest.stages, engines, [setting.batch], [setting.length], int_high, repeats)
        return [row[str(setting.batch)] for row in times[str(setting.length)]]

    def profile(self, folder: Path, manifest: Manifest, int_high: Mapping[str, int], repeats: int
                ) -> tuple[dict[str, Any], str]:
        """The stage profile (the form `stage_profile.profile_stages` writes) at the graph buckets,
        and the device's name."""
        sizes, lengths = engine_buckets(self.settings(manifest.max_batch_size), manifest)
        lengths = lengths if manifest.has_seq else [0]
        engines = self.stage_engines(folder, manifest)
        times = _timed(manifest.stages, engines, sizes, lengths, int_high, repeats)
        stages = []
        for k, stage in enumerate(manifest.stages):
            seconds = {str(n): times[str(n)][k] for n in lengths}
            stages.append({"file": stage.file, "seconds": seconds,
                           "preferred_bs": {n: preferred_batch_size({int(b): t for b, t in row.items()})
                                            for n, row in seconds.items()}})
        profile: dict[str, Any] = {"schema_version": PROFILE_SCHEMA_VERSION, "engine": self.engine,
                                   "device": self.device_name(engines), "batch_sizes": list(sizes),
                                   "lengths": list(lengths), "stages": stages}
        profile["diversity"] = diversity(manifest, profile)
        return profile, profile["device"]

    def run_once(self, model: onnx.ModelProto | Path, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One run of a graph on this engine and device, outside the runtime (the slicer's checks of a
        converted model): {output name: array}. An op the engine cannot run is named in the error."""
        proto = onnx.load(str(model)) if isinstance(model, Path) else model
        if self.engine == TORCH:
            import torch

            from dvabatch_backend.runtime.torch_engine import OnnxTorchModule

            module = OnnxTorchModule(proto).eval().to(self.device)
            with torch.inference_mode():
                outs = module(*[torch.from_numpy(np.ascontiguousarray(feeds[n])).to(self.device)
                                for n in module.input_names])
            return {name: out.float().cpu().numpy() if out.dtype == torch.bfloat16 else out.cpu().numpy()
                    for name, out in zip(module.output_names, outs)}
        # onnxruntime serves on the CPU only (`dvabatch slice --device cuda` takes the torch engine)
        session = full_session(proto)
        names = [o.name for o in session.get_outputs()]
        return dict(zip(names, session.run(names, {i.name: feeds[i.name] for i in session.get_inputs()})))

    def fast_path_seconds(self, folder: Path, manifest: Manifest, int_high: Mapping[str, int], repeats: int
                          ) -> dict[str, dict[str, float]]:
        """One query's time at each profiled length, the unsliced model against the stages in a row
        (boundaries as served): {length: {"model": s, "stages": s}}, for `slice_model.fast_path_record`."""
        settings = self.settings(manifest.max_batch_size)
        _, lengths = engine_buckets(settings, manifest)
        lengths = lengths if manifest.has_seq else [0]
        whole = make_engine(folder / (manifest.full_model or "model.onnx"), settings, manifest)
        model = _timed([StageSpec(str(manifest.full_model), manifest.inputs, manifest.outputs)], [whole], [1], lengths,
                       int_high, repeats)
        del whole
        stages = _timed(manifest.stages, self.stage_engines(folder, manifest), [1], lengths, int_high, repeats)
        return {str(n): {"model": model[str(n)][0]["1"], "stages": sum(row["1"] for row in stages[str(n)])}
                for n in lengths}


def _timed(stages: Sequence[StageSpec], engines: Sequence[Any], sizes: Sequence[int], lengths: Sequence[int],
           int_high: Mapping[str, int], repeats: int) -> dict[str, list[dict[str, float]]]:
    """`time_engines` on random valid inputs, each boundary where it lives as served."""
    return time_engines(stages, engines, sizes, lengths, random_input(int_high), repeats,
                        memory=served_memory(engines))
