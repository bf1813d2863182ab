"""A stage's time on its device, from events recorded on its stream around each run.

On a device a stage's `run` returns once its work is queued (boundaries in device memory), so the
executor's busy time (`StageStats.busy_seconds`) is the host's launch time, not the device's. Each
engine on a stream keeps a `DeviceTimer`: an event recorded on the stream before a run's work and
one after it; once the second has completed, the time between them (CUDA's event timing, or the
stand-in's deadlines) is the run's time on the device, queued behind nothing of its own stream.
`collect()` adds the completed runs, read by whoever holds the engine loop's step, at the end of each step; `seconds()` is what was collected, which the metrics read
(`StageStats.device_seconds`, the `dvabatch_stage_device_seconds_total` metric) without touching
an event.

Thread discipline: one run at a time per engine (a launch inside a step) calls `start`/`stop`;
the step's holder calls `collect`; any thread may call `seconds`. `_lock` guards the pending pairs
and the total. Completed pairs are added whenever a run stops and whenever a step collects, so the
pending ones are at most the engine's work still on the device.
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Any, Callable, Iterable


class DeviceTimer:
    """Events around each run on a stream (module docstring). `new_event()` makes a timing event
    (`record(stream)`, `query()`); `elapsed(start, end)` is the seconds between two completed ones."""

    def __init__(self, new_event: Callable[[], Any], elapsed: Callable[[Any, Any], float]) -> None:
        self._new_event = new_event
        self._elapsed = elapsed
        self._free: list[Any] = []  # events whose pair was read, for reuse (creating one costs the host)
        self._pending: deque[tuple[Any, Any]] = deque()
        self._seconds = 0.0
        self._runs = 0
        self._lock = threading.Lock()

    def start(self, stream: Any) -> Any:
        """Record the event that starts a run, before its work is queued on `stream`."""
        event = self._event()
        event.record(stream)
        return event

    def stop(self, started: Any, stream: Any) -> None:
        """Record the event that ends the run `started` began, after its work was queued."""
        end = self._event()
        end.record(stream)
        with self._lock:
            self._pending.append((started, end))
            self._add_completed()

    def collect(self) -> None:
        """Add the runs completed on the device since the last collect (reads their events)."""
        with self._lock:
            self._add_completed()

    def seconds(self) -> float:
        """Device seconds of every run collected so far (reads no event)."""
        with self._lock:
            return self._seconds

    @property
    def runs(self) -> int:
        """Runs whose device time `seconds` holds."""
        with self._lock:
            return self._runs

    def _event(self) -> Any:
        with self._lock:
            if self._free:
                return self._free.pop()
        return self._new_event()

    def _add_completed(self) -> None:
        """(under `_lock`) Runs end in stream order: the completed ones are at the front."""
        while self._pending and self._pending[0][1].query():
            start, end = self._pending.popleft()
            self._seconds += max(0.0, self._elapsed(start, end))
            self._runs += 1
            self._free += (start, end)


def device_timers(engines: Iterable[Any]) -> list[DeviceTimer]:
    """The timers of those engines that run on a device (an engine's `device_timer`, where it has one)."""
    return [t for t in (getattr(e, "device_timer", None) for e in engines) if t is not None]


def cuda_timer() -> DeviceTimer:
    """Timing CUDA events (torch): `elapsed_time` is in milliseconds."""
    import torch

    return DeviceTimer(lambda: torch.cuda.Event(enable_timing=True), lambda s, e: s.elapsed_time(e) / 1e3)
