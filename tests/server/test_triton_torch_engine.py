"""Served from the real tritonserver with `engine: torch` in config.pbtxt: a zoo model (BERT-like,
test size) sliced into three stages runs every stage on the torch engine (CPU), and its answers to
concurrent queries of mixed lengths, over HTTP and gRPC, equal the unsliced model in onnxruntime.
An engine wrapper refuses (fails the model's load) any stage engine that is not the torch one: the
parameter reached the runtime."""
from __future__ import annotations


import numpy as np
import pytest

from dvabatch_backend.tools.serve import TritonServer
from slicer.model_config import parameters

from ..triton_support import Clients, add_variant, slice_zoo_model, unequal_answers

pytest.importorskip("torch")

ZOO_MODEL = "bert"
# engine_wrapper (a file in the version folder): the load fails unless every stage runs on torch
TORCH_ONLY_PY = """
def torch_only(stage, engine):
    if type(engine).__name__ != "TorchStageEngine":
        raise TypeError(f"stage {stage} runs on {type(engine).__name__}, not on the torch engine")
    return engine
"""


def test_a_sliced_model_served_on_the_torch_engine_answers_as_the_unsliced_model(tmp_path) -> None:
    repo = tmp_path / "repository"
    base = slice_zoo_model(repo / ".sliced", ZOO_MODEL)
    (base.version_dir / "torch_only.py").write_text(TORCH_ONLY_PY)
    model = add_variant(repo, base, f"{ZOO_MODEL}_torch", policy="input",
                        extra={"engine": "torch", "device": "cpu", "engine_wrapper": "torch_only.py:torch_only"})
    assert parameters((repo / model.name / "config.pbtxt").read_text())["engine"] == "torch"
    with TritonServer(repo) as server:
        server.wait_model_ready(model.name, timeout=180)
        clients = Clients(server.http_url, server.grpc_url)
        modes = clients.modes()
        rng = np.random.default_rng(5)
        work = [(mode, model.query(rng)) for mode in modes for _ in range(3)]  # 12 queries, mixed lengths
        failures = unequal_answers(modes, model, work, rtol=1e-3)  # concurrent clients
    assert failures == []
