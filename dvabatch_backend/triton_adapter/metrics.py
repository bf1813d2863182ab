"""Per-stage figures on Triton's metrics endpoint, beside Triton's own.

A sampler thread copies the scheduler's counters into Triton custom metrics every `period`
seconds (the hot path is left alone): batches, rows and busy seconds per stage, batch-queue
lengths, and the meta operations done. Only the adapter imports this module.
"""
from __future__ import annotations

import threading

import triton_python_backend_utils as pb_utils

from ..runtime.pipeline import Pipeline

_COUNTERS = {
    "dvabatch_stage_batches_total": "Batch items run by each stage",
    "dvabatch_stage_rows_total": "Queries (rows) run by each stage; over batches it is the mean batch size",
    "dvabatch_stage_busy_seconds_total": "Seconds each stage spent working",
}
_OPERATIONS = ("new", "stretch", "split", "early_exits", "stretch_refused", "split_refused", "policy_errors")


class StageMetrics:
    def __init__(self, scheduler: Pipeline, model: str, period: float = 0.25) -> None:
        self._scheduler = scheduler
        self._period = period
        counter, gauge = pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.GAUGE
        families = {name: pb_utils.MetricFamily(name=name, description=text, kind=counter)
                    for name, text in _COUNTERS.items()}
        queue = pb_utils.MetricFamily(name="dvabatch_stage_queue_length",
                                      description="Items waiting in each stage's batch queue", kind=gauge)
        ops = pb_utils.MetricFamily(name="dvabatch_meta_operations_total",
                                    description="Meta operations carried out (and refused)", kind=counter)
        stages = range(scheduler.num_stages)
        self._per_stage = {name: [fam.Metric(labels={"model": model, "stage": str(k)}) for k in stages]
                           for name, fam in families.items()}
        self._queues = [queue.Metric(labels={"model": model, "stage": str(k)}) for k in stages]
        self._ops = {op: ops.Metric(labels={"model": model, "operation": op}) for op in _OPERATIONS}
        self._families = [*families.values(), queue, ops]  # keep them alive while reporting
        self._last: dict[tuple[str, int], float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dvabatch-metrics", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self._period):
            self.sample()

    def sample(self) -> None:
        stats, queues = self._scheduler.observe()
        for k, stage in enumerate(stats.stages):
            self._add("dvabatch_stage_batches_total", k, stage.batches)
            self._add("dvabatch_stage_rows_total", k, stage.rows)
            self._add("dvabatch_stage_busy_seconds_total", k, stage.busy_seconds)
            self._queues[k].set(queues[k])
        for op, metric in self._ops.items():
            value = getattr(stats, op)
            metric.increment(value - self._last.get((op, -1), 0))
            self._last[(op, -1)] = value

    def _add(self, name: str, stage: int, total: float) -> None:
        self._per_stage[name][stage].increment(total - self._last.get((name, stage), 0))
        self._last[(name, stage)] = total

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()
