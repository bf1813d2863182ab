"""Fuzzing the real tritonserver over HTTP and gRPC with hypothesis (perf.reliability.fuzz's strategies and
runner): rounds of requests sent together, each bad one (wrong dtype, rank, dims, huge lengths and
row counts, zero rows or length, ids out of the embedding, missing, extra or repeated inputs, shapes
the data does not fill) answered INVALID_ARGUMENT / HTTP 400 with a message naming the problem, each
good one (and each carrying NaN/Inf as data) answered equal to the unsliced model run on each row
alone; every call under a client timeout, and the server and the models' backend stubs still the
same processes after every round. bert is served under the input policy (rows of mixed lengths
padded into one batch), vgg19 (float input: NaN/Inf) under hybrid (stretch and split)."""
from __future__ import annotations

import pytest

from dvabatch_backend.tools.serve import TritonServer
from perf.reliability.fuzz import INVALID, PROTOCOLS, FuzzModel, Fuzzer, FuzzTally, liveness

from ..triton_support import add_variant, slice_zoo_model

ROUNDS = 90  # about 4 requests a round: a few hundred cases, ~30 s here
SERVED = {"bert_fuzz": ("bert", "input"), "vgg19_fuzz": ("vgg19", "hybrid")}


@pytest.fixture(scope="module")
def tally(tmp_path_factory) -> FuzzTally:
    repo = tmp_path_factory.mktemp("fuzz_repository")
    models = []
    for name, (zoo_name, policy) in SERVED.items():
        base = slice_zoo_model(repo / ".sliced", zoo_name)
        served = add_variant(repo, base, name, policy=policy)
        models.append(FuzzModel(name, served.version_dir, served.int_high))
    server = TritonServer(repo, explicit=True, load=list(SERVED)).start()
    try:
        for name in SERVED:
            server.wait_model_ready(name, timeout=120)
        fuzzer = Fuzzer(server.http_url, server.grpc_url, models,
                        liveness(server, [(repo / name).resolve() for name in SERVED]))
        try:
            yield fuzzer.run(ROUNDS, seed_value=20240601)
        finally:
            fuzzer.close()
    finally:
        server.stop()


def test_no_crash_no_hang(tally: FuzzTally) -> None:
    assert tally.rounds == ROUNDS
    assert tally.crashes == []
    assert tally.hangs == 0


def test_every_bad_request_is_the_clients_mistake_named(tally: FuzzTally) -> None:
    bad = [f for f in tally.failures if "good request" not in f and "unsliced" not in f]
    assert bad == [], "\n".join(bad)
    for protocol in PROTOCOLS:
        assert tally.bad_cases(protocol) >= 50, tally.report()
        codes = {code for (p, code) in tally.codes if p == protocol}
        assert codes == {INVALID[protocol]}, codes
    bad_kinds = {kind for (_, kind), n in tally.kinds.items() if kind != "good" and not kind.startswith("data")}
    assert len(bad_kinds) >= 12, bad_kinds  # the generator reaches most kinds of mistake
    assert len(tally.templates) >= 10, tally.templates  # and they are told apart


def test_every_good_request_is_answered_correctly(tally: FuzzTally) -> None:
    assert tally.failures == [], "\n".join(tally.failures)
    assert tally.good_sent >= 100
    assert tally.good_answered == tally.good_correct == tally.good_sent
    for protocol in PROTOCOLS:
        assert tally.cases[(protocol, "data")] > 0  # NaN/Inf went out as data, and was answered exactly
