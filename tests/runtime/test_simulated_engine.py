"""The GPU stand-in (runtime/simulated.py): streams and events ordered on a manual clock (no
timing), a run charged at its graph bucket, the runtime's device path (fences on its events,
boundaries in its device memory) answering as the unsliced model, and unknown engine kinds refused."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from dvabatch_backend.runtime.fences import CudaEventFence
from dvabatch_backend.runtime.loading import load_pipeline, make_engine, make_engines
from dvabatch_backend.runtime.manifest import TensorSpec
from dvabatch_backend.runtime.settings import RuntimeSettings
from dvabatch_backend.runtime.simulated import (DeviceArray, DeviceParameters, DeviceProfile, ManualClock, SimEvent,
                                                SimulatedDevice, SimulatedMemory, SimulatedStageEngine)
from policies import load_policy
from tests.conftest import Collector, assert_all_answered_correctly, assert_matches_reference


def _profile(stages: int = 2, launch_s: float = 0.0, **extra: object) -> dict:
    by_length = {str(n): [{"1": 1e-3 * n / 16, "2": 1.5e-3 * n / 16, "4": 2.5e-3 * n / 16} for _ in range(stages)]
                 for n in (16, 32)}
    return {"measured_on": "a test device", "stage_times": by_length["32"], "stage_times_by_length": by_length,
            "parameters": {"launch_s": launch_s, "copy_latency_s": 1e-5, "copy_bytes_per_s": 1e9}, **extra}


def _device(**params: float) -> tuple[SimulatedDevice, ManualClock]:
    clock = ManualClock()
    profile = DeviceProfile.from_json(_profile(**params))
    return SimulatedDevice(profile, clock, clock.sleep, spin_s=0.0), clock


def test_a_stream_runs_after_the_event_it_waits_on_and_the_host_waits_only_where_it_synchronizes() -> None:
    device, clock = _device()
    a, b = device.stream(), device.stream()
    assert device.enqueue(a, 1.0) == 1.0
    written = device.event()
    written.record(a)
    b.wait_event(written)
    assert device.enqueue(b, 0.5, "out") == 1.5  # a copy engine is free, but b waits for a's event
    assert clock.now == 0.0  # launches returned at once: no host time spent
    assert not written.query() and not b.query()
    written.synchronize()
    assert clock.now == 1.0 and written.query() and not b.query()
    b.synchronize()
    assert clock.now == 1.5 and b.query()


def test_two_streams_share_the_compute_one_at_a_time_while_copies_overlap() -> None:
    device, clock = _device(launch_s=0.25)
    a, b = device.stream(), device.stream()
    assert device.enqueue(a, 1.0) == 1.25  # launched at 0, started after the launch latency
    assert device.enqueue(b, 1.0) == 2.25  # another stream's replay waits for the device
    assert device.enqueue(device.stream(), 0.5, "in") == 0.75  # a copy runs beside them
    device.synchronize()
    assert clock.now == 2.25


def test_an_event_never_recorded_orders_nothing() -> None:
    device, _ = _device()
    s = device.stream()
    s.wait_event(SimEvent(device))
    assert s.tail == 0.0


def test_a_run_is_charged_at_its_graph_bucket_less_the_copies_its_profile_made() -> None:
    device, clock = _device(launch_s=1e-5)
    specs = [TensorSpec("x", "float32", ("batch", "seq", 8))]
    out_specs = [TensorSpec("y", "float32", ("batch", "seq", 8))]
    engine = SimulatedStageEngine(device, specs, [(1, specs, out_specs)], ([1, 2, 4], [16, 32]), pad_length=True)
    assert engine.bucket(3, 20) == (4, 32) and engine.bucket(1, 16) == (1, 16)
    params = device.profile.parameters
    bucket_bytes = 4 * 32 * 8 * 4
    expected = device.profile.run_seconds(1, 4, 32) - params.launch_s - 2 * params.copy_seconds(bucket_bytes)
    assert engine.compute_seconds(4, 32) == pytest.approx(expected)
    inputs, outputs = {"x": np.ones((3, 20, 8), np.float32)}, {"y": np.zeros((3, 20, 8), np.float32)}
    engine.run(inputs, outputs)  # host outputs: returns once they are copied out
    copies = params.copy_seconds(inputs["x"].nbytes) + params.copy_seconds(outputs["y"].nbytes)
    # the copy in starts after the launch latency; compute and copy out each launch after it
    assert clock.now == pytest.approx(params.launch_s + copies + expected)
    assert engine.replays == 1 and np.all(outputs["y"] == 0)  # a measuring run computes no values

    device_out = {"y": SimulatedMemory(device).zeros(3 * 20 * 8, np.dtype("float32")).reshape(3, 20, 8)}
    assert isinstance(device_out["y"], DeviceArray)
    before = clock.now
    engine.run(inputs, device_out)  # device outputs: queued, not waited for
    assert clock.now == before and engine.stream.tail > before


def test_each_host_tensor_is_a_copy_of_its_own_in_the_charge_and_in_what_the_profile_paid() -> None:
    """The torch engine copies each host tensor on its own, each paying the copy's latency: a stage
    of three inputs paid three in its profiled run (where the copies were summed into one, a
    middle BERT stage on the H200, 34 us a copy, was charged 100 us a run too much)."""
    device, clock = _device(launch_s=1e-5)
    specs = [TensorSpec(name, "float32", ("batch", "seq", 8)) for name in ("a", "b", "c")]
    out_specs = [TensorSpec("y", "float32", ("batch", "seq", 8))]
    engine = SimulatedStageEngine(device, specs, [(1, specs, out_specs)], ([1, 2, 4], [16, 32]), pad_length=True)
    params = device.profile.parameters
    tensor_bytes = 2 * 16 * 8 * 4
    expected = device.profile.run_seconds(1, 2, 16) - params.launch_s - 4 * params.copy_seconds(tensor_bytes)
    assert engine.compute_seconds(2, 16) == pytest.approx(expected)
    inputs = {s.name: np.ones((2, 16, 8), np.float32) for s in specs}
    engine.run(inputs, {"y": np.zeros((2, 16, 8), np.float32)})
    assert clock.now == pytest.approx(params.launch_s + 4 * params.copy_seconds(tensor_bytes) + expected)


@pytest.mark.parametrize("boundaries", ["host", "device"])
def test_a_profile_with_device_boundaries_paid_only_the_models_own_copies(boundaries: str) -> None:
    """A profile timed with the boundaries between stages in device memory (as
    `perf.gpu.device_profile` times them now) made no copies of them: a middle stage's compute is
    its whole run less the launch, and only the model's own inputs and outputs are subtracted. A
    profile with host boundaries paid a copy of each (where a large boundary's modelled copy outgrew
    the run, compute read 0: ResNet-152 on the stand-in twice as fast as the H100)."""
    clock = ManualClock()
    profile = DeviceProfile.from_json(_profile(launch_s=1e-5, boundaries=boundaries))
    device = SimulatedDevice(profile, clock, clock.sleep, spin_s=0.0)
    model_in, middle = TensorSpec("x", "float32", ("batch", "seq", 8)), TensorSpec("h", "float32", ("batch", "seq", 8))
    first = SimulatedStageEngine(device, [model_in], [(0, [model_in], [middle])], ([1, 2, 4], [16, 32]), True,
                                 model_io=frozenset({"x", "y"}))
    second = SimulatedStageEngine(device, [middle], [(1, [middle], [TensorSpec("y", "float32", ("batch", "seq", 8))])],
                                  ([1, 2, 4], [16, 32]), True, model_io=frozenset({"x", "y"}))
    params, copy = profile.parameters, profile.parameters.copy_seconds(4 * 32 * 8 * 4)
    run = profile.run_seconds(1, 4, 32)
    host = boundaries == "host"
    assert first.compute_seconds(4, 32) == pytest.approx(run - params.launch_s - copy - (copy if host else 0.0))
    assert second.compute_seconds(4, 32) == pytest.approx(run - params.launch_s - (copy if host else 0.0) - copy)


def test_a_profiles_boundaries_are_host_or_device() -> None:
    assert DeviceProfile.from_json(_profile()).boundaries == "host"  # the profiles measured before
    with pytest.raises(ValueError, match="boundaries must be 'host' or 'device'"):
        DeviceProfile.from_json(_profile(boundaries="pinned"))


def test_the_engines_host_work_is_spent_on_the_calling_thread_before_its_launch() -> None:
    """`host_run_s`: a run with device outputs returns once the host work is done (not at once),
    and its work reaches the device that much later; the device's time is unchanged."""
    clock = ManualClock()
    profile = DeviceProfile.from_json(_profile(launch_s=1e-5))
    timed = replace(profile, parameters=replace(profile.parameters, host_run_s=2e-4))
    device = SimulatedDevice(timed, clock, clock.sleep, spin_s=0.0)
    specs = [TensorSpec("x", "float32", ("batch", "seq", 8))]
    engine = SimulatedStageEngine(device, specs, [(1, specs, specs)], ([1, 2, 4], [16, 32]), pad_length=True)
    on_device = {"x": SimulatedMemory(device).zeros(2 * 16 * 8, np.dtype("float32")).reshape(2, 16, 8)}
    engine.run(on_device, {"x": SimulatedMemory(device).zeros(2 * 16 * 8, np.dtype("float32")).reshape(2, 16, 8)})
    assert clock.now == pytest.approx(2e-4)  # the host's own work, then the launch returned at once
    assert engine.stream.tail == pytest.approx(2e-4 + 1e-5 + engine.compute_seconds(2, 16))


def test_a_stages_device_time_comes_from_its_events_once_the_device_reached_them() -> None:
    """The timer counts a run when its end event completes, at the device's time, not the host's."""
    device, clock = _device(launch_s=1e-5)
    specs = [TensorSpec("x", "float32", ("batch", "seq", 8))]
    engine = SimulatedStageEngine(device, specs, [(1, specs, specs)], ([1, 2, 4], [16, 32]), pad_length=True)
    inputs = {"x": np.ones((2, 16, 8), np.float32)}
    device_out = {"y": SimulatedMemory(device).zeros(2 * 16 * 8, np.dtype("float32")).reshape(2, 16, 8)}
    engine.run(inputs, device_out)  # queued: the host returns at once
    params = device.profile.parameters
    expected = params.launch_s + params.copy_seconds(inputs["x"].nbytes) + engine.compute_seconds(2, 16)
    engine.device_timer.collect()
    assert engine.device_timer.seconds() == 0.0 and engine.device_timer.runs == 0  # not reached yet
    clock.sleep(engine.stream.tail - clock.now)
    assert engine.device_timer.seconds() == 0.0  # reached, but no step has collected it: no event is read
    engine.device_timer.collect()
    assert engine.device_timer.seconds() == pytest.approx(expected) and engine.device_timer.runs == 1
    clock.sleep(1.0)  # idle: the next run's time starts when it is launched, not at the last deadline
    engine.run(inputs, device_out)
    clock.sleep(engine.stream.tail - clock.now)
    engine.device_timer.collect()
    assert engine.device_timer.seconds() == pytest.approx(2 * expected) and engine.device_timer.runs == 2


def test_the_unsliced_model_costs_its_stages_summed_until_a_device_measures_it() -> None:
    profile = DeviceProfile.from_json(_profile())
    assert profile.run_seconds(None, 2, 32) == pytest.approx(profile.run_seconds(0, 2, 32) + profile.run_seconds(1, 2, 32))
    measured = DeviceProfile.from_json(_profile(model_times={"stage_times": [{"1": 0.5, "4": 2.0}]}))
    assert measured.run_seconds(None, 2, 0) == pytest.approx(1.0)
    assert measured.run_seconds(0, 8, 0) > measured.run_seconds(0, 4, 0)  # past the profile: along the last two


def _profile_file(tmp_path: Path, stages: int, **extra: object) -> Path:
    path = tmp_path / "device.json"
    path.write_text(json.dumps(_profile(stages, 1e-5, **extra)))
    return path


def test_a_pipeline_on_the_stand_in_crosses_its_device_memory_and_answers_as_the_unsliced_model(zoo, tmp_path: Path) -> None:
    model = zoo.stages("token", 3)
    settings = RuntimeSettings(engine="simulated", device_profile=str(_profile_file(tmp_path, 3, values="computed")),
                               num_buffer_pairs=2)
    pipeline = load_pipeline(model.dir, load_policy("pipelined", {}, model.dir), settings)
    buffers = pipeline.scheduler.board.buffers.buffers
    assert all(isinstance(b.memory, SimulatedMemory) for row in buffers[1:-1] for b in row)  # between stages
    assert not any(isinstance(b.memory, SimulatedMemory) for b in buffers[0] + buffers[-1])  # the host's
    assert all(isinstance(b.fence, CudaEventFence) for row in buffers for b in row)
    collector = Collector()
    pipeline.start()
    try:
        rng = np.random.default_rng(3)
        sent = {}
        for _ in range(24):
            query = model.query(rng)
            sent[pipeline.submit(query, collector)] = query
        assert_all_answered_correctly(model, pipeline, collector, sent)
    finally:
        pipeline.stop()


def test_the_stand_in_needs_a_profile_of_the_models_stages_and_unknown_engines_are_refused(zoo, tmp_path: Path) -> None:
    model = zoo.stages("token", 2)
    stage = model.dir / model.manifest.stages[0].file
    with pytest.raises(ValueError, match="needs a device profile"):
        make_engine(stage, RuntimeSettings(engine="simulated"), model.manifest)
    with pytest.raises(ValueError, match="has 3 stage"):
        make_engine(stage, RuntimeSettings(engine="simulated", device_profile=str(_profile_file(tmp_path, 3))),
                    model.manifest)
    with pytest.raises(ValueError, match="not one this runtime knows"):
        make_engine(stage, RuntimeSettings(engine="tensorrt"), model.manifest)
    with pytest.raises(ValueError, match="unknown parameters"):
        DeviceProfile.from_json({**_profile(), "parameters": {"warp_speed": 9}})
    assert DeviceParameters().concurrent_kernels == 1  # streams share the device until measured


def test_the_baselines_run_on_the_stand_in_at_the_dvabatch_models_buckets(zoo, tmp_path: Path) -> None:
    """ZeroBatch's engine on the stand-in (perf/baselines/model.py, engine "simulated") is charged at
    the graph buckets the dvabatch model's engines are, and costs its stages summed."""
    from perf.baselines import model as baseline_model

    model = zoo.stages("token", 2)
    profile = _profile_file(tmp_path, 2)
    settings = baseline_model.parse_parameters({"engine": "simulated", "device_profile": str(profile)}, model.dir)
    runner = baseline_model.make_runner(settings, model.manifest)
    engines = make_engines(model.dir, model.manifest, RuntimeSettings(engine="simulated", device_profile=str(profile)))
    assert all(e.buckets == runner.engine.buckets for e in engines)
    stages = sum(e.compute_seconds(4, 32) for e in engines)
    assert runner.engine.compute_seconds(4, 32) == pytest.approx(stages)
    with pytest.raises(ValueError, match="needs a device profile"):
        baseline_model.parse_parameters({"engine": "simulated"}, model.dir)


def test_a_manifest_profiled_elsewhere_is_re_profiled_on_the_serving_device_once(zoo, tmp_path: Path,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Loaded on the stand-in, a CPU-profiled manifest's stage times are timed on the device at each
    graph bucket, kept beside the manifest by the device's name, and read back by the next load;
    the pipeline's policies plan with them. A read-only model folder keeps them in the cache."""
    import shutil

    from dvabatch_backend.runtime import device_times
    from dvabatch_backend.runtime.loading import engine_buckets

    model = zoo.stages("token", 2)
    folder = tmp_path / "m"
    shutil.copytree(model.dir, folder)
    settings = RuntimeSettings(engine="simulated", device_profile=str(_profile_file(tmp_path, 2)))
    pipeline = load_pipeline(folder, load_policy("load", {}, folder), settings)
    pipeline.stop()
    manifest = pipeline.manifest
    assert device_times.profiled_on(model.manifest) == "cpu"
    assert manifest.extra["profiled_on"] == "a test device (simulated)"
    sizes, lengths = engine_buckets(settings, model.manifest)
    assert set(manifest.stage_times_by_length()) == set(lengths)
    assert all(set(stage) == set(sizes) for stage in manifest.stage_times())
    kept = folder / "stage_times.a-test-device-simulated.json"
    assert kept.is_file()

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the kept stage times were timed again")

    monkeypatch.setattr(device_times, "time_engines", never)
    again = load_pipeline(folder, load_policy("load", {}, folder), settings)
    again.stop()
    assert again.manifest.stage_times() == manifest.stage_times()

    monkeypatch.setattr(device_times.os, "access", lambda path, mode: False)  # a read-only model repository
    monkeypatch.setenv(device_times.CACHE_ENV, str(tmp_path / "cache"))
    elsewhere = device_times.cache_file(folder, model.manifest, "a test device (simulated)")
    assert elsewhere.parent.parent == tmp_path / "cache" and elsewhere.name == kept.name


class _DeviceFault:
    """A stage engine whose `faulty`-th run raises as CUDA does when the device runs out of memory
    (the error torch raises), then runs on; everything else (its stream, its device) is the inner
    engine's, so the runtime keeps the device path (boundaries in device memory, events)."""

    def __init__(self, inner: object, faulty: int) -> None:
        self.inner, self.faulty, self.runs = inner, faulty, 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def run(self, inputs: object, outputs: object) -> None:
        self.runs += 1
        if self.runs == self.faulty:
            import torch

            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (a test's fault)")
        self.inner.run(inputs, outputs)  # type: ignore[attr-defined]


@pytest.mark.parametrize("pairs", [1, 2])
def test_an_out_of_memory_during_a_batch_touches_only_that_batch_and_the_model_serves_on(zoo, tmp_path: Path,
                                                                                          pairs: int) -> None:
    model = zoo.stages("token", 3)
    settings = RuntimeSettings(engine="simulated", device_profile=str(_profile_file(tmp_path, 3, values="computed")),
                               num_buffer_pairs=pairs, fast_path=False)
    faults: list[_DeviceFault] = []

    def wrap(stage: int, engine: object) -> object:
        if stage != 1:
            return engine
        faults.append(_DeviceFault(engine, faulty=2))
        return faults[-1]

    pipeline = load_pipeline(model.dir, load_policy("pipelined", {}, model.dir), settings, wrap=wrap)
    buffers = pipeline.scheduler.board.buffers.buffers
    assert all(isinstance(b.memory, SimulatedMemory) for row in buffers[1:-1] for b in row)  # the device path
    collector = Collector()
    rng = np.random.default_rng(5)
    pipeline.start()
    try:
        sent = {}
        for _ in range(12):
            query = model.query(rng)
            sent[pipeline.submit(query, collector)] = query
        assert collector.wait_for(set(sent), timeout=30)
        failed = {qid for qid in sent if collector.one(qid).error is not None}
        assert faults[0].runs >= 2  # the fault happened
        for qid in set(sent) - failed:
            assert_matches_reference(model, sent[qid], collector.one(qid))
        for qid in failed:  # a failed row names the stage and the cause
            message = str(collector.one(qid).error)
            assert "stage 1" in message and "out of memory" in message
        later = {}
        for _ in range(6):  # the model serves on after the fault
            query = model.query(rng)
            later[pipeline.submit(query, collector)] = query
        assert collector.wait_for(set(later), timeout=30)
        for qid, query in later.items():
            assert_matches_reference(model, query, collector.one(qid))
        assert pipeline.scheduler.buffer_violations == []
    finally:
        pipeline.stop()
