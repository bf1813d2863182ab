"""The package as a user installs it: `pip install .` without the test extra, in a fresh virtualenv,
slices a model. A requirement the slicer imports at run time but `setup.py` does not declare (sympy,
which onnxruntime's symbolic shape inference needs and does not require) fails here, where the
test extra would have brought it along (torch requires sympy)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# what a copy of the source leaves out: environments, generated models, results, caches
NOT_SOURCE = shutil.ignore_patterns(".git", ".venv*", "work", "build", "dist", "*.egg-info", "__pycache__",
                                    ".pytest_cache", ".hypothesis", "*.onnx", "model_repository")


def run(argv: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done


def test_the_package_without_its_test_extra_slices_a_model(tmp_path: Path) -> None:
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCE)  # the build writes into its source: not into ours
    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    run([sys.executable, "-m", "venv", str(venv)], tmp_path, env, 120)
    bin_dir = venv / "bin"
    env["PATH"] = os.pathsep.join([str(bin_dir), env.get("PATH", "")])
    run([str(bin_dir / "python"), "-m", "pip", "install", "-q", str(source)], tmp_path, env, 900)
    # the venv holds only what the base package requires: no torch, no sympy by way of it
    listed = run([str(bin_dir / "python"), "-m", "pip", "list", "--format=json"], tmp_path, env, 120)
    installed = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert "torch" not in installed and "pytest" not in installed, sorted(installed)

    model = tmp_path / "bert.onnx"
    run([str(bin_dir / "dvabatch"), "zoo", "bert", "--size", "test", "--out", str(model)], tmp_path, env, 300)
    out = tmp_path / "repo" / "bert"
    run([str(bin_dir / "dvabatch"), "slice", str(model), "--stages", "2", "--out", str(out), "--bs-max", "4",
         "--max-length", "16", "--repeats", "2"], tmp_path, env, 600)
    manifest = json.loads((out / "1" / "manifest.json").read_text())
    assert len(manifest["stages"]) == 2
    assert (out / "config.pbtxt").is_file() and (out / "1" / "model.py").is_file()
