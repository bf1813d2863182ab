"""Cut an ONNX graph into pipeline stages and write a sliced model directory.

A cut position ``p`` splits the graph's node list (which ONNX keeps in topological order)
into ``nodes[:p]`` and ``nodes[p:]``; N-1 positions give N stages. Boundary k is what flows
into stage k: boundary 0 is the model inputs, boundary N the model outputs.

Names at the boundaries: a tensor keeps its original name where the stage before the
boundary produced it (and at boundaries 0 and N). A tensor that only passes through a stage
(a model input such as ``mask`` needed later, or a tensor made two stages back) cannot keep
its name, because an ONNX graph cannot have one name as both input and output: at boundary
k it is called ``f"{orig}__{k}"``, the stage before adds an ``Identity`` that forwards it and
the stage after reads the renamed tensor. A model output made before the last stage is
renamed the same way at every internal boundary, so the last stage can restore its name.

Boundary dims are exact: a dim that follows the length is the expression onnxruntime's symbolic
shape inference gives for it (`symbolic_dims`: ``floor(seq/2 - 1/2) + 1``, a detector head's sum of
three such), and the probes confirm it. The probes run the full model in onnxruntime at several
(batch, seq) settings (two batch sizes at one length, the other lengths at one batch size); they
give the dtypes and which dim is the batch, and confirm each expression at every probed length,
a mismatch being an error naming the tensor. Where inference knows no expression for a dim, one
of the form ``(seq+A)//K`` is fitted to the probes. The lengths are the model's own
(`slicer.axes.probe_lengths`, kept in the model's metadata under `PROBE_LENGTHS_KEY`).

Batch-independent tensors (shape arithmetic such as ``Shape -> Gather -> Concat``, constants,
``Range`` over the length: anything computed from constants and the *shapes* of row tensors)
never cross a cut: each stage that reads one recomputes it (`recomputable_tensors`), with every
``Shape`` of a tensor it does not have rebuilt from the shape of one it has. So they do not make
a position illegal.
"""
from __future__ import annotations

import logging
from pathlib import Path
from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

import numpy as np
import onnx
import onnx.numpy_helper
import onnxruntime as ort
from onnx import helper

from dvabatch_backend.runtime.manifest import (
    BATCH,
    SEQ,
    SUPPORTED_DTYPES,
    Manifest,
    StageSpec,
    TensorSpec,
    derived_dim,
    is_length_dim,
    length_dim_terms,
)
from dvabatch_backend.runtime.length_expr import is_length, parse_length

from .length_nodes import length_nodes
from .sessions import copy_data_files, external_data_dir, forget_data_dir, proto_session, save_with_data

FULL_MODEL_FILE = "model.onnx"
MANIFEST_FILE = "manifest.json"
PROBE_BATCHES = (2, 3)
DEFAULT_PROBE_LENGTHS = (3, 5, 7)
PROBE_LENGTHS_KEY = "dvabatch.probe_lengths"
OUTPUT_BATCH_AXES_KEY = "dvabatch.output_batch_axes"
log = logging.getLogger(__name__)
# ops whose output differs between two runs: never recomputed
_NONDETERMINISTIC = {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial", "Bernoulli"}


def output_dims(model: onnx.ModelProto) -> dict[str, tuple[int | str | None, ...]]:
    """Each model output's dims as symbolic inference gives them (`symbolic_dims`)."""
    inferred = symbolic_dims(model)
    return {o.name: inferred[o.name] for o in model.graph.output if o.name in inferred}


def output_strides(model: onnx.ModelProto) -> set[int]:
    """The whole numbers the model's outputs' length dims divide the length by (symbolic
    inference): the strides whose multiples `slicer.axes.length_rule` tries as a rule."""
    return {k for dims in output_dims(model).values() for d in dims if is_length(d)
            for k in parse_length(str(d)).divisors()}


def output_batch_axes(model: onnx.ModelProto) -> dict[str, int]:
    """The outputs `slicer.axes.batch_first_outputs` made batch-first, with their own batch axis."""
    raw = next((p.value for p in model.metadata_props if p.key == OUTPUT_BATCH_AXES_KEY), "")
    return {k: int(v) for k, _, v in (item.rpartition("=") for item in raw.split(",") if item)}


def probe_settings(model: onnx.ModelProto) -> tuple[tuple[int, int], ...]:
    """The (batch, seq) settings the model is probed at: (b1, L1), (b2, L1), (b1, L2), (b1, L3)."""
    raw = next((p.value for p in model.metadata_props if p.key == PROBE_LENGTHS_KEY), None)
    lengths = [int(v) for v in raw.split(",")] if raw else list(DEFAULT_PROBE_LENGTHS)
    b1, b2 = PROBE_BATCHES
    return ((b1, lengths[0]), (b2, lengths[0]), *((b1, n) for n in lengths[1:]))


def set_probe_lengths(model: onnx.ModelProto, lengths: Sequence[int]) -> None:
    for prop in list(model.metadata_props):
        if prop.key == PROBE_LENGTHS_KEY:
            model.metadata_props.remove(prop)
    helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props},
                                   PROBE_LENGTHS_KEY: ",".join(str(int(n)) for n in lengths)})


@dataclass(frozen=True)
class LaidOutSpec(TensorSpec):
    """A row tensor whose batch axis in the graph is not the first (an RNN's time-major [T, N, C]):
    it crosses a cut batch-first (`dims`, transposed at the end of the stage that makes it and back
    at the start of the stage that reads it); `graph_dims` is its layout in the graph."""

    batch_axis: int = 0
    graph_dims: tuple[int | str, ...] = ()

    @property
    def to_batch_first(self) -> list[int]:
        return [self.batch_axis] + [i for i in range(len(self.graph_dims)) if i != self.batch_axis]

    @property
    def to_graph(self) -> list[int]:
        forward = self.to_batch_first
        return [forward.index(i) for i in range(len(forward))]


MERGED = "batch*seq"  # a graph dim holding every row's every position ([batch*seq, hidden])


@dataclass(frozen=True)
class MergedSpec(TensorSpec):
    """A row tensor whose leading graph dim holds the batch and the length merged, batch-major (GPT-2's
    MLP on ``[batch*seq, hidden]``, reshaped from ``[batch, seq, hidden]``): it crosses a cut as
    ``[batch, seq, ...]`` (`dims`: reshaped at the end of the stage that makes it, back at the start
    of the stage that reads it); `graph_dims` is ``(MERGED, ...)``, every other dim a constant. The
    stages' check against the original confirms the order."""

    graph_dims: tuple[int | str, ...] = ()


@dataclass(frozen=True)
class Recomputable:
    """Batch-independent tensors and how to remake them: `shape_leaves` maps a `Shape` node's
    output to the row tensor it reads, `length_dims[t]` the length dims (`seq`, `seq//K`) `t`
    depends on, which the stage remaking it must be able to read off a row tensor it receives."""

    tensors: frozenset[str]
    shape_leaves: Mapping[str, str]  # Shape node output -> the row tensor it reads
    length_dims: Mapping[str, frozenset[str]]


def length_source(dim: str, specs: Sequence[TensorSpec]) -> tuple[TensorSpec, int, str | None] | None:
    """A row tensor whose shape gives length dim `dim`: (spec, axis, how), `dim` being
    ``shape[axis]`` itself (`how` None) or the expression `how` of it (its ``seq`` standing for
    ``shape[axis]``); or None."""
    for spec in specs:
        if dim in spec.dims:
            return spec, spec.dims.index(dim), None
    for spec in specs:
        if SEQ in spec.dims:
            return spec, spec.dims.index(SEQ), dim
    try:
        add, divisor = length_dim_terms(dim)
    except ValueError:
        return None
    for spec in specs:  # floor(floor(seq / K1) / (K2 / K1)) == floor(seq / K2)
        for axis, d in enumerate(spec.dims):
            if add == 0 and isinstance(d, str) and d != SEQ and is_length_dim(d):
                try:
                    a1, k1 = length_dim_terms(d)
                except ValueError:
                    continue
                if a1 == 0 and divisor % k1 == 0:
                    return spec, axis, f"seq//{divisor // k1}"
    return None


def recomputable_tensors(model: onnx.ModelProto) -> Recomputable:
    """Tensors computed only from constants and the shapes of row tensors (see the module doc)."""
    graph = model.graph
    inits = _initializer_names(graph)
    candidates = [n.input[0] for n in graph.node if n.op_type == "Shape" and n.input]
    specs = probe_specs(model, [t for t in dict.fromkeys(candidates) if t not in inits])
    ok: set[str] = set(inits)
    needs: dict[str, frozenset[str]] = {t: frozenset() for t in inits}
    leaves: dict[str, str] = {}
    for node in graph.node:
        if any(True for _ in _subgraphs(node)) or node.op_type in _NONDETERMINISTIC or not node.output:
            continue
        ins = [i for i in node.input if i]
        if node.op_type == "Shape" and ins[0] not in ok:
            spec = specs.get(ins[0])
            if not isinstance(spec, TensorSpec):
                continue
            ok.add(node.output[0])
            leaves[node.output[0]] = ins[0]
            needs[node.output[0]] = frozenset(d for d in spec.dims[1:] if isinstance(d, str))
        elif all(i in ok for i in ins):
            for o in node.output:
                if o:
                    ok.add(o)
                    needs[o] = frozenset().union(*(needs[i] for i in ins))
    tensors = frozenset(ok - inits - {o.name for o in graph.output})
    return Recomputable(tensors, leaves, {t: needs[t] for t in tensors})


def boundary_tensors(model: onnx.ModelProto, cut_positions: Sequence[int]) -> list[list[str]]:
    """Original names of the tensors at each boundary 0..N for the given cut positions.

    Internal boundary at position p: tensors made by ``nodes[:p]`` or graph inputs (not
    initializers) that ``nodes[p:]`` read or that are graph outputs. Graph inputs come
    first in input order, then the rest in production order.
    """
    graph = model.graph
    positions = _check_positions(model, cut_positions)
    inputs = _graph_inputs(graph)
    outputs = [o.name for o in graph.output]
    output_set = set(outputs)
    made_at: dict[str, int] = {name: -1 for name in inputs}
    last_use: dict[str, int] = {}
    for i, node in enumerate(graph.node):
        for name in _node_inputs(node):
            last_use[name] = i
        for name in node.output:
            if name and name not in made_at:
                made_at[name] = i
    bounds = [list(inputs)]
    for p in positions:
        bounds.append(
            [t for t, i in made_at.items() if i < p and (last_use.get(t, -1) >= p or t in output_set)]
        )
    bounds.append(outputs)
    return bounds


def cut_positions_after(model: onnx.ModelProto, tensor_names: Sequence[str]) -> list[int]:
    """For each named tensor (in the given order), the position right after the node making it."""
    made_by = {name: i for i, node in enumerate(model.graph.node) for name in node.output if name}
    positions = []
    for name in tensor_names:
        if name not in made_by:
            what = (
                "a graph input" if name in {i.name for i in model.graph.input}
                else "an initializer" if name in _initializer_names(model.graph)
                else "not a tensor of the graph"
            )
            raise ValueError(f"cannot cut after tensor {name!r}: no node produces it ({what})")
        positions.append(made_by[name] + 1)
    return positions


def even_cuts(layers: Sequence[str], num_stages: int) -> list[str]:
    """The `num_stages - 1` layers to cut after (for `cut_positions_after`) so that every stage
    holds about as many of `layers` (the layer outputs, in order) as the next: a cut by count,
    not by measured time (`slicer.slice_model` balances by time)."""
    n = len(layers)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot cut {n} layers into {num_stages} stages")
    return [layers[round(i * n / num_stages) - 1] for i in range(1, num_stages)]


def cut_model(
    model: onnx.ModelProto,
    cut_positions: Sequence[int],
    out_dir: Path,
    name: str,
    max_batch_size: int,
    max_length: int,
) -> Manifest:
    """Cut `model` at `cut_positions` and write the sliced model directory `out_dir`.

    Writes ``stage{i}.onnx`` for each stage, ``model.onnx`` (the full model) and
    ``manifest.json``; returns the manifest. Nothing is written unless every stage was
    built and checked.
    """
    graph = model.graph
    recomp = recomputable_tensors(model)
    crossing = boundary_tensors(model, cut_positions)
    n_stages = len(crossing) - 1
    bounds = [crossing[0]] + [[t for t in b if t not in recomp.tensors] for b in crossing[1:-1]] + [crossing[-1]]
    remade = [[]] + [[t for t in b if t in recomp.tensors] for b in crossing[1:-1]]
    starts = [0, *cut_positions]
    ends = [*cut_positions, len(graph.node)]

    for k, bound in enumerate(bounds[1:-1], start=1):
        if not bound:
            raise ValueError(f"no batch-carrying tensor crosses the cut at position {starts[k]} (boundary {k})")
    specs = _tensor_specs(model, bounds)
    moved = {t: spec for t, spec in specs.items() if isinstance(spec, (LaidOutSpec, MergedSpec))}
    names = _boundary_names(model, bounds, starts, ends, renamed=set(moved))
    boundary_specs = [
        tuple(_renamed_spec(specs[t], names[k][t]) for t in bound) for k, bound in enumerate(bounds)
    ]
    leaf_specs = {t: spec for t, spec in probe_specs(model, sorted(set(recomp.shape_leaves.values()))).items()
                  if isinstance(spec, TensorSpec)}

    stage_models = []
    for k in range(n_stages):
        replicas, constants = _remake_nodes(model, k, remade[k], recomp, names[k], boundary_specs[k], leaf_specs,
                                            moved)
        stage_models.append(_build_stage(model, k, starts[k], ends[k], bounds, names, boundary_specs,
                                         replicas, constants, moved))
    manifest = Manifest(
        name=name,
        max_batch_size=max_batch_size,
        max_length=max_length,
        inputs=boundary_specs[0],
        outputs=boundary_specs[-1],
        stages=tuple(
            StageSpec(f"stage{k}.onnx", boundary_specs[k], boundary_specs[k + 1]) for k in range(n_stages)
        ),
        full_model=FULL_MODEL_FILE,
        output_batch_axes=output_batch_axes(model),
    )
    Manifest.from_json(manifest.to_json())  # the checks Manifest.load makes; raises ManifestError

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    data_dir = external_data_dir(model)
    for k, stage in enumerate(stage_models):  # a large model's weights: each stage's into a data file of its own
        save_with_data(stage, out_dir / f"stage{k}.onnx", f"stage{k}.onnx.data", data_dir)
        if data_dir is not None:
            _check_stage(str(out_dir / f"stage{k}.onnx"), k, starts[k], ends[k])
    copy_data_files(model, out_dir)
    saved = onnx.ModelProto()
    saved.CopyFrom(model)
    forget_data_dir(saved)  # its data files now lie beside it
    onnx.save(saved, str(out_dir / FULL_MODEL_FILE))
    manifest.dump(out_dir / MANIFEST_FILE)
    return manifest


# --- graph helpers ---------------------------------------------------------------------


def _initializer_names(graph: onnx.GraphProto) -> set[str]:
    return {t.name for t in graph.initializer} | {t.values.name for t in graph.sparse_initializer}


def _graph_inputs(graph: onnx.GraphProto) -> list[str]:
    inits = _initializer_names(graph)
    return [i.name for i in graph.input if i.name not in inits]


def _subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr.g
        elif attr.type == onnx.AttributeProto.GRAPHS:
            yield from attr.graphs


def _outer_refs(graph: onnx.GraphProto) -> list[str]:
    """Names a subgraph reads from enclosing scopes."""
    defined = {i.name for i in graph.input} | _initializer_names(graph)
    defined |= {name for node in graph.node for name in node.output}
    used = [name for node in graph.node for name in _node_inputs(node)]
    used += [o.name for o in graph.output]
    return [name for name in dict.fromkeys(used) if name not in defined]


def _node_inputs(node: onnx.NodeProto) -> list[str]:
    """The tensors a node reads: its inputs and what its subgraphs take from outside."""
    names = [name for name in node.input if name]
    for sub in _subgraphs(node):
        names += _outer_refs(sub)
    return list(dict.fromkeys(names))


def _rename_inputs(graph_nodes: Iterator[onnx.NodeProto], rename: dict[str, str]) -> None:
    """Rename reads of tensors in place, inside subgraphs too (ONNX names are unique across scopes)."""
    for node in graph_nodes:
        for i, name in enumerate(node.input):
            if name in rename:
                node.input[i] = rename[name]
        for sub in _subgraphs(node):
            _rename_inputs(iter(sub.node), rename)
            for out in sub.output:
                if out.name in rename:
                    out.name = rename[out.name]


def _check_positions(model: onnx.ModelProto, cut_positions: Sequence[int]) -> list[int]:
    n = len(model.graph.node)
    positions = list(cut_positions)
    for p in positions:
        if isinstance(p, bool) or not isinstance(p, (int, np.integer)):
            raise ValueError(f"cut positions must be ints, got {p!r} in {positions}")
        if not 0 < p < n:
            raise ValueError(f"cut position {p} is outside (0, {n}): the graph has {n} nodes; positions {positions}")
    if any(b <= a for a, b in zip(positions, positions[1:])):
        raise ValueError(f"cut positions must be strictly increasing, got {positions}")
    return [int(p) for p in positions]


# --- boundary names and specs ----------------------------------------------------------


def _boundary_names(
    model: onnx.ModelProto, bounds: list[list[str]], starts: list[int], ends: list[int], renamed: set[str] = set()
) -> list[dict[str, str]]:
    """For each boundary, original tensor name -> the name it has at that boundary (`renamed`
    tensors always get a name of their own: they cross transposed)."""
    graph = model.graph
    outputs = {o.name for o in graph.output}
    n = len(bounds) - 1
    names: list[dict[str, str]] = [{t: t for t in bounds[0]}]
    for k in range(1, n):
        made_before = {o for node in graph.node[starts[k - 1]:ends[k - 1]] for o in node.output if o}
        names.append({t: t if t in made_before and t not in outputs and t not in renamed else f"{t}__{k}"
                      for t in bounds[k]})
    names.append({t: t for t in bounds[n]})

    existing = set(_graph_inputs(graph)) | _initializer_names(graph) | outputs
    existing |= {o for node in graph.node for o in node.output}
    for k in range(1, n):
        for t, new in names[k].items():
            if new != t and new in existing:
                raise ValueError(
                    f"cannot rename pass-through tensor {t!r} at boundary {k}: the graph already has a tensor {new!r}"
                )
    return names


def _renamed_spec(spec: TensorSpec, name: str) -> TensorSpec:
    return spec if spec.name == name else TensorSpec(name, spec.dtype, spec.dims)


def _input_spec(vi: onnx.ValueInfoProto) -> TensorSpec:
    """A model input's spec from its declared type: dims are ints, "batch" or "seq"."""
    if not vi.type.HasField("tensor_type") or not vi.type.tensor_type.HasField("shape"):
        raise ValueError(f"model input {vi.name!r} must be a tensor with a declared shape")
    tt = vi.type.tensor_type
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type)).name
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"model input {vi.name!r} has dtype {dtype}, not one of {SUPPORTED_DTYPES}")
    dims: list[int | str] = []
    for i, d in enumerate(tt.shape.dim):
        if d.HasField("dim_value") and d.dim_value > 0:
            dims.append(int(d.dim_value))
        elif d.HasField("dim_param") and d.dim_param in (BATCH, SEQ):
            dims.append(d.dim_param)
        else:
            raise ValueError(
                f"model input {vi.name!r} dim {i} ({str(d).strip() or 'unknown'}) must be a positive int "
                f"or the dim_param {BATCH!r} or {SEQ!r}"
            )
    if not dims or dims[0] != BATCH or BATCH in dims[1:]:
        raise ValueError(f"model input {vi.name!r} must have {BATCH!r} as its first and only first dim, got {dims}")
    return TensorSpec(vi.name, dtype, tuple(dims))


def _probe_feed(spec: TensorSpec, batch: int, seq: int, rng: np.random.Generator) -> np.ndarray:
    shape = spec.shape(batch, seq)
    dtype = spec.np_dtype
    if np.issubdtype(dtype, np.floating):
        return rng.standard_normal(shape).astype(dtype)
    return np.ones(shape, dtype=dtype)


def _tensor_specs(model: onnx.ModelProto, bounds: list[list[str]]) -> dict[str, TensorSpec]:
    """Specs of every boundary tensor under its original name: inputs declared, the rest probed."""
    wanted = list(dict.fromkeys(t for bound in bounds for t in bound))
    inits = _initializer_names(model.graph)
    for t in wanted:
        if t in inits:
            raise ValueError(f"boundary tensor {t!r} is an initializer; a model output must be computed by a node")
    specs: dict[str, TensorSpec] = {}
    for t, spec in probe_specs(model, wanted).items():
        if isinstance(spec, str):
            raise ValueError(spec)
        specs[t] = spec
    return specs


def input_specs(model: onnx.ModelProto) -> dict[str, TensorSpec]:
    """The model inputs' specs, from their declared types."""
    inits = _initializer_names(model.graph)
    return {vi.name: _input_spec(vi) for vi in model.graph.input if vi.name not in inits}


def probe_specs(model: onnx.ModelProto, tensors: Sequence[str]) -> dict[str, TensorSpec | str]:
    """Specs of `tensors` (and the model inputs), found by running the model at two shapes.

    A tensor that cannot sit in a stage boundary (no leading batch dim, a dim that is neither
    batch, seq nor constant, an unsupported dtype) maps to a string saying why.
    """
    specs: dict[str, TensorSpec | str] = dict(input_specs(model))
    has_seq = any(s.has_seq for s in specs.values() if isinstance(s, TensorSpec))
    wanted = [t for t in dict.fromkeys(tensors) if t not in specs]
    if not wanted:
        return specs
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    declared = {o.name for o in probe.graph.output}
    probe.graph.output.extend(onnx.ValueInfoProto(name=t) for t in wanted if t not in declared)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = proto_session(probe, options)
    rng = np.random.default_rng(0)
    inputs = [s for s in specs.values() if isinstance(s, TensorSpec)]
    settings = probe_settings(model)
    runs = [session.run(wanted, {s.name: _probe_feed(s, b, q, rng) for s in inputs}) for b, q in settings]
    inferred = symbolic_dims(model) if has_seq else {}
    for j, t in enumerate(wanted):
        specs[t] = _probed_spec(t, [np.asarray(run[j]) for run in runs], settings, has_seq, inferred.get(t))
    return specs


_symbolic_cache: list[tuple[onnx.ModelProto, tuple, dict[str, tuple[int | str | None, ...]]]] = []


def symbolic_dims(model: onnx.ModelProto) -> dict[str, tuple[int | str | None, ...]]:
    """Every tensor's dims as onnxruntime's symbolic shape inference gives them for the canonical
    model (inputs ``[batch, ..., seq, ...]``): ints, expressions of ``batch`` and ``seq`` as sympy
    prints them, or None where it knows nothing. {} where inference fails on the model (its own
    limits: an op it does not know); the probes' fitting stands in then. Remembered per model
    (a few seconds on a large graph; every boundary question asks it)."""
    key = (len(model.graph.node), len(model.graph.output), tuple(n.name for n in model.graph.node[-3:]))
    for held, held_key, dims in _symbolic_cache:
        if held is model and held_key == key:
            return dims
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    dims: dict[str, tuple[int | str | None, ...]] = {}
    try:
        inferred = SymbolicShapeInference.infer_shapes(model, auto_merge=True)
    except Exception as exc:  # inference's own limits; the probes' fitting stands in
        log.info("symbolic shape inference failed (%s: %s); length dims are fitted to probes",
                 type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        inferred = None
    if inferred is not None:
        for vi in [*inferred.graph.value_info, *inferred.graph.output]:
            if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape"):
                dims[vi.name] = tuple(int(d.dim_value) if d.HasField("dim_value") else
                                      d.dim_param if d.HasField("dim_param") else None
                                      for d in vi.type.tensor_type.shape.dim)
    _symbolic_cache[:] = [*_symbolic_cache[-3:], (model, key, dims)]
    return dims


def _probed_spec(t: str, arrays: list[np.ndarray], settings: tuple[tuple[int, int], ...], has_seq: bool,
                 inferred: Sequence[int | str | None] | None = None) -> TensorSpec | str:
    """Dims from the probe runs: a dim that follows the batch size is `batch`, one that follows the
    length is `seq`, one that follows it otherwise its expression from symbolic inference
    (`inferred`, confirmed at every probe) or, where inference has none, a ``(seq+A)//K`` fitted
    to the probes; one that follows neither is a constant."""
    dtype = arrays[0].dtype.name
    if dtype not in SUPPORTED_DTYPES:
        return f"boundary tensor {t!r} has dtype {dtype}, not one of {SUPPORTED_DTYPES}"
    if len({a.ndim for a in arrays}) != 1:
        return f"boundary tensor {t!r} changes rank with the input shape: {[a.shape for a in arrays]}"
    batches = tuple(b for b, _ in settings)
    lengths = tuple(n for _, n in settings)
    merged = tuple(b * n for b, n in settings)
    dims: list[int | str] = []
    for i, sizes in enumerate(zip(*(a.shape for a in arrays))):
        if sizes == batches:
            dims.append(BATCH)
        elif has_seq and sizes == merged:
            dims.append(MERGED)
        elif len(set(sizes)) == 1 and sizes[0] > 0:
            dims.append(int(sizes[0]))
        elif has_seq and sizes == lengths:
            dims.append(SEQ)
        elif has_seq and inferred is not None and i < len(inferred) and is_length(inferred[i]):
            expression = parse_length(str(inferred[i]))
            wanted = [expression(n) for n in lengths]
            if list(sizes) != wanted:
                at = ", ".join(f"{d} (inferred {w}) at seq={n}" for d, w, n in zip(sizes, wanted, lengths))
                return (f"boundary tensor {t!r} dim {i}: symbolic shape inference gives {inferred[i]!r}, but the "
                        f"model gives {at}")
            dims.append(expression.text)
        elif has_seq and (derived := _derived_length(sizes, settings)) is not None:  # only when nothing else fits
            dims.append(derived)
        else:
            at = ", ".join(f"{d} at (batch={b}, seq={n})" for d, (b, n) in zip(sizes, settings))
            return (f"boundary tensor {t!r} dim {i} is {at}: neither {BATCH!r}, {SEQ!r}, a length derived "
                    f"from it (seq//K) nor a positive constant")
    if MERGED in dims:
        rest = dims[1:]
        if dims[0] != MERGED or not all(isinstance(d, int) for d in rest):
            return (f"boundary tensor {t!r} has dims {dims}: a dim merging the batch and the length crosses a cut "
                    f"only leading, with every other dim a constant")
        return MergedSpec(t, dtype, (BATCH, SEQ, *rest), graph_dims=tuple(dims))
    if dims.count(BATCH) != 1:
        return (
            f"boundary tensor {t!r} has shape {arrays[0].shape} at batch={batches[0]}: it must have exactly one "
            f"{BATCH!r} dim, got {dims}"
        )
    axis = dims.index(BATCH)
    if axis:
        others = [d for i, d in enumerate(dims) if i != axis]
        return LaidOutSpec(t, dtype, (BATCH, *others), batch_axis=axis, graph_dims=tuple(dims))
    return TensorSpec(t, dtype, tuple(dims))


def _derived_length(sizes: Sequence[int], settings: Sequence[tuple[int, int]]) -> str | None:
    """`floor((seq + A) / K)` if that is what `sizes` are at `settings` (the batch size must not
    matter): a convolution's or pooling's output width. The smallest K that fits wins."""
    if sizes[0] != sizes[1]:
        return None
    points = [(n, d) for j, (d, (_, n)) in enumerate(zip(sizes, settings)) if j != 1]  # batch b1 only
    if len({d for _, d in points}) < 2:
        return None
    for divisor in range(2, max(n for n, _ in points) + 1):
        for add in range(divisor):
            if all((n + add) // divisor == d for n, d in points):
                return derived_dim(add, divisor)
    return None


# --- stages ----------------------------------------------------------------------------


def _value_info(spec: TensorSpec) -> onnx.ValueInfoProto:
    elem = helper.np_dtype_to_tensor_dtype(spec.np_dtype)
    return helper.make_tensor_value_info(spec.name, elem, list(spec.dims))


def _build_stage(
    model: onnx.ModelProto,
    k: int,
    start: int,
    end: int,
    bounds: list[list[str]],
    names: list[dict[str, str]],
    boundary_specs: list[tuple[TensorSpec, ...]],
    replicas: Sequence[onnx.NodeProto] = (),
    constants: Sequence[onnx.TensorProto] = (),
    moved: Mapping[str, "LaidOutSpec | MergedSpec"] = {},
) -> onnx.ModelProto:
    graph = model.graph
    layout_constants: list[onnx.TensorProto] = []
    # tensors that crossed batch-first (or with the batch and the length apart) go back to the graph's layout
    nodes = [node for t in bounds[k] if t in moved
             for node in _to_graph_layout(moved[t], names[k][t], _own(t, k), layout_constants)]
    nodes += list(replicas)
    body = []
    for src in graph.node[start:end]:
        node = onnx.NodeProto()
        node.CopyFrom(src)
        body.append(node)
    rename = {t: (_own(t, k) if t in moved else new) for t, new in names[k].items() if new != t}
    _rename_inputs(iter(body), rename)
    nodes += body

    produced = {o for node in nodes for o in node.output if o}
    for t in bounds[k + 1]:
        target = names[k + 1][t]
        if t in produced and t in moved:
            nodes += _to_boundary_layout(moved[t], t, target, boundary_specs[k][0].name, layout_constants)
            continue
        if t in produced:
            source = t
        elif t in names[k]:
            source = names[k][t]
        else:
            raise ValueError(f"stage {k} cannot provide boundary tensor {t!r}")
        if source != target:
            nodes.append(helper.make_node("Identity", [source], [target], name=f"forward_{target}"))

    used = {name for node in nodes for name in _node_inputs(node)}
    initializers = [t for t in graph.initializer if t.name in used] + list(constants) + layout_constants
    sparse = [t for t in graph.sparse_initializer if t.values.name in used]
    boundary_names = {s.name for s in boundary_specs[k]} | {s.name for s in boundary_specs[k + 1]}
    value_info = [vi for vi in graph.value_info if vi.name in produced and vi.name not in boundary_names]

    stage_graph = helper.make_graph(
        nodes,
        f"{graph.name or 'model'}_stage{k}",
        [_value_info(s) for s in boundary_specs[k]],
        [_value_info(s) for s in boundary_specs[k + 1]],
        initializer=initializers,
        value_info=value_info,
        sparse_initializer=sparse,
    )
    stage = helper.make_model(stage_graph, opset_imports=list(model.opset_import), producer_name="slicer.cut")
    stage.ir_version = model.ir_version
    stage.functions.extend(model.functions)
    if external_data_dir(model) is None:  # else checked by path once saved beside its data (cut_model)
        _check_stage(stage, k, start, end)
    return stage


def _check_stage(stage: onnx.ModelProto | str, k: int, start: int, end: int) -> None:
    try:
        onnx.checker.check_model(stage)
    except onnx.checker.ValidationError as exc:
        raise ValueError(f"stage {k} (nodes {start}..{end - 1}) is not a valid ONNX model: {exc}") from exc


def _to_graph_layout(spec: "LaidOutSpec | MergedSpec", source: str, target: str,
                     constants: list[onnx.TensorProto]) -> list[onnx.NodeProto]:
    """Nodes turning a boundary tensor (batch-first, batch and length apart) into its graph layout."""
    if isinstance(spec, LaidOutSpec):
        return [helper.make_node("Transpose", [source], [target], perm=spec.to_graph, name=f"{target}_layout")]
    shape = f"{target}_graph_shape"
    constants.append(onnx.numpy_helper.from_array(np.array([-1, *spec.graph_dims[1:]], np.int64), shape))
    return [helper.make_node("Reshape", [source, shape], [target], name=f"{target}_layout")]


def _to_boundary_layout(spec: "LaidOutSpec | MergedSpec", source: str, target: str, batch_source: str,
                        constants: list[onnx.TensorProto]) -> list[onnx.NodeProto]:
    """Nodes turning a tensor in its graph layout into its boundary layout; a merged one reads the
    batch size off dim 0 of `batch_source` (any tensor entering the stage: each is batch-first)."""
    if isinstance(spec, LaidOutSpec):
        return [helper.make_node("Transpose", [source], [target], perm=spec.to_batch_first,
                                 name=f"{target}_batch_first")]
    zero, rest = f"{target}_axis0", f"{target}_rest"
    constants.append(onnx.numpy_helper.from_array(np.array([0], np.int64), zero))
    constants.append(onnx.numpy_helper.from_array(np.array([-1, *spec.graph_dims[1:]], np.int64), rest))
    return [
        helper.make_node("Shape", [batch_source], [f"{target}_rows_shape"], name=f"{target}_rows_shape_node"),
        helper.make_node("Gather", [f"{target}_rows_shape", zero], [f"{target}_rows"], axis=0,
                         name=f"{target}_rows_node"),
        helper.make_node("Concat", [f"{target}_rows", rest], [f"{target}_boundary_shape"], axis=0,
                         name=f"{target}_boundary_shape_node"),
        helper.make_node("Reshape", [source, f"{target}_boundary_shape"], [target], name=f"{target}_batch_first"),
    ]


# --- batch-independent tensors, remade in the stage that reads them ---------------------


def _own(t: str, k: int) -> str:
    """The name, inside stage k, of a tensor that crossed batch-first, back in the graph's layout."""
    return f"{t}__own{k}"


def _remake_nodes(
    model: onnx.ModelProto,
    k: int,
    wanted: Sequence[str],
    recomp: Recomputable,
    names: Mapping[str, str],
    in_specs: Sequence[TensorSpec],
    leaf_specs: Mapping[str, TensorSpec],
    moved: Mapping[str, "LaidOutSpec | MergedSpec"] = {},
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """Nodes (in graph order) that remake `wanted` inside stage `k`, and the constants they add.

    A `Shape` of a row tensor the stage receives reads it under its boundary name; a `Shape` of
    one it does not is rebuilt from the shape of a row tensor it does receive (a donor with the
    batch and, where needed, the length dim): the value is the same for the batch being run.
    """
    if not wanted:
        return [], []
    graph = model.graph
    producer = {o: i for i, node in enumerate(graph.node) for o in node.output if o}
    chosen: set[int] = set()
    leaves: dict[int, str] = {}  # node index -> the row tensor its Shape reads
    stack = list(wanted)
    seen: set[str] = set()
    while stack:
        t = stack.pop()
        if t in seen or t not in recomp.tensors:
            continue
        seen.add(t)
        idx = producer[t]
        if t in recomp.shape_leaves:
            leaves[idx] = recomp.shape_leaves[t]
            continue
        chosen.add(idx)
        stack.extend(i for i in graph.node[idx].input if i)
    nodes: list[onnx.NodeProto] = []
    constants: list[onnx.TensorProto] = []
    for idx in sorted(chosen | set(leaves)):
        src = graph.node[idx]
        if idx not in leaves:
            node = onnx.NodeProto()
            node.CopyFrom(src)
            node.name = f"{src.name or src.op_type}__remade{k}"
            nodes.append(node)
            continue
        x = leaves[idx]
        if x in names:  # the stage receives x itself
            node = onnx.NodeProto()
            node.CopyFrom(src)
            node.input[0] = _own(x, k) if x in moved else names[x]
            node.name = f"{src.name or 'shape'}__remade{k}"
            nodes.append(node)
            continue
        added, consts = _shape_from_donor(src, leaf_specs[x], in_specs, k)
        nodes += added
        constants += consts
    return nodes, constants


def _shape_from_donor(shape_node: onnx.NodeProto, x: TensorSpec, in_specs: Sequence[TensorSpec],
                      k: int) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """`Shape(x)` (with its start/end) rebuilt from the shapes of row tensors the stage receives:
    the batch dim and each length dim read off one that has it (or computed from one with the
    length), constants as constants."""
    out = shape_node.output[0]
    attrs = {a.name: helper.get_attribute_value(a) for a in shape_node.attribute}
    graph_dims = x.graph_dims if isinstance(x, (LaidOutSpec, MergedSpec)) else x.dims
    rank = len(graph_dims)
    start, end = int(attrs.get("start", 0)), int(attrs.get("end", rank))
    dims = list(graph_dims)[slice(start, end)]
    nodes: list[onnx.NodeProto] = []
    constants: list[onnx.TensorProto] = []
    shapes: dict[str, str] = {}

    def const(name: str, value: list[int]) -> str:
        constants.append(onnx.numpy_helper.from_array(np.array(value, np.int64), name))
        return name

    def shape_of(spec: TensorSpec) -> str:
        if spec.name not in shapes:
            shapes[spec.name] = f"{out}__shape_of{k}_{len(shapes)}"
            nodes.append(helper.make_node("Shape", [spec.name], [shapes[spec.name]], name=f"{shapes[spec.name]}_node"))
        return shapes[spec.name]

    def read(dim: str, piece: str) -> str:
        found = (in_specs[0], 0, None) if dim == BATCH else length_source(dim, in_specs)
        if found is None:
            raise ValueError(f"stage {k} cannot remake {out!r}: no tensor entering it has a dim giving {dim!r}")
        spec, axis, how = found
        value = f"{piece}_read"
        nodes.append(helper.make_node("Gather", [shape_of(spec), const(f"{piece}_axis", [axis])], [value], axis=0,
                                      name=f"{value}_node"))
        if how is not None:
            computed = length_nodes(how, value, f"{piece}_len")
            nodes.extend(computed.nodes)
            constants.extend(computed.constants)
            value = computed.output
        return value

    pieces = []
    for j, dim in enumerate(dims):
        piece = f"{out}__piece{k}_{j}"
        if not isinstance(dim, str):
            pieces.append(const(piece, [int(dim)]))
        elif dim == MERGED:
            rows, length = read(BATCH, f"{piece}_rows"), read(SEQ, f"{piece}_length")
            nodes.append(helper.make_node("Mul", [rows, length], [piece], name=f"{piece}_node"))
            pieces.append(piece)
        else:
            pieces.append(read(dim, piece))
    if not pieces:
        const(out, [])
        return nodes, constants
    nodes.append(helper.make_node("Concat", pieces, [out], axis=0, name=f"{out}__concat{k}"))
    return nodes, constants
