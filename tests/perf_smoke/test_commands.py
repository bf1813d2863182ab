"""Every `python -m perf....` command that no other test runs, run as a command at its smallest size:
it finishes, exits 0 and prints its table. No figure is asserted (figures are the benchmarks' business).

Each runs in a process of its own, as a user runs it: some take onnxruntime's global thread pool,
which a process keeps for good (and which would refuse every later session with threads of its own)."""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ..triton_support import slice_zoo_model

REPO = Path(__file__).resolve().parents[2]


def run(module: str, *args: str, timeout: float = 600, codes: tuple[int, ...] = (0,)) -> str:
    done = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode in codes, f"{module} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return slice_zoo_model(tmp_path_factory.mktemp("sliced"), "bert", stages=2).version_dir.parent


def test_overhead_quick() -> None:
    assert "overhead" in run("perf.costs.overhead", "--quick", "--no-breakdown").lower()


def test_thread_pool(bert_dir: Path) -> None:
    assert "global" in run("perf.costs.thread_pool", str(bert_dir), "--lengths", "16", "--rounds", "1", "--block", "2")


def test_operator_diversity(tmp_path: Path) -> None:
    out = run("perf.paper.operator_diversity", "--models", "unet", "--size", "test", "--stages", "2", "--bs-max", "8",
              "--json", str(tmp_path / "od.json"))
    assert "preferred" in out and (tmp_path / "od.json").is_file()


def test_large_model_without_serving(tmp_path: Path) -> None:
    # its verdict (the slicer's peak memory under 2x the weights) means nothing at 20 MiB, where the
    # interpreter and onnxruntime outweigh the model: exit 1 is that verdict, not a failure to run
    out = run("perf.costs.large_model", "--gib", "0.02", "--stages", "2", "--no-serve", "--out", str(tmp_path),
              codes=(0, 1))
    assert "peak RSS" in out and (tmp_path / "large_model" / "results.json").is_file()


@pytest.mark.server
@pytest.mark.skipif(shutil.which("py-spy") is None and importlib.util.find_spec("py_spy") is None,
                    reason="py-spy is not installed")
def test_served_profile(bert_dir: Path, tmp_path: Path) -> None:
    out = run("perf.costs.served_profile", str(bert_dir), "--clients", "2", "--seconds", "1", "--out", str(tmp_path))
    assert "DVABatch" in out and "ZeroBatch (" in out and "ZeroBatch-spin (" in out
    assert (tmp_path / "served_profile.json").is_file()


@pytest.mark.server
def test_overload(zoo_out: Path) -> None:
    assert "sustained" in run("perf.reliability.overload", "--size", "test", "--seconds", "1", "--factor", "2", "--quick",
                              "--out", str(zoo_out))


@pytest.mark.server
def test_refusals(bert_dir: Path) -> None:
    out = run("perf.reliability.refusals", str(bert_dir), "--seconds", "1", "--factor", "2", "--clients", "4",
              "--systems", "slicer", timeout=600)  # one system: the loop over systems is the same
    assert "sustained" in out and "poisson 2x" in out and "overload: answered p99" in out
