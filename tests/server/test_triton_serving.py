"""Served from the real tritonserver: every zoo model (test size), sliced, under every built-in
policy, answers over HTTP and gRPC, sync and async, equal to the unsliced model run on each
query alone, with concurrent clients and varying input lengths."""
from __future__ import annotations


import numpy as np
import pytest

from dvabatch_backend.tools.serve import TritonServer
from slicer.zoo import ZOO

from ..triton_support import POLICIES, Clients, ServedModel, add_variant, slice_zoo_model, unequal_answers


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> dict:
    repo = tmp_path_factory.mktemp("repository")
    models: dict[tuple[str, str], ServedModel] = {}
    for zoo_name in sorted(ZOO):
        base = slice_zoo_model(repo / ".sliced", zoo_name)
        for policy in POLICIES:
            name = f"{zoo_name}_{policy}"
            models[(zoo_name, policy)] = add_variant(repo, base, name, policy=policy)
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
    rng = np.random.default_rng([sorted(ZOO).index(zoo_name), POLICIES.index(policy)])  # the same every run
    modes = clients.modes()
    work = [(mode, model.query(rng)) for mode in modes for _ in range(3)]  # 12 queries, mixed lengths
    assert unequal_answers(modes, model, work) == []
