"""Fuzzing the real tritonserver with generated bad requests over HTTP and gRPC, good ones interleaved:

    python -m perf.reliability.fuzz --cases 1000        # >= 1000 bad requests per protocol; prints the tally

Hypothesis draws *rounds*: a few requests sent at the same time (so that they meet in the server's
batches), each over a protocol it draws, at least one of them a good request. A request is

- **bad** (the client's mistake): a wrong dtype, rank, fixed dim, a length past the largest profiled
  (up to huge), too many rows (up to huge), zero rows, zero length, rows or lengths that disagree
  between inputs, token ids outside the embedding (negative or past it), a missing, an extra or a
  repeated input, a declared shape its data does not fill, a negative dim (gRPC only: Triton's HTTP
  frontend answers that one 500 "Unable to parse 'shape'", a Triton limitation we cannot reach), or
  a request of several rows one of which is bad. It must be answered INVALID_ARGUMENT (gRPC) /
  HTTP 400 with a message naming the problem (`Request.fragments`).
- **good**: valid rows (1..3, mixed lengths, masks with padded tails), sent as binary or, over
  HTTP, JSON. Every row must equal the unsliced model run on that row alone (same output names and
  shapes, atol 1e-4, rtol 1e-3).
- **data**: valid shapes whose values are odd but not wrong -- NaN/Inf in float inputs (the runtime
  passes them through as data: nothing says the model cannot take them). Checked as good requests
  (NaN where the unsliced model gives NaN), and they must not disturb the requests batched with them.

Every call has a client timeout (a hang is counted, never waited for); after every round the server
process must be alive and the models' backend stubs the same processes (a crash is counted).
Byte sizes stay under `MAX_REQUEST_BYTES`.
"""
from __future__ import annotations

import argparse
import logging
import re
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from dvabatch_backend.runtime.manifest import Manifest, TensorSpec

log = logging.getLogger("perf.reliability.fuzz")

__all__ = ["FuzzModel", "FuzzTally", "Fuzzer", "Outcome", "Request", "liveness", "main", "rounds"]

PROTOCOLS = ("http", "grpc")
MAX_REQUEST_BYTES = 48 << 20  # one request's tensors: sane, under the 64 MiB the brief allows
TIMEOUT_S = 30.0  # every call's client timeout; no answer within it is a hang
ATOL, RTOL = 1e-4, 1e-3  # as the real-export tests (stage-split and batched runs reorder reductions)
INVALID = {"http": "400", "grpc": "StatusCode.INVALID_ARGUMENT"}
# dtypes a request may wrongly carry (Triton names them on the wire; object is BYTES)
WRONG_DTYPES = ("int32", "int64", "float32", "float64", "float16", "int8", "uint8", "bool", "object")


# ----------------------------------------------------------------------------------------------
# what is fuzzed


@dataclass
class FuzzModel:
    """A served model: its name on the server, the sliced folder's manifest and unsliced model."""

    name: str
    version_dir: Path
    int_high: Mapping[str, int]  # exclusive bounds of good integer values (token ids)
    manifest: Manifest = field(init=False)

    def __post_init__(self) -> None:
        import onnxruntime as ort

        self.manifest = Manifest.load(self.version_dir / "manifest.json")
        self._full = ort.InferenceSession(str(self.version_dir / (self.manifest.full_model or "model.onnx")),
                                          providers=["CPUExecutionProvider"])
        self._lock = threading.Lock()

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        return self.manifest.inputs

    @property
    def has_seq(self) -> bool:
        return any(spec.has_seq for spec in self.inputs)

    def reference(self, row: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The unsliced model on one row alone (batch dim kept, of 1)."""
        names = [o.name for o in self._full.get_outputs()]
        with self._lock:
            return dict(zip(names, self._full.run(names, {k: v[None] for k, v in row.items()})))

    def valid_feeds(self, rng: np.random.Generator, rows: int, length: int) -> dict[str, np.ndarray]:
        """`rows` valid rows of one length; masks padded with a zero tail on some rows."""
        from slicer.profiler import random_inputs

        return random_inputs(self.inputs, rows, length, rng, dict(self.int_high))

    def lengths(self) -> list[int]:
        """The valid lengths (0 for a model without one)."""
        return self.manifest.valid_lengths() if self.has_seq else [0]


@dataclass
class Request:
    """One request: its tensors (batch dim included) and how they go on the wire."""

    kind: str  # "good", "data: ...", or the bad kind
    model: str
    feeds: list[tuple[str, np.ndarray]]  # a list: an input may be repeated
    protocol: str
    declared: dict[int, list[int]] = field(default_factory=dict)  # feed index -> shape on the wire
    binary: bool = True  # HTTP only: False sends the data as JSON
    fragments: tuple[str, ...] = ()  # bad: what the error message must contain

    @property
    def bad(self) -> bool:
        return not (self.kind == "good" or self.kind.startswith("data"))

    def describe(self) -> str:
        shapes = [(name, str(arr.dtype), list(arr.shape)) for name, arr in self.feeds]
        return f"{self.protocol} {self.model} {self.kind!r} {shapes} declared={self.declared} binary={self.binary}"



# ----------------------------------------------------------------------------------------------
# strategies


def _rng(data: st.DataObject) -> np.random.Generator:
    return np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))


def _max_rows(length: int, model: FuzzModel) -> int:
    """The most rows of this length whose tensors stay within MAX_REQUEST_BYTES."""
    row_bytes = sum(int(np.prod(spec.shape(1, length))) * spec.np_dtype.itemsize for spec in model.inputs)
    return MAX_REQUEST_BYTES // max(row_bytes, 1)


def _good_shape(data: st.DataObject, model: FuzzModel) -> tuple[int, int]:
    rows = data.draw(st.integers(1, min(3, model.manifest.max_batch_size)), label="rows")
    length = data.draw(st.sampled_from(model.lengths()), label="length")
    return rows, length


def good_request(data: st.DataObject, model: FuzzModel, protocol: str) -> Request:
    rows, length = _good_shape(data, model)
    feeds = model.valid_feeds(_rng(data), rows, length)
    # JSON only for integer data: JSON cannot carry NaN, and floats would round-trip through text
    json_ok = protocol == "http" and all(np.issubdtype(a.dtype, np.integer) for a in feeds.values())
    binary = not json_ok or data.draw(st.booleans(), label="binary")
    return Request("good", model.name, list(feeds.items()), protocol, binary=binary)


def data_request(data: st.DataObject, model: FuzzModel, protocol: str) -> Request | None:
    """NaN/Inf (and extremes) in a float input: data the runtime passes through. None when the model has no float input."""
    floats = [spec for spec in model.inputs if np.issubdtype(spec.np_dtype, np.floating)]
    if not floats:
        return None
    rows, length = _good_shape(data, model)
    feeds = model.valid_feeds(_rng(data), rows, length)
    spec = data.draw(st.sampled_from(floats), label="float input")
    arr = feeds[spec.name]
    specials = st.sampled_from([np.nan, np.inf, -np.inf, np.finfo(np.float32).max, -np.finfo(np.float32).max])
    count = data.draw(st.integers(1, 8), label="count")
    for _ in range(count):
        index = tuple(data.draw(st.integers(0, n - 1)) for n in arr.shape)
        arr[index] = data.draw(specials, label="value")
    if data.draw(st.booleans(), label="whole row"):
        arr[0] = data.draw(specials, label="row value")
    return Request("data: non-finite floats", model.name, list(feeds.items()), protocol)


def _bad(kind: str, model: FuzzModel, feeds: Mapping[str, np.ndarray] | list[tuple[str, np.ndarray]], protocol: str,
         *fragments: str, **extra: Any) -> Request:
    items = list(feeds.items()) if isinstance(feeds, Mapping) else feeds
    return Request(kind, model.name, items, protocol, fragments=fragments, **extra)


def _valid(data: st.DataObject, model: FuzzModel) -> tuple[dict[str, np.ndarray], int, int]:
    rows, length = _good_shape(data, model)
    return model.valid_feeds(_rng(data), rows, length), rows, length


def bad_dtype(data: st.DataObject, model: FuzzModel, protocol: str) -> Request:
    feeds, _, _ = _valid(data, model)
    spec = data.draw(st.sampled_from(model.inputs), label="input")
    dtype = data.draw(st.sampled_from([d for d in WRONG_DTYPES if d != spec.dtype]), label="dtype")
    arr = feeds[spec.name]
    feeds[spec.name] = arr.astype(str).astype(object) if dtype == "object" else arr.astype(dtype)
    return _bad("wrong dtype", model, feeds, protocol, spec.name, "data-type")


def bad_rank(data: st.DataObject, model: FuzzModel, protocol: str) -> Request:
    feeds, rows, _ = _valid(data, model)
    spec = data.draw(st.sampled_from(model.inputs), label="input")
    arr = feeds[spec.name]
    how = data.draw(st.sampled_from(["add axis", "drop axes", "flatten"]), label="how")
    if how == "add axis":
        axis = data.draw(st.integers(1, arr.ndim), label="axis")
        arr = np.expand_dims(arr, axis)
        if data.draw(st.booleans(), label="repeat"):
            arr = np.repeat(arr, 2, axis=axis)
    elif how == "drop axes" or arr.ndim == 2:
        arr = np.ascontiguousarray(arr.reshape(rows, -1)[:, 0])  # only the batch axis left
    else:
        arr = arr.reshape(rows, -1)
    feeds[spec.name] = arr
    return _bad("wrong rank", model, feeds, protocol, spec.name, "shape")


def bad_fixed_dim(data: st.DataObject, model: FuzzModel, protocol: str) -> Request | None:
    fixed = [(spec, axis) for spec in model.inputs for axis, d in enumerate(spec.dims) if isinstance(d, int)]
    if not fixed:
        return None
    feeds, rows, length = _valid(data, model)
    spec, axis = data.draw(st.sampled_from(fixed), label="fixed dim")
    size = data.draw(st.integers(1, 4 * spec.dims[axis]).filter(lambda n: n != spec.dims[axis]), label="size")
    shape = list(feeds[spec.name].shape)
    shape[axis] = size
    feeds[spec.name] = np.zeros(shape, spec.np_dtype)
    return _bad("wrong fixed dim", model, feeds, protocol, spec.name, "shape")


def too_long(data: st.DataObject, model: FuzzModel, protocol: str) -> Request | None:
    if not model.has_seq:
        return None
    limit = model.manifest.max_length
    rows = data.draw(st.integers(1, 2), label="rows")
    huge = max(limit + 1, MAX_REQUEST_BYTES // (rows * 8 * len(model.inputs)))
    length = data.draw(st.one_of(st.integers(limit + 1, 2 * limit), st.integers(limit + 1, huge)), label="length")
    feeds = model.valid_feeds(_rng(data), rows, 1)
    feeds = {spec.name: np.resize(feeds[spec.name], spec.shape(rows, length)) for spec in model.inputs}
    return _bad("too long", model, feeds, protocol, f"has length {length}", f"largest profiled {limit}")


def too_many_rows(data: st.DataObject, model: FuzzModel, protocol: str) -> Request:
    length = data.draw(st.sampled_from(model.lengths()), label="length")
    bs_max = model.manifest.max_batch_size
    most = max(bs_max + 1, min(10**6, _max_rows(length, model)))
    rows = data.draw(st.one_of(st.integers(bs_max + 1, 2 * bs_max), st.integers(bs_max + 1, most)), label="rows")
    feeds = {spec.name: np.zeros(spec.shape(rows, length), spec.np_dtype) for spec in model.inputs}
    return _bad("too many rows", model, feeds, protocol, f"batch-size must be <= {bs_max}")


def zero_rows(data: st.DataObject, model: FuzzModel, protocol: str) -> Request:
    length = data.draw(st.sampled_from(model.lengths()), label="length")
    feeds = {spec.name: np.zeros(spec.shape(0, length), spec.np_dtype) for spec in model.inputs}
    return _bad("zero rows", model, feeds, protocol)


def zero_length(data: st.DataObject, model: FuzzModel, protocol: str) -> Request | None:
    if not model.has_seq:
        return None
    rows = data.draw(st.integers(1, 3), label="rows")
    feeds = {spec.name: np.zeros(spec.shape(rows, 0), spec.np_dtype) for spec in model.inputs}
    first = next(spec.name for spec in model.inputs if spec.has_seq)
    return _bad("zero length", model, feeds, protocol, first, "empty")


def rows_disagree(data: st.DataObject, model: FuzzModel, protocol: str) -> Request | None:
    if len(model.inputs) < 2:
        return None
    feeds, rows, length = _valid(data, model)
    spec = data.draw(st.sampled_from(model.inputs[1:]), label="input")
    other = data.draw(st.integers(0, model.manifest.max_batch_size).filter(lambda n: n != rows), label="rows")
    feeds[spec.name] = np.resize(feeds[spec.name], spec.shape(other, length))
    # Triton sizes every input by the first one's rows: an empty one is told by its byte size
    fragments = ("byte size mismatch", spec.name) if other == 0 else ("batch size does not match",)
    return _bad("rows disagree", model, feeds, protocol, *fragments)


def lengths_disagree(data: st.DataObject, model: FuzzModel, protocol: str) -> Request | None:
    seq = [spec for spec in model.inputs if spec.has_seq]
    if len(seq) < 2:
        return None
    feeds, rows, length = _valid(data, model)
    spec = data.draw(st.sampled_from(seq[1:]), label="input")
    other = data.draw(st.sampled_from([n for n in model.lengths() if n != length]), label="length")
    feeds[spec.name] = np.resize(feeds[spec.name], spec.shape(rows, other))
    return _bad("lengths disagree", model, feeds, protocol, "disagree on the sequence length")


def ids_out_of_range(data: st.DataObject, model: FuzzModel, protocol: str) -> Request | None:
    bounds = dict(model.manifest.input_bounds)
    if not bounds:
        return None
    feeds, _, _ = _valid(data, model)
    name = data.draw(st.sampled_from(sorted(bounds)), label="input")
    bound = bounds[name]
    top = int(np.iinfo(feeds[name].dtype).max)
    value = data.draw(st.one_of(st.integers(bound, 2 * bound), st.integers(bound, top),
                                st.integers(-top - 1, -1), st.integers(-bound, -1)), label="id")
    arr = feeds[name]
    for _ in range(data.draw(st.integers(1, 3), label="count")):
        arr[tuple(data.draw(st.integers(0, n - 1)) for n in arr.shape)] = value
    return _bad("id out of range", model, feeds, protocol, name, f"outside [0, {bound})")


def missing_input(data: st.DataObject, model: FuzzModel, protocol: str) -> Request:
    feeds, _, _ = _valid(data, model)
    drop = data.draw(st.lists(st.sampled_from([s.name for s in model.inputs]), min_size=1, unique=True), label="drop")
    kept = {k: v for k, v in feeds.items() if k not in drop}
    return _bad("missing input", model, kept, protocol, "missing required input", drop[0])


def extra_input(data: st.DataObject, model: FuzzModel, protocol: str) -> Request:
    feeds, rows, _ = _valid(data, model)
    names = {s.name for s in model.inputs}
    name = data.draw(st.text("abcdefghijklmnopqrstuvwxyz_0123456789", min_size=1, max_size=12)
                     .filter(lambda n: n not in names), label="name")
    dtype = data.draw(st.sampled_from(["int64", "float32", "int32"]), label="dtype")
    width = data.draw(st.integers(1, 8), label="width")
    feeds[name] = np.zeros((rows, width), dtype)
    return _bad("extra input", model, feeds, protocol, name)


def repeated_input(data: st.DataObject, model: FuzzModel, protocol: str) -> Request:
    feeds, _, _ = _valid(data, model)
    spec = data.draw(st.sampled_from(model.inputs), label="input")
    items = list(feeds.items()) + [(spec.name, feeds[spec.name].copy())]
    return _bad("repeated input", model, items, protocol, spec.name)


def _one_axis(data: st.DataObject, model: FuzzModel) -> tuple[dict[str, np.ndarray], int, str, np.ndarray, list[int], int]:
    """A valid request's feeds, one input drawn from them (its index, name, array and shape as a
    list), and one of its axes: what a strategy that breaks one declared dim starts from."""
    feeds, _, _ = _valid(data, model)
    index = data.draw(st.integers(0, len(feeds) - 1), label="input")
    name, arr = list(feeds.items())[index]
    return feeds, index, name, arr, list(arr.shape), data.draw(st.integers(0, arr.ndim - 1), label="axis")


def short_data(data: st.DataObject, model: FuzzModel, protocol: str) -> Request:
    """A declared shape its data does not fill (or overfills): the byte size disagrees."""
    feeds, index, name, arr, shape, axis = _one_axis(data, model)
    shape[axis] = data.draw(st.integers(1, max(2, 2 * shape[axis])).filter(lambda n: n != arr.shape[axis]),
                            label="size")
    # Triton names the first input whose batch size disagrees, or says the batch is too big
    fragments = () if axis == 0 else (name,)
    return _bad("byte size mismatch", model, feeds, protocol, *fragments, declared={index: shape})


def negative_dim(data: st.DataObject, model: FuzzModel, protocol: str) -> Request:
    feeds, index, name, arr, shape, axis = _one_axis(data, model)
    shape[axis] = -data.draw(st.integers(1, 64), label="size")
    fragments = () if axis == 0 else (name,)
    return _bad("negative dim", model, feeds, "grpc", *fragments, declared={index: shape})


def one_bad_row(data: st.DataObject, model: FuzzModel, protocol: str) -> Request | None:
    """Rows of one request, one of them bad (an id out of range): the whole request is refused."""
    bounds = dict(model.manifest.input_bounds)
    if not bounds or model.manifest.max_batch_size < 2:
        return None
    rows = data.draw(st.integers(2, min(4, model.manifest.max_batch_size)), label="rows")
    length = data.draw(st.sampled_from(model.lengths()), label="length")
    feeds = model.valid_feeds(_rng(data), rows, length)
    name = data.draw(st.sampled_from(sorted(bounds)), label="input")
    row = data.draw(st.integers(0, rows - 1), label="row")
    feeds[name][row, data.draw(st.integers(0, max(length, 1) - 1), label="position")] = bounds[name]
    return _bad("one bad row", model, feeds, protocol, f"outside [0, {bounds[name]})")


BAD_KINDS: dict[str, Callable[[st.DataObject, FuzzModel, str], Request | None]] = {
    "wrong dtype": bad_dtype, "wrong rank": bad_rank, "wrong fixed dim": bad_fixed_dim, "too long": too_long,
    "too many rows": too_many_rows, "zero rows": zero_rows, "zero length": zero_length,
    "rows disagree": rows_disagree, "lengths disagree": lengths_disagree, "id out of range": ids_out_of_range,
    "missing input": missing_input, "extra input": extra_input, "repeated input": repeated_input,
    "byte size mismatch": short_data, "negative dim": negative_dim, "one bad row": one_bad_row,
}


def draw_request(data: st.DataObject, models: Sequence[FuzzModel], good: bool) -> Request:
    """A good (or data) request when `good`, else a bad one; model, kind and protocol drawn."""
    while True:
        model = data.draw(st.sampled_from(models), label="model")
        protocol = data.draw(st.sampled_from(PROTOCOLS), label="protocol")
        if good:
            made = data_request(data, model, protocol) if data.draw(st.integers(0, 3), label="data?") == 0 else None
            return made or good_request(data, model, protocol)
        made = BAD_KINDS[data.draw(st.sampled_from(sorted(BAD_KINDS)), label="kind")](data, model, protocol)
        if made is not None:
            return made


def rounds(data: st.DataObject, models: Sequence[FuzzModel], most: int = 6) -> list[Request]:
    """One round: 2..`most` requests sent together, at least one good, about two in three bad."""
    size = data.draw(st.integers(2, most), label="round size")
    good = [True] + [data.draw(st.integers(0, 2), label="good?") == 0 for _ in range(size - 1)]
    order = data.draw(st.permutations(range(size)), label="order")
    return [draw_request(data, models, good[i]) for i in order]


# ----------------------------------------------------------------------------------------------
# sending and checking


@dataclass
class Outcome:
    ok: bool
    code: str | None = None  # "400", "StatusCode.INVALID_ARGUMENT", ...; "hang" for no answer in time
    message: str = ""
    outputs: dict[str, np.ndarray] | None = None


class Clients:
    """One client per thread and protocol (tritonclient.http clients are not shared across threads);
    `close` closes all of them (a live keep-alive connection delays the server's exit)."""

    def __init__(self, http_url: str, grpc_url: str, timeout: float = TIMEOUT_S) -> None:
        self.http_url, self.grpc_url, self.timeout = http_url, grpc_url, timeout
        self._local = threading.local()
        self._all: list[Any] = []
        self._lock = threading.Lock()

    def get(self, protocol: str) -> Any:
        client = getattr(self._local, protocol, None)
        if client is None:
            import tritonclient.grpc as grpcclient
            import tritonclient.http as httpclient

            client = (httpclient.InferenceServerClient(self.http_url, connection_timeout=self.timeout,
                                                       network_timeout=self.timeout)
                      if protocol == "http" else grpcclient.InferenceServerClient(self.grpc_url))
            setattr(self._local, protocol, client)
            with self._lock:
                self._all.append(client)
        return client

    def forget(self, protocol: str) -> None:
        """Drop this thread's client (after a timeout its connection is in an unknown state)."""
        if hasattr(self._local, protocol):
            delattr(self._local, protocol)

    def close(self) -> None:
        with self._lock:
            clients, self._all = self._all, []
        for client in clients:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - best effort at the end
                pass


def _wire_inputs(request: Request) -> list[Any]:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import np_to_triton_dtype

    module = httpclient if request.protocol == "http" else grpcclient
    inputs = []
    for i, (name, arr) in enumerate(request.feeds):
        arr = np.ascontiguousarray(arr)
        tensor = module.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
        if request.protocol == "http":
            tensor.set_data_from_numpy(arr, binary_data=request.binary)
        else:
            tensor.set_data_from_numpy(arr)
        if i in request.declared:
            tensor.set_shape(request.declared[i])
        inputs.append(tensor)
    return inputs


def send(clients: Clients, request: Request) -> Outcome:
    """One request with a client timeout; the answer, the server's error, or a hang."""
    from tritonclient.utils import InferenceServerException

    client = clients.get(request.protocol)
    try:
        inputs = _wire_inputs(request)
        if request.protocol == "http":
            result = client.infer(request.model, inputs)
            names = [o["name"] for o in result.get_response()["outputs"]]
        else:
            result = client.infer(request.model, inputs, client_timeout=clients.timeout)
            names = [o.name for o in result.get_response().outputs]
        return Outcome(True, outputs={name: result.as_numpy(name) for name in names})
    except InferenceServerException as exc:
        code = str(exc.status())
        if code == "StatusCode.DEADLINE_EXCEEDED":
            clients.forget(request.protocol)
            return Outcome(False, "hang", exc.message() or "")
        return Outcome(False, code, exc.message() or "")
    except Exception as exc:  # noqa: BLE001 - a timeout or a dropped connection: no answer
        clients.forget(request.protocol)
        return Outcome(False, "hang", f"{type(exc).__name__}: {exc}")


def check(request: Request, outcome: Outcome, model: FuzzModel) -> str | None:
    """What is wrong with the outcome, or None."""
    if outcome.code == "hang":
        return f"no answer within the client timeout: {outcome.message}"
    if request.bad:
        if outcome.ok:
            return "a bad request was answered"
        if outcome.code != INVALID[request.protocol]:
            return f"code {outcome.code}, expected {INVALID[request.protocol]}: {outcome.message!r}"
        missing = [f for f in request.fragments if f not in outcome.message]
        return f"message {outcome.message!r} lacks {missing}" if missing else None
    if not outcome.ok:
        return f"a good request failed: {outcome.code} {outcome.message!r}"
    return _compare(dict(request.feeds), outcome.outputs or {}, model)


def _compare(feeds: Mapping[str, np.ndarray], got: Mapping[str, np.ndarray], model: FuzzModel) -> str | None:
    rows = next(iter(feeds.values())).shape[0]
    for r in range(rows):
        want = model.reference({k: v[r] for k, v in feeds.items()})
        if sorted(got) != sorted(want):
            return f"outputs {sorted(got)}, expected {sorted(want)}"
        for name, ref in want.items():
            axis = model.manifest.output_batch_axes.get(name, 0)
            expected_shape = ref.shape[:axis] + (rows,) + ref.shape[axis + 1:]
            if got[name].shape != expected_shape:
                return f"row {r} {name}: shape {got[name].shape}, expected {expected_shape}"
            row = np.take(got[name], [r], axis=axis)
            if not np.allclose(row, ref, atol=ATOL, rtol=RTOL, equal_nan=True):
                diff = np.nanmax(np.abs(row.astype(float) - ref.astype(float)))
                return f"row {r} {name}: differs from the unsliced model (max |diff| {diff:.3g})"
    return None


def template(message: str) -> str:
    """The message with numbers (query ids, sizes, values) replaced by N and the list of the inputs
    sent (drawn names) by [...]: one line per distinct error."""
    message = re.sub(r"Got input\(s\) \[[^\]]*\]", "Got input(s) [...]", message)
    return re.sub(r"-?\d+", "N", message)


@dataclass
class FuzzTally:
    """What a fuzz run saw."""

    cases: Counter = field(default_factory=Counter)  # (protocol, "bad"|"good"|"data") -> count
    kinds: Counter = field(default_factory=Counter)  # (protocol, kind) -> count
    codes: Counter = field(default_factory=Counter)  # (protocol, code) of the errors
    messages: Counter = field(default_factory=Counter)  # exact messages
    templates: Counter = field(default_factory=Counter)  # messages with numbers replaced
    good_sent: int = 0
    good_answered: int = 0
    good_correct: int = 0
    hangs: int = 0
    crashes: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    rounds: int = 0
    seconds: float = 0.0

    def bad_cases(self, protocol: str) -> int:
        return self.cases[(protocol, "bad")]

    def record(self, request: Request, outcome: Outcome, failure: str | None) -> None:
        group = "bad" if request.bad else ("good" if request.kind == "good" else "data")
        self.cases[(request.protocol, group)] += 1
        self.kinds[(request.protocol, request.kind)] += 1
        if outcome.code == "hang":
            self.hangs += 1
        elif not outcome.ok:
            self.codes[(request.protocol, outcome.code)] += 1
            self.messages[outcome.message] += 1
            self.templates[template(outcome.message)] += 1
        if not request.bad:
            self.good_sent += 1
            self.good_answered += outcome.ok
            self.good_correct += outcome.ok and failure is None
        if failure:
            self.failures.append(f"{request.describe()}: {failure}")

    def passed(self) -> bool:
        return not self.failures and not self.crashes and self.hangs == 0

    def report(self) -> list[str]:
        lines = [f"fuzz: {self.rounds} rounds in {self.seconds:.1f} s"]
        for protocol in PROTOCOLS:
            lines.append(f"  {protocol}: {self.cases[(protocol, 'bad')]} bad, {self.cases[(protocol, 'good')]} good, "
                         f"{self.cases[(protocol, 'data')]} data (NaN/Inf) requests")
        lines.append("  errors by code: " + ", ".join(f"{p} {c}: {n}" for (p, c), n in sorted(self.codes.items())))
        lines.append("  requests by kind: " + ", ".join(
            f"{k} {sum(n for (p, kk), n in self.kinds.items() if kk == k)}" for k in sorted({k for _, k in self.kinds})))
        lines.append(f"  good and data requests: {self.good_answered}/{self.good_sent} answered, "
                     f"{self.good_correct}/{self.good_sent} correct")
        lines.append(f"  hangs: {self.hangs}; crashes: {len(self.crashes)}")
        lines.append(f"  distinct error messages: {len(self.messages)} exact, {len(self.templates)} with numbers as N:")
        lines += [f"    {n:5d}  {t}" for t, n in self.templates.most_common()]
        if self.failures:
            lines.append(f"  FAILURES ({len(self.failures)}):")
            lines += [f"    {f}" for f in self.failures[:30]]
        lines += [f"  CRASH: {c}" for c in self.crashes]
        return lines


# ----------------------------------------------------------------------------------------------
# the runner


class Fuzzer:
    """Sends hypothesis-drawn rounds to a running server and tallies them. `alive()` says whether
    the server and the models' stub processes are still the ones that started (a crash otherwise)."""

    def __init__(self, http_url: str, grpc_url: str, models: Sequence[FuzzModel],
                 alive: Callable[[], str | None] = lambda: None, workers: int = 6) -> None:
        self.models = list(models)
        self._by_name = {m.name: m for m in self.models}
        self.clients = Clients(http_url, grpc_url)
        self.alive = alive
        self.tally = FuzzTally()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="fuzz")

    def run_round(self, requests: Sequence[Request]) -> None:
        """Send the requests together, check each, and check the server is still whole."""
        outcomes = list(self._pool.map(lambda r: send(self.clients, r), requests))
        for request, outcome in zip(requests, outcomes):
            self.tally.record(request, outcome, check(request, outcome, self._by_name[request.model]))
        self.tally.rounds += 1
        crash = self.alive()
        if crash:
            self.tally.crashes.append(crash)

    def run(self, examples: int, seed_value: int = 0) -> FuzzTally:
        """`examples` hypothesis-drawn rounds (generation only: failures are tallied, not raised)."""
        began = time.perf_counter()

        @seed(seed_value)
        @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(st.data())
        def one_round(data: st.DataObject) -> None:
            if not self.tally.crashes:
                self.run_round(rounds(data, self.models))

        one_round()
        self.tally.seconds += time.perf_counter() - began
        return self.tally

    def run_until(self, bad_per_protocol: int, seed_value: int = 0, batch: int = 100) -> FuzzTally:
        """Rounds until every protocol had `bad_per_protocol` bad requests (or the server crashed)."""
        k = 0
        while min(self.tally.bad_cases(p) for p in PROTOCOLS) < bad_per_protocol and not self.tally.crashes:
            self.run(batch, seed_value + k)
            k += 1
            log.info("fuzz: %d rounds, bad requests %s", self.tally.rounds,
                     {p: self.tally.bad_cases(p) for p in PROTOCOLS})
        return self.tally

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.clients.close()


def liveness(server: Any, model_dirs: Sequence[Path]) -> Callable[[], str | None]:
    """A check that the server process runs and each model's stub processes are those of the start."""
    from dvabatch_backend.tools.serve import stub_processes

    def stubs() -> dict[Path, list[int]]:
        out = {}
        for model_dir in model_dirs:
            prefix = str(model_dir) + "/"
            out[model_dir] = sorted(stub_processes(lambda argv, p=prefix: len(argv) > 1 and argv[1].startswith(p)))
        return out

    started = stubs()

    def alive() -> str | None:
        if server.exited():
            return f"tritonserver exited:\n{server.log_tail()}"
        now = stubs()
        return None if now == started else f"backend stubs changed: {started} -> {now}"

    return alive


# ----------------------------------------------------------------------------------------------
# the command


FUZZ_MODELS = {"bert": "input", "vgg19": "hybrid"}  # zoo model -> policy of its served variant


def fuzz_served(out_dir: Path, bad_per_protocol: int, seed_value: int = 0) -> FuzzTally:
    """Slice the zoo's test-size bert and vgg19 into `out_dir`, serve them from one tritonserver and
    fuzz until each protocol had `bad_per_protocol` bad requests."""
    from dvabatch_backend.tools.serve import TritonServer
    from perf.baselines.bench import sliced
    from slicer.triton_files import add_model_variant

    repo = out_dir / "repository"
    models = []
    for zoo_name, policy in FUZZ_MODELS.items():
        version_dir, _, int_high, _ = sliced(zoo_name, "test", out_dir)
        name = f"{zoo_name}_fuzz"
        add_model_variant(repo, version_dir, name, policy=policy)
        models.append(FuzzModel(name, version_dir, int_high))
    with TritonServer(repo, explicit=True, load=[m.name for m in models]) as server:
        for model in models:
            server.wait_model_ready(model.name, timeout=180)
        fuzzer = Fuzzer(server.http_url, server.grpc_url, models,
                        liveness(server, [(repo / m.name).resolve() for m in models]))
        try:
            return fuzzer.run_until(bad_per_protocol, seed_value)
        finally:
            fuzzer.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.reliability.fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=1000, help="bad requests per protocol (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=None, help="keep the sliced models here (default: a temporary folder)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with tempfile.TemporaryDirectory(prefix="dvabatch-fuzz-") as tmp:
        tally = fuzz_served(args.out or Path(tmp), args.cases, args.seed)
    for line in tally.report():
        print(line)
    print("PASS" if tally.passed() else "FAIL")
    return 0 if tally.passed() else 1


if __name__ == "__main__":
    sys.exit(main())
