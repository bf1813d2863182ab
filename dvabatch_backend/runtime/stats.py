"""Counters and an optional trace of what the runtime did, for tests, demos and metrics."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class StageStats:
    batches: int = 0
    rows: int = 0
    busy_seconds: float = 0.0  # the executor's, launch to return: on a device, the host's part
    # the stage's time on its device, from events around each run (runtime/device_timing.py);
    # filled in by `Pipeline.observe` for engines on a device, 0 on the CPU
    device_seconds: float = 0.0


@dataclass
class RuntimeStats:
    submitted: int = 0
    answered_ok: int = 0
    answered_error: int = 0
    new: int = 0
    stretch: int = 0
    split: int = 0
    stretch_refused: int = 0
    split_refused: int = 0
    early_exits: int = 0
    policy_errors: int = 0
    # decisions re-shaped because the model is not pad-safe (manifest.pad_safe False): a New mixing
    # lengths carried out as one batch per length, a pad length ignored, a Stretch across lengths refused
    pad_unsafe_splits: int = 0
    handoffs: int = 0
    # where the engines run beside the host, a caller's calls by who ran them (`Pipeline.hands_over`)
    calls_handed_over: int = 0
    calls_run_here: int = 0
    # admission (runtime/admission.py): refused at arrival, or dropped while queued, never run
    queue_full: int = 0
    timed_out: int = 0
    cancelled: int = 0
    slo_rejected: int = 0
    cancelled_in_flight: int = 0  # cancelled after stage 0 took it: it finishes, the answer is discarded
    within_slo: int = 0  # answers (results) within the latency target: goodput; every result without one
    queued: int = 0  # admitted, not yet taken by stage 0 (a gauge)
    caller_drains: int = 0  # requests refused because they waited in the caller's queue past its bound
    # the one-stage route (`Scheduler.serve_whole_model`): runs of the unsliced model, their rows,
    # the host seconds they took, and the model's time on its device (its events; 0 on the CPU)
    whole_runs: int = 0
    whole_rows: int = 0
    whole_seconds: float = 0.0
    whole_device_seconds: float = 0.0
    # answers with their result taken from a batch-table row's outputs (every result: a metric to check it)
    table_answered: int = 0
    # the engine loop's own steps and the host time they took (`EngineLoop`, copied by `Pipeline.observe`)
    loop_steps: int = 0
    loop_step_seconds: float = 0.0
    stages: list[StageStats] = field(default_factory=list)


@dataclass(frozen=True)
class TraceEvent:
    """One thing that happened. `kind` is new, stretch, split, push (onto `stage`'s queue), run or exit.

    For `run`, [t0, t1] is the time the executor spent in the working state.
    """

    kind: str
    t0: float
    t1: float
    stage: int | None
    batch_id: int
    start: int = 0
    num: int = 0
    detail: str = ""


class Trace:
    """What the runtime did, in order, when `enabled` (`RuntimeSettings.record_trace`); `events`
    stays empty otherwise. `item` is the batch item the event concerns (a `BatchItem`)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.events: list[TraceEvent] = []

    def record(self, kind: str, t0: float, stage: int | None, item: Any, detail: str = "",
               t1: float | None = None) -> None:
        if self.enabled:
            self.events.append(TraceEvent(kind, t0, t0 if t1 is None else t1, stage, item.batch_id, item.start,
                                          item.num, detail))
