"""`write_stage_plot` draws `stages.png` from what a manifest records: a readable PNG, wide enough to
read, for a model with a length and several candidates, and for a fixed-shape model with one."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dvabatch_backend.runtime.manifest import Manifest
from slicer.plots import write_stage_plot

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
BATCH_SIZES = (1, 2, 4, 8)


@dataclass
class FakeCandidate:
    stages: int
    throughput: float | None
    balance: float = 1.0
    seconds: float = 0.0


def _tensor(name: str, dims: list[Any]) -> dict[str, Any]:
    return {"name": name, "dtype": "float32", "dims": dims}


def _times(num_stages: int, scale: float) -> list[dict[str, float]]:
    """Made-up stage times, growing with the batch and the stage index (no measurement involved)."""
    return [{str(bs): scale * (k + 1) * (1.0 + 0.5 * bs) * 1e-4 for bs in BATCH_SIZES} for k in range(num_stages)]


def _manifest(num_stages: int, with_length: bool, **extra: Any) -> Manifest:
    """A minimal valid manifest of `num_stages` chained stages, with stage times in its extras."""
    dims = ["batch", "seq", 4] if with_length else ["batch", 4]
    names = ["x"] + [f"t{k}" for k in range(1, num_stages)] + ["y"]
    stages = [{"file": f"stage{k}.onnx", "inputs": [_tensor(names[k], dims)], "outputs": [_tensor(names[k + 1], dims)]}
              for k in range(num_stages)]
    doc: dict[str, Any] = {
        "schema_version": 1, "name": "toy", "max_batch_size": max(BATCH_SIZES), "max_length": 32 if with_length else 0,
        "inputs": [_tensor("x", dims)], "outputs": [_tensor("y", dims)], "stages": stages,
        "stage_times": _times(num_stages, 4.0),
    }
    if with_length:
        doc["stage_times_by_length"] = {str(n): _times(num_stages, n / 8) for n in (8, 16, 32)}
    doc.update(extra)
    return Manifest.from_json(doc)


def _assert_png(path: Path | None, folder: Path) -> None:
    image = pytest.importorskip("matplotlib.image")
    assert path == folder / "stages.png"
    assert path.is_file()
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    pixels = image.imread(str(path))
    assert pixels.shape[1] > 500


def test_plot_with_lengths_and_candidates(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    manifest = _manifest(2, with_length=True)
    assert manifest.stage_times_by_length()  # the length panel has something to draw
    candidates = [FakeCandidate(1, 120.0, 1.0), FakeCandidate(2, 180.0, 1.1)]
    _assert_png(write_stage_plot(tmp_path, manifest, candidates), tmp_path)


def test_plot_fixed_shape_one_candidate(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    manifest = _manifest(1, with_length=False,
                         slicing={"stage_count": {"chosen": 1, "why": "asked for (--stages)"}})
    assert manifest.stage_times_by_length() == {}
    _assert_png(write_stage_plot(tmp_path, manifest, [FakeCandidate(1, None)]), tmp_path)


def test_no_matplotlib_returns_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins
    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert write_stage_plot(tmp_path, _manifest(1, with_length=False), []) is None
    assert not (tmp_path / "stages.png").exists()
