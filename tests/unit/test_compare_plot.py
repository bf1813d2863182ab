"""`perf.compare.plot` draws the comparison from plain figures (no server): a PNG that reads back;
and `tools.progress.StepProgress` on a stream that is not a terminal writes one counted line per step
with the time left."""
from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest

from dvabatch_backend.tools.progress import StepProgress
from perf.compare.plot import Curve, LoadPoint, colour_of, plot_latency

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def synthetic_curves() -> list[Curve]:
    """Three systems at two loads (queries/s, with the fraction of a peak) and their lone query."""
    def points(mean: tuple[float, float], p99: tuple[float, float]) -> list[LoadPoint]:
        return [LoadPoint(50.0, mean[0], p99[0], 0.5), LoadPoint(90.0, mean[1], p99[1], 0.9)]

    return [Curve("DVABatch", points((6.0, 9.0), (14.0, 25.0)), lone_mean_ms=4.0, lone_p99_ms=5.5),
            Curve("ZeroBatch", points((7.0, 15.0), (18.0, 60.0)), lone_mean_ms=3.9, lone_p99_ms=5.0),
            Curve("DelayBatch", points((8.0, 12.0), (16.0, 40.0)), lone_mean_ms=5.0, lone_p99_ms=6.0)]


def test_plot_writes_a_png_that_reads_back(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    path = plot_latency(synthetic_curves(), tmp_path / "out" / "latency.png",
                        x_label="offered load (queries/s; fraction of ZeroBatch's peak)", title="synthetic")
    assert path == tmp_path / "out" / "latency.png" and path.is_file()
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    image = imread(path)
    assert image.shape[1] > 500 and image.shape[0] > 200


def test_plot_takes_missing_figures_and_draws_nothing_without_any(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    partial = [Curve("DVABatch", [LoadPoint(1.0, None, 3.0), LoadPoint(2.0, 2.0, None)]),
               Curve("ZeroBatch", [], lone_mean_ms=1.0)]
    assert plot_latency(partial, tmp_path / "partial.png") == tmp_path / "partial.png"
    assert plot_latency([Curve("DVABatch", [LoadPoint(1.0, None, None)])], tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()


def test_plot_returns_none_without_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.split(".")[0] == "matplotlib":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert plot_latency(synthetic_curves(), tmp_path / "latency.png") is None
    assert not (tmp_path / "latency.png").exists()


def test_each_system_keeps_its_colour() -> None:
    assert colour_of("ZeroBatch", set()) == colour_of("ZeroBatch", {colour_of("DVABatch", set())})
    assert colour_of("DelayBatch-2ms", set()) == colour_of("DelayBatch", set())
    taken = {colour_of("DelayBatch", set())}
    assert colour_of("DelayBatch-4ms", taken) not in taken


def test_step_progress_off_a_terminal_writes_a_counted_line_per_step() -> None:
    stream = io.StringIO()
    progress = StepProgress("compare", stream)
    progress.expect(4)
    progress("ZeroBatch peak")
    progress("DVABatch lone queries")
    progress.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    assert "step 1 of 4" in lines[0] and "ZeroBatch peak" in lines[0]
    # each message says what begins: the time left is known once a step is done, from the second on
    assert "step 2 of 4" in lines[1] and "left" in lines[1] and "DVABatch lone queries" in lines[1]
    assert "left" in stream.getvalue()


def test_perf_analyzers_results_become_curves_without_the_bursty_load_or_the_overhead_variants() -> None:
    from perf.compare import by_perf_analyzer as pa

    def system(label: str, scale: float) -> pa.SystemResult:
        loads = {key: {"rate": rate, "mean_ms": scale * rate / 10, "p99_ms": scale * rate / 4}
                 for key, rate in (("0.5x", 20.0), ("0.9x", 36.0), ("0.5x gamma4", 20.0))}
        return pa.SystemResult(label, label.lower(), c1_mean_ms=scale, c1_p99_ms=2 * scale, loads=loads)

    curves = pa.curves([system(pa.DVA, 1.0), system(pa.ZERO, 1.5), system(pa.DELAY, 2.0),
                        pa.SystemResult(pa.ECHO, "echo", c1_mean_ms=0.5)], pa.FIXED_LOADS)
    assert [c.label for c in curves] == [pa.DVA, pa.ZERO, pa.DELAY]
    for curve in curves:
        assert [(p.load, p.fraction) for p in curve.points] == [(20.0, 0.5), (36.0, 0.9)]
        assert curve.lone_mean_ms is not None and curve.lone_p99_ms == 2 * curve.lone_mean_ms


def test_own_drivers_rows_become_curves(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from perf.compare import by_own_driver as own

    def figures(mean: float, p99: float) -> dict[str, float]:
        return {"latency_mean_ms": mean, "latency_p99_ms": p99}

    rows = [SimpleNamespace(fraction=f, rate=100.0 * f, dva_summary=figures(f, 2 * f), zero_summary=figures(3 * f, 5 * f))
            for f in own.LOADS]
    lone = {"dva": SimpleNamespace(summary=lambda: figures(0.5, 0.7)),
            "zero": SimpleNamespace(summary=lambda: figures(0.4, 0.6))}
    dva, zero = own.curves(rows, lone, "dva", "zero")  # type: ignore[arg-type]
    assert (dva.label, zero.label) == ("DVABatch", "ZeroBatch")
    assert [(p.load, p.mean_ms, p.p99_ms, p.fraction) for p in zero.points] == [
        (100.0 * f, 3 * f, 5 * f, f) for f in own.LOADS]
    assert (dva.lone_mean_ms, dva.lone_p99_ms, zero.lone_mean_ms) == (0.5, 0.7, 0.4)
