"""A small helper for building ONNX graphs from numpy weights, shared by the zoo models.

Every node gets a unique, readable name (the profiler maps costs back by node name), every
model uses IR version 10 and opset 17 (onnxruntime 1.31 refuses onnx 1.23's default IR 14).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

IR_VERSION = 10
OPSET = 17


class GraphBuilder:
    def __init__(self, name: str, seed: int = 0) -> None:
        self.name = name
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.metadata: dict[str, str] = {}
        self._counts: dict[str, int] = {}

    def fresh(self, hint: str) -> str:
        """A unique name starting with `hint`."""
        n = self._counts.get(hint, 0)
        self._counts[hint] = n + 1
        return hint if n == 0 else f"{hint}_{n}"

    def input(self, name: str, elem_type: int, dims: Sequence[int | str]) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, list(dims)))
        return name

    def output(self, name: str, elem_type: int, dims: Sequence[int | str]) -> str:
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, list(dims)))
        return name

    def const(self, array: np.ndarray, hint: str = "const") -> str:
        name = self.fresh(hint)
        self.initializers.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def weight(self, shape: Sequence[int], hint: str, scale: float | None = None) -> str:
        """Seeded normal weights, scaled by 1/sqrt(fan-in) unless `scale` is given."""
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else int(shape[0])
        std = scale if scale is not None else 1.0 / np.sqrt(max(fan_in, 1))
        return self.const((self.rng.standard_normal(shape) * std).astype(np.float32), hint)

    def op(self, op_type: str, inputs: Sequence[str], hint: str | None = None, outputs: int = 1,
           out: str | None = None, **attrs: object) -> str | list[str]:
        """Add a node; returns its output name (or names when `outputs` > 1).

        `out` names the (single) output explicitly, e.g. a graph output.
        """
        base = self.fresh(hint or op_type.lower())
        outs = [out or base] if outputs == 1 else [f"{base}_out{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=base, **attrs))
        return outs[0] if outputs == 1 else outs

    def model(self) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, initializer=self.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="dvabatch.zoo")
        model.ir_version = IR_VERSION
        for key, value in self.metadata.items():
            model.metadata_props.append(onnx.StringStringEntryProto(key=key, value=value))
        onnx.checker.check_model(model)
        return model
