"""Every `python -m perf....` command that no other test runs, run at its smallest size: it finishes,
exits 0 and prints its table. No figure is asserted (figures are the benchmarks' business)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from perf.costs import large_model, overhead, served_profile, thread_pool
from perf.paper import operator_diversity
from perf.reliability import overload

from ..triton_support import slice_zoo_model


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return slice_zoo_model(tmp_path_factory.mktemp("sliced"), "bert", stages=2).version_dir.parent


def test_overhead_quick(capsys: pytest.CaptureFixture[str]) -> None:
    assert overhead.main(["--quick", "--no-breakdown"]) in (0, None)
    assert "overhead" in capsys.readouterr().out.lower()


def test_thread_pool(bert_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert thread_pool.main([str(bert_dir), "--lengths", "16", "--rounds", "1", "--block", "2"]) == 0
    assert "global" in capsys.readouterr().out


def test_operator_diversity(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert operator_diversity.main(["--models", "unet", "--size", "test", "--stages", "2", "--bs-max", "8",
                                    "--json", str(tmp_path / "od.json")]) == 0
    assert "preferred" in capsys.readouterr().out and (tmp_path / "od.json").is_file()


def test_large_model_without_serving(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert large_model.main(["--gib", "0.02", "--stages", "2", "--no-serve", "--out", str(tmp_path)]) == 0
    assert "peak" in capsys.readouterr().out.lower()


@pytest.mark.server
@pytest.mark.skipif(importlib.util.find_spec("py_spy") is None, reason="py-spy is not installed")
def test_served_profile(bert_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert served_profile.main([str(bert_dir), "--clients", "2", "--seconds", "1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "DVABatch" in out and "ZeroBatch" in out and (tmp_path / "served_profile.json").is_file()


@pytest.mark.server
def test_overload(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert overload.main(["--size", "test", "--seconds", "1", "--factor", "2", "--out", str(tmp_path)]) == 0
    assert "sustained" in capsys.readouterr().out
