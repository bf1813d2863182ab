"""The property test with the torch engine on the CPU: under random arrivals and random legal meta
operations every query is answered once, equal to the unsliced model (onnxruntime), and no
buffer-pair check fires. tests/gpu/test_gpu.py runs the same with every stage on CUDA."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

from .test_property import run_scenario, scenarios

pytest.importorskip("torch")
from dvabatch_backend.runtime.torch_engine import TorchStageEngine  # noqa: E402  (the torch engine's API)

_engines: dict[Path, list[TorchStageEngine]] = {}


def cpu_engines(model) -> list[TorchStageEngine]:
    """Loaded once per sliced model: a torch engine is used by one executor thread at a time."""
    if model.dir not in _engines:
        _engines[model.dir] = [TorchStageEngine(model.dir / s.file, device="cpu") for s in model.manifest.stages]
    return _engines[model.dir]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(scenario=scenarios())
def test_random_schedules_on_the_torch_engine_answer_every_query_once_and_correctly(zoo, scenario: dict) -> None:
    model = zoo.get(scenario["kind"], scenario["cuts"])
    run_scenario(model, cpu_engines(model), scenario)
