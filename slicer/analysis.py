"""Where a graph may be cut: the tensors crossing each position, and which positions are legal.

A cut at position p splits the node list (topological order) into nodes[:p] and nodes[p:].
The tensors crossing it are those made before p (or model inputs) and used at or after p (or
model outputs): activations, skip connections and pass-through inputs such as a mask. Each
becomes a stage-boundary tensor. A position is legal when every crossing tensor can live in a
runtime buffer (a leading batch dim; other dims constant or the sequence length) and there
are at most `max_tensors` of them. Nodes with subgraphs (If, Loop, Scan) are atomic, and
tensors their subgraphs read from outside count as used by them, so no cut passes through
control flow.
"""
from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from typing import Iterator

import onnx
from onnx import helper

from dvabatch_backend.runtime.manifest import BATCH, SEQ, TensorSpec

from .cut import _initializer_names, length_source, probe_specs, recomputable_tensors


@dataclass(frozen=True)
class CutPoint:
    position: int  # the cut falls before nodes[position]
    tensors: tuple[str, ...]
    bytes_per_row: int  # bytes crossing per query, at the reference length


def node_inputs(node: onnx.NodeProto) -> Iterator[str]:
    """Every tensor a node reads, including those its subgraphs read from the outer scope."""
    yield from (i for i in node.input if i)
    for attr in node.attribute:
        graphs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
        for g in graphs:
            local = {i.name for i in g.input} | _initializer_names(g)
            for sub in g.node:
                local.update(o for o in sub.output if o)
            for sub in g.node:
                yield from (i for i in node_inputs(sub) if i not in local)


def crossing_tensors(model: onnx.ModelProto) -> list[tuple[str, ...]]:
    """For each position p in 0..len(nodes), the tensors crossing a cut there (in birth order)."""
    graph = model.graph
    n = len(graph.node)
    inits = _initializer_names(graph)
    born: dict[str, int] = {i.name: 0 for i in graph.input if i.name not in inits}
    last_use: dict[str, int] = {}
    for idx, node in enumerate(graph.node):
        for t in node_inputs(node):
            if t not in inits:
                last_use[t] = idx
        for o in node.output:
            if o:
                born.setdefault(o, idx + 1)
    for o in graph.output:
        last_use[o.name] = n
    births: dict[int, list[str]] = {}
    for t, b in born.items():
        if last_use.get(t, -1) >= b:
            births.setdefault(b, []).append(t)
    alive: dict[str, int] = {}  # insertion order = birth order
    crossing: list[tuple[str, ...]] = []
    for p in range(n + 1):
        for t in births.get(p, ()):
            alive[t] = last_use[t]
        for t in [t for t, last in alive.items() if last < p]:
            del alive[t]
        crossing.append(tuple(alive))
    return crossing


def legal_cut_points(model: onnx.ModelProto, reference_length: int, max_tensors: int = 8,
                     illegal: Counter[str] | None = None) -> list[CutPoint]:
    """Every legal internal cut position, with its crossing row tensors and their bytes per query.

    Batch-independent tensors crossing a position (shape arithmetic, constants) do not count:
    the later stage remakes them (`slicer.cut.recomputable_tensors`), provided the row tensors
    crossing give every length dim they depend on. `illegal`, given, counts the other positions
    by why (`illegal_reason`).
    """
    recomp = recomputable_tensors(model)
    live = crossing_tensors(model)
    n = len(model.graph.node)
    rows = {p: tuple(t for t in ts if t not in recomp.tensors) for p, ts in enumerate(live) if 0 < p < n}
    candidates = {p: ts for p, ts in rows.items() if 0 < len(ts) <= max_tensors}
    why = illegal if illegal is not None else Counter()
    why["no row tensor crosses (only shape arithmetic and constants)"] += sum(1 for ts in rows.values() if not ts)
    why[f"more than {max_tensors} row tensors cross"] += sum(1 for ts in rows.values() if len(ts) > max_tensors)
    specs = probe_specs(model, sorted({t for ts in candidates.values() for t in ts}))
    points = []
    for p, tensors in sorted(candidates.items()):
        found = [specs[t] for t in tensors]
        problem = next((s for s in found if isinstance(s, str)), None)
        if problem is not None:
            why[illegal_reason(problem)] += 1
            continue
        needed = set().union(*(recomp.length_dims[t] for t in live[p] if t in recomp.tensors)) - {BATCH}
        if any(length_source(d, found) is None for d in needed):  # type: ignore[arg-type]
            why["shape arithmetic needs a length no crossing tensor gives"] += 1
            continue
        points.append(CutPoint(p, tensors, sum(_row_bytes(s, reference_length) for s in found)))  # type: ignore[arg-type]
    return points


def illegal_reason(problem: str) -> str:
    """A crossing tensor's problem as a kind: its names, shapes and numbers left out."""
    kind = re.sub(r"'[^']*'|\([^)]*\)|\[[^\]]*\]|\d+", "_", problem)
    return re.sub(r"(_[ ,]*)+_", "_", kind)[:120]


def _row_bytes(spec: TensorSpec, length: int) -> int:
    return math.prod(spec.sample_shape(max(length, 1))) * spec.np_dtype.itemsize


def name_nodes(model: onnx.ModelProto) -> onnx.ModelProto:
    """Give every node a unique name (profiles map costs back by name); returns the model."""
    seen: set[str] = set()
    for idx, node in enumerate(model.graph.node):
        if not node.name or node.name in seen:
            node.name = f"{node.op_type.lower()}_{idx}"
        seen.add(node.name)
    return model




LENGTH_CARRIER = "dvabatch_length_carrier"


def with_length_carrier(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """A copy of `model` with a length carrier, or None where it would not help.

    Shape arithmetic over the input length (a detector's width) is remade in a later stage from
    a row tensor that has the length dim; where only downsampled widths cross (``(seq+1)//2``), the
    length cannot be read back. The carrier is one row of the input along its length (every other
    axis sliced to 1), kept alive to the last node, so the length crosses every cut at a cost of a
    few bytes per query.
    """
    recomp = recomputable_tensors(model)
    if not any(d != BATCH for dims in recomp.length_dims.values() for d in dims):
        return None
    inits = _initializer_names(model.graph)
    source = next((vi for vi in model.graph.input if vi.name not in inits
                   and any(d.dim_param == SEQ for d in vi.type.tensor_type.shape.dim)), None)
    if source is None:
        return None
    dims = source.type.tensor_type.shape.dim
    others = [i for i, d in enumerate(dims) if i > 0 and d.dim_param != SEQ]
    if not others:
        return None  # the input is [batch, seq] itself: it crosses wherever it is read
    out = onnx.ModelProto()
    out.CopyFrom(model)
    starts, ends, axes = (f"{LENGTH_CARRIER}_{k}" for k in ("starts", "ends", "axes"))
    out.graph.initializer.extend([
        helper.make_tensor(starts, onnx.TensorProto.INT64, [len(others)], [0] * len(others)),
        helper.make_tensor(ends, onnx.TensorProto.INT64, [len(others)], [1] * len(others)),
        helper.make_tensor(axes, onnx.TensorProto.INT64, [len(others)], others),
    ])
    slice_node = helper.make_node("Slice", [source.name, starts, ends, axes], [LENGTH_CARRIER], name=LENGTH_CARRIER)
    keep = helper.make_node("Identity", [LENGTH_CARRIER], [f"{LENGTH_CARRIER}_kept"], name=f"{LENGTH_CARRIER}_kept")
    nodes = [slice_node, *out.graph.node, keep]
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out
