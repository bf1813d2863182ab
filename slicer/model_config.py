"""config.pbtxt as Triton reads it: Triton's `ModelConfig` message, written and read with protobuf's
`text_format` (every string escaped, nothing parsed by hand).

The message comes from tritonclient's generated module (`tritonclient.grpc.model_config_pb2`), the
same `model_config.proto` the server parses, at the version this project pins for client and server
alike; vendoring a copy would register a second `inference.ModelConfig` beside tritonclient's in
protobuf's one descriptor pool wherever both are imported (the tests, the perf tools).
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as pb

from dvabatch_backend.runtime.manifest import Manifest, TensorSpec, is_length_dim

ModelConfig = pb.ModelConfig
# config.pbtxt's data_type of each manifest dtype: "TYPE_" + Triton's datatype name, the name a
# client puts on the wire (tritonclient.utils.np_to_triton_dtype)
DATA_TYPES = {dtype: pb.DataType.Value(f"TYPE_{wire}") for dtype, wire in {
    "float32": "FP32", "float16": "FP16", "float64": "FP64", "int64": "INT64",
    "int32": "INT32", "int8": "INT8", "uint8": "UINT8", "bool": "BOOL",
}.items()}


def parse(text: str) -> ModelConfig:
    return text_format.Parse(text, ModelConfig())


def dump(config: ModelConfig) -> str:
    return text_format.MessageToString(config)


def read(path: Path) -> ModelConfig:
    return parse(Path(path).read_text())


def parameters(config: ModelConfig | str) -> dict[str, str]:
    """The string parameters of a config (or of config.pbtxt's text)."""
    config = parse(config) if isinstance(config, str) else config
    return {key: value.string_value for key, value in config.parameters.items()}


def set_parameters(config: ModelConfig, values: Mapping[str, object]) -> ModelConfig:
    """Set (or replace) string parameters; returns `config`."""
    for key, value in values.items():
        config.parameters[key].string_value = str(value)
    return config


def with_parameters(text: str, values: Mapping[str, object], name: str | None = None) -> str:
    """config.pbtxt's text with these parameters set (and renamed to `name`, if given)."""
    config = set_parameters(parse(text), values)
    if name is not None:
        config.name = name
    return dump(config)


def python_model(manifest: Manifest, name: str, values: Mapping[str, object], bs_max: int | None = None,
                 delay_us: int = 0, queue_size: int = 0) -> ModelConfig:
    """A Python-backend model over `manifest`'s inputs and outputs: one CPU instance behind Triton's
    dynamic batcher (`delay_us` of queue delay, ragged inputs), `values` as string parameters.
    `queue_size` > 0: the batcher's default queue policy holds at most that many requests and
    refuses the next at once (UNAVAILABLE "Exceeds maximum queue size")."""
    config = ModelConfig(name=name, backend="python",
                         max_batch_size=manifest.max_batch_size if bs_max is None else bs_max)
    for spec in manifest.inputs:
        config.input.add(name=spec.name, data_type=DATA_TYPES[spec.dtype], dims=_dims(spec), allow_ragged_batch=True)
    for spec in manifest.outputs:
        config.output.add(name=spec.name, data_type=DATA_TYPES[spec.dtype], dims=_dims(spec))
    config.dynamic_batching.SetInParent()
    config.dynamic_batching.max_queue_delay_microseconds = delay_us
    if queue_size:
        config.dynamic_batching.default_queue_policy.max_queue_size = queue_size
    config.instance_group.add(kind=pb.ModelInstanceGroup.KIND_CPU, count=1)
    return set_parameters(config, values)


def _dims(spec: TensorSpec) -> list[int]:
    """The dims after the batch dim (left to max_batch_size); a length dim variable (-1)."""
    return [-1 if is_length_dim(d) else int(d) for d in spec.dims[1:]]
