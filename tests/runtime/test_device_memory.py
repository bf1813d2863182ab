"""Boundaries in device memory (runtime/device_memory.py), on the CPU: the middle boundaries as
torch tensors (`TorchMemory("cpu")`), the torch engine reading and writing them where they are.
This runs the code path a GPU takes (engines handed tensors, host readers through
`StageBuffer.host_rows`) without one; tests/gpu/test_gpu.py runs it on CUDA streams.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from dvabatch_backend.runtime.buffers import HOST_MEMORY, BufferMemory, host_memory
from dvabatch_backend.runtime.decisions import BatchTableView
from dvabatch_backend.runtime.fences import host_fences
from policies import create_policy
from policies.examples.early_exit import EarlyExitPolicy

from ..conftest import (Collector, ExitQueries, SlicedModel, assert_all_answered_correctly, assert_matches_reference, call,
                        make_scheduler, sliced_cascade)
from .test_property import drive_scenario, scenario_policy, scenarios

torch = pytest.importorskip("torch")
from dvabatch_backend.runtime.device_memory import TorchMemory  # noqa: E402
from dvabatch_backend.runtime.torch_engine import TorchStageEngine  # noqa: E402


class CountingMemory(TorchMemory):
    """`TorchMemory` on the CPU that counts the copies host readers take."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.copies = 0

    def to_host(self, view):
        self.copies += 1
        return super().to_host(view)


def middle_in(memory: BufferMemory, num_stages: int):
    """A `MemoryFactory`: the boundaries between two stages in `memory`, boundary 0 and the last on the host."""
    return lambda boundary, pair: memory if 0 < boundary < num_stages else HOST_MEMORY


_engines: dict[Path, list[TorchStageEngine]] = {}


def torch_engines(model: SlicedModel) -> list[TorchStageEngine]:
    if model.dir not in _engines:
        _engines[model.dir] = [TorchStageEngine(model.dir / s.file, device="cpu") for s in model.manifest.stages]
    return _engines[model.dir]


def answer_a_batch(model: SlicedModel, pipeline, n: int, seed: int) -> None:
    """`n` queries submitted at once: every one answered, as the unsliced model."""
    rng = np.random.default_rng(seed)
    collector = Collector()
    with pipeline:
        batch = [model.query(rng) for _ in range(n)]
        sent = dict(zip(pipeline.submit_many([(q, collector) for q in batch]), batch))
        assert_all_answered_correctly(model, pipeline, collector, sent)


def on_torch_memory(model: SlicedModel, policy, memory: BufferMemory | None = None, **settings):
    pipeline = make_scheduler(model, policy, torch_engines(model), **settings)
    pipeline.install_buffers(host_fences, middle_in(memory or TorchMemory("cpu"), model.manifest.num_stages))
    return pipeline


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(scenario=scenarios())
def test_random_schedules_over_torch_memory_answer_every_query_once_and_correctly(zoo, scenario: dict) -> None:
    model = zoo.get(scenario["kind"], scenario["cuts"])
    pipeline = on_torch_memory(model, scenario_policy(scenario), num_buffer_pairs=scenario["pairs"],
                               bs_max=scenario["bs_max"])
    middle = [b for row in pipeline.scheduler.board.buffers.buffers[1:-1] for b in row]
    assert all(isinstance(t, torch.Tensor) for b in middle for t in b.views(1).values())
    drive_scenario(model, pipeline, scenario)


@pytest.fixture(scope="module")
def cascade(tmp_path_factory) -> SlicedModel:
    return sliced_cascade(tmp_path_factory.mktemp("cascade_torch"))


def test_an_early_exit_reads_a_boundary_in_device_memory_through_host_copies(cascade: SlicedModel) -> None:
    exits = ExitQueries.make(cascade, 8, seed=1)
    memory = CountingMemory()
    pipeline = on_torch_memory(cascade, EarlyExitPolicy(threshold=exits.threshold, exit_stage=0), memory,
                               num_buffer_pairs=2)
    collector = Collector()
    with pipeline:
        sent = pipeline.submit_many([(q, collector) for q in exits.queries])
        assert collector.wait_for(sent)
    exits.assert_answered(collector, sent)
    assert pipeline.stats.early_exits == int(exits.leaves.sum())
    assert pipeline.buffer_violations == []
    assert memory.copies > 0  # the policy's look at the head and the exits' answers: copies, not the tensors


def test_a_policy_that_never_looks_at_stage_outputs_copies_nothing_to_the_host(zoo) -> None:
    model = zoo.get("token", ("h2", "h4"))
    memory = CountingMemory()
    pipeline = on_torch_memory(model, create_policy("load"), memory, num_buffer_pairs=2)
    answer_a_batch(model, pipeline, 6, seed=2)
    assert memory.copies == 0


def test_a_callers_steps_run_its_stages_over_boundaries_in_device_memory(zoo) -> None:
    model = zoo.get("token", ("h2", "h4"))
    pipeline = on_torch_memory(model, create_policy("load"), num_buffer_pairs=1)
    rng = np.random.default_rng(3)
    query = model.query(rng)
    collector = Collector()
    with pipeline:
        (qid,), answered = call(pipeline, [query], collector)
    assert answered
    assert_matches_reference(model, query, collector.one(qid))
    assert [s.batches for s in pipeline.stats.stages] == [1, 1, 1]


def test_installing_buffers_after_the_start_is_refused(zoo) -> None:
    model = zoo.get("token", ("h2", "h4"))
    pipeline = make_scheduler(model, create_policy("load"), torch_engines(model))
    with pipeline:
        with pytest.raises(RuntimeError, match="before the pipeline starts"):
            pipeline.install_buffers(host_fences, host_memory)


def test_a_policy_view_computes_stage_outputs_only_when_asked() -> None:
    calls = []

    def outputs():
        calls.append(1)
        return {"h": np.ones((2, 3), np.float32)}

    view = BatchTableView(None, stage_outputs=outputs)  # type: ignore[arg-type]
    assert calls == []
    first = view.stage_outputs()
    assert view.stage_outputs() is first and len(calls) == 1
    with pytest.raises(ValueError):
        first["h"][0, 0] = 2.0  # read-only


def test_a_model_with_no_stage_on_a_stream_keeps_host_buffers_whatever_the_device_says(zoo) -> None:
    """onnxruntime stages with `device: cuda` (the setting names no engine of its own): no stage runs on
    a CUDA stream, so the buffers stay host memory with host fences, and nothing asks for CUDA."""
    from dvabatch_backend.runtime.fences import HostFence
    from dvabatch_backend.runtime.loading import load_pipeline
    from dvabatch_backend.runtime.settings import RuntimeSettings

    model = zoo.get("token", ("h2", "h4"))
    pipeline = load_pipeline(model.dir, create_policy("load"), RuntimeSettings(engine="onnxruntime", device="cuda"))
    buffers = [b for row in pipeline.scheduler.board.buffers.buffers for b in row]
    assert all(type(b.fence) is HostFence and not b.memory.on_device for b in buffers)
    answer_a_batch(model, pipeline, 5, seed=4)


def test_stream_memory_puts_the_boundaries_between_two_streams_on_their_device(monkeypatch) -> None:
    """Boundary k lies between stages k-1 and k: device memory where both run on streams of one device,
    page-locked host memory where the host is on one side, host memory where it is on both."""
    from types import SimpleNamespace

    from dvabatch_backend.runtime import device_memory
    from dvabatch_backend.runtime.device_memory import PinnedMemory, stream_memory

    monkeypatch.setattr(device_memory, "as_torch_stream", lambda s: s)  # stand-in streams: no CUDA here
    on = SimpleNamespace(device=torch.device("cpu"))
    memory = stream_memory([on, on, None, None])  # 4 stages: 0 and 1 on a stream, 2 and 3 on the host
    kinds = [type(memory(k, 0)) for k in range(5)]
    assert kinds == [PinnedMemory, TorchMemory, PinnedMemory, type(HOST_MEMORY), type(HOST_MEMORY)]
    assert memory(1, 0).device == on.device
