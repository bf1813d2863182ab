"""Per-stage figures on Triton's metrics endpoint, beside Triton's own.

A sampler thread copies the scheduler's counters into Triton custom metrics every `period`
seconds (the hot path is left alone): batches, rows and busy seconds per stage, batch-queue
lengths, the meta operations done, the batch table's answers and the unsliced model's runs.
Only the adapter imports this module.
"""
from __future__ import annotations

import threading

import triton_python_backend_utils as pb_utils

from ..runtime.pipeline import Pipeline

_COUNTERS = {
    "dvabatch_stage_batches_total": "Batch items run by each stage",
    "dvabatch_stage_rows_total": "Queries (rows) run by each stage; over batches it is the mean batch size",
    "dvabatch_stage_busy_seconds_total": "Seconds each stage's executor spent in its runs (on a device: launching them)",
    "dvabatch_stage_device_seconds_total": "Seconds each stage's runs took on its device (from events around each run; 0 on the CPU)",
}
_OPERATIONS = ("new", "stretch", "split", "early_exits", "stretch_refused", "split_refused", "policy_errors")
# queries answered without running, by reason (runtime/admission.py), and cancelled after they started
_REFUSALS = {"queue_full": "queue_full", "timeout": "timed_out", "cancelled": "cancelled", "slo": "slo_rejected",
             "cancelled_in_flight": "cancelled_in_flight"}


class StageMetrics:
    def __init__(self, scheduler: Pipeline, model: str, period: float = 0.25,
                 device_calls: bool = False) -> None:
        """`device_calls`: the model runs on a device, where `execute` may hand calls to the engine
        loop (`dvabatch_device_calls_total`)."""
        self._scheduler = scheduler
        self._device_calls = device_calls
        self._model = model
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
        queued = pb_utils.MetricFamily(name="dvabatch_queued_queries", kind=gauge,
                                       description="Queries admitted and not yet taken by stage 0 (bounded by max_queue_size)")
        refused = pb_utils.MetricFamily(name="dvabatch_refused_queries_total", kind=counter,
                                        description="Queries answered without running, by reason; cancelled_in_flight ran anyway")
        goodput = pb_utils.MetricFamily(name="dvabatch_goodput_queries_total", kind=counter,
                                        description="Queries answered with their result within the latency target (slo_ms; every result without one)")
        whole = pb_utils.MetricFamily(name="dvabatch_whole_model_queries_total", kind=counter,
                                     description="Queries whose batch ran the unsliced model (the one-stage route: a batch that met nobody)")
        whole_batches = pb_utils.MetricFamily(name="dvabatch_whole_model_batches_total", kind=counter,
                                             description="Batches that ran the unsliced model (rows of the batch table like any other)")
        whole_device = pb_utils.MetricFamily(name="dvabatch_whole_model_device_seconds_total", kind=counter,
                                            description="Seconds the unsliced model took on its device (events around each run; 0 on the CPU)")
        self._whole_device = whole_device.Metric(labels={"model": model})
        drains = pb_utils.MetricFamily(name="dvabatch_caller_drains_total", kind=counter,
                                       description="Requests refused unread because they waited in Triton's queue past the bound")
        self._drains = drains.Metric(labels={"model": model})
        steps = pb_utils.MetricFamily(name="dvabatch_loop_steps_total", kind=counter,
                                      description="Steps of the engine loop (completions read, the batch window, launches)")
        step_seconds = pb_utils.MetricFamily(name="dvabatch_loop_step_seconds_total", kind=counter,
                                             description="Host seconds the engine loop's steps took (launches run on its thread included)")
        self._steps, self._step_seconds = steps.Metric(labels={"model": model}), step_seconds.Metric(labels={"model": model})
        tabled = pb_utils.MetricFamily(name="dvabatch_table_answered_queries_total", kind=counter,
                                       description="Queries answered with their result from a batch that was a row of the "
                                                   "batch table (every result: the served path is the table's)")
        self._tabled = tabled.Metric(labels={"model": model})
        self._whole = whole.Metric(labels={"model": model})
        self._whole_batches = whole_batches.Metric(labels={"model": model})
        self._queued = queued.Metric(labels={"model": model})
        self._refused = {reason: refused.Metric(labels={"model": model, "reason": reason}) for reason in _REFUSALS}
        self._goodput = goodput.Metric(labels={"model": model})
        self._families = [*families.values(), queue, ops, queued, refused, goodput, whole, whole_batches, whole_device,
                          drains, steps, step_seconds, tabled]  # alive while reporting
        if device_calls:
            calls = pb_utils.MetricFamily(name="dvabatch_device_calls_total", kind=counter,
                                          description="execute calls where the model runs on a device: handed to the engine "
                                                      "loop (handed), or run by execute itself (here; Pipeline.hands_over)")
            self._calls = {path: calls.Metric(labels={"model": model, "path": path}) for path in ("handed", "here")}
            self._families.append(calls)
        self._last: dict[tuple[str, int], float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dvabatch-metrics", daemon=True)
        self._thread.start()

    def loaded(self, seconds: float, device_bytes: int | None) -> None:
        """The model's load (its engines made, graphs captured, stages re-profiled where it serves
        elsewhere than it was profiled) and the device memory it took, as gauges."""
        gauge = pb_utils.MetricFamily.GAUGE
        load = pb_utils.MetricFamily(name="dvabatch_load_seconds", kind=gauge,
                                     description="Seconds the model took to load (engines, CUDA graphs, re-profiling)")
        memory = pb_utils.MetricFamily(name="dvabatch_device_memory_bytes", kind=gauge,
                                       description="Device memory the model's process took at load (torch's reserved; absent on the CPU)")
        self._families += [load, memory]
        self._loaded = [load.Metric(labels={"model": self._model})]  # alive while reporting
        self._loaded[0].set(seconds)
        if device_bytes is not None:
            self._loaded.append(memory.Metric(labels={"model": self._model}))
            self._loaded[1].set(device_bytes)

    def _loop(self) -> None:
        while not self._stop.wait(self._period):
            self.sample()

    def sample(self) -> None:
        """Copy what changed since the last sample: each metric update is a round trip to the server,
        on the channel the answers take, so unchanged ones are not sent."""
        stats, queues = self._scheduler.observe()
        for k, stage in enumerate(stats.stages):
            self._add("dvabatch_stage_batches_total", k, stage.batches)
            self._add("dvabatch_stage_rows_total", k, stage.rows)
            self._add("dvabatch_stage_busy_seconds_total", k, stage.busy_seconds)
            self._add("dvabatch_stage_device_seconds_total", k, stage.device_seconds)
            self._set(self._queues[k], ("queue", k), queues[k])
        for op, metric in self._ops.items():
            self._increment(metric, op, getattr(stats, op))
        for reason, metric in self._refused.items():
            self._increment(metric, reason, getattr(stats, _REFUSALS[reason]))
        self._increment(self._goodput, "within_slo", stats.within_slo)
        self._increment(self._whole, "whole_rows", stats.whole_rows)
        self._increment(self._whole_batches, "whole_runs", stats.whole_runs)
        self._increment(self._whole_device, "whole_device_seconds", stats.whole_device_seconds)
        self._increment(self._drains, "caller_drains", stats.caller_drains)
        self._increment(self._steps, "loop_steps", stats.loop_steps)
        self._increment(self._tabled, "table_answered", stats.table_answered)
        self._increment(self._step_seconds, "loop_step_seconds", stats.loop_step_seconds)
        self._set(self._queued, ("queued", -1), stats.queued)
        if self._device_calls:
            self._increment(self._calls["handed"], "calls_handed", stats.calls_handed_over)
            self._increment(self._calls["here"], "calls_here", stats.calls_run_here)

    def _increment(self, metric: object, key: str, total: float) -> None:
        self._counter(metric, (key, -1), total)

    def _add(self, name: str, stage: int, total: float) -> None:
        self._counter(self._per_stage[name][stage], (name, stage), total)

    def _counter(self, metric: object, key: tuple[str, int], total: float) -> None:
        delta = total - self._last.get(key, 0)
        if delta:
            metric.increment(delta)  # type: ignore[attr-defined]
            self._last[key] = total

    def _set(self, metric: object, key: tuple[str, int], value: float) -> None:
        if self._last.get(key) != value:
            metric.set(value)  # type: ignore[attr-defined]
            self._last[key] = value

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()
