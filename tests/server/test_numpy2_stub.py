"""Served by a backend stub whose numpy is 2.x (as on a GPU image with a recent torch): every answer
carries its data, equal to the unsliced model's, on the fast path and through the pipeline, and so
does a baseline's (ZeroBatch's answers once left with no data, and cost it nothing to send).

The pytriton wheel's stub reads an array's byte size with a pybind11 older than numpy 2; under numpy
2 it read 0, and every response left with the right shapes and no data.

The stub's interpreter starts isolated: it ignores PYTHONPATH, and its own sys.path is the first
`python3` on PATH's (the launcher puts its own interpreter there: in a virtualenv, its site-packages
and this numpy 1). The generated model.py puts the launcher's sys.path (passed as PYTHONPATH) first,
in its order, so a numpy 2 wheel unpacked and put first on this process's sys.path gives the stub
numpy 2 while this process keeps its own. (Before, the launcher's paths were appended after the
stub's: in a virtualenv the stub took the virtualenv's numpy.)"""
from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from dvabatch_backend.tools.serve import TritonServer, stub_processes
from perf.baselines import add_baseline

from ..triton_support import Clients, ServedModel, add_variant, slice_zoo_model, unequal_answers

NUMPY_2 = "numpy==2.2.6"  # the last 2.x with a wheel for every Python this project runs on


@pytest.fixture(scope="module")
def numpy2_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding numpy 2, unpacked from its wheel for this Python (from PyPI, as the test
    command installs the rest)."""
    wheels = tmp_path_factory.mktemp("numpy2-wheel")
    got = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                          NUMPY_2, "-d", str(wheels)], capture_output=True, text=True, timeout=300)
    found = sorted(wheels.glob("numpy-*.whl"))
    if got.returncode or not found:
        pytest.skip(f"no {NUMPY_2} wheel could be downloaded: {got.stderr.strip()[-300:]}")
    site = tmp_path_factory.mktemp("numpy2-site")
    with zipfile.ZipFile(found[0]) as wheel:
        wheel.extractall(site)
    return site


def stub_numpy_dirs(model: str) -> set[str]:
    """The folders of the numpy extension modules the model's stub processes have loaded."""
    dirs: set[str] = set()
    for pid in stub_processes(lambda argv: f"/{model}/" in argv[1]):
        maps = Path(f"/proc/{pid}/maps").read_text()
        dirs |= {str(Path(p).parent.parent) for p in re.findall(r"(\S*/numpy/\S*_multiarray_umath\S*\.so)", maps)}
    return dirs


def test_a_stub_on_numpy_2_answers_with_the_data(tmp_path, numpy2_site: Path, monkeypatch) -> None:
    repo = tmp_path / "repository"
    base = slice_zoo_model(repo / ".sliced", "bert")
    model = add_variant(repo, base, "bert_numpy2", policy="input")
    add_baseline(repo, base.version_dir, "bert_zerobatch", 0)
    baseline = ServedModel("bert_zerobatch", base.version_dir, base.manifest, base.int_high, base.max_length)
    monkeypatch.syspath_prepend(str(numpy2_site))  # the server's PYTHONPATH: numpy 2 first
    server = TritonServer(repo).start()
    monkeypatch.undo()
    try:
        failures = []
        for served in (model, baseline):
            server.wait_model_ready(served.name, timeout=180)
            assert stub_numpy_dirs(served.name) == {str(numpy2_site / "numpy")}, "the stub did not load numpy 2"
            modes = Clients(server.http_url, server.grpc_url).modes()
            rng = np.random.default_rng(11)
            lone = [(mode, served.query(rng)) for mode in modes]  # one at a time: the fast path
            together = [(mode, served.query(rng)) for mode in modes for _ in range(3)]  # concurrent: the pipeline too
            failures += unequal_answers(modes, served, lone, concurrent=False) + unequal_answers(modes, served, together)
    finally:
        server.stop()
    assert failures == []
