"""The stages' GPU timeline from CUDA events: when each stage's work ran on its stream.

`EventTimedEngine` wraps a stage engine that runs on a CUDA stream (`engine.stream`, as
`TorchStageEngine` on "cuda") and records a timing event on that stream before and after each
`run`; `intervals()` turns them into (start_ms, end_ms) from one origin event, so intervals of
different stages (different streams) compare on one clock. `overlapping_pairs` says which runs of
different stages overlapped: with one buffer pair none may, with two some should.

torch is imported when an engine is wrapped, never at import time.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np


@dataclass(frozen=True)
class Interval:
    stage: int
    start_ms: float
    end_ms: float


class Timeline:
    """The origin event every interval is measured from, and every wrapped engine's events."""

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self.origin = torch.cuda.Event(enable_timing=True)
        self.origin.record(torch.cuda.current_stream())
        self._events: list[tuple[int, Any, Any]] = []
        self._lock = threading.Lock()

    def add(self, stage: int, start: Any, end: Any) -> None:
        with self._lock:
            self._events.append((stage, start, end))

    def intervals(self) -> list[Interval]:
        """Every recorded run as an interval in ms after the origin (waits for the events)."""
        self._torch.cuda.synchronize()
        with self._lock:
            events = list(self._events)
        return [Interval(stage, self.origin.elapsed_time(start), self.origin.elapsed_time(end))
                for stage, start, end in events]


class EventTimedEngine:
    """A stage engine whose runs are timed on its own CUDA stream (the engine's `stream`).

    The end event is waited for before `run` returns, so whatever the scheduler starts after this
    run (the next stage, on another stream) is recorded later on the GPU's clock too: with one
    buffer pair a false overlap of a few microseconds cannot appear.
    """

    def __init__(self, stage: int, engine: Any, timeline: Timeline) -> None:
        import torch

        if getattr(engine, "stream", None) is None:
            raise ValueError("EventTimedEngine needs an engine running on a CUDA stream (`engine.stream`)")
        self._torch = torch
        self.stage, self.engine, self.timeline = stage, engine, timeline
        self.stream = engine.stream

    def run(self, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
        start = self._torch.cuda.Event(enable_timing=True)
        end = self._torch.cuda.Event(enable_timing=True)
        start.record(self.stream)
        self.engine.run(inputs, outputs)
        end.record(self.stream)
        end.synchronize()
        self.timeline.add(self.stage, start, end)


def overlapping_pairs(intervals: Sequence[Interval]) -> list[tuple[Interval, Interval]]:
    """Pairs of runs of different stages whose intervals overlap (strictly: touching is not overlap)."""
    ordered = sorted(intervals, key=lambda i: i.start_ms)
    pairs = []
    for k, a in enumerate(ordered):
        for b in ordered[k + 1:]:
            if b.start_ms >= a.end_ms:
                break
            if b.stage != a.stage:
                pairs.append((a, b))
    return pairs


def busy_overlap_ms(intervals: Sequence[Interval]) -> float:
    """Total time (ms) during which at least two stages were running."""
    edges = sorted([(i.start_ms, 1) for i in intervals] + [(i.end_ms, -1) for i in intervals])
    total, running, last = 0.0, 0, 0.0
    for t, step in edges:
        if running >= 2:
            total += t - last
        running, last = running + step, t
    return total
