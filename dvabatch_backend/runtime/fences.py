"""Completion fences of the buffers between stages: on the host (`HostFence`) and on a GPU (`CudaEventFence`).

A fence belongs to one buffer (one boundary, one buffer pair). The `BufferPool` drives it:

- `reset()` when the stage before the buffer starts writing it;
- `record()` when that stage finished (its work is queued, or done on the host);
- `wait()` when the stage after it starts reading: False means the writer never recorded, which
  the pool's self-check reports as a broken buffer-pair rule;
- `record_read()` when the reader finished with it, and `wait_read()` before the pool hands the
  buffer back to its writer (legitimation): the writer may overwrite it only once it is read;
- `synchronize()` before a host reader outside the stages (an early exit, a policy) reads it.

On the CPU every engine finishes before `run` returns, so `HostFence` only keeps the flag the
self-check needs. With engines on CUDA streams (`TorchStageEngine` on "cuda", TensorRT),
`CudaEventFence` records a torch.cuda.Event (or the GPU stand-in's, runtime/simulated.py) on the writer's stream; the reader's stream waits on
it (`Stream.wait_event`: the GPU orders the work, the host does not block); on legitimation the
writer's stream waits likewise for the reader's read. The host waits only where it reads or
writes a boundary itself: the answers, a host reader's copy, and the gather into boundary 0.

A pool is given a `FenceFactory` (boundary, pair) -> fence; `host_fences` is the default, and
`cuda_fences(streams)` builds the CUDA ones from each stage's stream. torch is imported only by
`CudaEventFence` and `cuda_fences`, so the runtime needs no torch on the CPU.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Protocol, Sequence


class Fence(Protocol):
    """What the `BufferPool` calls on a buffer's fence (see the module docstring)."""

    def reset(self) -> None: ...

    def record(self) -> None: ...

    def wait(self) -> bool: ...

    def record_read(self) -> None: ...

    def wait_read(self) -> None: ...

    def synchronize(self) -> None: ...


FenceFactory = Callable[[int, int], Fence]  # (boundary, pair) -> the fence of that buffer


class HostFence:
    """Completion fence of a buffer on CPU: recorded by the stage that writes it, checked by the reader.

    CPU engines finish their work before `run` returns, so recording marks completion at once
    and a reader finds it complete; reading is finished when the reader's `run` returns.
    """

    def __init__(self) -> None:
        self._done = True

    def reset(self) -> None:
        self._done = False

    def record(self) -> None:
        self._done = True

    def wait(self) -> bool:
        return self._done

    def record_read(self) -> None:
        """Nothing to record: the reader's `run` returned, so it has read the buffer."""

    def wait_read(self) -> None:
        """Nothing to wait for (see `record_read`)."""

    def synchronize(self) -> None:
        """Nothing to wait for: the writer's `run` returned, so the buffer is written."""


def host_fences(boundary: int, pair: int) -> HostFence:
    """The default `FenceFactory`: a `HostFence` for every buffer."""
    return HostFence()


# A torch.cuda.Stream, or None for the host (the boundary is written or read by the CPU).
# Typed Any: torch is imported lazily and may be absent.
StreamLike = Optional[Any]


def _torch_cuda() -> Any:
    """torch, checked to see a CUDA device; RuntimeError otherwise (the message names what is missing)."""
    try:
        import torch
    except ImportError:
        raise RuntimeError("CUDA call failed: torch is not installed (CudaEventFence needs torch with CUDA)") from None
    if not torch.cuda.is_available():
        raise RuntimeError("CUDA call failed: torch sees no CUDA device (torch.cuda.is_available() is False)")
    return torch


def is_simulated(stream: StreamLike) -> bool:
    """Whether `stream` is the GPU stand-in's (runtime/simulated.py: torch.cuda's names, its own events)."""
    return bool(getattr(stream, "simulated", False))


def as_torch_stream(stream: StreamLike) -> StreamLike:
    """A torch stream for `stream`: None stays None (the host), a torch.cuda.Stream stays as it is, a
    raw cudaStream_t handle (an int, or cuda-python's object: TensorRT's path) is wrapped."""
    if stream is None or is_simulated(stream):
        return stream
    torch = _torch_cuda()
    if isinstance(stream, torch.cuda.Stream):
        return stream
    return torch.cuda.ExternalStream(int(stream))


class CudaEventFence:
    """The GPU fence behind `HostFence`'s interface, on torch.cuda events.

    `record` records an event on the writer's stream after the stage queued its work; `wait`
    makes the reader's stream wait for it (`Stream.wait_event`) and returns True at once. A None
    stream is the host: recording from the host marks completion (the CPU wrote the buffer), and
    a host reader blocks on the event (`synchronize`): an answer must be complete before it is
    sent. Like `HostFence`, `wait` returns False when the fence was reset and its writer has not
    recorded: waiting on an event never recorded would silently not wait, so the pool's
    self-check must see it.

    `record_read` records a second event on the reader's stream after its work; `wait_read`, which
    the pool calls before handing the buffer back to its writer (legitimation), makes the writer's
    stream wait on it (the host, where the host writes), so that a writer never overwrites what a
    reader's queued work still reads.
    """

    def __init__(self, writer_stream: StreamLike = None, reader_stream: StreamLike = None) -> None:
        self.writer_stream = as_torch_stream(writer_stream)
        self.reader_stream = as_torch_stream(reader_stream)
        simulated = next((s for s in (self.writer_stream, self.reader_stream) if is_simulated(s)), None)
        # the stand-in's streams take its own events; torch's, torch.cuda's (no timing: cheaper)
        new_event = simulated.device.event if simulated is not None else _torch_cuda().cuda.Event
        self._written = new_event()
        self._read = new_event()
        self._recorded = True  # like HostFence: a fresh buffer holds nothing to wait for
        self._written_on_gpu = False  # whether `_written` was ever recorded on a stream
        self._read_on_gpu = False

    def reset(self) -> None:
        self._recorded = False

    def record(self) -> None:
        if self.writer_stream is not None:
            self._written.record(self.writer_stream)
            self._written_on_gpu = True
        self._recorded = True

    def wait(self) -> bool:
        if not self._recorded:
            return False
        if not self._written_on_gpu:
            return True  # the host wrote it: complete already
        if self.reader_stream is None:
            self._written.synchronize()  # a host reader (answers): the host must wait
        else:
            self.reader_stream.wait_event(self._written)
        return True

    def record_read(self) -> None:
        if self.reader_stream is not None:
            self._read.record(self.reader_stream)
            self._read_on_gpu = True

    def wait_read(self) -> None:
        """Legitimation: the writer may overwrite the buffer only once it is read. A writer on a
        stream waits on the GPU (`Stream.wait_event`: its later work runs after the read; the host
        and the scheduler's lock do not wait); the host as the writer (gather) blocks on it."""
        if not self._read_on_gpu:
            return
        if self.writer_stream is None:
            self._read.synchronize()
        else:
            self.writer_stream.wait_event(self._read)

    def query(self) -> bool:
        """Whether the recorded write has finished on the GPU (never blocks)."""
        return self._recorded and (not self._written_on_gpu or bool(self._written.query()))

    def synchronize(self) -> None:
        """Block the host until the recorded write is done (a host reader outside the pool)."""
        if self._written_on_gpu:
            self._written.synchronize()


def cuda_fences(streams: Sequence[StreamLike]) -> FenceFactory:
    """A `FenceFactory` for a pipeline whose stage i runs on `streams[i]` (None: on the host).

    Boundary k is written by stage k-1 and read by stage k; boundary 0 is written by the host
    (gather) and the last boundary read by the host (scatter, answers).
    """
    stages = [as_torch_stream(s) for s in streams]

    def fence(boundary: int, pair: int) -> CudaEventFence:
        writer = stages[boundary - 1] if boundary > 0 else None
        reader = stages[boundary] if boundary < len(stages) else None
        return CudaEventFence(writer, reader)

    return fence


def install_fences(pipeline: Any, fence_factory: FenceFactory) -> None:
    """Give a `Pipeline`'s (or a `Scheduler`'s) buffer pool the fences of `fence_factory`, before it
    starts (a `Scheduler` also takes `fence_factory` when it is made)."""
    scheduler = getattr(pipeline, "scheduler", pipeline)
    with scheduler.lock:
        scheduler.board.buffers.install_fences(fence_factory)
