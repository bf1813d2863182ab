"""The comparison as a picture: each system's mean and p99 latency against the offered load.

    from perf.compare.plot import Curve, LoadPoint, plot_latency
    plot_latency([Curve("DVABatch", [LoadPoint(120.0, 8.1, 19.0, 0.5), ...], lone_mean_ms=4.2), ...],
                 Path("work/compare/minilm/latency.png"), x_label="offered load (queries/s)")

One colour per system (DVABatch, ZeroBatch, DelayBatch keep theirs from one figure to the next; any
other system takes the next free colour), its mean a solid line and its p99 a dashed one over the
loads, and its lone query (concurrency 1: one query at a time, no load to speak of) as points at the
left edge, above the tick "lone query". The figures come from a driver's results as plain
dataclasses, so the picture is drawn (and tested) without a server. matplotlib is optional: without
it `plot_latency` draws nothing and returns None.
"""
from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

FILE_NAME = "latency.png"
# a system keeps its colour whichever others are drawn beside it (matplotlib's default cycle)
COLOURS = {"DVABatch": "tab:blue", "ZeroBatch": "tab:orange", "DelayBatch": "tab:green"}
SPARE_COLOURS = ("tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:gray")
# the y axis turns logarithmic when the highest figure is this many times the lowest: a p99 under
# heavy load would otherwise flatten the lone query and the light load into the bottom edge
LOG_SCALE_SPAN = 20.0
WRAP = 110  # characters of a title or axis label line: about the axes' width at their font size
LONE_DODGE = 0.015  # the lone queries' spacing around x = 0, as a fraction of the highest load


@dataclass(frozen=True)
class LoadPoint:
    """One system at one offered load: `load` in the figure's x unit (queries/s, or a fraction of a
    baseline's peak), its mean and p99 latency in ms (None: not measured), and optionally what
    fraction of the reference rate `load` is (shown under the tick)."""

    load: float
    mean_ms: float | None
    p99_ms: float | None
    fraction: float | None = None


@dataclass
class Curve:
    """One system's figures: its loads, and its lone query (concurrency 1) mean and p99 in ms."""

    label: str
    points: list[LoadPoint] = field(default_factory=list)
    lone_mean_ms: float | None = None
    lone_p99_ms: float | None = None


def colour_of(label: str, taken: set[str]) -> str:
    """A system's colour: its own for the three named systems (a variant such as "DelayBatch-2ms"
    takes its family's when that is free), else the first spare one nobody took."""
    family = label.split("-")[0]
    for name in (label, family):
        if name in COLOURS and COLOURS[name] not in taken:
            return COLOURS[name]
    return next((c for c in SPARE_COLOURS if c not in taken), "black")


def _finite(value: float | None) -> TypeGuard[float]:
    """A figure that can be drawn on a latency axis (measured, finite, above zero)."""
    return value is not None and math.isfinite(value) and value > 0


def plot_latency(curves: Sequence[Curve], path: Path, x_label: str = "offered load (queries/s)",
                 title: str | None = None) -> Path | None:
    """`draw_latency` on a figure of its own, the legend beside the axes, written as a PNG to `path`
    (its folder made if needed); returns it. None, drawing nothing, when matplotlib is not installed
    or nothing was measured."""
    try:
        # a Figure of its own, not pyplot's: no backend chosen for the process, no figure kept open
        from matplotlib.figure import Figure
    except ImportError:
        return None
    if not _measured(curves):
        return None
    figure = Figure(figsize=(9.0, 5.6), dpi=120)
    axes = figure.subplots()
    handles = draw_latency(axes, curves, x_label)
    if title:
        axes.set_title("\n".join(textwrap.wrap(title, WRAP)), fontsize=11)
    # beside the axes, not on them: no line or point of any system is hidden under it
    axes.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", bbox_inches="tight")
    return path


def _measured(curves: Sequence[Curve]) -> list[float]:
    """Every figure of `curves` that can be drawn."""
    return [v for c in curves for v in (c.lone_mean_ms, c.lone_p99_ms, *(x for p in c.points for x in (p.mean_ms, p.p99_ms)))
            if _finite(v)]


def draw_latency(axes: Any, curves: Sequence[Curve], x_label: str = "offered load (queries/s)") -> list[Any]:
    """On `axes` (matplotlib's): mean (solid) and p99 (dashed) latency in ms against the offered
    load, one colour per system in `curves`, each system's lone query (concurrency 1) as points at
    x = 0 labelled "lone query" (mean filled, p99 hollow; the systems side by side). Returns the
    legend's handles, for the caller to place; draws nothing where nothing was measured."""
    from matplotlib.lines import Line2D

    values = _measured(curves)
    if not values:
        return []
    taken: set[str] = set()
    handles: list[Any] = []
    ticks: dict[float, str] = {}
    right = max((p.load for c in curves for p in c.points), default=1.0) or 1.0
    for i, curve in enumerate(curves):
        colour = colour_of(curve.label, taken)
        taken.add(colour)
        points = sorted(curve.points, key=lambda p: p.load)
        for stat, style in (("mean_ms", "-"), ("p99_ms", "--")):
            xy: list[tuple[float, float]] = [(p.load, v) for p in points if _finite(v := getattr(p, stat))]
            if xy:
                axes.plot([x for x, _ in xy], [y for _, y in xy], linestyle=style, marker="o", markersize=4, color=colour, linewidth=1.8)
        for p in points:
            ticks.setdefault(p.load, f"{p.load:.4g}" + (f"\n({p.fraction:g}x)" if p.fraction is not None else ""))
        # the systems' lone queries side by side around x = 0: their figures are often within a
        # marker's height of each other, and one would hide the next
        lone_x = (i - (len(curves) - 1) / 2) * LONE_DODGE * right
        if _finite(curve.lone_mean_ms):
            axes.plot([lone_x], [curve.lone_mean_ms], marker="D", markersize=7, color=colour, linestyle="none")
        if _finite(curve.lone_p99_ms):
            axes.plot([lone_x], [curve.lone_p99_ms], marker="D", markersize=7, markerfacecolor="white",
                      markeredgecolor=colour, linestyle="none")
        handles.append(Line2D([], [], color=colour, linewidth=3, label=curve.label))
    handles += [Line2D([], [], color="black", linestyle="-", label="mean"),
                Line2D([], [], color="black", linestyle="--", label="p99")]
    lone = any(_finite(c.lone_mean_ms) or _finite(c.lone_p99_ms) for c in curves)
    if lone:
        ticks[0.0] = "lone\nquery"
        handles += [Line2D([], [], color="black", marker="D", linestyle="none", label="lone query (concurrency 1), mean"),
                    Line2D([], [], color="black", marker="D", markerfacecolor="white", linestyle="none",
                           label="lone query (concurrency 1), p99")]
    axes.set_xticks(sorted(ticks), [ticks[x] for x in sorted(ticks)])
    axes.set_xlim(-0.08 * right if lone else 0.0, 1.08 * right)
    logarithmic = max(values) / min(values) > LOG_SCALE_SPAN
    if logarithmic:
        from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

        axes.set_yscale("log")
        # plain milliseconds at 1, 2 and 5 of each decade: powers of ten alone are too few to read by
        axes.yaxis.set_major_locator(LogLocator(base=10.0, subs=(1.0, 2.0, 5.0)))
        axes.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        axes.yaxis.set_minor_locator(NullLocator())
    else:
        axes.set_ylim(bottom=0.0)  # heights read as latencies, not as differences
    axes.set_ylabel("latency (ms" + (", log scale)" if logarithmic else ")"))
    axes.set_xlabel("\n".join(textwrap.wrap(x_label, WRAP)))
    axes.grid(True, which="major", alpha=0.3)
    return handles


def written_line(written: Path | None, wanted: Path) -> str:
    """What a command's output says of its plot: where it was written (relative to the working
    folder when under it), or why there is none."""
    if written is None:
        return f"no plot in {wanted}: matplotlib is not installed (pip install matplotlib), or nothing was measured"
    try:
        shown = written.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        shown = written
    return f"wrote {shown}"
