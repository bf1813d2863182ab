"""TensorRT stage engines (TensorRT 10 Python API) for serving sliced stages on a GPU.

Three parts:

- `build_engine` turns one stage's ONNX file into a serialized TensorRT engine with one
  optimization profile covering batch 1..bs_max and seq 1..max_length;
- `TrtStageEngine` runs such an engine behind the runtime's `StageEngine` protocol
  (`run(inputs, outputs)`); its GPU completion fence is the runtime's
  `dvabatch_backend.runtime.fences.CudaEventFence` (re-exported here), which takes the engine's
  raw cudaStream_t (`TrtStageEngine.stream`) as well as a torch stream;
- `profile_engine` times the engine at given (batch, length) settings with CUDA events.

Only TensorRT 10 calls are used: `create_network(0)` (explicit batch is the only mode),
`build_serialized_network`, `set_input_shape` / `set_tensor_address` / `execute_async_v3`;
none of the 8.x binding-index API. CUDA comes from cuda-python (`cuda.bindings.runtime`, or
`cuda.cudart` before cuda-python 12.6).

Neither package is needed to import this module: they are imported inside the functions
that use them, and `tensorrt_available()` tells whether TensorRT can be used. cuda-python
ships no type information for its runtime module, so every CUDA call goes through
`_check`/`_cudart` and is typed `Any` there; the TensorRT calls are checked against the
`tensorrt-stubs` package (see tests/slicer/test_trt_typecheck.py).
"""
from __future__ import annotations

import functools
import importlib
import logging
import math
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence, Union

import numpy as np
import numpy.typing as npt

from dvabatch_backend.runtime.fences import CudaEventFence
from dvabatch_backend.runtime.manifest import TensorSpec

if TYPE_CHECKING:
    import tensorrt as trt

    from dvabatch_backend.runtime.engine import StageEngine

log = logging.getLogger(__name__)

__all__ = [
    "CudaArrayLike",
    "CudaEventFence",
    "TrtStageEngine",
    "build_engine",
    "cuda_available",
    "profile_engine",
    "tensorrt_available",
]


class CudaArrayLike(Protocol):
    """A device array: anything exposing the CUDA array interface (CuPy, PyTorch, Numba, ...)."""

    @property
    def __cuda_array_interface__(self) -> Mapping[str, Any]: ...


# What `TrtStageEngine.run` accepts per tensor: a host array (staged through device scratch
# memory) or a device array (bound in place).
TensorArray = Union[npt.NDArray[Any], CudaArrayLike]

# A cuda-python stream (cudaStream_t) or a raw handle; 0 is the legacy default stream.
CudaStream = Any


# ---------------------------------------------------------------------------- availability


def tensorrt_available() -> bool:
    """Whether the TensorRT Python package (with its libraries) can be imported in this environment.

    Installing only `tensorrt-stubs` leaves a `tensorrt/` folder of .pyi files, which Python
    imports as an empty namespace package: that is not TensorRT, hence the `Builder` check.
    """
    try:
        import tensorrt as trt
    except Exception:  # ImportError, or OSError when libnvinfer cannot be loaded
        return False
    return hasattr(trt, "Builder")


def cuda_available() -> bool:
    """Whether cuda-python is installed and sees at least one CUDA device."""
    try:
        cudart = _cudart()
    except RuntimeError:
        return False
    err, count = cudart.cudaGetDeviceCount()
    return bool(err == cudart.cudaError_t.cudaSuccess and count > 0)


def _require_tensorrt() -> None:
    if not tensorrt_available():
        raise RuntimeError(
            "TensorRT is not installed: install the `tensorrt` package (TensorRT 10) on a machine "
            "with an NVIDIA GPU to build or run TensorRT engines"
        )


@functools.cache
def _cudart() -> Any:
    """cuda-python's CUDA runtime module (untyped: cuda-python ships no stubs for it)."""
    for name in ("cuda.bindings.runtime", "cuda.cudart"):  # the second: cuda-python < 12.6
        try:
            module: ModuleType = importlib.import_module(name)
        except ImportError:
            continue
        return module
    raise RuntimeError("cuda-python is not installed: pip install 'cuda-python>=12' (the `gpu` extra)")


def _check(result: Any) -> Any:
    """Unpack a cuda-python call's `(error, *values)` tuple: raise on error, else the value(s)."""
    cudart = _cudart()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != cudart.cudaError_t.cudaSuccess:
        _, name = cudart.cudaGetErrorName(err)
        raise RuntimeError(f"CUDA call failed: {name.decode() if isinstance(name, bytes) else err}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


# ---------------------------------------------------------------------------- TensorRT glue


def _recording_logger() -> tuple[trt.ILogger, list[str]]:
    """A TensorRT logger forwarding to `logging`, and the list it appends error messages to."""
    import tensorrt as trt

    errors: list[str] = []
    error = trt.ILogger.Severity.ERROR
    warning = trt.ILogger.Severity.WARNING
    info = trt.ILogger.Severity.INFO

    class RecordingLogger(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)

        def log(self, severity: trt.ILogger.Severity, msg: str) -> None:
            if severity <= error:  # INTERNAL_ERROR and ERROR
                errors.append(msg)
                log.error("TensorRT: %s", msg)
            elif severity <= warning:
                log.warning("TensorRT: %s", msg)
            elif severity <= info:
                log.debug("TensorRT: %s", msg)

    return RecordingLogger(), errors


def _dims(dims: trt.Dims) -> tuple[int, ...]:
    return tuple(int(dims[i]) for i in range(len(dims)))


def _numpy_dtype(dtype: trt.DataType) -> np.dtype[Any]:
    import tensorrt as trt

    table = {
        trt.DataType.FLOAT: np.float32,
        trt.DataType.HALF: np.float16,
        trt.DataType.INT8: np.int8,
        trt.DataType.UINT8: np.uint8,
        trt.DataType.INT32: np.int32,
        trt.DataType.INT64: np.int64,
        trt.DataType.BOOL: np.bool_,
    }
    if dtype not in table:
        raise TypeError(f"TensorRT type {dtype} has no numpy equivalent the runtime supports")
    return np.dtype(table[dtype])


def _io_tensors(engine: trt.ICudaEngine) -> tuple[list[str], list[str]]:
    """The engine's input and output tensor names, in engine order."""
    import tensorrt as trt

    inputs, outputs = [], []
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT:
            inputs.append(name)
        else:
            outputs.append(name)
    return inputs, outputs


def _deserialize(engine: bytes | str | Path) -> tuple[trt.ILogger, trt.Runtime, trt.ICudaEngine]:
    """Logger, runtime and engine: the caller keeps all three (the runtime must outlive the engine)."""
    _require_tensorrt()
    import tensorrt as trt

    data = engine if isinstance(engine, bytes) else Path(engine).read_bytes()
    logger, errors = _recording_logger()
    runtime = trt.Runtime(logger)
    cuda_engine: trt.ICudaEngine | None = runtime.deserialize_cuda_engine(data)
    if cuda_engine is None:
        raise RuntimeError("TensorRT could not deserialize the engine: " + ("; ".join(errors) or "see the log"))
    return logger, runtime, cuda_engine


def _context(engine: trt.ICudaEngine) -> trt.IExecutionContext:
    context: trt.IExecutionContext | None = engine.create_execution_context()
    if context is None:
        raise RuntimeError("TensorRT could not create an execution context (out of GPU memory?)")
    return context


def _check_profile_args(inputs: Sequence[TensorSpec], bs_max: int, max_length: int, opt_batch: int, opt_length: int) -> None:
    if not inputs:
        raise ValueError("no input TensorSpecs given")
    if not 1 <= opt_batch <= bs_max:
        raise ValueError(f"need 1 <= opt_batch <= bs_max, got opt_batch={opt_batch}, bs_max={bs_max}")
    if any(spec.has_seq for spec in inputs) and not 1 <= opt_length <= max_length:
        raise ValueError(f"need 1 <= opt_length <= max_length, got opt_length={opt_length}, max_length={max_length}")


# ---------------------------------------------------------------------------- building


def build_engine(
    onnx_path: str | Path,
    inputs: Sequence[TensorSpec],
    bs_max: int,
    max_length: int,
    opt_batch: int,
    opt_length: int,
    fp16: bool = False,
    workspace_bytes: int = 1 << 30,
) -> bytes:
    """Build a serialized TensorRT engine (a plan) for one stage's ONNX file.

    One optimization profile covers every dynamic input named in `inputs`: min at batch 1 /
    seq 1, opt at (`opt_batch`, `opt_length`), max at (`bs_max`, `max_length`), from each
    TensorSpec's dims. The ONNX inputs and `inputs` must name the same tensors, and a
    dimension the ONNX model fixes must agree with the spec. Raises `RuntimeError` with the
    parser's or builder's messages when TensorRT fails, `ValueError` for bad arguments.
    """
    _check_profile_args(inputs, bs_max, max_length, opt_batch, opt_length)
    onnx_path = Path(onnx_path)
    if not onnx_path.is_file():
        raise FileNotFoundError(f"ONNX model {onnx_path} not found")
    _require_tensorrt()
    import tensorrt as trt

    logger, errors = _recording_logger()
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # TensorRT 10: explicit batch is the only mode
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):  # from a file, so external weights load too
        messages = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise RuntimeError(f"TensorRT could not parse {onnx_path}:\n  " + "\n  ".join(messages or errors or ["no message"]))

    specs = {spec.name: spec for spec in inputs}
    network_inputs = [network.get_input(i) for i in range(network.num_inputs)]
    names = [tensor.name for tensor in network_inputs]
    if sorted(names) != sorted(specs):
        raise ValueError(f"{onnx_path} has inputs {sorted(names)}, the TensorSpecs name {sorted(specs)}")

    profile = builder.create_optimization_profile()
    dynamic = False
    for tensor in network_inputs:
        spec = specs[tensor.name]
        if tensor.is_shape_tensor:
            raise ValueError(f"input {tensor.name!r} is a shape tensor, which the runtime does not feed")
        fixed = _dims(tensor.shape)
        low, opt, high = spec.shape(1, 1), spec.shape(opt_batch, opt_length), spec.shape(bs_max, max_length)
        if len(fixed) != len(spec.dims):
            raise ValueError(f"input {tensor.name!r} has rank {len(fixed)} in {onnx_path}, its TensorSpec dims are {spec.dims}")
        for axis, size in enumerate(fixed):
            if size >= 0 and not size == low[axis] == opt[axis] == high[axis]:
                raise ValueError(
                    f"input {tensor.name!r} axis {axis} is fixed to {size} in {onnx_path} "
                    f"but its TensorSpec dim is {spec.dims[axis]!r}"
                )
        if -1 in fixed:
            profile.set_shape(tensor.name, trt.Dims(list(low)), trt.Dims(list(opt)), trt.Dims(list(high)))
            dynamic = True

    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    if fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    if dynamic and config.add_optimization_profile(profile) < 0:
        raise RuntimeError("TensorRT rejected the optimization profile: " + ("; ".join(errors) or "see the log"))

    plan: trt.IHostMemory | None = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError(f"TensorRT could not build an engine for {onnx_path}: " + ("; ".join(errors) or "see the log"))
    return bytes(plan)


# ---------------------------------------------------------------------------- device memory


class _DeviceBuffer:
    """`nbytes` of device memory from cudaMalloc, freed by `free`."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.ptr: int = int(_check(_cudart().cudaMalloc(max(nbytes, 1))))

    def free(self) -> None:
        if self.ptr:
            _check(_cudart().cudaFree(self.ptr))
            self.ptr = 0


def _device_view(name: str, array: CudaArrayLike, dtype: np.dtype[Any]) -> tuple[int, tuple[int, ...]]:
    """Data pointer and shape of a C-contiguous device array of `dtype`."""
    iface = array.__cuda_array_interface__
    shape = tuple(int(d) for d in iface["shape"])
    if np.dtype(iface["typestr"]) != dtype:
        raise TypeError(f"tensor {name!r}: device array of {np.dtype(iface['typestr'])}, the engine wants {dtype}")
    strides = iface.get("strides")
    if strides is not None:
        contiguous = [dtype.itemsize * math.prod(shape[i + 1:]) for i in range(len(shape))]
        if any(n > 1 and s != c for n, s, c in zip(shape, strides, contiguous)):
            raise ValueError(f"tensor {name!r}: device array is not C-contiguous (strides {tuple(strides)})")
    return int(iface["data"][0]), shape


def _check_host(name: str, array: npt.NDArray[Any], dtype: np.dtype[Any], capacity: int) -> None:
    if array.dtype != dtype:
        raise TypeError(f"tensor {name!r}: array of {array.dtype}, the engine wants {dtype}")
    if not array.flags.c_contiguous:
        raise ValueError(f"tensor {name!r}: array is not C-contiguous")
    if array.nbytes > capacity:
        raise ValueError(f"tensor {name!r}: {array.shape} is larger than the bs_max/max_length buffer ({capacity} bytes)")


# ---------------------------------------------------------------------------- running


class TrtStageEngine:
    """A TensorRT engine behind the `StageEngine` protocol, on its own CUDA stream.

    `run(inputs, outputs)` takes each tensor as either

    - a device array (anything with `__cuda_array_interface__`): bound in place, no copy; or
    - a host numpy array (what the runtime's buffers are): copied host->device into a
      per-tensor device scratch buffer before the engine runs, and outputs device->host
      after, with cudaMemcpyAsync on the engine's stream. Scratch buffers are allocated once,
      sized for `bs_max` rows at `max_length`.

    With host outputs `run` waits for the stream before returning, so the arrays hold the
    results as the runtime's `HostFence` expects. With device outputs only it returns once
    the work is queued: record a `CudaEventFence` with `stream` as its writer stream for the stage
    that reads them. Device inputs written on another stream must be ordered by the caller (a
    `CudaEventFence` whose reader stream is `stream`). Used by one executor thread at a time.
    """

    def __init__(
        self,
        engine: bytes | str | Path,
        inputs: Sequence[TensorSpec],
        outputs: Sequence[TensorSpec],
        bs_max: int,
        max_length: int,
    ) -> None:
        self._logger, self._runtime, self._engine = _deserialize(engine)
        engine_inputs, engine_outputs = _io_tensors(self._engine)
        if sorted(engine_inputs) != sorted(s.name for s in inputs) or sorted(engine_outputs) != sorted(s.name for s in outputs):
            raise ValueError(
                f"engine tensors (inputs {engine_inputs}, outputs {engine_outputs}) differ from the TensorSpecs "
                f"(inputs {[s.name for s in inputs]}, outputs {[s.name for s in outputs]})"
            )
        self._dtypes: dict[str, np.dtype[Any]] = {}
        for spec in (*inputs, *outputs):
            dtype = _numpy_dtype(self._engine.get_tensor_dtype(spec.name))
            if dtype != spec.np_dtype:
                raise TypeError(f"tensor {spec.name!r} is {dtype} in the engine, {spec.np_dtype} in its TensorSpec")
            self._dtypes[spec.name] = dtype
        self._inputs = tuple(s.name for s in inputs)
        self._outputs = tuple(s.name for s in outputs)
        self._context = _context(self._engine)
        self._input_shapes: dict[str, tuple[int, ...]] = {}
        self._output_shapes: dict[str, tuple[int, ...]] = {}
        self._scratch: dict[str, _DeviceBuffer] = {}
        self._stream: CudaStream = None
        try:
            cudart = _cudart()
            self._stream = _check(cudart.cudaStreamCreateWithFlags(cudart.cudaStreamNonBlocking))
            for spec in (*inputs, *outputs):
                nbytes = math.prod(spec.shape(bs_max, max(max_length, 1))) * spec.np_dtype.itemsize
                self._scratch[spec.name] = _DeviceBuffer(nbytes)
        except BaseException:
            self.close()
            raise

    @property
    def stream(self) -> CudaStream:
        """The CUDA stream the engine's copies and kernels run on."""
        return self._stream

    def run(self, inputs: Mapping[str, TensorArray], outputs: Mapping[str, TensorArray]) -> None:
        cudart = _cudart()
        context = self._context
        changed = False
        for name in self._inputs:
            array = inputs[name]
            if isinstance(array, np.ndarray):
                scratch = self._scratch[name]
                _check_host(name, array, self._dtypes[name], scratch.nbytes)
                _check(cudart.cudaMemcpyAsync(
                    scratch.ptr, array.ctypes.data, array.nbytes, cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, self._stream
                ))
                ptr, shape = scratch.ptr, tuple(array.shape)
            else:
                ptr, shape = _device_view(name, array, self._dtypes[name])
            if self._input_shapes.get(name) != shape:
                if not context.set_input_shape(name, shape):
                    self._input_shapes.clear()  # the context's shapes are unknown now: set all next time
                    raise ValueError(f"tensor {name!r}: shape {shape} is outside the engine's optimization profile")
                self._input_shapes[name] = shape
                changed = True
            context.set_tensor_address(name, ptr)
        if changed:
            self._output_shapes = {name: _dims(context.get_tensor_shape(name)) for name in self._outputs}

        downloads: list[tuple[npt.NDArray[Any], int]] = []
        for name in self._outputs:
            array = outputs[name]
            if isinstance(array, np.ndarray):
                scratch = self._scratch[name]
                _check_host(name, array, self._dtypes[name], scratch.nbytes)
                ptr, shape = scratch.ptr, tuple(array.shape)
                downloads.append((array, ptr))
            else:
                ptr, shape = _device_view(name, array, self._dtypes[name])
            if shape != self._output_shapes[name]:
                raise ValueError(f"tensor {name!r}: output array is {shape}, the engine makes {self._output_shapes[name]}")
            context.set_tensor_address(name, ptr)

        if not context.execute_async_v3(int(self._stream)):
            raise RuntimeError("TensorRT execute_async_v3 failed (see the log)")
        for array, ptr in downloads:
            _check(cudart.cudaMemcpyAsync(
                array.ctypes.data, ptr, array.nbytes, cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost, self._stream
            ))
        if downloads:
            _check(cudart.cudaStreamSynchronize(self._stream))

    def close(self) -> None:
        """Free the scratch buffers and the stream (after the queued work is done)."""
        if self._stream is None and not self._scratch:
            return
        cudart = _cudart()
        if self._stream is not None:
            _check(cudart.cudaStreamSynchronize(self._stream))
        for buffer in self._scratch.values():
            buffer.free()
        self._scratch.clear()
        if self._stream is not None:
            _check(cudart.cudaStreamDestroy(self._stream))
            self._stream = None

    def __enter__(self) -> TrtStageEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------- profiling


def profile_engine(
    engine_bytes: bytes,
    inputs: Sequence[TensorSpec],
    batch_sizes: Sequence[int],
    lengths: Sequence[int],
    repeats: int = 20,
    warmup: int = 3,
) -> dict[tuple[int, int], float]:
    """Mean seconds of one `execute_async_v3` at each (batch size, length), timed with CUDA events.

    Inputs are zero-filled device buffers (`inputs` gives their dims); outputs are sized from
    the engine's shapes. Every setting must lie inside the engine's optimization profile.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    _logger, _runtime, engine = _deserialize(engine_bytes)  # all three live until we return
    cudart = _cudart()
    context = _context(engine)
    input_names, output_names = _io_tensors(engine)
    specs = {spec.name: spec for spec in inputs}
    if sorted(input_names) != sorted(specs):
        raise ValueError(f"engine inputs {sorted(input_names)} differ from the TensorSpecs {sorted(specs)}")
    itemsize = {name: _numpy_dtype(engine.get_tensor_dtype(name)).itemsize for name in (*input_names, *output_names)}

    settings = [(bs, length) for bs in batch_sizes for length in lengths]
    shapes: dict[tuple[int, int], dict[str, tuple[int, ...]]] = {}
    for bs, length in settings:
        for name in input_names:
            shape = specs[name].shape(bs, length)
            if not context.set_input_shape(name, shape):
                raise ValueError(f"(batch {bs}, length {length}) is outside the engine's profile for {name!r}")
        current = {name: specs[name].shape(bs, length) for name in input_names}
        current.update({name: _dims(context.get_tensor_shape(name)) for name in output_names})
        if any(d < 0 for name in output_names for d in current[name]):
            raise ValueError("outputs with data-dependent shapes cannot be profiled")
        shapes[(bs, length)] = current
    sizes = {name: max(math.prod(s[name]) for s in shapes.values()) * itemsize[name] for name in itemsize}

    stream: CudaStream = _check(cudart.cudaStreamCreateWithFlags(cudart.cudaStreamNonBlocking))
    start: Any = _check(cudart.cudaEventCreate())
    end: Any = _check(cudart.cudaEventCreate())
    buffers: dict[str, _DeviceBuffer] = {}
    try:
        for name, nbytes in sizes.items():
            buffers[name] = _DeviceBuffer(nbytes)
            _check(cudart.cudaMemsetAsync(buffers[name].ptr, 0, max(nbytes, 1), stream))
            context.set_tensor_address(name, buffers[name].ptr)
        timings: dict[tuple[int, int], float] = {}
        for setting in settings:
            for name in input_names:
                context.set_input_shape(name, shapes[setting][name])
            for _ in range(warmup):
                if not context.execute_async_v3(int(stream)):
                    raise RuntimeError(f"TensorRT execute_async_v3 failed at {setting}")
            _check(cudart.cudaEventRecord(start, stream))
            for _ in range(repeats):
                context.execute_async_v3(int(stream))
            _check(cudart.cudaEventRecord(end, stream))
            _check(cudart.cudaEventSynchronize(end))
            milliseconds = float(_check(cudart.cudaEventElapsedTime(start, end)))
            timings[setting] = milliseconds / 1000.0 / repeats
        return timings
    finally:
        _check(cudart.cudaStreamSynchronize(stream))
        for buffer in buffers.values():
            buffer.free()
        _check(cudart.cudaEventDestroy(start))
        _check(cudart.cudaEventDestroy(end))
        _check(cudart.cudaStreamDestroy(stream))


if TYPE_CHECKING:
    def _conforms(engine: TrtStageEngine) -> StageEngine:
        """Type-checked only: TrtStageEngine satisfies the runtime's StageEngine protocol."""
        return engine
