"""The slicer's picture of a sliced model: `stages.png` in the version folder, beside the manifest.

It shows what the manifest records about the stages, so a reader sees at a glance how balanced the
cut is, how each stage grows with the batch (and with the length), and why this stage count won.
matplotlib is imported only when a picture is drawn: the slicer imports fast without it, and a
missing matplotlib costs the picture, never the slice.
"""
from __future__ import annotations

import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from dvabatch_backend.runtime.manifest import Manifest

if TYPE_CHECKING:
    from .slice_model import Candidate

PLOT_FILE = "stages.png"
FIGURE_INCHES = (12.0, 3.5)
FIGURE_DPI = 100


def write_stage_plot(version_dir: Path, manifest: Manifest, candidates: Sequence["Candidate"]) -> Path | None:
    """Draw `version_dir / stages.png` and return its path; None when matplotlib cannot be imported.

    The panels, left to right: each stage's profiled time (ms) against batch size, one line per stage,
    on a log-2 axis, at the length the manifest's `stage_times` were taken; for a model with a length,
    each stage's time at the largest profiled batch size against length; and, where the slicer had two
    or more stage counts to choose from, each candidate's served queries/s with the chosen count
    highlighted (else a note that the count was asked for or had no alternative). A manifest without a
    profile still gets a picture, with a note where the times would be.
    """
    try:
        # a Figure of its own, not pyplot's: no backend chosen for the process, no figure kept open
        from matplotlib.figure import Figure
    except ImportError:
        return None

    by_batch = manifest.stage_times()
    by_length = manifest.stage_times_by_length()
    batch_sizes = sorted({bs for stage in by_batch for bs in stage})
    bs_max = batch_sizes[-1] if batch_sizes else manifest.max_batch_size
    panels = 3 if by_length else 2
    fig = Figure(figsize=FIGURE_INCHES, dpi=FIGURE_DPI)
    axes = fig.subplots(1, panels, gridspec_kw={"width_ratios": [1.2] * (panels - 1) + [1.0]})
    _batch_panel(axes[0], by_batch, batch_sizes, _reference_length(manifest, by_length))
    if by_length:
        _length_panel(axes[1], by_length, bs_max)
    _candidates_panel(axes[-1], manifest, candidates)
    fig.suptitle(f"{manifest.name}: {manifest.num_stages} stage(s), bs_max {bs_max}", fontsize=11)
    fig.tight_layout()
    path = Path(version_dir) / PLOT_FILE
    fig.savefig(path, dpi=FIGURE_DPI)
    return path


def _reference_length(manifest: Manifest, by_length: dict[int, Any]) -> int | None:
    """The length `stage_times` were taken at (the slicer's reference), None for a fixed-shape model."""
    if not manifest.has_seq:
        return None
    slicing = manifest.extra.get("slicing")
    reference = slicing.get("reference") if isinstance(slicing, dict) else None
    length = reference.get("length") if isinstance(reference, dict) else None
    if isinstance(length, int) and not isinstance(length, bool) and length > 0:
        return length
    return max(by_length) if by_length else manifest.max_length


def _batch_panel(ax: Any, by_batch: Sequence[dict[int, float]], batch_sizes: list[int], length: int | None) -> None:
    """Each stage's time against batch size; the profiled sizes are the ticks, written out in full."""
    from matplotlib.ticker import FixedLocator, NullLocator
    where = f" at length {length}" if length is not None else ""
    ax.set_title(f"stage time vs batch size{where}", fontsize=9)
    if not batch_sizes:
        _note(ax, "no stage times in the manifest")
        return
    for k, stage in enumerate(by_batch):
        sizes = sorted(stage)
        ax.plot(sizes, [stage[bs] * 1e3 for bs in sizes], marker="o", markersize=3, label=f"stage {k}")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(batch_sizes))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([str(bs) for bs in batch_sizes], fontsize=8)
    ax.set_xlabel("batch size", fontsize=8)
    ax.set_ylabel("ms", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    _legend(ax, len(by_batch))


def _length_panel(ax: Any, by_length: dict[int, Sequence[dict[int, float]]], bs_max: int) -> None:
    """Each stage's time at the largest profiled batch size against length (where it was profiled)."""
    ax.set_title(f"stage time vs length at batch {bs_max}", fontsize=9)
    lengths = sorted(by_length)
    stages = max(len(v) for v in by_length.values())
    for k in range(stages):
        points = [(n, by_length[n][k][bs_max]) for n in lengths if k < len(by_length[n]) and bs_max in by_length[n][k]]
        if points:
            ax.plot([n for n, _ in points], [t * 1e3 for _, t in points], marker="o", markersize=3, label=f"stage {k}")
    ax.set_xlabel("length", fontsize=8)
    ax.set_ylabel("ms", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    _legend(ax, stages)


def _candidates_panel(ax: Any, manifest: Manifest, candidates: Sequence["Candidate"]) -> None:
    """A bar per stage count tried, its served queries/s; the chosen count in a strong colour."""
    ax.set_title("stage-count candidates", fontsize=9)
    measured = sorted(((c.stages, c.throughput) for c in candidates if c.throughput is not None), key=lambda x: x[0])
    if len(candidates) < 2 or not measured:
        _note(ax, f"{manifest.num_stages} stage(s): {_why_no_choice(manifest, candidates)}")
        return
    counts = [n for n, _ in measured]
    rates = [q for _, q in measured]
    colours = ["tab:orange" if n == manifest.num_stages else "tab:gray" for n in counts]
    bars = ax.bar([str(n) for n in counts], rates, color=colours)
    for bar, rate in zip(bars, rates):
        ax.annotate(f"{rate:.0f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                    va="bottom", fontsize=7)
    ax.set_xlabel("stages (chosen in orange)", fontsize=8)
    ax.set_ylabel("queries/s as served", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.set_ylim(0, max(rates) * 1.15 or 1.0)  # room for the figures above the bars
    ax.grid(True, axis="y", alpha=0.3)


def _why_no_choice(manifest: Manifest, candidates: Sequence["Candidate"]) -> str:
    """Why there is no comparison to draw: the count was asked for, or nothing else could be cut."""
    slicing = manifest.extra.get("slicing")
    record = slicing.get("stage_count") if isinstance(slicing, dict) else None
    why = record.get("why") if isinstance(record, dict) else None
    if isinstance(why, str) and len(candidates) < 2:
        return why
    if len(candidates) < 2:
        return "the stage count was given or had no alternative"
    return "the candidates were not measured as served"


def _note(ax: Any, text: str) -> None:
    """A short text in place of a plot; wrapped so it stays inside a narrow panel."""
    ax.text(0.5, 0.5, textwrap.fill(text, 40), ha="center", va="center", fontsize=9, transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_frame_on(False)


def _legend(ax: Any, lines: int) -> None:
    """A legend small enough to leave the lines visible; more columns when there are many stages."""
    if lines:
        ax.legend(fontsize=7, ncol=1 if lines <= 4 else 2, loc="upper left", frameon=False)
