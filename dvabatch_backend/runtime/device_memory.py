"""Boundary tensors in device memory: a batch crosses from one GPU stage to the next without
leaving the device.

With every buffer in host memory each stage on a GPU pays a round trip per batch: copy its input
in, run, copy its output out and wait for the copy (the host must not read a buffer the device is
still writing). `place_on_streams` keeps each boundary that lies between two stages on CUDA streams
in device memory (`TorchMemory`): the writer's engine copies its outputs there on its own stream,
the buffer's `CudaEventFence` orders the reader's stream after it, and the host waits only where
it reads: the model's outputs (the last boundary, host memory as before) and the host readers of a
middle boundary (`StageBuffer.host_rows`: an early exit, a policy looking at a stage's outputs).
Boundary 0 stays in host memory too: the host gathers the queries' inputs into it. Those two
are page-locked (`PinnedMemory`), so a stage's copy in is queued on its stream rather than waited
for, and its copy out takes the direct path; the fences already keep the host from gathering into
boundary 0 before the copy of the last batch there has run (`CudaEventFence.wait_read`).

torch is imported only when these are used, so the runtime runs without torch on the CPU.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .buffers import HOST_MEMORY, BufferMemory, MemoryFactory
from .fences import FenceFactory, StreamLike, as_torch_stream, cuda_fences, is_simulated


def _torch_dtype(dtype: np.dtype) -> Any:
    """torch's dtype for a numpy one (torch's own mapping, through an empty array)."""
    import torch

    return torch.from_numpy(np.zeros(0, dtype)).dtype


class TorchMemory:
    """Buffers as torch tensors on `device` ("cuda", "cuda:1"; "cpu" runs the same path without a
    GPU). Host readers get numpy copies (`to_host`)."""

    on_device = True

    def __init__(self, device: Any) -> None:
        import torch

        self._torch = torch
        self.device = torch.device(device)

    def zeros(self, size: int, dtype: np.dtype) -> Any:
        return self._torch.zeros(size, dtype=_torch_dtype(dtype), device=self.device)

    def to_host(self, view: Any) -> np.ndarray:
        return view.detach().cpu().numpy()


class PinnedMemory:
    """Host buffers in page-locked memory, as numpy arrays (what the host reads and writes: the
    model's inputs and outputs): copies between them and a GPU can run on a stream without the host
    waiting for them."""

    on_device = False

    def __init__(self) -> None:
        import torch

        self._torch = torch

    def zeros(self, size: int, dtype: np.dtype) -> np.ndarray:
        pinned = self._torch.zeros(size, dtype=_torch_dtype(dtype), pin_memory=True)
        return pinned.numpy()  # the array keeps the tensor, and so the page-locked memory, alive

    def to_host(self, view: Any) -> np.ndarray:
        return view


def stream_memory(streams: Sequence[StreamLike]) -> MemoryFactory:
    """A `MemoryFactory` for a pipeline whose stage i runs on `streams[i]` (None: on the host):
    boundary k (between stages k-1 and k) in the device memory of their streams where both run on
    one device; a boundary the host touches next to a stage on a stream (boundary 0, the last one)
    in page-locked host memory; any other in host memory."""
    stages = [as_torch_stream(s) for s in streams]

    def memory(boundary: int, pair: int) -> BufferMemory:
        writer = stages[boundary - 1] if boundary > 0 else None
        reader = stages[boundary] if boundary < len(stages) else None
        stage = writer if writer is not None else reader
        if is_simulated(stage):  # the GPU stand-in: its own device memory; host memory is host memory
            both = writer is not None and reader is not None and writer.device is reader.device
            return stage.device.memory if both else HOST_MEMORY
        if writer is not None and reader is not None and writer.device == reader.device:
            return TorchMemory(writer.device)
        return HOST_MEMORY if writer is None and reader is None else PinnedMemory()

    return memory


def place_on_streams(pipeline: Any, streams: Sequence[StreamLike]) -> None:
    """Give a `Pipeline` (not started) whose stage i runs on `streams[i]` `CudaEventFence`s on those
    streams and its middle boundaries in device memory (module docstring). A stage shown with no stream (None: a wrapped engine) reads and writes host memory."""
    fences: FenceFactory = cuda_fences(streams)
    pipeline.install_buffers(fences, stream_memory(streams))
    if any(is_simulated(s) for s in streams):
        return  # the stand-in's buffers are numpy zeros, written already
    import torch

    torch.cuda.synchronize()  # the new buffers' zeros are written before any stage's stream reads them
