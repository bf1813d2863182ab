"""Served from the real tritonserver: every zoo model (test size), sliced, under every built-in
policy, answers over HTTP and gRPC, sync and async, equal to the unsliced model run on each
query alone, with concurrent clients and varying input lengths."""
from __future__ import annotations

import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

from dvabatch_backend.tools.serve import TritonServer
from slicer.triton_files import config_pbtxt
from slicer.zoo import ZOO

from ..runtime.test_compat import LEGACY_POLICY_PY
from ..triton_support import POLICIES, Clients, ServedModel, add_variant, slice_zoo_model


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> dict:
    repo = tmp_path_factory.mktemp("repository")
    models: dict[tuple[str, str], ServedModel] = {}
    for zoo_name in sorted(ZOO):
        base = slice_zoo_model(repo / ".sliced", zoo_name)
        for policy in POLICIES:
            name = f"{zoo_name}_{policy}"
            models[(zoo_name, policy)] = add_variant(repo, base, name, policy=policy)
    models[("legacy", "legacy")] = _legacy_model(repo, models[(sorted(ZOO)[0], "pipelined")])
    server = TritonServer(repo).start()
    try:
        for model in models.values():
            server.wait_model_ready(model.name, timeout=180)
        yield {"server": server, "models": models, "clients": Clients(server.http_url, server.grpc_url)}
    finally:
        server.stop()


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("zoo_name", sorted(ZOO))
def test_answers_equal_the_unsliced_model(served, zoo_name: str, policy: str) -> None:
    model: ServedModel = served["models"][(zoo_name, policy)]
    clients: Clients = served["clients"]
    rng = np.random.default_rng(hash((zoo_name, policy)) % 2**32)
    modes = clients.modes()
    work = [(mode, model.query(rng)) for mode in modes for _ in range(3)]  # 12 queries, mixed lengths
    failures: list[str] = []

    def send(mode: str, query: dict) -> None:
        try:
            got = modes[mode](model.name, query)
            for name, ref in model.reference(query).items():
                np.testing.assert_allclose(got[name], ref, atol=1e-4, rtol=0, err_msg=f"{mode} {name}")
        except Exception as exc:  # collected: every query must succeed
            failures.append(f"{mode}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=send, args=w) for w in work]  # concurrent clients
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert failures == []


# What the slicer wrote into model.py before the runtime's packages were split by layer.
LEGACY_MODEL_PY = """import os
import site
import sys

for _path in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    if _path and _path not in sys.path:
        site.addsitedir(_path)

from dvabatch_backend.triton_model import TritonPythonModel  # noqa: E402,F401
"""


def _legacy_model(repo: Path, base: ServedModel) -> ServedModel:
    version_dir = repo / "legacy" / "1"
    shutil.copytree(base.version_dir.resolve(), version_dir)
    (version_dir / "model.py").write_text(LEGACY_MODEL_PY)
    (version_dir / "old_style.py").write_text(LEGACY_POLICY_PY)
    (repo / "legacy" / "config.pbtxt").write_text(
        config_pbtxt(base.manifest, policy="old_style.py:OldStylePolicy", name="legacy"))
    return ServedModel("legacy", version_dir, base.manifest, base.int_high, base.max_length)


def test_model_py_and_policy_from_before_the_layer_split_still_serve(served) -> None:
    model: ServedModel = served["models"][("legacy", "legacy")]
    clients: Clients = served["clients"]
    rng = np.random.default_rng(7)
    for mode, infer in clients.modes().items():
        query = model.query(rng)
        got = infer(model.name, query)
        for name, ref in model.reference(query).items():
            np.testing.assert_allclose(got[name], ref, atol=1e-4, rtol=0, err_msg=f"{mode} {name}")
