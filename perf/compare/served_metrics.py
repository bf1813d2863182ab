"""Batch sizes as served, read from the server's Prometheus metrics between two moments.

Triton counts, per model, the queries it answered (`nv_inference_count`) and the executions that
ran them (`nv_inference_exec_count`): for a baseline their ratio is the batcher's mean batch. The
dvabatch adapter adds per stage the batches and rows each stage ran (`dvabatch_stage_*`), the
runs of the unsliced model, the batch table's answers and the meta operations (triton_adapter/metrics.py). `scrape` reads
one snapshot, `batch_report` turns two snapshots into each model's figures.
"""
from __future__ import annotations

import re
import urllib.request
from collections.abc import Mapping
from typing import Any

Snapshot = dict[tuple[str, str, str], float]  # (metric, model, the other labels) -> value
_LINE = re.compile(r'^(\w+)\{(.*)\} ([0-9.eE+-]+|NaN)$')
_LABEL = re.compile(r'(\w+)="([^"]*)"')
ADAPTER_SAMPLE_S = 0.25  # the adapter copies its counters to the server this often


def scrape(url: str, timeout: float = 5.0) -> Snapshot:
    """Every labelled sample of the metrics page that names a model."""
    text = urllib.request.urlopen(url, timeout=timeout).read().decode()
    return parse(text)


def parse(text: str) -> Snapshot:
    found: Snapshot = {}
    for line in text.splitlines():
        match = _LINE.match(line)
        if not match:
            continue
        labels = dict(_LABEL.findall(match.group(2)))
        model = labels.pop("model", None)
        if model is None:
            continue
        others = ",".join(f"{k}={v}" for k, v in sorted(labels.items()) if k != "version")
        found[(match.group(1), model, others)] = float(match.group(3))
    return found


def _delta(before: Snapshot, after: Snapshot, metric: str, model: str) -> dict[str, float]:
    return {labels: value - before.get((name, m, labels), 0.0)
            for (name, m, labels), value in after.items() if name == metric and m == model}


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 2) if b else None


def batch_report(before: Snapshot, after: Snapshot, model: str) -> dict[str, Any]:
    """What `model` ran between the snapshots: queries and executions (Triton's), the mean batch
    of an execution; and for a dvabatch model each stage's mean batch, the inline runs and their
    mean batch, the share of answers whose batch was a row of the batch table, and the meta
    operations."""
    queries = sum(_delta(before, after, "nv_inference_count", model).values())
    executions = sum(_delta(before, after, "nv_inference_exec_count", model).values())
    report: dict[str, Any] = {"queries": queries, "executions": executions,
                              "mean_execution_batch": _ratio(queries, executions)}
    batches = _delta(before, after, "dvabatch_stage_batches_total", model)
    if batches:
        rows = _delta(before, after, "dvabatch_stage_rows_total", model)
        report["stage_batches"] = {k: batches[k] for k in sorted(batches)}
        report["stage_mean_batch"] = {k: _ratio(rows.get(k, 0.0), batches[k]) for k in sorted(batches)}
        # the fast path's, where a checkout from before the one batch table serves (perf.compare.before_after)
        inline = sum(_delta(before, after, "dvabatch_fast_path_batches_total", model).values())
        inline_queries = sum(_delta(before, after, "dvabatch_fast_path_queries_total", model).values())
        whole = sum(_delta(before, after, "dvabatch_whole_model_batches_total", model).values())
        whole_queries = sum(_delta(before, after, "dvabatch_whole_model_queries_total", model).values())
        report["inline_runs"], report["inline_mean_batch"] = inline, _ratio(inline_queries, inline)
        report["whole_model_runs"], report["whole_model_mean_batch"] = whole, _ratio(whole_queries, whole)
        tabled = sum(_delta(before, after, "dvabatch_table_answered_queries_total", model).values())
        report["table_answered"] = tabled  # answers whose batch was a row of the batch table
        report["table_share"] = _ratio(tabled, tabled + inline_queries)
        report["loop_steps"] = sum(_delta(before, after, "dvabatch_loop_steps_total", model).values())
        report["meta_operations"] = {k: v for k, v in _delta(before, after, "dvabatch_meta_operations_total", model).items()
                                     if v}
        calls = _delta(before, after, "dvabatch_device_calls_total", model)
        if calls:  # the hand-off's calls, by path (labels "path=handed", "path=here")
            report["device_calls"] = {k.split("=", 1)[-1]: v for k, v in sorted(calls.items())}
    return report


def batch_reports(before: Snapshot, after: Snapshot, models: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """{label: batch_report} for each of `models` ({label: model name})."""
    return {label: batch_report(before, after, model) for label, model in models.items()}
