"""Axis discovery as a user meets it: any dim names, unnamed dims, the overrides, and one clear line
(leaving nothing behind) for axes dvabatch cannot batch along."""
from __future__ import annotations

from pathlib import Path

import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from dvabatch_backend.tools.cli import main
from slicer.axes import AxisError, AxisOverrides, canonical_model, discover_axes

ARGS = ["--stages", "2", "--bs-max", "4", "--max-length", "16", "--repeats", "2"]


def _image_model(dims: list, path: Path | None = None) -> onnx.ModelProto:
    """x [N, C, H, W] -> two ReLUs -> y of the same shape, with the input dims as given."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)
    nodes = [helper.make_node("Relu", ["x"], ["h"], name="r1"), helper.make_node("Sigmoid", ["h"], ["y"], name="r2")]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y]), opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    if path is not None:
        onnx.save(model, str(path))
    return model


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("slicing: step")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_exporter_dim_names_and_unnamed_dims_are_discovered() -> None:
    model = _image_model(["unk__214", 3, 8, "p2o.DynamicDimension.1"])
    axes = discover_axes(model)
    assert axes.variable == {"x": 3}
    dims = [d.dim_param or d.dim_value for d in canonical_model(model, axes).graph.input[0].type.tensor_type.shape.dim]
    assert dims == ["batch", 3, 8, "seq"]
    unnamed = _image_model([None, 3, 8, 8])  # batch dim with neither name nor value
    assert discover_axes(unnamed).variable == {"x": None}


def test_a_fixed_batch_dim_is_refused_with_what_to_do(tmp_path, capsys) -> None:
    path = tmp_path / "one.onnx"
    _image_model([1, 3, 8, 8], path)
    parent = tmp_path / "repo"
    parent.mkdir()
    assert main(["slice", str(path), "--out", str(parent / "m"), *ARGS]) != 0
    line = _one_line(capsys.readouterr().err)
    assert "fixed batch dim of 1" in line and "dynamic_axes" in line
    assert list(parent.iterdir()) == []


def test_two_variable_axes_need_an_override(tmp_path, capsys) -> None:
    path = tmp_path / "hw.onnx"
    _image_model(["N", 3, "height", "width"], path)
    parent = tmp_path / "repo"
    parent.mkdir()
    assert main(["slice", str(path), "--out", str(parent / "m"), *ARGS]) != 0
    line = _one_line(capsys.readouterr().err)
    assert "2 variable axes" in line and "--fixed" in line and "--variable-axis" in line
    assert list(parent.iterdir()) == []

    assert main(["slice", str(path), "--out", str(parent / "m"), *ARGS, "--variable-axis", "x:3",
                 "--fixed", "height=8"]) == 0
    capsys.readouterr()
    full = ort.InferenceSession(str(parent / "m" / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    shape = [d if isinstance(d, int) else "sym" for d in full.get_inputs()[0].shape]
    assert shape == ["sym", 3, 8, "sym"]


@pytest.mark.parametrize("flag, value, expected", [
    ("--fixed", "height", "--fixed DIM=VALUE"),
    ("--variable-axis", "x:9", "axis 9 of 'x' is not dynamic"),
    ("--batch-axis", "x:1", "batch must be the first axis"),
    ("--variable-axis", "nope:1", "no model input named"),
])
def test_bad_axis_flags_get_one_clear_line(tmp_path, capsys, flag: str, value: str, expected: str) -> None:
    path = tmp_path / "w.onnx"
    _image_model(["N", 3, 8, "width"], path)
    parent = tmp_path / "repo"
    parent.mkdir()
    assert main(["slice", str(path), "--out", str(parent / "m"), *ARGS, flag, value]) != 0
    assert expected in _one_line(capsys.readouterr().err)
    assert list(parent.iterdir()) == []


def test_overrides_parse() -> None:
    o = AxisOverrides.parse(["x:0"], ["x:3"], ["height=8", "x:2=8"])
    assert (dict(o.batch_axis), dict(o.variable_axis), dict(o.fixed)) == ({"x": 0}, {"x": 3}, {"height": 8, "x:2": 8})
    with pytest.raises(AxisError):
        AxisOverrides.parse(fixed=["x:2"])
