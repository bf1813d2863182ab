"""A length expression (`dvabatch_backend.runtime.length_expr`) as ONNX nodes over an int64 value.

A stage that remakes shape arithmetic (a detector's grid, `slicer.cut`) may need a length dim it
receives no tensor with, such as ``8*floor(floor(seq/2 - 1/2)/2) + 14``, from the length itself
(read off a tensor with ``seq``). The nodes compute it exactly in int64: each subexpression is an
int64 tensor ``v`` and a whole scale ``s`` with value ``v / s``; ``floor`` is ``(v - Mod(v, s)) / s``
(Mod with fmod 0 takes the divisor's sign, so this is the floor for negative values too) and
``ceil(x)`` is ``-floor(-x)``.
"""
from __future__ import annotations

import ast
import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np
import onnx
import onnx.numpy_helper
from onnx import helper

from dvabatch_backend.runtime.length_expr import constant_value, parse_length


@dataclass
class LengthNodes:
    """Nodes and constants that compute one expression; `output` names the int64 result ([1])."""

    prefix: str
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    constants: list[onnx.TensorProto] = field(default_factory=list)
    output: str = ""
    _count: int = 0

    def _name(self, what: str) -> str:
        self._count += 1
        return f"{self.prefix}_{what}{self._count}"

    def const(self, value: int) -> str:
        name = self._name("c")
        self.constants.append(onnx.numpy_helper.from_array(np.array([int(value)], np.int64), name))
        return name

    def op(self, op_type: str, inputs: list[str], **attrs: Any) -> str:
        out = self._name(op_type.lower())
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=f"{out}_node", **attrs))
        return out


def length_nodes(expression: str, seq_value: str, prefix: str) -> LengthNodes:
    """Nodes computing `expression` from `seq_value` (an int64 [1] tensor holding the length)."""
    built = LengthNodes(prefix)
    value, scale = _emit(parse_length(expression).tree, seq_value, built)
    built.output = value if scale == 1 else _floor(value, scale, built)
    return built


Scaled = tuple[str, int]  # (int64 tensor v, scale s): the value v / s


def _emit(node: ast.expr, seq: str, b: LengthNodes) -> Scaled:
    if isinstance(node, ast.Constant):
        value = Fraction(repr(node.value)) if isinstance(node.value, float) else Fraction(int(node.value))  # type: ignore[arg-type]
        return (b.const(value.numerator), value.denominator)
    if isinstance(node, ast.Name):
        return seq, 1
    if isinstance(node, ast.UnaryOp):
        v, s = _emit(node.operand, seq, b)
        return (b.op("Neg", [v]), s) if isinstance(node.op, ast.USub) else (v, s)
    if isinstance(node, ast.BinOp):
        if isinstance(node.op, ast.Div) or isinstance(node.op, ast.FloorDiv):
            divisor = _fraction(node.right)
            v, s = _emit(node.left, seq, b)
            # v / s / (p / q) = v * q / (s * p)
            v = v if divisor.denominator == 1 else b.op("Mul", [v, b.const(divisor.denominator)])
            scale = s * divisor.numerator
            if scale < 0:
                v, scale = b.op("Neg", [v]), -scale
            return (_floor(v, scale, b), 1) if isinstance(node.op, ast.FloorDiv) else (v, scale)
        left, right = _emit(node.left, seq, b), _emit(node.right, seq, b)
        if isinstance(node.op, (ast.Add, ast.Sub)):
            common = math.lcm(left[1], right[1])
            lv, rv = (_rescale(x, common, b) for x in (left, right))
            return b.op("Add" if isinstance(node.op, ast.Add) else "Sub", [lv, rv]), common
        if isinstance(node.op, ast.Mult):
            return b.op("Mul", [left[0], right[0]]), left[1] * right[1]
        if isinstance(node.op, ast.Pow):
            power = int(_fraction(node.right))
            v, s = b.const(1), 1
            for _ in range(power):
                v, s = b.op("Mul", [v, left[0]]), s * left[1]
            return v, s
    if isinstance(node, ast.Call):
        name = node.func.id  # type: ignore[attr-defined]
        args = [_emit(a, seq, b) for a in node.args]
        if name in ("floor", "ceil"):
            v, s = args[0]
            if s == 1:
                return v, 1
            if name == "floor":
                return _floor(v, s, b), 1
            return b.op("Neg", [_floor(b.op("Neg", [v]), s, b)]), 1
        common = math.lcm(*(s for _, s in args))
        values = [_rescale(a, common, b) for a in args]
        return b.op("Max" if name.lower() == "max" else "Min", values), common
    raise ValueError(f"cannot build ONNX nodes for {ast.unparse(node)!r}")


def _fraction(node: ast.expr) -> Fraction:
    value = constant_value(node)
    if value is None:
        raise ValueError(f"a divisor or power must be a constant, got {ast.unparse(node)!r}")
    return value


def _rescale(x: Scaled, scale: int, b: LengthNodes) -> str:
    v, s = x
    return v if s == scale else b.op("Mul", [v, b.const(scale // s)])


def _floor(v: str, scale: int, b: LengthNodes) -> str:
    k = b.const(scale)
    return b.op("Div", [b.op("Sub", [v, b.op("Mod", [v, k], fmod=0)]), k])
