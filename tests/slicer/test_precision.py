"""`dvabatch slice --precision fp16|bf16`: the stages and the unsliced model converted, their inputs
and outputs in their types, each output checked against the fp32 model within the precision's
tolerance; where the serving engine cannot run an op in that precision, a clear error naming it.

fp16 runs here on onnxruntime's CPU engine, bf16 on the torch engine (onnxruntime's CPU engine has
no bf16 kernels). Correctness is the fp32 unsliced model run on each query alone, shapes included."""
from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST

from dvabatch_backend import Manifest, RuntimeSettings, load_pipeline
from policies import create_policy
from slicer.errors import SliceError
from slicer.cut import input_specs
from slicer.precision import PRECISIONS, check_outputs, convert, output_error
from slicer.profiler import int_bounds, random_inputs
from slicer.serving_engine import ServingEngine
from slicer.slice_model import SliceOptions, slice_model
from slicer.zoo import ZOO, build

ONNXRUNTIME_CPU = ServingEngine()
TORCH_CPU = ServingEngine("torch", "cpu")


def _float_types(graph: onnx.GraphProto) -> set[int]:
    floats = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16}
    return {t.data_type for t in graph.initializer if t.data_type in floats}


def _in_order(graph: onnx.GraphProto) -> bool:
    known = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {""}
    for node in graph.node:
        if not set(node.input) <= known:
            return False
        known |= set(node.output)
    return True


@pytest.mark.parametrize("name", ["fp16", "bf16"])
@pytest.mark.parametrize("zoo", ["bert", "resnet152"])
def test_conversion_keeps_inputs_and_outputs_and_orders_the_nodes(zoo: str, name: str) -> None:
    model = build(zoo)
    half = convert(model, PRECISIONS[name])
    io = [(v.name, v.type.tensor_type.elem_type) for v in [*model.graph.input, *model.graph.output]]
    assert [(v.name, v.type.tensor_type.elem_type) for v in [*half.graph.input, *half.graph.output]] == io
    # every float weight converted but those of ops the converter keeps in fp32 (no half kernels)
    assert PRECISIONS[name].onnx_type in _float_types(half.graph)
    fp32 = {t.name for t in half.graph.initializer if t.data_type == TensorProto.FLOAT}
    assert {n.op_type for n in half.graph.node if set(n.input) & fp32} <= set(DEFAULT_OP_BLOCK_LIST)
    assert _in_order(half.graph)  # the converter's casts placed where the torch engine runs them in order


@pytest.mark.parametrize("name", ["fp16", "bf16"])
@pytest.mark.parametrize("zoo", sorted(ZOO))
def test_every_zoo_model_runs_within_its_tolerance(zoo: str, name: str) -> None:
    """Each zoo model converted and run on the CPU engine that runs the precision (onnxruntime for
    fp16, torch for bf16), against the fp32 model at the longest length."""
    if name == "bf16":
        pytest.importorskip("torch")
    model = build(zoo)
    inputs = list(input_specs(model).values())
    feeds = random_inputs(inputs, 2, ZOO[zoo].max_length.get("test", 0), np.random.default_rng(5), int_bounds(model))
    full = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    expected = dict(zip([o.name for o in full.get_outputs()], full.run(None, feeds)))
    got = (ONNXRUNTIME_CPU if name == "fp16" else TORCH_CPU).run_once(convert(model, PRECISIONS[name]), feeds)
    assert check_outputs(got, expected, PRECISIONS[name], zoo) > 0  # converted: not the fp32 answers


def test_bf16_keeps_a_finite_mask_fill_finite() -> None:
    """fp32's most negative value (a common attention-mask fill) rounds to -inf in bf16, and
    0 * -inf is NaN where the mask lets a token through: it is clamped to bf16's largest."""
    model = build("bert")
    fills = [t.name for t in model.graph.initializer
             if t.data_type == TensorProto.FLOAT and np.isclose(np.abs(numpy_helper.to_array(t)).max(initial=0),
                                                                np.finfo(np.float32).max)]
    assert fills, "the zoo's BERT masks with fp32's min"
    half = {t.name: t for t in convert(model, PRECISIONS["bf16"]).graph.initializer}
    for name in fills:
        assert np.isfinite(numpy_helper.to_array(half[name]).astype(np.float32)).all()


def test_output_error_is_relative_to_the_largest_magnitude() -> None:
    ref = np.array([100.0, -200.0, 1.0], np.float32)
    assert output_error(ref + np.float32(2.0), ref) == pytest.approx(0.01)
    assert output_error(np.array([np.inf, 0, 0], np.float32), ref) == float("inf")
    assert output_error(ref, ref) == 0.0


def _slice(tmp: Path, name: str, serving: ServingEngine) -> tuple[onnx.ModelProto, Manifest, Path]:
    model = build("bert")
    report = slice_model(model, tmp / f"bert_{name}", SliceOptions(
        stages=2, max_batch_size=4, max_length=32, repeats=2, calibration_rounds=0, batch_sizes=(1, 2, 4),
        serving=serving, precision=name))
    return model, report.manifest, report.out_dir / "1"


@pytest.fixture(scope="module")
def fp16_slice(tmp_path_factory: pytest.TempPathFactory):
    return _slice(tmp_path_factory.mktemp("fp16"), "fp16", ONNXRUNTIME_CPU)


def _answers(folder: Path, settings: RuntimeSettings, queries: list[dict[str, np.ndarray]]) -> list:
    answers: list = [None] * len(queries)
    done = threading.Semaphore(0)

    def answer(i: int):
        return lambda a: (answers.__setitem__(i, a), done.release())

    with load_pipeline(folder, create_policy("input"), settings) as pipeline:
        for i, query in enumerate(queries):
            pipeline.submit(query, answer(i))
        for _ in queries:
            assert done.acquire(timeout=60)
    return answers


def _check_served(model: onnx.ModelProto, manifest: Manifest, folder: Path, settings: RuntimeSettings,
                  name: str) -> None:
    """Queries of mixed lengths through the runtime, each against the fp32 model on it alone."""
    full = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in full.get_outputs()]
    rng = np.random.default_rng(7)
    queries = [{k: v[0] for k, v in random_inputs(manifest.inputs, 1, n, rng, int_bounds(model)).items()}
               for n in (3, 17, 32, 9)]
    for query, answer in zip(queries, _answers(folder, settings, queries)):
        assert answer.error is None
        expected = dict(zip(names, full.run(None, {k: v[None] for k, v in query.items()})))
        for out, want in expected.items():
            got = answer.outputs[out]
            assert got.shape == want[0].shape and got.dtype == want.dtype
            assert output_error(got, want[0]) <= PRECISIONS[name].tolerance


def test_an_fp16_slice_records_its_precision_and_its_files_are_fp16(fp16_slice) -> None:
    model, manifest, folder = fp16_slice
    record = manifest.extra["slicing"]["precision"]
    assert record["precision"] == "fp16" and record["tolerance"] == PRECISIONS["fp16"].tolerance
    assert 0 < record["model_error"] <= record["tolerance"] and 0 < record["stages_error"] <= record["tolerance"]
    for file in [s.file for s in manifest.stages] + [str(manifest.full_model)]:
        graph = onnx.load(str(folder / file)).graph
        assert TensorProto.FLOAT16 in _float_types(graph), file
    # the model's inputs and outputs as exported; the boundaries between stages stay fp32
    assert [(t.name, t.dtype) for t in manifest.inputs] == [(i.name, "int64") for i in model.graph.input]
    assert {t.dtype for s in manifest.stages for t in s.outputs if t.dtype.startswith("float")} == {"float32"}


def test_an_fp16_slice_serves_answers_within_its_tolerance(fp16_slice) -> None:
    model, manifest, folder = fp16_slice
    _check_served(model, manifest, folder, RuntimeSettings(num_buffer_pairs=1), "fp16")


def test_bf16_on_the_torch_engine_serves_answers_within_its_tolerance(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    model, manifest, folder = _slice(tmp_path, "bf16", TORCH_CPU)
    assert manifest.extra["slicing"]["precision"]["precision"] == "bf16"
    assert TensorProto.BFLOAT16 in _float_types(onnx.load(str(folder / manifest.stages[0].file)).graph)
    _check_served(model, manifest, folder, RuntimeSettings(engine="torch", device="cpu", num_buffer_pairs=1), "bf16")


def test_bf16_on_onnxruntime_is_refused_naming_the_op(tmp_path: Path) -> None:
    with pytest.raises(SliceError, match=r"cannot run in bf16 on onnxruntime on cpu: .*mask/invert.*--engine torch"):
        _slice(tmp_path, "bf16", ONNXRUNTIME_CPU)
    assert not (tmp_path / "bert_bf16").exists()


def test_a_model_fp16_cannot_hold_is_refused_naming_the_output(tmp_path: Path) -> None:
    """x @ W * 1e5 * 1e-5 is x @ W in fp32; in fp16 the product overflows (its largest is 65504)."""
    w = numpy_helper.from_array(np.eye(8, dtype=np.float32), "w")
    up = numpy_helper.from_array(np.array(1e5, np.float32), "up")
    down = numpy_helper.from_array(np.array(1e-5, np.float32), "down")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"], name="matmul"),
         helper.make_node("Mul", ["h", "up"], ["big"], name="scale_up"),
         helper.make_node("Mul", ["big", "down"], ["y"], name="scale_down")],
        "overflow", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])], [w, up, down])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(SliceError, match=r"unsliced model .* in fp16: output 'y' differs from the fp32 model"):
        slice_model(model, tmp_path / "overflow", SliceOptions(stages=1, max_batch_size=2, repeats=1,
                                                               precision="fp16"))


def test_an_unknown_precision_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SliceError, match="precision 'int4' is not one of fp32, fp16, bf16"):
        slice_model(build("bert"), tmp_path / "x", SliceOptions(stages=2, precision="int4"))
