"""The GPU runs' CPU-checkable parts: the overlap arithmetic over stage intervals, and the sized
toy model the overlap check slices (its stages run in order equal the whole, on onnxruntime)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import onnxruntime as ort

from perf.gpu.pipelines import sliced_token_mlp
from perf.gpu.timeline import Interval, busy_overlap_ms, overlapping_pairs


def test_serial_intervals_do_not_overlap() -> None:
    serial = [Interval(0, 0.0, 1.0), Interval(1, 1.0, 2.0), Interval(0, 2.5, 3.0), Interval(1, 3.0, 4.0)]
    assert overlapping_pairs(serial) == []
    assert busy_overlap_ms(serial) == 0.0


def test_overlap_only_between_different_stages() -> None:
    runs = [Interval(0, 0.0, 2.0), Interval(1, 1.5, 3.0), Interval(0, 2.5, 4.0), Interval(1, 3.5, 5.0)]
    pairs = overlapping_pairs(runs)
    assert [(a.stage, b.stage) for a, b in pairs] == [(0, 1), (1, 0), (0, 1)]
    assert busy_overlap_ms(runs) == 0.5 + 0.5 + 0.5
    same_stage = [Interval(2, 0.0, 2.0), Interval(2, 1.0, 3.0)]
    assert overlapping_pairs(same_stage) == []


def test_sliced_token_mlp_stages_equal_the_whole(tmp_path: Path) -> None:
    model_dir, manifest = sliced_token_mlp(tmp_path / "m", hidden=32, layers=6, stages=3, bs_max=4, max_length=16)
    assert manifest.num_stages == 3
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((2, 5, 32)).astype(np.float32), "mask": np.ones((2, 5), np.float32)}
    whole = ort.InferenceSession(str(model_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    tensors = dict(feeds)
    for spec in manifest.stages:
        session = ort.InferenceSession(str(model_dir / spec.file), providers=["CPUExecutionProvider"])
        out = session.run(None, {i.name: tensors[i.name] for i in session.get_inputs()})
        tensors.update({o.name: v for o, v in zip(session.get_outputs(), out)})
    for output, value in zip(whole.get_outputs(), whole.run(None, feeds)):
        np.testing.assert_allclose(tensors[output.name], value, atol=1e-5)


class _GatedEngine:
    """Records each batch's rows; the first run waits for `gate` (ordering by events, not time)."""

    def __init__(self) -> None:
        import threading

        self.gate, self.entered = threading.Event(), threading.Event()
        self.batches: list[int] = []

    def run(self, inputs, outputs) -> None:
        self.entered.set()
        self.gate.wait(30)
        self.batches.append(len(next(iter(inputs.values()))))


def _on(event):
    """A side-by-side `done` callback that sets `event` (and keeps whether the answer was a result)."""
    def done(ok: bool) -> None:
        event.ok = ok
        event.set()
    return done


def _batcher_queries(tmp_path: Path, n: int):
    from perf.gpu.side_by_side import QUICK, make_queries, prepare

    model_dir, manifest, int_high = prepare(tmp_path, QUICK, "cpu")
    return manifest, make_queries(QUICK, manifest, int_high, n, seed=0)


def test_zerobatch_runs_what_queued_behind_the_running_batch(tmp_path: Path) -> None:
    import threading

    from perf.gpu.side_by_side import DynamicBatcher

    manifest, queries = _batcher_queries(tmp_path, 3)
    engine = _GatedEngine()
    batcher = DynamicBatcher(engine, manifest, bs_max=4).start()
    done = [threading.Event() for _ in queries]
    batcher.submit(queries[0], _on(done[0]))
    assert engine.entered.wait(30)  # the first query runs alone, at once (no delay)
    for q, d in zip(queries[1:], done[1:]):
        batcher.submit(q, _on(d))
    engine.gate.set()
    assert all(d.wait(30) for d in done)
    batcher.stop()
    assert engine.batches == [1, 2]


def test_delaybatch_waits_for_a_full_batch_within_its_delay(tmp_path: Path) -> None:
    import threading

    from perf.gpu.side_by_side import DynamicBatcher

    manifest, queries = _batcher_queries(tmp_path, 3)
    engine = _GatedEngine()
    engine.gate.set()
    batcher = DynamicBatcher(engine, manifest, bs_max=3, delay_s=60.0).start()  # only a full batch can start it
    done = [threading.Event() for _ in queries]
    for q, d in zip(queries, done):
        assert not engine.entered.is_set()
        batcher.submit(q, _on(d))
    assert all(d.wait(30) for d in done)
    batcher.stop()
    assert engine.batches == [3]


def test_gpu_side_by_side_on_a_zoo_model_answers_every_query(tmp_path: Path) -> None:
    """The zoo path of perf.gpu.side_by_side on the CPU (ResNet-152 at the zoo's test size): cut
    evenly, profiled with the engine it serves on into the manifest, every system answers all."""
    from dataclasses import replace

    from dvabatch_backend import Manifest
    from perf.gpu.side_by_side import QUICK, run

    setup = replace(QUICK, model="resnet152", size="test", max_length=0, preset="", stages=2, policies=("load",))
    result = run(tmp_path, setup, "cpu")
    manifest = Manifest.load(tmp_path / "model" / "manifest.json")
    assert [sorted(t) for t in manifest.stage_times()] == [[1, 2, 4]] * 2
    assert set(result["lone"]) == {"ZeroBatch", "DelayBatch-1ms", "DVABatch-load"}
    for load in result["loads"]:
        assert all(s["answered"] == s["sent"] == load["queries"] for s in load["systems"].values())
        batches = load["systems"]["DVABatch-load"]["batches"]
        ran = batches["pipeline_mean_bs"] * batches["pipeline_batches"] + batches["whole_mean_bs"] * batches["whole_batches"]
        assert 0 < ran <= load["queries"] and 0 <= batches["whole_share"] <= 1


class _ThreadRecordingEngine(_GatedEngine):
    """A stage engine that also records the thread each batch ran on."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[str] = []

    def run(self, inputs, outputs) -> None:
        import threading

        self.threads.append(threading.current_thread().name)
        super().run(inputs, outputs)


@pytest.mark.parametrize("pairs,hand_off", [(2, False), (1, False), (2, True), (1, True)])
def test_dvabatch_takes_what_queued_as_the_adapter_execute_does(tmp_path: Path, pairs: int, hand_off: bool) -> None:
    """The side by side's DVABatch front hands the runtime what queued while its last call ran, as
    Triton hands `execute`: a lone query runs at once on the front's thread (the loop idle), the
    three that queued behind it together, as one batch: on the front's thread too, or, with the
    hand-over rule (`hand_off`: several requests, the hand-over not yet measured), on the engine
    loop's thread (one pair) or its launch worker (two)."""
    import threading

    from dvabatch_backend.runtime.pipeline import Pipeline
    from dvabatch_backend.runtime.settings import RuntimeSettings
    from perf.gpu.side_by_side import DvaBatch
    from policies import create_policy

    manifest, queries = _batcher_queries(tmp_path, 4)
    engines = [_ThreadRecordingEngine() for _ in manifest.stages]
    for engine in engines[1:]:
        engine.gate.set()
    settings = RuntimeSettings(num_buffer_pairs=pairs, bs_max=4)
    front = DvaBatch(Pipeline.create(manifest, engines, create_policy("load"), settings), hand_off).start()
    done = [threading.Event() for _ in queries]
    try:
        front.submit(queries[0], _on(done[0]))
        assert engines[0].entered.wait(30)  # the lone query runs at once
        for q, d in zip(queries[1:], done[1:]):
            front.submit(q, _on(d))
        engines[0].gate.set()
        assert all(d.wait(30) for d in done)
    finally:
        front.stop()
    assert all(d.ok for d in done)
    assert engines[0].batches == [1, 3]
    second = "dvabatch-execute" if not hand_off else "dvabatch-launch" if pairs > 1 else "dvabatch-engine-loop"
    assert engines[0].threads[0] == "dvabatch-execute" and engines[0].threads[1].startswith(second)
