"""`dvabatch slice --device/--engine`: the stages timed by the engine that will serve them.

On a GPU the slicer times the cuts, the stage profile, the fast path and the candidates with the
torch engine and its CUDA graphs (slicer/serving_engine.py). The same code runs the torch engine on
the CPU here: the manifest, profile and config it writes are checked, the buffer-pair candidates
measured, and the GPU config it writes for `--device cuda` read back."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest

from dvabatch_backend import Manifest, RuntimeSettings, load_pipeline
from dvabatch_backend.runtime.loading import engine_buckets
from policies import create_policy
from slicer import model_config
from slicer.profiler import int_bounds, random_inputs
from slicer.serving_engine import PAIR_CANDIDATES, ServingEngine
from slicer.slice_model import Candidate, SliceOptions, _write_config, choose_buffer_pairs, slice_model
from slicer.zoo import build

TORCH_CPU = ServingEngine("torch", "cpu")


@pytest.fixture(scope="module")
def sliced(tmp_path_factory: pytest.TempPathFactory):
    model = build("bert")
    out = tmp_path_factory.mktemp("torch-slice") / "bert_torch"
    report = slice_model(model, out, SliceOptions(stages=None, candidates=(2, 3), max_batch_size=4, max_length=32,
                                                  repeats=2, calibration_rounds=0, serving=TORCH_CPU))
    return model, report


def test_the_stages_are_profiled_by_the_serving_engine_at_its_buckets(sliced) -> None:
    _, report = sliced
    folder = report.out_dir / "1"
    manifest = Manifest.load(folder / "manifest.json")
    profile = json.loads((folder / "profile.json").read_text())
    sizes, lengths = engine_buckets(TORCH_CPU.settings(manifest.max_batch_size), manifest)
    assert profile["engine"] == "torch" and profile["batch_sizes"] == sizes and profile["lengths"] == lengths
    assert manifest.extra["slicing"]["engine"] == {"engine": "torch", "device": "cpu"}
    assert "profiled_on" not in manifest.extra  # the CPU: no device to re-profile for
    for stage in manifest.extra["stage_times_by_length"].values():
        assert [sorted(map(int, row)) for row in stage] == [sizes] * manifest.num_stages
    assert set(manifest.extra["slicing"]["stage_count"]["queries_per_second"]) == {"2", "3"}
    assert "one buffer pair, torch on cpu)" in manifest.extra["slicing"]["stage_count"]["why"]
    assert "one query on torch, cpu" in manifest.extra["fast_path"]["why"]
    params = model_config.parameters((report.out_dir / "config.pbtxt").read_text())
    assert params["engine"] == "torch" and params["device"] == "cpu"


def test_the_slice_serves_on_its_engine_equal_to_the_model(sliced) -> None:
    import onnxruntime as ort

    model, report = sliced
    folder = report.out_dir / "1"
    manifest = Manifest.load(folder / "manifest.json")
    full = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(4)
    query = {k: v[0] for k, v in random_inputs(manifest.inputs, 1, 20, rng, int_bounds(model)).items()}
    answers = []
    answered = threading.Event()
    pipeline = load_pipeline(folder, create_policy("input"), RuntimeSettings(engine="torch", device="cpu",
                                                                             num_buffer_pairs=1))
    with pipeline:
        pipeline.submit(query, lambda answer: (answers.append(answer), answered.set()))
        assert answered.wait(timeout=60)
    expected = full.run(None, {k: v[None] for k, v in query.items()})
    names = [o.name for o in full.get_outputs()]
    assert len(answers) == 1 and answers[0].error is None
    for name, want in zip(names, expected):
        np.testing.assert_allclose(answers[0].outputs[name], want[0], atol=1e-4)


def test_buffer_pairs_are_measured_and_recorded(sliced) -> None:
    _, report = sliced
    chosen = Candidate(report.chosen.stages, report.out_dir / "1", report.manifest, report.chosen.partition,
                       report.chosen.stage_seconds)
    options = SliceOptions(max_batch_size=4, serving=TORCH_CPU)
    record = choose_buffer_pairs(chosen, 16, dict(report.manifest.extra.get("input_bounds", {})), 4, options,
                                 lambda message: None, rounds=1)
    assert set(record["queries_per_second"]) == {str(p) for p in PAIR_CANDIDATES}
    assert all(q > 0 for q in record["queries_per_second"].values())
    best = max(record["queries_per_second"].values())
    assert record["queries_per_second"][str(record["chosen"])] >= 0.9 * best


def test_a_measured_candidate_is_freed_before_the_next_loads(sliced) -> None:
    """A stopped pipeline is a cycle: left to the collector, candidates' sessions piled up and the
    later ones measured a fraction of their rate. None is left once a measurement returns."""
    import gc

    from dvabatch_backend.runtime.pipeline import Pipeline
    from slicer.slice_model import measure_pipeline

    _, report = sliced
    folder = report.out_dir / "1"
    alive = lambda: sum(isinstance(o, Pipeline) for o in gc.get_objects())  # noqa: E731
    gc.collect()
    before = alive()
    gc.disable()  # only the measurement's own collection may free it
    try:
        rate = measure_pipeline(folder, report.manifest, 16, dict(report.manifest.extra.get("input_bounds", {})),
                                seconds=0.0, concurrency=2,
                                settings=RuntimeSettings(engine="torch", device="cpu", num_buffer_pairs=1))
        assert alive() == before
    finally:
        gc.enable()
    assert rate > 0


def test_a_cuda_slice_writes_the_gpu_config_with_the_pairs_it_chose(sliced, tmp_path: Path) -> None:
    _, report = sliced
    doc = report.manifest.to_json()
    doc["slicing"]["buffer_pairs"] = {"chosen": 2, "why": "measured"}
    model_dir = tmp_path / "m"
    (model_dir / "1").mkdir(parents=True)
    _write_config(model_dir, Manifest.from_json(doc), "input", ServingEngine("torch", "cuda"))
    config = model_config.parse((model_dir / "config.pbtxt").read_text())
    params = model_config.parameters((model_dir / "config.pbtxt").read_text())
    assert [g.kind for g in config.instance_group] == [model_config.pb.ModelInstanceGroup.KIND_GPU]
    assert params["engine"] == "torch" and params["device"] == "cuda" and params["num_buffer_pairs"] == "2"


def test_cuda_needs_the_torch_engine(tmp_path: Path) -> None:
    from dvabatch_backend.tools.cli import main

    assert main(["slice", str(tmp_path / "m.onnx"), "--device", "cuda", "--engine", "onnxruntime",
                 "--out", str(tmp_path / "out")]) == 2


def test_a_candidate_re_profiled_on_its_device_logs_no_warning(sliced, tmp_path: Path, caplog) -> None:
    """On a GPU each candidate's stages are re-profiled at load on purpose; the warning that tells
    a user their served model was profiled elsewhere is not logged for it (the stand-in's device
    takes the GPU's place here). A served load of the same folder still warns."""
    import logging
    import shutil

    from slicer.slice_model import measure_pipeline

    _, report = sliced
    stages = len(report.manifest.stages)
    profile = tmp_path / "device.json"
    profile.write_text(json.dumps({"measured_on": "a test GPU", "stage_times": [{"1": 1e-4, "4": 2e-4}] * stages}))
    settings = RuntimeSettings(engine="simulated", device_profile=str(profile), num_buffer_pairs=1)
    served, candidate = tmp_path / "served", tmp_path / "candidate"
    shutil.copytree(report.out_dir, served)
    shutil.copytree(report.out_dir, candidate)
    bounds = dict(report.manifest.extra.get("input_bounds", {}))
    with caplog.at_level(logging.INFO, logger="dvabatch_backend.runtime.device_times"):
        assert measure_pipeline(candidate / "1", report.manifest, 16, bounds, seconds=0.0, concurrency=2,
                                settings=settings) > 0
        quiet = [r for r in caplog.records if r.levelno >= logging.WARNING]
        with load_pipeline(served / "1", create_policy("load"), settings):
            pass
    assert quiet == []
    assert any("re-profiled at load" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
