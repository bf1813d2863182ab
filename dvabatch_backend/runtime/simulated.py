"""A GPU stand-in, for measuring where no GPU is at hand: the engine kind `simulated`.

A measuring instrument, never a default (`engine: simulated`, `device_profile: FILE`). It stands for
the torch engine on CUDA replaying CUDA graphs as the runtime serves it, and goes through the same
path: each stage on a stream of its own, the buffers' fences on events (`fences.CudaEventFence`
takes these streams), the boundaries between stages in device memory (`device_memory.
place_on_streams`), batches padded to graph buckets before stage 0 (`settings.replays_graphs`),
the host waiting only where it reads (an answer, the entry's `wait_for_device`).

- `DeviceProfile`: what a run costs. Each stage's time per batch size and length, as the device
  measured its `run()` (copy in, graph replay, copy out: `../shared/gpu-profiles/` holds measured
  profiles), and the `DeviceParameters` (launch, copies, streams at once). A run is charged at the
  graph bucket it would replay (rounded up, as the torch engine pads), its compute being the
  profiled time less the launch and the copies the profile's run made. The unsliced model costs
  the sum of its stages until a device run measures it (`model_times`).
- `SimulatedDevice`: the clock model of one device. Its compute engine and its two copy engines
  (host to device, device to host) each do one thing at a time, in launch order: until two
  streams at once are measured (`DeviceParameters.concurrent_kernels`), stages share the device
  one at a time, and copies overlap compute as a GPU's copy engines do.
- `SimStream`, `SimEvent`: the names of torch.cuda's the runtime calls. A launch returns at once
  and moves the stream's tail; an event is the deadline its stream had when recorded, which
  `query` compares with the clock and `synchronize` sleeps until; `wait_event` orders a stream
  after it. No thread per stream, no CPU spent while a kernel "runs".
- `DeviceArray`, `SimulatedMemory`: device memory, numpy arrays marked as on the device.
- `SimulatedStageEngine`: `run(inputs, outputs)` queues the copy of each host input, the replay,
  the copy of each host output, and waits where an output is host memory (as the torch engine
  does). The outputs are left as they are (zeros: a measuring run needs no values), unless the
  profile says `"values": "computed"`, where a CPU engine also computes them (tests: answers equal
  to the unsliced model's through the stand-in's streams).

The clock and the sleep are injectable (`SimulatedDevice(profile, clock, sleep, spin_s=0)`), so that
tests order streams and events on a manual clock, with no timing.
"""
from __future__ import annotations

import json
import math
import os
import threading
import time
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from .cost import StageCost
from .device_timing import DeviceTimer
from .manifest import Manifest, TensorSpec, dim_size, is_length_dim
from .settings import SIMULATED  # noqa: F401 - the engine kind, named where the engine is


@dataclass(frozen=True)
class DeviceParameters:
    """What a run costs beside its compute. Defaults are one GPU's, as `perf.gpu.device_profile`
    measures them (its profiles under perf/gpu/profiles/); a profile file may give its own
    (`"parameters"`; docs/gpu.md).

    - launch_s: from the host's launch of a one-kernel CUDA graph to the device's end, less the
      kernel's own time (host clock, synchronized; CUDA events);
    - copy_latency_s, copy_bytes_per_s: one copy between pageable host memory and the device,
      fitted over copies of a range of sizes each way as latency + bytes / bandwidth;
    - concurrent_kernels: graph replays of different streams running at once: 2 where two stages
      replayed on two streams at once take well under the two one after the other (the threshold
      is `perf.gpu.device_profile`'s), else 1, one at a time;
    - sync_wake_s: how late the host notices work done (CUDA's default spin-then-yield sync wakes
      within microseconds; a sleeping host thread later, and the stand-in's own sleep is already
      that late, so 0 by default);
    - host_run_s: the torch engine's own host time for one run (its Python, the copies' and the
      graph's launches; outputs in device memory, nothing waited for), which the stand-in's run
      spends on the calling thread before its launch: 0 unless the profile gives it
      (`perf.gpu.device_profile` measures it). Unpriced, a pipeline whose stage threads each pay it
      per batch is served too fast."""

    launch_s: float = 24e-6
    copy_latency_s: float = 4.4e-6
    copy_bytes_per_s: float = 6.6e9
    concurrent_kernels: int = 1
    sync_wake_s: float = 0.0
    host_run_s: float = 0.0

    def copy_seconds(self, nbytes: int) -> float:
        return 0.0 if nbytes <= 0 else self.copy_latency_s + nbytes / self.copy_bytes_per_s

    def copies_seconds(self, sizes: Iterable[int]) -> float:
        """One copy per tensor (`sizes` in bytes), each with its latency: how the torch engine
        moves a run's host inputs in and outputs out, and so how a profile's run paid them."""
        return sum(self.copy_seconds(n) for n in sizes)


Times = dict[int, float]  # seconds by batch size


@dataclass(frozen=True)
class DeviceProfile:
    """A device's measured stage times and its parameters (module docstring).

    `stage_times[i]`: stage i's run time by batch size at the longest length (or a fixed-shape
    model's); `stage_times_by_length[L][i]` the same at length L; `model_times` (optional, same
    forms under "stage_times"/"by_length" as one stage) the unsliced model's. `boundaries`: where
    the profile's runs kept the tensors between stages: "host" (each run copied its inputs in and
    its outputs out: the profiles measured before `perf.gpu.device_profile` timed them as served)
    or "device" (only the model's own inputs and outputs were copied)."""

    name: str
    stage_times: tuple[Times, ...]
    stage_times_by_length: Mapping[int, tuple[Times, ...]] = field(default_factory=dict)
    model_times: tuple[Times, ...] | None = None  # as one stage: (by batch size,)
    model_times_by_length: Mapping[int, tuple[Times, ...]] = field(default_factory=dict)
    parameters: DeviceParameters = DeviceParameters()
    computed_values: bool = False
    source: str = ""
    boundaries: str = "host"

    @property
    def num_stages(self) -> int:
        return len(self.stage_times)

    @classmethod
    def load(cls, path: str | Path) -> DeviceProfile:
        doc = json.loads(Path(path).read_text())
        return cls.from_json(doc, source=str(path))

    @classmethod
    def from_json(cls, doc: Mapping[str, Any], source: str = "") -> DeviceProfile:
        if not doc.get("stage_times"):
            raise ValueError(f"device profile {source or '(given)'} has no stage_times")
        model = doc.get("model_times") or {}
        params = doc.get("parameters") or {}
        unknown = set(params) - set(DeviceParameters.__dataclass_fields__)
        if unknown:
            raise ValueError(f"device profile {source}: unknown parameters {sorted(unknown)}")
        values = doc.get("values", "zeros")
        if values not in ("zeros", "computed"):
            raise ValueError(f"device profile {source}: values must be 'zeros' or 'computed', got {values!r}")
        boundaries = doc.get("boundaries", "host")
        if boundaries not in ("host", "device"):
            raise ValueError(f"device profile {source}: boundaries must be 'host' or 'device', got {boundaries!r}")
        return cls(name=str(doc.get("measured_on") or doc.get("name") or "unnamed device") + " (simulated)",
                   stage_times=_stages(doc["stage_times"]),
                   stage_times_by_length={int(k): _stages(v) for k, v in (doc.get("stage_times_by_length") or {}).items()},
                   model_times=_stages(model["stage_times"]) if model.get("stage_times") else None,
                   model_times_by_length={int(k): _stages(v) for k, v in (model.get("by_length") or {}).items()},
                   parameters=replace(DeviceParameters(), **params), computed_values=values == "computed",
                   source=source, boundaries=boundaries)

    def run_seconds(self, stage: int | None, batch: int, length: int) -> float:
        """A run's time as profiled (copies in and out included) at `batch` rows and `length`
        (0: fixed shape); `stage` None is the unsliced model: measured, else its stages summed."""
        if stage is None:
            if self._model_cost is None:
                return sum(self.run_seconds(k, batch, length) for k in range(self.num_stages))
            return self._model_cost.time(0, batch, length or None)
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"the device profile has {self.num_stages} stage(s); stage {stage} was asked for")
        return self._stage_cost.time(stage, batch, length or None)

    # read by the runtime's one rule for profiled times (runtime/cost.py): linear between profiled
    # points, flat below the smallest, proportional beyond the largest
    @cached_property
    def _stage_cost(self) -> StageCost:
        return StageCost(self.stage_times, self.num_stages, self.stage_times_by_length)

    @cached_property
    def _model_cost(self) -> StageCost | None:
        return None if self.model_times is None else StageCost(self.model_times, 1, self.model_times_by_length)


def _stages(raw: Sequence[Mapping[str, float]]) -> tuple[Times, ...]:
    return tuple({int(bs): float(t) for bs, t in stage.items()} for stage in raw)


SPIN_S = 150e-6  # how long before a deadline the host stops sleeping and spins (`SimulatedDevice.wait_until`)


class ManualClock:
    """A clock that moves only when slept on: for tests that order streams and events without timing."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)


class SimulatedDevice:
    """One device's engines (module docstring). Thread-safe: stages launch from their own threads."""

    def __init__(self, profile: DeviceProfile, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep, spin_s: float = SPIN_S) -> None:
        self.profile = profile
        self.name = profile.name
        self.clock, self._sleep, self._spin_s = clock, sleep, spin_s
        self._lock = threading.Lock()
        # when each engine is next free: compute (one slot per concurrent kernel), copies each way
        self._compute_free = [0.0] * max(1, profile.parameters.concurrent_kernels)
        self._copy_free = {"in": 0.0, "out": 0.0}
        self.memory = SimulatedMemory(self)
        self.busy_seconds = 0.0  # compute charged so far (what `utilization` would read)

    def stream(self) -> SimStream:
        return SimStream(self)

    def event(self) -> SimEvent:
        return SimEvent(self)

    def enqueue(self, stream: SimStream, seconds: float, engine: str = "compute") -> float:
        """Queue `seconds` of work on `stream`, on the device's `engine` ("compute", "in", "out"),
        after everything the stream holds; returns when it will end."""
        with self._lock:
            ready = max(self.clock() + self.profile.parameters.launch_s, stream.tail)
            if engine == "compute":
                slot = min(range(len(self._compute_free)), key=self._compute_free.__getitem__)
                start = max(ready, self._compute_free[slot])
                self._compute_free[slot] = end = start + seconds
                self.busy_seconds += seconds
            else:
                start = max(ready, self._copy_free[engine])
                self._copy_free[engine] = end = start + seconds
            stream.tail = end
            return end

    def wait_until(self, deadline: float) -> None:
        """Block the calling (host) thread until the clock reaches `deadline` (+ the sync's wake-up)."""
        self.host_until(deadline + self.profile.parameters.sync_wake_s)

    def host_until(self, deadline: float) -> None:
        """Keep the calling (host) thread until the clock reaches `deadline`: waiting, or the host
        work a real engine would be doing (`DeviceParameters.host_run_s`)."""
        while True:
            left = deadline - self.clock()
            if left <= 0:
                return
            # the last `spin_s` spun, yielding the GIL: a sleep wakes tens of microseconds late,
            # where CUDA's synchronize spins on the host and notices the end within microseconds
            # (`time.sleep(0)` is such a sleep too; `os.sched_yield` returns at once)
            if left > self._spin_s:
                self._sleep(left - self._spin_s)
            else:
                os.sched_yield()

    def synchronize(self) -> None:
        """Wait for everything queued on the device (torch.cuda.synchronize)."""
        with self._lock:
            last = max(*self._compute_free, *self._copy_free.values())
        self.wait_until(last)


class SimStream:
    """A stream on a `SimulatedDevice`: its work in order, ending at `tail` (module docstring)."""

    simulated = True

    def __init__(self, device: SimulatedDevice) -> None:
        self.device = device
        self.tail = 0.0  # when the last work queued on this stream ends (device clock)

    def wait_event(self, event: SimEvent) -> None:
        """Later work on this stream starts after `event`'s (the GPU orders it; the host goes on)."""
        if event.recorded:
            with self.device._lock:
                self.tail = max(self.tail, event.at)

    def query(self) -> bool:
        return self.device.clock() >= self.tail

    def synchronize(self) -> None:
        self.device.wait_until(self.tail)


class SimEvent:
    """An event on a `SimulatedDevice`: the deadline of the stream it was recorded on."""

    def __init__(self, device: SimulatedDevice) -> None:
        self.device = device
        self.at = 0.0
        self.recorded = False

    def record(self, stream: SimStream) -> None:
        with self.device._lock:
            self.at = stream.tail
        self.recorded = True

    def query(self) -> bool:
        return self.device.clock() >= self.at

    def synchronize(self) -> None:
        self.device.wait_until(self.at)


class SimTimingEvent(SimEvent):
    """An event that stamps when the device reaches it (for `DeviceTimer`): on an idle stream that
    is now, not the stream's last deadline, as a CUDA timing event records the time the GPU
    processes it."""

    def record(self, stream: SimStream) -> None:
        with self.device._lock:
            self.at = max(stream.tail, self.device.clock())
        self.recorded = True


def sim_timer(device: SimulatedDevice) -> DeviceTimer:
    return DeviceTimer(lambda: SimTimingEvent(device), lambda start, end: end.at - start.at)


class DeviceArray(np.ndarray):
    """A numpy array standing for device memory: a stage reads and writes it without a copy; a
    host reader gets a plain copy (`SimulatedMemory.to_host`). Views of it stay `DeviceArray`s."""


class SimulatedMemory:
    """`BufferMemory` on a simulated device (buffers.BufferMemory)."""

    on_device = True

    def __init__(self, device: SimulatedDevice) -> None:
        self.device = device

    def zeros(self, size: int, dtype: np.dtype) -> DeviceArray:
        return np.zeros(size, dtype).view(DeviceArray)

    def to_host(self, view: Any) -> np.ndarray:
        return np.array(view, copy=True).view(np.ndarray)


def on_device(array: Any) -> bool:
    return isinstance(array, DeviceArray)


Part = tuple[int | None, Sequence[TensorSpec], Sequence[TensorSpec]]  # (profile stage, its inputs, its outputs)


class SimulatedStageEngine:
    """One stage (or the unsliced model) on a simulated device (module docstring).

    `parts`: what a run replays, each a (profile stage, inputs, outputs): a stage is one part; the
    unsliced model is every stage's (their replays summed, without the copies between them) or,
    where the profile measured it, one part of stage None. `buckets` are the graph buckets (batch
    sizes, lengths) the torch engine would capture (`settings.graph_buckets`); `pad_length`: a
    batch's length may be padded up to a bucket's (the torch engine's `capture_buckets`), else its
    exact length is charged."""

    def __init__(self, device: SimulatedDevice, inputs: Sequence[TensorSpec], parts: Sequence[Part],
                 buckets: tuple[Sequence[int], Sequence[int]], pad_length: bool, values: Any = None,
                 name: str = "", model_io: frozenset[str] | None = None) -> None:
        self.device = device
        self.input_specs = tuple(inputs)  # what `run` is given: where it reads the batch's rows and length
        self._parts = tuple(parts)
        self.input_names = [s.name for s in self.input_specs]
        self.output_names = [s.name for s in parts[-1][2]]
        self.sizes, self.lengths = sorted(buckets[0]), sorted(buckets[1])
        self.pad_length = pad_length
        self.stream = device.stream()
        self.device_timer = sim_timer(device)  # each run's time on the device (runtime/device_timing.py)
        self._values = values  # an engine computing the outputs' values on the CPU, or None
        self.name = name
        self.replays = 0
        self._compute_cache: dict[tuple[int, int], float] = {}
        # the tensors a profile with device boundaries copied: the model's own inputs and outputs
        # (None: every part's, as a profile with host boundaries did)
        self._profiled_copies = model_io if device.profile.boundaries == "device" else None

    @property
    def buckets(self) -> tuple[list[int], list[int]]:
        return list(self.sizes), list(self.lengths)

    def bucket(self, rows: int, length: int) -> tuple[int, int]:
        """The graph bucket a batch of `rows` at `length` replays: the smallest holding it."""
        size = next((s for s in self.sizes if s >= rows), rows)
        if length <= 0:
            return size, 0
        if self.pad_length:
            return size, next((n for n in self.lengths if n >= length), length)
        return size, length

    def run(self, inputs: Mapping[str, Any], outputs: Mapping[str, Any]) -> None:
        called = self.device.clock()
        rows, length = self._rows_and_length(inputs)
        size, bucket_length = self.bucket(rows, length)
        params = self.device.profile.parameters
        if params.host_run_s:  # the torch engine's host work before its launch, less what this took
            self.device.host_until(called + params.host_run_s)
        # one copy per host tensor, as the torch engine makes them (each pays the copy's latency)
        copy_in = params.copies_seconds(a.nbytes for a in inputs.values() if not on_device(a))
        copy_out = params.copies_seconds(a.nbytes for a in outputs.values() if not on_device(a))
        began = self.device_timer.start(self.stream)
        if copy_in:
            self.device.enqueue(self.stream, copy_in, "in")
        self.device.enqueue(self.stream, self.compute_seconds(size, bucket_length))
        if copy_out:
            self.device.enqueue(self.stream, copy_out, "out")
        self.device_timer.stop(began, self.stream)
        self.replays += 1
        if self._values is not None:
            self._values.run(inputs, outputs)
        if copy_out:  # host outputs: complete when `run` returns, as the torch engine's
            self.stream.synchronize()

    def wait_for_device(self) -> None:
        self.stream.synchronize()

    def compute_seconds(self, size: int, length: int) -> float:
        """The replay's device time at a bucket: each part's profiled run less its launch and the
        copies it made (each of its inputs in and outputs out that were in host memory when
        profiled, at the bucket's shapes: every one, or with device boundaries the model's own)."""
        key = (size, length)
        seconds = self._compute_cache.get(key)
        if seconds is None:
            params = self.device.profile.parameters
            seconds = 0.0
            for stage, inputs, outputs in self._parts:
                copies = params.copies_seconds(math.prod(s.shape(size, max(length, 1))) * s.np_dtype.itemsize
                                               for s in (*inputs, *outputs)
                                               if self._profiled_copies is None or s.name in self._profiled_copies)
                profiled = self.device.profile.run_seconds(stage, size, length)
                seconds += max(0.0, profiled - params.launch_s - copies)
            self._compute_cache[key] = seconds
        return seconds

    def _rows_and_length(self, inputs: Mapping[str, Any]) -> tuple[int, int]:
        """The batch's rows and the model length its inputs are padded to (0: fixed shape)."""
        rows, length = 0, 0
        for spec in self.input_specs:
            array = inputs[spec.name]
            rows = max(rows, int(array.shape[0]))
            for axis, dim in enumerate(spec.dims):
                if is_length_dim(dim):
                    length = max(length, _model_length(dim, int(array.shape[axis]), self.lengths))
        return rows, length

    def __repr__(self) -> str:
        return f"SimulatedStageEngine({self.name} on {self.device.name})"


def _model_length(dim: Any, size: int, buckets: Sequence[int]) -> int:
    """The model length whose `dim` is `size`: the smallest bucket that gives at least `size`, else
    `size` itself (a plain `seq` dim)."""
    for n in buckets:
        if dim_size(dim, n) >= size:
            return n
    return size


_devices: dict[str, SimulatedDevice] = {}
_devices_lock = threading.Lock()


def simulated_device(profile_path: str | Path) -> SimulatedDevice:
    """The process's simulated device for a profile file (one per file: every engine loaded with it
    shares it, as the stages of a model and the baselines beside it share one GPU)."""
    key = str(Path(profile_path).resolve())
    with _devices_lock:
        device = _devices.get(key)
        if device is None:
            device = _devices[key] = SimulatedDevice(DeviceProfile.load(key))
        return device


def simulated_engine(path: Path, profile_path: str | Path | None, manifest: Manifest,
                     buckets: tuple[Sequence[int], Sequence[int]], pad_length: bool) -> SimulatedStageEngine:
    """The engine over the ONNX file at `path` (a stage of `manifest`, or its unsliced model)."""
    if not profile_path:
        raise ValueError("engine 'simulated' needs a device profile (the `device_profile` parameter: a JSON file "
                         "of stage times, as ../shared/gpu-profiles/ holds)")
    device = simulated_device(profile_path)
    profile = device.profile
    if profile.num_stages != manifest.num_stages:
        raise ValueError(f"the device profile {profile.source} has {profile.num_stages} stage(s); "
                         f"{manifest.name} has {manifest.num_stages}")
    names = [s.file for s in manifest.stages]
    if path.name in names:
        k = names.index(path.name)
        inputs = manifest.stages[k].inputs
        parts: list[Part] = [(k, inputs, manifest.stages[k].outputs)]
    elif path.name == manifest.full_model:
        inputs = manifest.inputs
        parts = ([(None, manifest.inputs, manifest.outputs)] if profile.model_times is not None
                 else [(k, s.inputs, s.outputs) for k, s in enumerate(manifest.stages)])
    else:
        raise ValueError(f"{path.name} is neither a stage of {manifest.name} nor its unsliced model")
    values = None
    if profile.computed_values:  # tests: real answers through the stand-in's streams
        from .engine import OrtStageEngine

        values = OrtStageEngine(path, 1)
    model_io = frozenset(t.name for t in (*manifest.inputs, *manifest.outputs))
    return SimulatedStageEngine(device, inputs, parts, buckets, pad_length, values, path.name, model_io)
