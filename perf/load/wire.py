"""numpy <-> Triton requests: one query's arrays as a serialized gRPC `ModelInferRequest` or an
HTTP/REST infer body, built before a run's clock starts (perf.load.transport sends them).

A query's inputs are given without the batch dim and sent as `[1, ...]`; datatypes are Triton's
names for the numpy dtypes (`tritonclient.utils.np_to_triton_dtype`: float32 -> FP32, ...).
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

__all__ = ["Query", "grpc_request", "http_request", "query_length"]

Query = Mapping[str, np.ndarray]


def query_length(query: Query, add_batch_dim: bool = True) -> int | None:
    """A sequence query's actual length: the count of nonzeros in its attention mask when it has
    one, else the sequence dim of its first integer input (token ids); None for other models."""
    axis = 0 if add_batch_dim else 1
    for name, arr in query.items():
        if "mask" in name and arr.ndim > axis:
            return int(np.count_nonzero(arr))
    for arr in query.values():
        if np.issubdtype(arr.dtype, np.integer) and arr.ndim > axis:
            return int(arr.shape[axis])
    return None


def grpc_request(model: str, query: Query, add_batch_dim: bool = True, version: str = "", request_id: str = "") -> bytes:
    """A serialized KServe v2 `ModelInferRequest` (raw input contents) for one query."""
    from tritonclient.grpc import service_pb2
    from tritonclient.utils import np_to_triton_dtype, serialize_byte_tensor

    request = service_pb2.ModelInferRequest(model_name=model, model_version=version, id=request_id)
    for name, arr in query.items():
        arr = np.ascontiguousarray(arr[None] if add_batch_dim else arr)
        datatype = np_to_triton_dtype(arr.dtype)
        if datatype is None:
            raise ValueError(f"input {name!r}: no Triton datatype for numpy dtype {arr.dtype}")
        tensor = request.inputs.add()
        tensor.name, tensor.datatype = name, datatype
        tensor.shape.extend(arr.shape)
        request.raw_input_contents.append(serialize_byte_tensor(arr).tobytes() if datatype == "BYTES" else arr.tobytes())
    return request.SerializeToString()


def http_request(query: Query, add_batch_dim: bool = True, request_id: str = "") -> tuple[bytes, dict[str, str]]:
    """An HTTP/REST infer body (binary inputs, binary outputs) and its headers, for one query."""
    import tritonclient.http as httpclient

    from dvabatch_backend.tools.serve import infer_inputs

    inputs = infer_inputs(httpclient, query, add_batch_dim)  # binary data: tritonclient.http's default
    body, json_size = httpclient.InferenceServerClient.generate_request_body(inputs, request_id=request_id)
    # identity: Triton would otherwise gzip answers for aiohttp's default Accept-Encoding
    headers = {"Content-Type": "application/octet-stream", "Accept-Encoding": "identity"}
    if json_size is not None:
        headers["Inference-Header-Content-Length"] = str(json_size)
    return body, headers
