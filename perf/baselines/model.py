"""Triton Python-backend model of the ZeroBatch and DelayBatch baselines (a baseline's version folder
holds a `model.py` that imports it: `slicer.triton_files.stub_entry`).

The unsliced `model.onnx` runs on the engine the dvabatch model serving it would use: by default
one onnxruntime CPU session with the runtime's session options (`ort_session_options(threads)`),
or, with `engine` "torch", the runtime's torch engine (`TorchStageEngine`, on `device` "cpu" or
"cuda") running the whole model as one stage. Triton's dynamic batcher forms the batches: the inputs allow
ragged batches, so requests of different lengths arrive together in one `execute`, one request
object each with its own shapes ([k, T, ...]: k rows of length T). `execute` pads every request to
the longest length in the batch with zeros (masks are zero there), stacks the rows, runs the batch
once, and answers each request, in order, with its own rows cut back to its own length on every
output that has a sequence dimension. A bad request is answered with an error and left out of the
batch; a failed run answers every request of the batch with the error.

Config parameters: `onnx_model` (file in the version folder, default model.onnx), `manifest`
(default manifest.json: which dims are batch and seq, and the longest length), `threads`
(intra-op threads, default 1), `spinning` (onnxruntime's threads spin-wait for work, its own
default; default false: they sleep, as the runtime's do), `engine` ("onnxruntime", the default, "torch", or
"simulated": the GPU stand-in, with `device_profile`, a file relative to the version folder or absolute),
`device` ("cpu", the default, or "cuda": torch only) and `respond` (`RESPONDS`: how the answers go back).
The torch engine and the stand-in are made as the runtime makes the dvabatch model's unsliced model
(`EngineRunner`): the same CUDA-graph buckets.
"""
from __future__ import annotations

import json
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from dvabatch_backend.runtime.engine import OFF, ON, ort_session_options
from dvabatch_backend.runtime.loading import make_engine
from dvabatch_backend.runtime.settings import SIMULATED, RuntimeSettings
from dvabatch_backend.triton_adapter import parameters
from dvabatch_backend.runtime.manifest import SEQ, Manifest, TensorSpec, dim_size, is_length_dim

try:
    import triton_python_backend_utils as pb_utils

    # tensors cross the stub as the dvabatch adapter's do (by DLPack under numpy 2, where the stub
    # reads numpy arrays with no data): a baseline pays for its answers' bytes as the adapter does
    from dvabatch_backend.triton_adapter.model import input_array, output_tensor
except ImportError:  # imported outside Triton (tests, tools): the batching functions below still work
    pb_utils = None

PARAMETERS = {"onnx_model": "model.onnx", "manifest": "manifest.json", "threads": "1", "engine": "onnxruntime",
              "device": "cpu", "respond": "return",
              "spinning": "false"}
# how the answers go back (what the served path costs, measured apart): returned from `execute`; sent
# through each request's response sender inside `execute`; sent by one worker thread that `execute`
# hands the requests to; or "echo": no model at all, zeros of the outputs' shapes returned (the least
# any Python-backend model pays here)
RESPONDS = ("return", "sender", "thread", "echo")
ENGINES = ("onnxruntime", "torch", SIMULATED)
DEVICES = ("cpu", "cuda")


class BadRequest(ValueError):
    """A request whose tensors do not fit the model; the message is what the client reads."""


@dataclass(frozen=True)
class Settings:
    onnx_model: Path
    manifest: Path
    threads: int
    engine: str = "onnxruntime"
    device: str = "cpu"
    respond: str = "return"
    spinning: bool = False  # onnxruntime's threads spin-wait for work (its default), or sleep (the runtime's)
    device_profile: Path | None = None  # the GPU stand-in's (engine "simulated")


@dataclass(frozen=True)
class Request:
    """One request's input arrays ([rows, ...]) and its length (0 for a model without seq)."""

    arrays: dict[str, np.ndarray]
    rows: int
    length: int


def parse_parameters(params: Mapping[str, str], version_dir: Path) -> Settings:
    """Read and check the config.pbtxt parameters (`triton_adapter.parameters`, the dvabatch
    adapter's reader); a ValueError names the bad one."""
    values = {**PARAMETERS, **params}
    values.update(parameters.read(params, {
        "onnx_model": parameters.text, "manifest": parameters.text, "threads": parameters.integer(1),
        "engine": parameters.choice(*ENGINES), "device": parameters.choice(*DEVICES),
        "respond": parameters.choice(*RESPONDS), "spinning": parameters.boolean,
        "device_profile": parameters.text}))
    files = {}
    for key in ("onnx_model", "manifest"):
        files[key] = version_dir / values[key]
        if not files[key].is_file():
            raise ValueError(f"parameter {key!r}: {files[key]} not found")
    engine, device = values["engine"], values["device"]
    if device == "cuda" and engine != "torch":
        raise ValueError("parameter 'device': 'cuda' needs engine 'torch' (onnxruntime runs on the CPU here)")
    spinning = values["spinning"] is True  # parsed where given; the default "false" otherwise
    profile = version_dir / values["device_profile"] if values.get("device_profile") else None
    if engine == SIMULATED and (profile is None or not profile.is_file()):
        raise ValueError(f"parameter 'device_profile': engine 'simulated' needs a device profile file, got {profile}")
    return Settings(files["onnx_model"], files["manifest"], int(values["threads"]), engine, device, values["respond"],
                    spinning, profile)


def load_manifest(path: Path) -> Manifest:
    """The manifest without its stage files (a baseline's version folder holds only model.onnx)."""
    return Manifest.from_json(json.loads(path.read_text()))


def parse_request(arrays: Mapping[str, np.ndarray], manifest: Manifest) -> Request:
    """Check one request's tensors ([k, ...] each) against the manifest's inputs."""
    specs = {t.name: t for t in manifest.inputs}
    missing = sorted(set(specs) - set(arrays))
    unknown = sorted(set(arrays) - set(specs))
    if missing or unknown:
        raise BadRequest(f"missing input(s) {missing}, unknown input(s) {unknown}; the model expects {sorted(specs)}")
    rows: set[int] = set()
    lengths: set[int] = set()
    for name, spec in specs.items():
        arr = arrays[name]
        if arr.dtype != spec.np_dtype:
            raise BadRequest(f"input {name!r} has dtype {arr.dtype}, expected {spec.dtype}")
        if arr.ndim != len(spec.dims):
            raise BadRequest(f"input {name!r} has shape {list(arr.shape)}, expected dims {list(spec.dims)}")
        rows.add(arr.shape[0])
        for axis, (got, want) in enumerate(zip(arr.shape[1:], spec.dims[1:]), start=1):
            if want == SEQ:
                lengths.add(got)
            elif got != want:
                raise BadRequest(f"input {name!r} dim {axis} is {got}, expected {want}")
    if len(rows) > 1:
        raise BadRequest(f"inputs disagree on the number of rows: {sorted(rows)}")
    if len(lengths) > 1:
        raise BadRequest(f"inputs disagree on the sequence length: {sorted(lengths)}")
    k, length = rows.pop(), (lengths.pop() if lengths else 0)
    if k < 1:
        raise BadRequest("the request has no rows")
    if manifest.has_seq and not 1 <= length <= manifest.max_length:
        raise BadRequest(f"input length {length} is outside 1..{manifest.max_length} (the manifest's max_length)")
    return Request(dict(arrays), k, length)


def pad_batch(requests: Sequence[Request], specs: Sequence[TensorSpec]) -> dict[str, np.ndarray]:
    """The requests' rows stacked, zero-padded to the longest length among them."""
    if len(requests) == 1:
        return requests[0].arrays
    rows = sum(r.rows for r in requests)
    longest = max(r.length for r in requests)
    batch = {}
    for spec in specs:
        out = np.zeros(spec.shape(rows, longest), dtype=spec.np_dtype)
        start = 0
        for request in requests:
            arr = request.arrays[spec.name]
            out[(slice(start, start + request.rows), *(slice(0, n) for n in arr.shape[1:]))] = arr
            start += request.rows
        batch[spec.name] = out
    return batch


def split_outputs(outputs: Mapping[str, np.ndarray], specs: Sequence[TensorSpec],
                  requests: Sequence[Request]) -> list[dict[str, np.ndarray]]:
    """Each request's rows of the batch outputs, cut back to its own length on seq dims."""
    answers = []
    start = 0
    for request in requests:
        answer = {}
        for spec in specs:
            index = (slice(start, start + request.rows),
                     *(slice(0, dim_size(d, request.length)) if is_length_dim(d) else slice(None) for d in spec.dims[1:]))
            answer[spec.name] = np.ascontiguousarray(outputs[spec.name][index])
        answers.append(answer)
        start += request.rows
    return answers


class OrtRunner:
    """The unsliced model in one onnxruntime CPU session."""

    def __init__(self, path: Path, threads: int, spinning: bool = False) -> None:
        import onnxruntime as ort

        self._session = ort.InferenceSession(str(path), ort_session_options(threads, spinning=ON if spinning else OFF),
                                             providers=["CPUExecutionProvider"])
        self.input_names = {i.name for i in self._session.get_inputs()}
        self.output_names = {o.name for o in self._session.get_outputs()}

    def run(self, batch: Mapping[str, np.ndarray], outputs: Sequence[TensorSpec], rows: int,
            length: int) -> dict[str, np.ndarray]:
        names = [t.name for t in outputs]
        return dict(zip(names, self._session.run(names, dict(batch))))


class EngineRunner:
    """The unsliced model on one of the runtime's engines (torch, or the GPU stand-in), loaded as the
    runtime loads the dvabatch model's unsliced model (`loading.make_engine` with the same bs_max):
    on CUDA the torch engine captures the same CUDA-graph buckets, warmed up by the capture; the
    stand-in is charged at the same buckets. Outputs are allocated at the shapes the manifest gives
    for the batch's rows and length, and the engine writes them."""

    def __init__(self, path: Path, manifest: Manifest, settings: RuntimeSettings) -> None:
        self.engine = make_engine(path, settings, manifest)
        self.input_names = set(self.engine.input_names)
        self.output_names = set(self.engine.output_names)

    def run(self, batch: Mapping[str, np.ndarray], outputs: Sequence[TensorSpec], rows: int,
            length: int) -> dict[str, np.ndarray]:
        results = {t.name: np.empty(t.shape(rows, length), dtype=t.np_dtype) for t in outputs}
        self.engine.run(batch, results)
        return results


def engine_settings(settings: Settings, manifest: Manifest) -> RuntimeSettings:
    """The runtime's settings the baseline's engine is made with: the engine, device and threads of
    the baseline's, the batch buckets of its manifest's bs_max (the dvabatch model's default)."""
    return RuntimeSettings(engine=settings.engine, device=settings.device, threads_per_stage=settings.threads,
                           bs_max=manifest.max_batch_size,
                           device_profile=str(settings.device_profile) if settings.device_profile else None)


def make_runner(settings: Settings, manifest: Manifest) -> OrtRunner | EngineRunner:
    # resolved: the file is a link into the sliced model's folder, where its external data would lie
    path = settings.onnx_model.resolve()
    if settings.engine == "onnxruntime":
        return OrtRunner(path, settings.threads, settings.spinning)
    return EngineRunner(path, manifest, engine_settings(settings, manifest))


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        version_dir = Path(args["model_repository"]) / args["model_version"]
        settings = parse_parameters(parameters.string_parameters(config), version_dir)
        self._manifest = load_manifest(settings.manifest)
        self._runner = make_runner(settings, self._manifest)
        session_inputs, session_outputs = self._runner.input_names, self._runner.output_names
        wanted_in = {t.name for t in self._manifest.inputs}
        wanted_out = {t.name for t in self._manifest.outputs}
        if session_inputs != wanted_in or not wanted_out <= session_outputs:
            raise ValueError(f"{settings.onnx_model.name} has inputs {sorted(session_inputs)} and outputs "
                             f"{sorted(session_outputs)}; the manifest wants {sorted(wanted_in)} and {sorted(wanted_out)}")
        self._engine = settings.engine
        self._respond = settings.respond
        self._work: queue.SimpleQueue[list[Any] | None] = queue.SimpleQueue()
        self._worker = None
        if self._respond == "thread":
            self._worker = threading.Thread(target=self._work_loop, name="baseline-worker", daemon=True)
            self._worker.start()
        pb_utils.Logger.log_info(f"baseline: {self._manifest.name} unsliced, {settings.engine} on {settings.device}, "
                                 f"{settings.threads} thread(s)")

    def execute(self, requests: list[Any]) -> list[Any] | None:
        if self._respond == "thread":
            self._work.put(requests)
            return None
        responses = self._answer(requests)
        if self._respond == "sender":
            self._send(requests, responses)
            return None
        return responses

    def _work_loop(self) -> None:
        while (requests := self._work.get()) is not None:
            self._send(requests, self._answer(requests))

    @staticmethod
    def _send(requests: list[Any], responses: list[Any]) -> None:
        for request, response in zip(requests, responses):
            request.get_response_sender().send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _answer(self, requests: list[Any]) -> list[Any]:
        """One response per request: its rows run in one padded batch with the others' (echo: zeros)."""
        responses: list[Any] = [None] * len(requests)
        batch: list[tuple[int, Request]] = []
        for i, request in enumerate(requests):
            try:
                batch.append((i, parse_request(self._read(request), self._manifest)))
            except BadRequest as exc:
                responses[i] = _error(str(exc), invalid_argument=True)
        if batch and self._respond == "echo":
            for i, request in batch:
                responses[i] = pb_utils.InferenceResponse(output_tensors=[
                    output_tensor(t.name, np.zeros(t.shape(request.rows, request.length), t.np_dtype))
                    for t in self._manifest.outputs])
        elif batch:
            parsed = [r for _, r in batch]
            rows, longest = sum(r.rows for r in parsed), max(r.length for r in parsed)
            try:
                results = self._runner.run(pad_batch(parsed, self._manifest.inputs), self._manifest.outputs, rows, longest)
            except Exception as exc:  # the engine's failure concerns every request of the batch
                for i, _ in batch:
                    responses[i] = _error(f"{self._engine} failed on a batch of {len(batch)} request(s): {exc}")
            else:
                answers = split_outputs(results, self._manifest.outputs, parsed)
                for (i, _), answer in zip(batch, answers):
                    responses[i] = pb_utils.InferenceResponse(
                        output_tensors=[output_tensor(name, arr) for name, arr in answer.items()])
        return responses

    def _read(self, request: Any) -> dict[str, np.ndarray]:
        arrays = {}
        for spec in self._manifest.inputs:
            tensor = pb_utils.get_input_tensor_by_name(request, spec.name)
            if tensor is not None:
                arrays[spec.name] = input_array(tensor)
        return arrays

    def finalize(self) -> None:
        if self._worker is not None:
            self._work.put(None)
            self._worker.join()
        self._runner = None


def _error(message: str, invalid_argument: bool = False) -> Any:
    """Bad input reads as the client's error (HTTP 400, gRPC INVALID_ARGUMENT), a failed run as internal."""
    code = pb_utils.TritonError.INVALID_ARG if invalid_argument else pb_utils.TritonError.INTERNAL
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))
