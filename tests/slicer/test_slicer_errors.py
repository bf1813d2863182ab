"""Bad input to the slicer: a clear error naming the problem, and nothing left in the output."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from slicer import toy
from slicer.analysis import legal_cut_points
from slicer.slice_model import SliceError, SliceOptions, slice_model

QUICK = SliceOptions(max_batch_size=4, max_length=8, repeats=2, calibration_rounds=0, batch_sizes=(1, 2))


def _no_leftovers(parent: Path, out: Path) -> None:
    assert not out.exists()
    assert [p.name for p in parent.iterdir()] == [], "a temporary folder was left behind"


def test_not_an_onnx_file(tmp_path) -> None:
    (tmp_path / "notes.onnx").write_text("this is not a model")
    out_parent = tmp_path / "out"
    out_parent.mkdir()
    with pytest.raises(SliceError, match="is not an ONNX model"):
        slice_model(tmp_path / "notes.onnx", out_parent / "m", QUICK)
    _no_leftovers(out_parent, out_parent / "m")


def test_truncated_file(tmp_path) -> None:
    whole = toy.token_mlp(8, 4).SerializeToString()
    (tmp_path / "cut.onnx").write_bytes(whole[: len(whole) // 2])
    out_parent = tmp_path / "out"
    out_parent.mkdir()
    with pytest.raises(SliceError, match="not an ONNX model|truncated|checker"):
        slice_model(tmp_path / "cut.onnx", out_parent / "m", QUICK)
    _no_leftovers(out_parent, out_parent / "m")


def test_more_stages_than_nodes(tmp_path) -> None:
    out_parent = tmp_path / "out"
    out_parent.mkdir()
    model = toy.dense_mlp(8, 2)  # 5 nodes
    with pytest.raises(SliceError, match="only 5 nodes"):
        slice_model(model, out_parent / "m", SliceOptions(**{**QUICK.__dict__, "stages": 9}))
    _no_leftovers(out_parent, out_parent / "m")


def test_no_legal_cut_for_the_stages_asked(tmp_path) -> None:
    # a sum over the batch crosses every position: it mixes rows, so no cut can carry it
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    nodes = [
        helper.make_node("ReduceSum", ["x", "axes"], ["total"], keepdims=1, name="sum"),
        helper.make_node("Mul", ["total", "two"], ["twice"], name="mul"),
        helper.make_node("Add", ["x", "twice"], ["y"], name="add"),
    ]
    inits = [helper.make_tensor("axes", TensorProto.INT64, [1], [0]), helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y], inits), opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    out_parent = tmp_path / "out"
    out_parent.mkdir()
    with pytest.raises(SliceError, match="legal cut point"):
        slice_model(model, out_parent / "m", SliceOptions(**{**QUICK.__dict__, "stages": 3}))
    _no_leftovers(out_parent, out_parent / "m")


def test_shape_arithmetic_crossing_a_cut_is_remade_not_refused(tmp_path) -> None:
    # Shape -> Cast -> ReduceSum: a tensor with no batch dim crosses every position; the later
    # stage remakes it from the shape of the rows it receives, so every position is legal
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    nodes = [
        helper.make_node("Shape", ["x"], ["s"], name="shape"),
        helper.make_node("Cast", ["s"], ["sf"], to=TensorProto.FLOAT, name="cast"),
        helper.make_node("ReduceSum", ["sf"], ["total"], keepdims=1, name="sum"),
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Add", ["r", "total"], ["y"], name="add"),
    ]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y]), opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    assert [p.position for p in legal_cut_points(model, 0)] == [1, 2, 3, 4]
    report = slice_model(model, tmp_path / "m", SliceOptions(**{**QUICK.__dict__, "stages": 3}))
    assert report.manifest.num_stages == 3  # verified against the original inside slice_model
    for stage in report.manifest.stages:
        assert all(t.dims[0] == "batch" for t in stage.inputs + stage.outputs)


def test_existing_output_is_not_overwritten_without_force(tmp_path) -> None:
    out = tmp_path / "m"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(SliceError, match="exists and is not empty"):
        slice_model(toy.dense_mlp(8, 3), out, SliceOptions(**{**QUICK.__dict__, "stages": 2}))
    assert (out / "keep.txt").read_text() == "mine"


def test_input_without_batch_dim_is_refused_with_its_name(tmp_path) -> None:
    x = helper.make_tensor_value_info("pixels", TensorProto.FLOAT, [3, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4])
    model = helper.make_model(
        helper.make_graph([helper.make_node("Relu", ["pixels"], ["y"], name="r")], "g", [x], [y]),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    model.ir_version = 10
    with pytest.raises(SliceError, match="pixels"):
        slice_model(model, tmp_path / "m", SliceOptions(**{**QUICK.__dict__, "stages": 1}))
    assert not (tmp_path / "m").exists()
    assert isinstance(onnx.load_model_from_string(model.SerializeToString()), onnx.ModelProto)


def test_stages_that_differ_from_the_original_fail_verification(tmp_path, monkeypatch) -> None:
    """The slicer's own check: a cut whose stages in a row do not give the original's outputs is an
    error naming the output and the difference, and nothing is written."""
    import numpy as np
    from onnx import numpy_helper

    from slicer import slice_model as slicing

    verify = slicing.verify_stages

    def tampered(model, folder, manifest, lengths, atol, *precision):  # the first weight matrix met, doubled
        for spec in manifest.stages:  # where the cut falls is measured: any stage may hold the weights
            stage = onnx.load(str(folder / spec.file))
            weights = [w for w in stage.graph.initializer
                       if numpy_helper.to_array(w).size > 1 and numpy_helper.to_array(w).dtype == np.float32]
            if weights:
                weights[0].CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weights[0]) * np.float32(2),
                                                            weights[0].name))
                onnx.save(stage, str(folder / spec.file))
                break
        return verify(model, folder, manifest, lengths, atol, *precision)

    monkeypatch.setattr(slicing, "verify_stages", tampered)
    out_parent = tmp_path / "out"
    out_parent.mkdir()
    with pytest.raises(SliceError, match=r"verification failed: output '.+' of the stages differs from the original by"):
        slice_model(toy.token_mlp(8, 4), out_parent / "m", dataclasses.replace(QUICK, stages=2))
    _no_leftovers(out_parent, out_parent / "m")
