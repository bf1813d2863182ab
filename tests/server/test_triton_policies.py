"""Multi-entry multi-exit, observed from a client of the real tritonserver:
- input diversity: short queries sent in the same burst as long ones are answered first;
- load diversity: a query arriving while a batch is in flight joins it (stretch counter moves);
- the custom early-exit example: confident queries come back early with the exit head's result."""
from __future__ import annotations

import re
import threading
import time
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from dvabatch_backend.tools.serve import TritonServer
from policies.examples.early_exit import confidence
from slicer import toy
from slicer.profiler import int_bounds
from slicer.slice_model import SliceOptions, slice_model

from ..triton_support import Clients, ServedModel, add_variant

HIDDEN, LONG, SHORT = 256, 256, 8  # wide enough that stage 0 (the batch window) outlasts a burst's sends


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("policies")
    sliced = tmp_path_factory.mktemp("sliced")
    token = toy.token_mlp(HIDDEN, 8)
    report = slice_model(token, sliced / "tm", SliceOptions(stages=4, max_batch_size=8, max_length=LONG, repeats=3,
                                                            batch_sizes=(1, 8), lengths=(SHORT, LONG),
                                                            calibration_rounds=1))
    base = ServedModel("tm", report.out_dir / "1", report.manifest, int_bounds(token), LONG)
    models = {
        # a batch window set in config.pbtxt (the profiled one, stage 0 at bs_max, is ~3 ms here:
        # about as long as a client takes to send the burst)
        "input": add_variant(repo, base, "tm_input", policy="input", policy_params={"window": 0.02}),
        "pipelined": add_variant(repo, base, "tm_pipelined", policy="pipelined"),
        "load": add_variant(repo, base, "tm_load", policy="load", policy_params={"t_comp_wait": 0.05}),
    }
    cascade = toy.cascade_mlp(features=1024, classes=4, layers=12)
    report = slice_model(cascade, sliced / "cascade", SliceOptions(stages=4, max_batch_size=8, repeats=3,
                                                                   batch_sizes=(1, 8), calibration_rounds=1))
    early = ServedModel("cascade", report.out_dir / "1", report.manifest, {}, 0)
    models["early"] = add_variant(repo, early, "cascade_early", policy="policies.examples.early_exit:EarlyExitPolicy",
                                  policy_params={"threshold": 0.6, "exit_stage": 0, "head": "early_logits"})
    with TritonServer(repo) as triton:
        for model in models.values():
            triton.wait_model_ready(model.name, timeout=120)
        yield triton, models


def _burst(url: str, model: str, queries: list[dict]) -> list[float]:
    """Send all queries at once (async gRPC); each one's answer time after the first send."""
    client = grpcclient.InferenceServerClient(url)
    done = [threading.Event() for _ in queries]
    times: list[float] = [0.0] * len(queries)
    errors: list = []

    def callback(i: int):
        def on_answer(result, error) -> None:
            times[i] = time.perf_counter()
            if error is not None:
                errors.append(error)
            done[i].set()
        return on_answer

    client.infer(model, Clients.inputs(grpcclient, queries[-1]))  # a warm channel: the sends form a tight burst
    requests = [Clients.inputs(grpcclient, q) for q in queries]
    start = time.perf_counter()
    for i, inputs in enumerate(requests):
        client.async_infer(model, inputs, callback(i), client_timeout=60)
    assert all(e.wait(60) for e in done) and errors == []
    return [t - start for t in times]


def _metric(server: TritonServer, model: str, operation: str) -> float:
    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    pattern = rf'dvabatch_meta_operations_total{{model="{model}",operation="{operation}"}} ([0-9.e+]+)'
    found = re.search(pattern, text) or re.search(
        rf'dvabatch_meta_operations_total{{operation="{operation}",model="{model}"}} ([0-9.e+]+)', text)
    return float(found.group(1)) if found else 0.0


def test_short_queries_in_a_burst_with_long_ones_exit_first(server) -> None:
    triton, models = server
    rng = np.random.default_rng(1)
    longs = [models["input"].query(rng, LONG) for _ in range(4)]
    shorts = [models["input"].query(rng, SHORT) for _ in range(4)]
    times = _burst(triton.grpc_url, "tm_input", longs + shorts)  # the long ones are sent first
    assert max(times[4:]) < min(times[:4]), times
    # the same burst with pipelined new-only: one batch padded to the longest, all leave together
    plain = _burst(triton.grpc_url, "tm_pipelined", longs + shorts)
    assert max(plain[4:]) > min(plain[:4]) * 0.5


def test_a_query_arriving_while_a_batch_is_in_flight_joins_it(server) -> None:
    triton, models = server
    model = models["load"]
    rng = np.random.default_rng(2)
    first = [model.query(rng, LONG) for _ in range(4)]  # one request of 4 rows: a batch of 4 in flight
    late = model.query(rng, 100)
    before = _metric(triton, "tm_load", "stretch")
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    client.infer("tm_load", Clients.inputs(grpcclient, model.query(rng, LONG)))  # warm: the first run is slow
    before = _metric(triton, "tm_load", "stretch")
    inputs = Clients.inputs(grpcclient, {name: np.stack([q[name] for q in first]) for name in first[0]},
                            add_batch_dim=False)
    box: list = []
    first_done = threading.Event()
    client.async_infer("tm_load", inputs, lambda result, error: (box.append((result, error)), first_done.set()),
                       client_timeout=60)
    time.sleep(0.005)  # the batch of 4 (~10 ms through 4 stages) is in its first stages now
    result = client.infer("tm_load", Clients.inputs(grpcclient, late), client_timeout=60)  # same channel
    late_answer = {n: result.as_numpy(n)[0] for n in ("tokens", "pooled")}
    assert first_done.wait(60) and box[0][1] is None
    for out, ref in model.reference(late).items():
        np.testing.assert_allclose(late_answer[out], ref, atol=1e-4, err_msg=f"late {out}")
    for i, query in enumerate(first):
        for out, ref in model.reference(query).items():
            np.testing.assert_allclose(box[0][0].as_numpy(out)[i], ref, atol=1e-4, err_msg=f"row {i} {out}")
    deadline = time.monotonic() + 5
    while _metric(triton, "tm_load", "stretch") <= before and time.monotonic() < deadline:
        time.sleep(0.1)  # the metrics are sampled every 0.25 s
    assert _metric(triton, "tm_load", "stretch") > before


def test_early_exit_policy_answers_confident_queries_early(server) -> None:
    triton, models = server
    model = models["early"]
    rng = np.random.default_rng(3)
    pool = [model.query(rng) for _ in range(200)]
    conf = [float(confidence(model.reference(q)["early_logits"][None])[0]) for q in pool]
    sure = [q for q, c in zip(pool, conf) if c >= 0.7][:4]
    unsure = [q for q, c in zip(pool, conf) if c <= 0.5][:4]
    assert len(sure) == 4 and len(unsure) == 4
    clients = Clients(triton.http_url, triton.grpc_url)
    clients.grpc_sync("cascade_early", unsure[0])  # warm

    def latency(query: dict) -> float:
        start = time.perf_counter()
        clients.grpc_sync("cascade_early", query)
        return time.perf_counter() - start

    early = [latency(q) for q in sure for _ in range(3)]
    late = [latency(q) for q in unsure for _ in range(3)]
    # a confident query leaves after the first of four stages (request overhead is common to both)
    assert np.median(early) < 0.85 * np.median(late), (early, late)
    for q in sure:  # answered with the exit head's result
        got = clients.grpc_sync("cascade_early", q)
        ref = model.reference(q)
        np.testing.assert_allclose(got["logits"], ref["early_logits"], atol=1e-4)
    for q in unsure:  # the full model
        got = clients.http_sync("cascade_early", q)
        np.testing.assert_allclose(got["logits"], model.reference(q)["logits"], atol=1e-4)
    assert _metric(triton, "cascade_early", "early_exits") >= 0  # the family is exported
