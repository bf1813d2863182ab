"""Length dims: a tensor dim written as an expression of the query's length ``seq``.

The slicer takes these from onnxruntime's symbolic shape inference, which writes a dim as sympy
prints it: ``seq``, ``floor(seq/2 - 1/2) + 1``, or a detector head's anchors
``8*floor(floor(floor(seq/2 - 1/2)/2)/2) + 4*floor(...) + 2*floor(...) + 14``. Older manifests
wrote ``seq//K`` and ``(seq+A)//K``; they are expressions of the same grammar.

`parse_length` reads one with Python's own parser and keeps only a small grammar (numbers,
``seq``, ``+ - * / //``, a whole-number power, ``floor``, ``ceil``, ``Max``, ``Min``): no `eval`,
no names but ``seq``. Arithmetic is exact (`fractions.Fraction` where a ``/`` makes one), and a
value that is not a whole number is an error, as a tensor's dim must be one.
"""
from __future__ import annotations

import ast
import functools
import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable, Union

SEQ = "seq"
Number = Union[int, Fraction]
_Fn = Callable[[int], Number]
_CALLS: dict[str, Callable[..., Number]] = {"floor": math.floor, "ceil": math.ceil, "Max": max, "Min": min,
                                            "max": max, "min": min}
_MAX_POWER = 4


class NotALength(ValueError):
    """The text is not a length expression of this grammar."""


@dataclass(frozen=True)
class LengthExpr:
    """One length dim: call it with a length for the dim's size there."""

    text: str
    tree: ast.expr = field(compare=False, repr=False)
    _fn: _Fn = field(compare=False, repr=False)

    def __call__(self, length: int) -> int:
        value = self._fn(length)
        if isinstance(value, Fraction):
            if value.denominator != 1:
                raise ValueError(f"length dim {self.text!r} is {value} at length {length}, not a whole number")
            return int(value)
        return value

    @property
    def is_seq(self) -> bool:
        return isinstance(self.tree, ast.Name)

    def divisors(self) -> frozenset[int]:
        """The whole numbers the length is divided by somewhere in it (strides and pools)."""
        found = set()
        for node in ast.walk(self.tree):
            if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Div, ast.FloorDiv)):
                d = constant_value(node.right)
                if d is not None and d.denominator == 1 and d > 1:
                    found.add(int(d))
        return frozenset(found)


@functools.lru_cache(maxsize=4096)
def parse_length(text: str) -> LengthExpr:
    """The length expression `text`; raises `NotALength` for anything outside the grammar, or
    for an expression without ``seq`` (a constant is an int dim, not a length)."""
    if not isinstance(text, str) or len(text) > 4000:
        raise NotALength(f"{text!r} is not a length expression")
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as exc:
        raise NotALength(f"{text!r} is not a length expression ({exc.msg})") from None
    fn = _compile(tree, text)
    if not any(isinstance(n, ast.Name) for n in ast.walk(tree)):
        raise NotALength(f"{text!r} does not depend on {SEQ!r}")
    return LengthExpr(text, tree, fn)


def is_length(dim: object) -> bool:
    """`dim` is ``seq`` or an expression of it."""
    if not isinstance(dim, str):
        return False
    try:
        parse_length(dim)
    except NotALength:
        return False
    return True


def constant_value(node: ast.expr) -> Fraction | None:
    """The value of a constant subexpression (no ``seq``), else None."""
    if any(isinstance(n, ast.Name) for n in ast.walk(node)):
        return None
    try:
        value = _compile(node, "")(0)
    except (NotALength, ZeroDivisionError, ValueError):
        return None
    return Fraction(value)


def _compile(node: ast.expr, text: str) -> _Fn:
    """A function of the length computing `node`, built from the tree (never `eval`)."""
    def bad(why: str) -> NotALength:
        return NotALength(f"{text!r} is not a length expression: {why}")

    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)) or not math.isfinite(node.value):
            raise bad(f"{node.value!r} is not a number")
        # sympy prints a Resize's scale as 2.0: the decimal as written, exactly
        value = node.value if isinstance(node.value, int) else _exact(Fraction(repr(node.value)))
        return lambda n: value
    if isinstance(node, ast.Name):
        if node.id != SEQ:
            raise bad(f"{node.id!r} is not {SEQ!r}")
        return lambda n: n
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        inner = _compile(node.operand, text)
        return (lambda n: -inner(n)) if isinstance(node.op, ast.USub) else inner
    if isinstance(node, ast.BinOp):
        left, right = _compile(node.left, text), _compile(node.right, text)
        op = node.op
        if isinstance(op, ast.Add):
            return lambda n: left(n) + right(n)
        if isinstance(op, ast.Sub):
            return lambda n: left(n) - right(n)
        if isinstance(op, ast.Mult):
            return lambda n: left(n) * right(n)
        if isinstance(op, ast.Div):
            return lambda n: _exact(Fraction(left(n)) / right(n))
        if isinstance(op, ast.FloorDiv):
            return lambda n: left(n) // right(n)
        if isinstance(op, ast.Pow):
            power = constant_value(node.right)
            if power is None or power.denominator != 1 or not 0 <= power <= _MAX_POWER:
                raise bad(f"a power must be a whole number from 0 to {_MAX_POWER}")
            k = int(power)
            return lambda n: left(n) ** k
        raise bad(f"operator {type(op).__name__}")
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords:
        call = _CALLS.get(node.func.id)
        if call is None or not node.args or (node.func.id in ("floor", "ceil") and len(node.args) != 1):
            raise bad(f"call {node.func.id!r}")
        args = [_compile(a, text) for a in node.args]
        if len(args) == 1:
            (only,) = args
            return lambda n: call(only(n))
        return lambda n: call(*(a(n) for a in args))
    raise bad(f"{type(node).__name__}")


def _exact(value: Fraction) -> Number:
    return int(value) if value.denominator == 1 else value
