"""PNG plots of `perf.paper.experiments` results (matplotlib, headless).

`plot(results, path)` draws the experiment's figure, one panel per model (three to a row):
- figure14, figure18, figure19: mean (solid) and p99 (dashed) latency versus offered load;
- figure15: every query's latency over the stepping load, the rate on a second axis;
- figure20: closed-loop peak throughput per configuration, its mean latency on a second axis;
- figure21: closed-loop mean latency at concurrency 1 per system.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from perf.compare.plot import Curve, LoadPoint, draw_latency

__all__ = ["plot"]


def plot(results: Mapping[str, Any], path: Path) -> Path | None:
    """Write the experiment's figure to `path`; None when there is nothing to draw."""
    # a Figure of its own, not pyplot's: no backend chosen for the process, no figure kept open
    from matplotlib.figure import Figure

    models = list(results.get("models", {}))
    draw = _DRAWERS.get(str(results.get("experiment")))
    if not models or draw is None:
        return None
    cols = min(len(models), 3)
    rows = -(-len(models) // cols)
    fig = Figure(figsize=(5 * cols, 4 * rows))
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax, model in zip(axes.flat, models):
        draw(ax, results["models"][model])
        ax.set_title(f"{model} ({results['experiment']})")
    for ax in list(axes.flat)[len(models):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return Path(path)


def _latency_vs_load(ax: Any, entry: Mapping[str, Any]) -> None:
    """Each system's mean and p99 against the offered load (`perf.compare.plot.draw_latency`)."""
    loads = entry.get("loads", [])
    curves = [Curve(label, [LoadPoint(level["rate_qps"], level["systems"][label].get("latency_mean_ms"),
                                      level["systems"][label].get("latency_p99_ms"), level.get("fraction"))
                            for level in loads])
              for label in (loads[0]["systems"] if loads else [])]
    ax.legend(handles=draw_latency(ax, curves, "offered load (qps)"), fontsize=7)


def _stepping(ax: Any, entry: Mapping[str, Any]) -> None:
    for i, (label, s) in enumerate(entry.get("stepping", {}).items()):
        latency = np.array([np.nan if v is None else v for v in s["latency_ms"]], dtype=float)
        ax.plot(np.arange(latency.size), latency, ".", markersize=2, color=f"C{i}",
                label=f"{label} (peak {s['peak_load_qps'] or 0:.0f} qps)")
    ax.set_xlabel("query id (issue order)")
    ax.set_ylabel("latency (ms)")
    ax.set_yscale("log")
    ax.legend(fontsize=7, loc="upper left", markerscale=4)
    rate_ax = ax.twinx()
    rate_ax.plot(entry.get("rates_qps", []), color="black", linewidth=1)
    rate_ax.set_ylabel("load (qps)")


def _peaks(ax: Any, entry: Mapping[str, Any]) -> None:
    peaks = entry.get("peaks", {})
    labels = list(peaks)
    x = np.arange(len(labels))
    ax.bar(x, [peaks[label].get("throughput_qps") or 0.0 for label in labels], color="C0")
    ax.set_xticks(x, labels, rotation=20, fontsize=8)
    ax.set_ylabel("peak throughput (qps)")
    latency_ax = ax.twinx()
    latency_ax.plot(x, [peaks[label].get("latency_mean_ms") or np.nan for label in labels], "o-", color="C3")
    latency_ax.set_ylabel("mean latency (ms)", color="C3")


def _closed_loop(ax: Any, entry: Mapping[str, Any]) -> None:
    stats = entry.get("closed_loop", {})
    labels = list(stats)
    x = np.arange(len(labels))
    ax.bar(x, [stats[label]["latency_mean_ms"] for label in labels], color=[f"C{i}" for i in range(len(labels))])
    ax.set_xticks(x, labels)
    ax.set_ylabel("mean latency at concurrency 1 (ms)")


_DRAWERS: dict[str, Callable[[Any, Mapping[str, Any]], None]] = {
    "figure14": _latency_vs_load, "figure18": _latency_vs_load, "figure19": _latency_vs_load,
    "figure15": _stepping, "figure20": _peaks, "figure21": _closed_loop}
