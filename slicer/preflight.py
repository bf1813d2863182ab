"""Checks made before any slicing work, each failing with one clear line (a `SliceError`).

- `read_model`: the file, with its external data (a missing data file is named), checked by the
  ONNX checker -- by path for models over protobuf's 2 GB limit, which cannot be checked as a proto.
- `check_opset`: the default-domain opset must be one the installed onnxruntime runs (7 .. its newest).
- `full_session`: the unsliced model in onnxruntime (its weights read from disk, for a model over
  2 GB), quiet: the
  probes below expect failures and report them themselves.
- `probe_max_length`: the model runs one query at the longest length asked; otherwise the longest
  length it does run is found by bisection and named.
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper
from onnx.external_data_helper import ExternalDataInfo, load_external_data_for_model, uses_external_data

from dvabatch_backend.runtime.manifest import TensorSpec

from .errors import SliceError, one_line
from .sessions import keep_data_on_disk, proto_session
from .profiler import random_inputs

PROTO_LIMIT = 2**31 - 1  # bytes: protobuf cannot serialize (or parse) a message larger
MIN_OPSET = 7  # onnxruntime only guarantees opsets from 7
DEFAULT_DOMAINS = ("", "ai.onnx")


def read_model(path: Path) -> onnx.ModelProto:
    """The model at `path`, checked, with its external data loaded, or, over 2 GB, left on disk
    (`slicer.sessions`). Not a model, a missing data file, an opset onnxruntime cannot run, a failed
    check: a SliceError."""
    if not path.is_file():
        raise SliceError(f"{path}: no such file")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf's DecodeError and friends
        raise SliceError(f"{path} is not an ONNX model (or is truncated): {one_line(exc)}") from exc
    if not model.graph.node:
        raise SliceError(f"{path} is not an ONNX model: it has no graph nodes")
    check_opset(model)
    _check_external_files(model, path)
    large = proto_size(model, path.parent) > PROTO_LIMIT
    if large:  # the weights stay on disk: sessions read them from there (slicer.sessions)
        keep_data_on_disk(model, path.parent)
    else:
        try:
            load_external_data_for_model(model, str(path.parent))
        except Exception as exc:
            raise SliceError(f"{path}: cannot read its external data: {one_line(exc)}") from exc
    try:
        onnx.checker.check_model(str(path) if large else model)
    except onnx.checker.ValidationError as exc:
        raise SliceError(f"the model does not pass the ONNX checker: {one_line(exc)}") from exc
    return model


def check_proto(model: onnx.ModelProto) -> None:
    """A model given as a proto: its opset and the checker (a proto over 2 GB cannot be checked)."""
    check_opset(model)
    if model.ByteSize() > PROTO_LIMIT:
        raise SliceError("the model is over 2 GB (protobuf's limit): save it with external data and pass its path")
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as exc:
        raise SliceError(f"the model does not pass the ONNX checker: {one_line(exc)}") from exc


def _check_external_files(model: onnx.ModelProto, path: Path) -> None:
    missing: dict[str, list[str]] = {}
    for tensor in _external_tensors(model):
        location = ExternalDataInfo(tensor).location
        if not (path.parent / location).is_file():
            missing.setdefault(location, []).append(tensor.name)
    if missing:
        location, tensors = next(iter(missing.items()))
        more = f" and {len(tensors) - 1} more" if len(tensors) > 1 else ""
        others = f" (and {len(missing) - 1} more missing files)" if len(missing) > 1 else ""
        raise SliceError(f"{path}: its external data file {location!r} is missing (expected in {path.parent}; "
                         f"it holds tensor {tensors[0]!r}{more}){others}")


def _external_tensors(model: onnx.ModelProto) -> list[TensorProto]:
    from onnx.external_data_helper import _get_all_tensors

    return [t for t in _get_all_tensors(model) if uses_external_data(t)]


def proto_size(model: onnx.ModelProto, base_dir: Path | None = None) -> int:
    """Bytes the model would take as one protobuf message, its external data included."""
    size = model.ByteSize()
    for tensor in _external_tensors(model):
        info = ExternalDataInfo(tensor)
        if info.length:
            size += int(info.length)
        elif base_dir is not None and (base_dir / info.location).is_file():
            size += (base_dir / info.location).stat().st_size
    return size


def check_opset(model: onnx.ModelProto) -> None:
    """The default-domain opset is one the installed onnxruntime runs, or a SliceError saying which it runs."""
    versions = [o.version for o in model.opset_import if o.domain in DEFAULT_DOMAINS]
    if not versions:
        return  # no default-domain operators: nothing to check here
    version = max(versions)
    newest = newest_ort_opset()
    if not MIN_OPSET <= version <= newest:
        raise SliceError(
            f"the model uses ONNX opset {version}; onnxruntime {ort.__version__} here runs opsets {MIN_OPSET} to "
            f"{newest}: convert it (onnx.version_converter.convert_version(model, {min(max(version, MIN_OPSET), newest)}))")


@functools.lru_cache(maxsize=1)
def newest_ort_opset(ceiling: int = 64) -> int:
    """The newest default-domain opset the installed onnxruntime loads a model of (bisection on a one-node model)."""
    lo, hi = max(MIN_OPSET, min(onnx.defs.onnx_opset_version(), 17)), ceiling + 1  # lo loads, hi does not
    if not _ort_loads_opset(lo):
        return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _ort_loads_opset(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _ort_loads_opset(version: int) -> bool:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "opset_probe", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", version)])
    model.ir_version = 10
    try:
        ort.InferenceSession(model.SerializeToString(), _quiet_options(), providers=["CPUExecutionProvider"])
    except Exception:
        return False
    return True


def _quiet_options(threads: int = 1) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.log_severity_level = 4  # fatal only: failures are reported by us, in one line
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return options


def full_session(model: onnx.ModelProto, threads: int = 1) -> ort.InferenceSession:
    """The unsliced model in onnxruntime (its weights read from disk where they stayed there).
    Quiet: failures are reported by the caller."""
    try:
        return proto_session(model, _quiet_options(threads))
    except Exception as exc:
        raise SliceError(f"onnxruntime cannot load the model: {one_line(exc)}") from exc


def probe_max_length(session: ort.InferenceSession, inputs: Sequence[TensorSpec], max_length: int,
                  int_high: Mapping[str, int] | None = None) -> None:
    """The model runs one query (batch 1) at `max_length`, or a SliceError naming the longest it runs.

    Models without a sequence axis (`max_length` 0) are run once at batch 1."""
    rng = np.random.default_rng(0)

    def failure(length: int) -> str | None:
        feeds = random_inputs(inputs, 1, length, rng, int_high)
        try:
            session.run(None, feeds)
        except Exception as exc:
            return one_line(exc)
        return None

    why = failure(max_length)
    if why is None:
        return
    if max_length <= 0:
        raise SliceError(f"the model fails on one query (batch 1): {why}")
    shortest = why if max_length == 1 else failure(1)
    if shortest is not None:
        raise SliceError(f"the model fails on one query (batch 1) even at length 1: {shortest}")
    works, fails = 1, max_length
    while fails - works > 1:
        mid = (works + fails) // 2
        if failure(mid) is None:
            works = mid
        else:
            fails = mid
    raise SliceError(f"the model fails at length {max_length} (a position table of {works}?): "
                     f"pass --max-length <= {works}")
