"""Helpers for tests against the real tritonserver: a model repository made by the slicer, and
one-query calls over HTTP and gRPC, sync and async."""
from __future__ import annotations

import atexit
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, TypeVar

import numpy as np
import onnxruntime as ort
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from dvabatch_backend.runtime.manifest import Manifest
from dvabatch_backend.tools.serve import TritonServer, infer_inputs, stub_processes
from slicer.profiler import int_bounds, random_inputs
from slicer.slice_model import SliceOptions, slice_model
from slicer.triton_files import add_model_variant
from slicer.zoo import ZOO, build

POLICIES = ("pipelined", "input", "operator", "load", "hybrid")


@dataclass
class ServedModel:
    """A sliced model in the repository, with its unsliced reference and a query maker."""

    name: str
    version_dir: Path
    manifest: Manifest
    int_high: dict[str, int]
    max_length: int

    def __post_init__(self) -> None:
        self._full = ort.InferenceSession(str(self.version_dir / "model.onnx"), providers=["CPUExecutionProvider"])

    def query(self, rng: np.random.Generator, length: int | None = None) -> dict[str, np.ndarray]:
        if length is None:
            length = int(rng.integers(1, self.max_length + 1)) if self.max_length else 0
        feeds = random_inputs(self.manifest.inputs, 1, length, rng, self.int_high)
        if "attention_mask" in feeds:
            feeds["attention_mask"][:] = 1
        return {k: v[0] for k, v in feeds.items()}

    def reference(self, query: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        names = [o.name for o in self._full.get_outputs()]
        return dict(zip(names, (r[0] for r in self._full.run(None, {k: v[None] for k, v in query.items()}))))


# each (zoo model, stage count) is sliced once per test process, in a folder removed when the session
# ends (tests/conftest.py) or at exit; a caller gets a copy of its own (tests write into their version
# folders: policies, logs, gates)
_slices: dict[tuple[str, int], tuple[Path, dict[str, int]]] = {}
_slice_lock = threading.Lock()
_slice_root: list[Path] = []


def remove_slices() -> None:
    with _slice_lock:
        for root in _slice_root:
            shutil.rmtree(root, ignore_errors=True)
        _slice_root.clear()
        _slices.clear()


atexit.register(remove_slices)


def slice_zoo_model(repository: Path, zoo_name: str, stages: int = 3) -> ServedModel:
    """The zoo model at test size sliced into `stages` stages, as `repository/zoo_name` (a copy of
    this process's one slice of it)."""
    max_length = ZOO[zoo_name].max_length.get("test", 0)
    with _slice_lock:
        if (zoo_name, stages) not in _slices:
            model = build(zoo_name, "test")
            options = SliceOptions(stages=stages, max_batch_size=8, max_length=max_length or 128, repeats=3,
                                   batch_sizes=(1, 2, 4, 8), lengths=(max_length,) if max_length else None,
                                   calibration_rounds=1)
            if not _slice_root:
                _slice_root.append(Path(tempfile.mkdtemp(prefix="dvabatch-test-slices-")))
            report = slice_model(model, _slice_root[0] / f"{zoo_name}-{stages}", options)
            _slices[(zoo_name, stages)] = report.out_dir, int_bounds(model)
        sliced, int_high = _slices[(zoo_name, stages)]
    target = repository / zoo_name
    shutil.copytree(sliced, target)
    version_dir = target / "1"
    return ServedModel(zoo_name, version_dir, Manifest.load(version_dir / "manifest.json"), dict(int_high), max_length)


def add_variant(repository: Path, base: ServedModel, name: str, **settings: object) -> ServedModel:
    """`base` served as `name` with other settings."""
    add_model_variant(repository, base.version_dir, name, **settings)
    return ServedModel(name, base.version_dir, base.manifest, base.int_high, base.max_length)


Call = Callable[[str, Mapping[str, np.ndarray]], dict[str, np.ndarray]]


class Clients:
    """One query per call (a request of one row), over each protocol and mode."""

    def __init__(self, http_url: str, grpc_url: str) -> None:
        self.http_url, self.grpc_url = http_url, grpc_url
        self._local = threading.local()  # tritonclient.http clients are not shared across threads

    def _http(self) -> httpclient.InferenceServerClient:
        if not hasattr(self._local, "http"):
            self._local.http = httpclient.InferenceServerClient(self.http_url, concurrency=4)
            self._local.grpc = grpcclient.InferenceServerClient(self.grpc_url)
        return self._local.http

    def _grpc(self) -> grpcclient.InferenceServerClient:
        self._http()
        return self._local.grpc

    inputs = staticmethod(infer_inputs)

    def http_sync(self, model: str, query: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        result = self._http().infer(model, self.inputs(httpclient, query))
        return _outputs(result)

    def http_async(self, model: str, query: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        result = self._http().async_infer(model, self.inputs(httpclient, query)).get_result(timeout=60)
        return _outputs(result)

    def grpc_sync(self, model: str, query: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return _outputs(self._grpc().infer(model, self.inputs(grpcclient, query), client_timeout=60))

    def grpc_async(self, model: str, query: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        done = threading.Event()
        box: list = []

        def callback(result, error) -> None:
            box.append((result, error))
            done.set()

        self._grpc().async_infer(model, self.inputs(grpcclient, query), callback, client_timeout=60)
        assert done.wait(60), "no gRPC answer within 60 s"
        result, error = box[0]
        if error is not None:
            raise error
        return _outputs(result)

    def modes(self) -> dict[str, Call]:
        return {"http": self.http_sync, "http-async": self.http_async,
                "grpc": self.grpc_sync, "grpc-async": self.grpc_async}


def unequal_answers(modes: Mapping[str, Call], model: ServedModel, work: list[tuple[str, dict[str, np.ndarray]]],
                    concurrent: bool = True, rtol: float = 0.0) -> list[str]:
    """Each (mode, query) of `work` sent by its mode, each on a thread of its own (`concurrent`) or
    one after another; what went wrong: an error, or an answer unequal to the unsliced model's."""
    failures: list[str] = []

    def send(mode: str, query: dict[str, np.ndarray]) -> None:
        try:
            got = modes[mode](model.name, query)
            for name, ref in model.reference(query).items():
                np.testing.assert_allclose(got[name], ref, atol=1e-4, rtol=rtol, err_msg=f"{mode} {name}")
        except Exception as exc:  # collected: every query must succeed
            failures.append(f"{mode}: {type(exc).__name__}: {exc}")

    if not concurrent:
        for item in work:
            send(*item)
        return failures
    threads = [threading.Thread(target=send, args=item) for item in work]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    hung = sum(t.is_alive() for t in threads)
    return failures + ([f"{hung} queries hung"] if hung else [])


def _outputs(result) -> dict[str, np.ndarray]:
    names = [o["name"] for o in result.get_response()["outputs"]] if isinstance(result.get_response(), dict) \
        else [o.name for o in result.get_response().outputs]
    return {name: result.as_numpy(name)[0] for name in names}


def control_client(server: TritonServer, protocol: str):
    if protocol == "http":
        return httpclient.InferenceServerClient(server.http_url, connection_timeout=60, network_timeout=60)
    return grpcclient.InferenceServerClient(server.grpc_url)


def stub_pids(model_dir: Path) -> list[int]:
    """Python-backend stub processes serving `model_dir` (their second argument is its model.py)."""
    prefix = str(model_dir) + "/"
    return stub_processes(lambda argv: len(argv) > 1 and argv[1].startswith(prefix))


T = TypeVar("T")


def settle(read: Callable[[], T], done: Callable[[T], bool], timeout: float) -> T:
    """Read a sampled counter until `done` holds for it (or the timeout passes); the last value."""
    deadline = time.monotonic() + timeout
    value = read()
    while not done(value) and time.monotonic() < deadline:
        time.sleep(0.05)  # polling: no assertion depends on how long this takes
        value = read()
    return value


def admitted_requests(server: TritonServer, model: str) -> int:
    """Requests Triton has handed to the model's `execute` (it returns at once: they are in the runtime)."""
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        stats = client.get_inference_statistics(model, as_json=True)["model_stats"][0]
    return int(stats.get("inference_count", 0))
