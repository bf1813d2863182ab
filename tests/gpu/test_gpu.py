"""The runtime on a GPU: the torch engine on CUDA behind the buffer pairs, with CUDA event fences.

Skipped without torch or without a CUDA device (so everywhere but a GPU host; see perf/README.md
for the steps of `python -m perf.gpu.run_device` that run it):

- the torch engine on CUDA equals onnxruntime stage by stage, and a CUDA graph's replay equals
  the eager run;
- `CudaEventFence` orders a reader stream after a writer stream;
- the property test (random arrivals, random legal meta operations) with every stage on CUDA:
  exactly one answer per query, equal to the unsliced model within fp32 tolerance, no
  buffer-pair rule broken;
- the first stage's executor waits for its batch on the device before it takes another;
- the overlap check from CUDA event timings: with one buffer pair the stages never overlap on
  the GPU timeline; with two they do;
- a model sliced on the device in fp16 and bf16 answers within each precision's tolerance.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: torch.cuda.is_available() is False", allow_module_level=True)

from hypothesis import HealthCheck, given, settings  # noqa: E402

from dvabatch_backend.runtime.fences import CudaEventFence, cuda_fences  # noqa: E402
from dvabatch_backend.runtime.loading import make_engine  # noqa: E402
from dvabatch_backend.runtime.settings import RuntimeSettings  # noqa: E402
from dvabatch_backend.runtime.torch_engine import TorchStageEngine  # noqa: E402  (the torch engine's API)
from perf.gpu.overlap import stage_timeline  # noqa: E402
from perf.gpu.pipelines import cuda_pipeline  # noqa: E402
from perf.gpu.timeline import overlapping_pairs  # noqa: E402

from ..conftest import Collector, ExitQueries, SlowEngine, assert_all_answered_correctly, sliced_cascade  # noqa: E402
from ..runtime.test_property import drive_scenario, scenario_policy, scenarios  # noqa: E402

# fp32 answers compared with the CPU's: no TF32 in matrix products or convolutions
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


class EngineCache:
    """Torch CUDA engines per sliced model, made once: loading a stage costs more than a query.
    With `graphs`, loaded as the runtime loads them on CUDA: CUDA graphs per bucket."""

    def __init__(self, graphs: bool = False) -> None:
        self._engines: dict[Path, list[TorchStageEngine]] = {}
        self._settings = RuntimeSettings(engine="torch", device="cuda", cuda_graphs=graphs)

    def get(self, model) -> list[TorchStageEngine]:
        if model.dir not in self._engines:
            self._engines[model.dir] = [make_engine(model.dir / s.file, self._settings, model.manifest)
                                        for s in model.manifest.stages]
        return self._engines[model.dir]


@pytest.fixture(scope="module")
def cuda_engines() -> EngineCache:
    return EngineCache()


@pytest.fixture(scope="module")
def graphed_engines() -> EngineCache:
    return EngineCache(graphs=True)


def stage_inputs(engine: TorchStageEngine, batch: int, length: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    shapes = engine.input_shapes(batch, length)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def ort_outputs(path: Path, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, inputs)))


def run_engine(engine, inputs: dict[str, np.ndarray], like: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    outputs = {name: np.empty_like(value) for name, value in like.items()}
    engine.run(inputs, outputs)
    return outputs


# -- the engine --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["token", "dense"])
def test_torch_on_cuda_equals_onnxruntime_stage_by_stage(zoo, cuda_engines: EngineCache, kind: str) -> None:
    model = zoo.stages(kind, 3)
    rng = np.random.default_rng(0)
    for spec, engine in zip(model.manifest.stages, cuda_engines.get(model)):
        for batch, length in ((1, 1), (3, 7), (8, 12)):
            inputs = stage_inputs(engine, batch, length, rng)
            expected = ort_outputs(model.dir / spec.file, inputs)
            got = run_engine(engine, inputs, expected)
            for name, value in expected.items():
                np.testing.assert_allclose(got[name], value, atol=1e-5, rtol=1e-5, err_msg=f"{spec.file}: {name}")


def test_cuda_graph_replay_equals_eager(zoo) -> None:
    model = zoo.stages("token", 3)
    rng = np.random.default_rng(1)
    for spec in model.manifest.stages:
        eager = TorchStageEngine(model.dir / spec.file, device="cuda")
        graphed = TorchStageEngine(model.dir / spec.file, device="cuda")
        key = graphed.capture(4, 9)
        assert key in graphed.captured
        for _ in range(3):  # replays reuse the static buffers: every replay must see its own inputs
            inputs = stage_inputs(eager, 4, 9, rng)
            like = ort_outputs(model.dir / spec.file, inputs)
            want, got = run_engine(eager, inputs, like), run_engine(graphed, inputs, like)
            for name in like:
                np.testing.assert_allclose(got[name], want[name], atol=1e-6, rtol=1e-6, err_msg=f"{spec.file}: {name}")
        other = stage_inputs(eager, 2, 9, rng)  # a shape not captured runs eagerly
        like = ort_outputs(model.dir / spec.file, other)
        for name, value in run_engine(graphed, other, like).items():
            np.testing.assert_allclose(value, like[name], atol=1e-5, rtol=1e-5)


def test_a_stages_device_time_comes_from_cuda_events_around_its_runs(zoo) -> None:
    model = zoo.stages("token", 3)
    spec = model.manifest.stages[0]
    engine = TorchStageEngine(model.dir / spec.file, device="cuda")
    engine.capture(4, 9)
    rng = np.random.default_rng(2)
    inputs = stage_inputs(engine, 4, 9, rng)
    like = ort_outputs(model.dir / spec.file, inputs)
    for _ in range(5):
        run_engine(engine, inputs, like)  # host outputs: each run waits for the device
    timer = engine.device_timer
    assert timer is not None
    timer.collect()  # as a step does: reads the last one too
    assert timer.seconds() > 0 and timer.runs == 5


@pytest.mark.parametrize("pad_length", [True, False])
def test_bucket_graphs_pad_and_cut_back_equal_eager(zoo, pad_length: bool) -> None:
    """A batch of any shape replays the smallest bucket's graph that holds it (rows, and with
    pad_length the length, zero-padded; outputs cut back) and answers as the eager run does."""
    model = zoo.stages("token", 3)
    rng = np.random.default_rng(2)
    for spec in model.manifest.stages:
        eager = TorchStageEngine(model.dir / spec.file, device="cuda")
        graphed = TorchStageEngine(model.dir / spec.file, device="cuda")
        assert graphed.capture_buckets([2, 4], [8, 12], pad_length=pad_length) == 4
        for batch, length, replays in ((3, 9, pad_length), (1, 1, pad_length), (4, 12, True), (3, 12, True),
                                       (5, 12, False), (2, 13, False)):
            before = graphed.replays
            inputs = stage_inputs(eager, batch, length, rng)
            like = ort_outputs(model.dir / spec.file, inputs)
            want, got = run_engine(eager, inputs, like), run_engine(graphed, inputs, like)
            assert graphed.replays - before == int(replays), (batch, length)
            for name in like:
                assert got[name].shape == like[name].shape
                np.testing.assert_allclose(got[name], want[name], atol=1e-5, rtol=1e-5, err_msg=f"{spec.file}: {name}")


# -- the fence -----------------------------------------------------------------------------


def test_cuda_event_fence_orders_the_reader_after_the_writer() -> None:
    writer, reader = torch.cuda.Stream(), torch.cuda.Stream()
    fence = CudaEventFence(writer, reader)
    data = torch.zeros(1 << 20, device="cuda")
    fence.reset()
    assert fence.wait() is False  # reset and not recorded: the pool's self-check sees it
    with torch.cuda.stream(writer):
        torch.cuda._sleep(50_000_000)  # keep the writer busy well past the reader's start
        data.fill_(7.0)
    fence.record()
    assert fence.wait() is True  # returns at once: the reader's stream waits, not the host
    with torch.cuda.stream(reader):
        seen = data.sum()
    fence.record_read()
    fence.wait_read()
    reader.synchronize()  # `seen` is the reader stream's; the host reads it once that stream is done
    assert float(seen.item()) == 7.0 * data.numel()


def test_legitimation_makes_the_writer_stream_wait_for_the_read_not_the_host() -> None:
    writer, reader = torch.cuda.Stream(), torch.cuda.Stream()
    fence = CudaEventFence(writer, reader)
    data = torch.full((1 << 20,), 3.0, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(reader):
        torch.cuda._sleep(200_000_000)  # the reader still busy when the buffer is handed back
        seen = data.sum()
    fence.record_read()
    fence.wait_read()
    assert not reader.query(), "wait_read blocked the host until the read was done"
    with torch.cuda.stream(writer):
        data.fill_(9.0)  # queued after the read: must not change what the reader sums
    torch.cuda.synchronize()
    assert float(seen.item()) == 3.0 * data.numel()


def test_cuda_fences_map_boundaries_to_streams() -> None:
    streams = [torch.cuda.Stream() for _ in range(3)]
    factory = cuda_fences(streams)
    first, middle, last = factory(0, 0), factory(2, 1), factory(3, 0)
    assert first.writer_stream is None and first.reader_stream == streams[0]
    assert middle.writer_stream == streams[1] and middle.reader_stream == streams[2]
    assert last.writer_stream == streams[2] and last.reader_stream is None


# -- the property test on the GPU -----------------------------------------------------------


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(scenario=scenarios())
def test_random_schedules_on_cuda_answer_every_query_once_and_correctly(zoo, graphed_engines: EngineCache,
                                                                        scenario: dict) -> None:
    """With the engines as the runtime loads them on CUDA: CUDA graphs per bucket."""
    model = zoo.get(scenario["kind"], scenario["cuts"])
    engines = graphed_engines.get(model)
    if scenario["delay"]:
        engines = [SlowEngine(e, scenario["delay"]) for e in engines]
    run_settings = RuntimeSettings(num_buffer_pairs=scenario["pairs"], bs_max=scenario["bs_max"], record_trace=True,
                                   engine="torch", device="cuda")
    pipeline = cuda_pipeline(model.manifest, engines, scenario_policy(scenario), run_settings)
    buffers = pipeline.scheduler.board.buffers.buffers
    assert all(isinstance(b.fence, CudaEventFence) for b in buffers[1])
    if not scenario["delay"] and len(buffers) > 2:  # a wrapped engine shows no stream: its boundaries stay on the host
        assert all(t.is_cuda for row in buffers[1:-1] for b in row for t in b.views(1).values())
    drive_scenario(model, pipeline, scenario)


def test_an_early_exit_on_cuda_answers_from_a_boundary_in_device_memory(tmp_path: Path) -> None:
    """The early-exit example policy over stages on CUDA: its look at the exit head and the exits'
    answers copy the boundary (in device memory) to the host once its writer's event completed."""
    from policies.examples.early_exit import EarlyExitPolicy

    cascade = sliced_cascade(tmp_path)
    exits = ExitQueries.make(cascade, 16, seed=5)
    pipeline = cuda_pipeline(cascade.manifest, EngineCache(graphs=True).get(cascade),
                             EarlyExitPolicy(threshold=exits.threshold, exit_stage=0),
                             RuntimeSettings(num_buffer_pairs=2, engine="torch", device="cuda"))
    assert pipeline.scheduler.board.buffers.buffers[1][0].memory.on_device
    collector = Collector()
    with pipeline:
        sent = pipeline.submit_many([(q, collector) for q in exits.queries])
        assert collector.wait_for(sent, timeout=30)
    exits.assert_answered(collector, sent, exit_atol=1e-4)
    assert pipeline.stats.early_exits == int(exits.leaves.sum())
    assert pipeline.buffer_violations == []


def test_the_entrys_executor_takes_no_batch_while_its_last_one_still_runs_on_the_device(zoo, graphed_engines: EngineCache) -> None:
    """`entry_waits_for_device` (the default): stage 0's engine returns with its work queued on its
    stream, and its executor waits for the device before it takes another batch; so each stage-0
    run starts after the last one finished on the device, each made 10 ms longer there."""
    from policies.load_diversity import LoadDiversityPolicy

    model = zoo.stages("token", 3)
    engines = graphed_engines.get(model)
    first = engines[0]
    finished: list = []  # each stage-0 run's completion event on its stream
    starts_after_the_last_finished: list[bool] = []
    run = first.run

    def slow_run(inputs, outputs) -> None:
        starts_after_the_last_finished.append(all(e.query() for e in finished))
        run(inputs, outputs)
        with torch.cuda.stream(first.stream):
            torch.cuda._sleep(20_000_000)  # GPU clock cycles: ~10 ms
            finished.append(torch.cuda.Event())
            finished[-1].record(first.stream)

    first.run = slow_run  # type: ignore[method-assign]
    try:
        pipeline = cuda_pipeline(model.manifest, engines, LoadDiversityPolicy(t_comp_wait=0.0),
                                 RuntimeSettings(num_buffer_pairs=2, engine="torch", device="cuda"))
        rng = np.random.default_rng(3)
        queries = [model.query(rng, int(n)) for n in rng.integers(1, 12, size=16)]
        collector = Collector()
        with pipeline:
            sent = [qid for q in queries for qid in pipeline.submit_many([(q, collector)])]
            assert_all_answered_correctly(model, pipeline, collector, dict(zip(sent, queries)))
    finally:
        del first.run  # the module's engines serve the other tests as loaded
    assert len(starts_after_the_last_finished) == pipeline.stats.stages[0].batches >= 2
    assert all(starts_after_the_last_finished)


# -- the overlap check -------------------------------------------------------------------------


def test_one_pair_never_overlaps_two_pairs_do(tmp_path: Path) -> None:
    """perf.gpu.overlap's run (a heavier token MLP in 3 stages, 48 queries at once): every stage
    run's interval on the GPU timeline, from CUDA events on the stages' streams."""
    serial = stage_timeline(tmp_path, pairs=1)
    assert len(serial) >= 3 * 6  # 48 queries in batches of at most 8, through 3 stages
    assert overlapping_pairs(serial) == [], "with one buffer pair two stages ran at once on the GPU"
    overlapped = stage_timeline(tmp_path, pairs=2)
    assert overlapping_pairs(overlapped), "with two buffer pairs no two stages ever ran at once on the GPU"


# -- a transformer's stages on graphs ------------------------------------------------------------


@pytest.mark.parametrize("pairs", [1, 2])
def test_a_transformers_stages_on_graphs_answer_mixed_lengths_as_the_unsliced_model(tmp_path: Path, pairs: int) -> None:
    """The zoo BERT (test size, 2 layers) in 2 stages, each on CUDA graphs of bucket lengths, queries of every
    length at once through the pipeline and one at a time on the fast path. A later stage's inputs
    hold an additive attention mask, which zero-padding to a bucket's length would unmask: the
    scheduler pads each batch before stage 0 instead (`settings.graph_length`)."""
    import onnxruntime as ort

    from perf.gpu.pipelines import sliced_zoo_model, torch_engines
    from perf.baselines.bench import query_maker
    from policies import create_policy

    model_dir, manifest, int_high = sliced_zoo_model("bert", tmp_path / "bert", stages=2, bs_max=8, max_length=40,
                                                     size="test")
    engines = torch_engines(model_dir, manifest, "cuda", cuda_graphs=True, bs_max=8)
    pipeline = cuda_pipeline(manifest, engines, create_policy("input"),
                             RuntimeSettings(num_buffer_pairs=pairs, bs_max=8, engine="torch", device="cuda"))
    rng = np.random.default_rng(pairs)
    query = query_maker(manifest, int_high)
    queries = [query(rng, n) for n in (1, 3, 7, 16, 17, 21, 32, 33, 40, 5, 12, 29)]
    full = ort.InferenceSession(str(model_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    names = [o.name for o in full.get_outputs()]

    def check(q: dict, got: dict) -> None:
        for name, ref in zip(names, full.run(names, {k: v[None] for k, v in q.items()})):
            np.testing.assert_allclose(got[name], ref[0], atol=1e-4, rtol=0, err_msg=name)

    collector = Collector()
    with pipeline:
        for q in queries[:3]:  # alone: the fast path (the stages in a row)
            out = pipeline.run_inline({k: v[None] for k, v in q.items()})
            assert out is not None
            check(q, {k: v[0] for k, v in out.items()})
        sent = dict(zip(pipeline.submit_many([(q, collector) for q in queries]), queries))
        assert collector.wait_for(set(sent), timeout=60)
    for qid, q in sent.items():
        answer = collector.one(qid)
        assert answer.error is None, answer.error
        check(q, answer.outputs)


# -- half precision on the device ----------------------------------------------------------------


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_a_half_precision_slice_on_graphs_answers_within_its_tolerance(tmp_path: Path, precision: str) -> None:
    """The zoo BERT (test size) sliced on the device in fp16 and bf16 (`--device cuda --precision`):
    the stages run on CUDA graphs in the half type, queries of mixed lengths answer within the
    precision's tolerance of the fp32 model run on each alone, in the exported shapes and types."""
    import onnxruntime as ort

    from dvabatch_backend.runtime.loading import load_pipeline
    from policies import create_policy
    from slicer.precision import PRECISIONS, output_error
    from slicer.profiler import int_bounds, random_inputs
    from slicer.serving_engine import ServingEngine
    from slicer.slice_model import SliceOptions, slice_model
    from slicer.zoo import build

    model = build("bert")
    report = slice_model(model, tmp_path / "bert", SliceOptions(
        stages=2, max_batch_size=8, max_length=32, repeats=2, calibration_rounds=0,
        serving=ServingEngine("torch", "cuda"), precision=precision))
    full = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in full.get_outputs()]
    rng = np.random.default_rng(8)
    queries = [{k: v[0] for k, v in random_inputs(report.manifest.inputs, 1, n, rng, int_bounds(model)).items()}
               for n in (1, 5, 16, 17, 32, 9)]
    collector = Collector()
    settings = RuntimeSettings(engine="torch", device="cuda", num_buffer_pairs=1, bs_max=8)
    with load_pipeline(report.out_dir, create_policy("input"), settings) as pipeline:
        sent = dict(zip(pipeline.submit_many([(q, collector) for q in queries]), queries))
        assert collector.wait_for(set(sent), timeout=60)
    for qid, query in sent.items():
        answer = collector.one(qid)
        assert answer.error is None
        for name, want in zip(names, full.run(names, {k: v[None] for k, v in query.items()})):
            got = answer.outputs[name]
            assert got.shape == want[0].shape and got.dtype == want.dtype, name
            assert output_error(got, want[0]) <= PRECISIONS[precision].tolerance, name
