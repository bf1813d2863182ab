"""Length dims as expressions of `seq`: the runtime's evaluator (no eval, exact arithmetic) and the
slicer's ONNX nodes for the same expression agree with plain Python at every length tried."""
from __future__ import annotations

import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from dvabatch_backend.runtime.length_expr import NotALength, is_length, parse_length
from dvabatch_backend.runtime.manifest import Manifest, TensorSpec, dim_size
from slicer.length_nodes import length_nodes

# each as sympy (or an older manifest) writes it, beside the same in plain Python
CASES = [
    ("seq", lambda n: n),
    ("seq//4", lambda n: n // 4),
    ("(seq+3)//4", lambda n: (n + 3) // 4),
    ("floor(seq/2 - 1/2) + 1", lambda n: math.ceil(n / 2)),
    ("floor(floor(seq/2 - 5/2)/2)", lambda n: ((n - 5) // 2) // 2),
    ("8*floor(floor(floor(seq/2 - 1/2)/2)/2) + 4*floor(floor(floor(floor(seq/2 - 1/2)/2)/2)/2) + 14",
     lambda n: 8 * ((((n - 1) // 2) // 2) // 2) + 4 * (((((n - 1) // 2) // 2) // 2) // 2) + 14),
    ("floor(2.0*floor(2.0*floor(floor(seq/2 - 1/2)/2))) + 4", lambda n: 4 * ((((n - 1) // 2) // 2)) + 4),
    ("ceil(3*seq/4 - 7/3) + 2", lambda n: -((-(9 * n - 28)) // 12) + 2),
    ("Max(1, floor(seq/7))", lambda n: max(1, n // 7)),
    ("seq**2 + 3", lambda n: n * n + 3),
    ("-floor(-seq/5)", lambda n: -((-n) // 5)),
]


@pytest.mark.parametrize("text,plain", CASES)
def test_the_evaluator_is_exact(text, plain) -> None:
    expression = parse_length(text)
    assert [expression(n) for n in range(-20, 400)] == [plain(n) for n in range(-20, 400)]
    assert dim_size(text, 37) == plain(37)


@pytest.mark.parametrize("text,plain", CASES)
def test_the_onnx_nodes_compute_the_same(text, plain) -> None:
    built = length_nodes(text, "length", "x")
    graph = helper.make_graph(built.nodes, "g", [helper.make_tensor_value_info("length", onnx.TensorProto.INT64, [1])],
                              [helper.make_tensor_value_info(built.output, onnx.TensorProto.INT64, [1])],
                              initializer=built.constants)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    got = [int(session.run(None, {"length": np.array([n], np.int64)})[0][0]) for n in range(-20, 300)]
    assert got == [plain(n) for n in range(-20, 300)]


@pytest.mark.parametrize("text", ["batch*seq", "seq.real", "__import__('os').system('true')", "7", "floor(seq, 2)",
                                  "seq if seq else 1", "[seq]", "seq**seq", "lambda: seq", "'seq'", "seq; 1"])
def test_anything_else_is_not_a_length(text) -> None:
    assert not is_length(text)
    with pytest.raises(NotALength):
        parse_length(text)


def test_a_fraction_is_no_dim() -> None:
    with pytest.raises(ValueError, match="not a whole number"):
        parse_length("seq/2")(3)


def test_the_manifest_takes_expressions_and_refuses_the_rest() -> None:
    spec = TensorSpec("y", "float32", ("batch", "floor(seq/2 - 1/2) + 1", 4))
    assert spec.has_seq and spec.shape(3, 9) == (3, 5, 4)
    stage = {"file": "s.onnx", "inputs": [{"name": "x", "dtype": "float32", "dims": ["batch", "seq"]}],
             "outputs": [spec.to_json()]}
    doc = {"schema_version": 1, "name": "m", "max_batch_size": 4, "max_length": 16, "inputs": stage["inputs"],
           "outputs": stage["outputs"], "stages": [stage], "min_length": 3, "length_multiple": 1,
           "length_rule": "fails under 3"}
    manifest = Manifest.from_json(doc)
    assert manifest.valid_lengths() == list(range(3, 17)) and not manifest.takes_length(2)
    bad = {**doc, "outputs": [{**spec.to_json(), "dims": ["batch", "__import__('os')", 4]}]}
    with pytest.raises(Exception, match="length expression"):
        Manifest.from_json(bad)
