"""Stage engines: run one stage on views of the preallocated buffers.

The protocol is one method, `run(inputs, outputs)`: both are dicts of C-contiguous arrays
whose shapes are the actual ones (rows of the batch, padded length). The engine writes its
results into `outputs` in place.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Protocol

import numpy as np


class StageEngine(Protocol):
    def run(self, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
        ...


def ort_session_options(threads: int) -> "object":
    """Session options for engines that share a few cores: fixed threads, no spin-waiting."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    options.log_severity_level = 3
    return options


class OrtStageEngine:
    """onnxruntime on the CPU provider, with I/O bound directly onto the buffers."""

    def __init__(self, path: str | Path, threads: int = 1, providers: tuple[str, ...] = ("CPUExecutionProvider",)) -> None:
        import onnxruntime as ort

        self.path = Path(path)
        self._session = ort.InferenceSession(str(path), ort_session_options(threads), providers=list(providers))

    def run(self, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
        binding = self._session.io_binding()
        for name, arr in inputs.items():
            binding.bind_input(name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)
        for name, arr in outputs.items():
            binding.bind_output(name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)
        self._session.run_with_iobinding(binding)
