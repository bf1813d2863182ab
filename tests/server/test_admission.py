"""Admission through the real tritonserver: the queue bound, request timeouts, client cancellation
and the latency target answer with Triton's codes and wording, lose nothing, and never run what
they drop.

A gate policy (gate_policy.py) holds every arriving query until the test creates its gate file, so
which queries are queued when does not depend on timing; waits are bounded polls of the metrics.
"""
from __future__ import annotations

import re
import shutil
import threading
import urllib.request
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from dvabatch_backend.tools.serve import TritonServer, infer_inputs

from ..triton_support import ServedModel, add_variant, admitted_requests, settle, slice_zoo_model

GATE_POLICY = Path(__file__).with_name("gate_policy.py")
GATED = f"{GATE_POLICY.name}:GatePolicy"
SETTLE = 60.0  # a bound on waits for sampled counters, never an expectation of speed
BOUND = 8


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    repo = tmp_path_factory.mktemp("admission")
    gates = tmp_path_factory.mktemp("gates")
    base = slice_zoo_model(repo / ".sliced", "bert")
    shutil.copy(GATE_POLICY, base.version_dir / GATE_POLICY.name)
    models = {
        # unbounded: 200 requests held by the gate, past the derived bound (this is about timeouts)
        "cancel": add_variant(repo, base, "adm_cancel", policy=GATED, extra={"max_queue_size": 0},
                              policy_params={"gate": gates / "cancel", "inner": "pipelined"}),
        "bound": add_variant(repo, base, "adm_bound", policy=GATED, extra={"max_queue_size": BOUND},
                             policy_params={"gate": gates / "bound", "inner": "pipelined"}),
        "slo": add_variant(repo, base, "adm_slo", extra={"slo_ms": 0.000001}),
        "slo_late": add_variant(repo, base, "adm_slo_late", extra={"slo_ms": 0.000001, "slo_action": "serve_late"}),
    }
    with TritonServer(repo) as triton:
        for model in models.values():
            triton.wait_model_ready(model.name, timeout=120)
        yield triton, models, gates


def _metric(server: TritonServer, family: str, model: str, **labels: str) -> float:
    """One sample of a dvabatch metric; missing is a failure, not 0."""
    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    for match in re.finditer(rf"^{family}{{([^}}]*)}} ([0-9.e+-]+)$", text, re.M):
        got = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
        if got.get("model") == model and all(got.get(k) == v for k, v in labels.items()):
            return float(match.group(2))
    raise AssertionError(f"no {family} for model {model!r} with {labels}")


def _settle(read: Callable[[], float], done: Callable[[float], bool]) -> float:
    return settle(read, done, SETTLE)


class Outcomes:
    """Each request's one outcome: its outputs, or the exception it ended with."""

    def __init__(self) -> None:
        self.results: dict[int, object] = {}
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)

    def put(self, key: int, value: object) -> None:
        with self._lock:
            assert key not in self.results, f"request {key} answered twice"
            self.results[key] = value
            self._done.notify_all()

    def wait(self, count: int, timeout: float = SETTLE) -> bool:
        with self._lock:
            return self._done.wait_for(lambda: len(self.results) >= count, timeout)

    def wait_for(self, keys: range, timeout: float = SETTLE) -> bool:
        with self._lock:
            return self._done.wait_for(lambda: all(k in self.results for k in keys), timeout)


def _send_http(server: TritonServer, model: str, query, key: int, outcomes: Outcomes, timeout_us: int | None = None):
    def run() -> None:
        with httpclient.InferenceServerClient(server.http_url, network_timeout=SETTLE) as client:
            try:
                result = client.infer(model, infer_inputs(httpclient, query), timeout=timeout_us)
                outcomes.put(key, {o["name"]: result.as_numpy(o["name"])[0] for o in result.get_response()["outputs"]})
            except InferenceServerException as exc:
                outcomes.put(key, exc)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _send_grpc_with_deadline(client: grpcclient.InferenceServerClient, model: str, query, key: int,
                             outcomes: Outcomes, deadline_s: float) -> None:
    def callback(result, error) -> None:
        outcomes.put(key, error if error is not None else {o.name: result.as_numpy(o.name)[0]
                                                           for o in result.get_response().outputs})
    client.async_infer(model, infer_inputs(grpcclient, query), callback, client_timeout=deadline_s)


def _check_answer(model: ServedModel, query, outcome) -> None:
    assert isinstance(outcome, dict), f"a good request failed: {outcome}"
    reference = model.reference(query)
    for name, want in reference.items():
        assert outcome[name].shape == want.shape, name
        np.testing.assert_allclose(outcome[name], want, atol=1e-4, rtol=0, err_msg=name)


def test_cancelled_and_timed_out_requests_never_run_and_the_others_are_answered(served) -> None:
    server, models, gates = served
    model = models["cancel"]
    rng = np.random.default_rng(0)
    good = [model.query(rng) for _ in range(100)]
    doomed = [model.query(rng) for _ in range(100)]
    outcomes = Outcomes()
    threads = [_send_http(server, model.name, q, i, outcomes) for i, q in enumerate(good)]
    # half time out by the request's own timeout (HTTP), half by the client's gRPC deadline (a cancellation)
    threads += [_send_http(server, model.name, q, 100 + i, outcomes, timeout_us=100_000)
                for i, q in enumerate(doomed[:50])]
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    for i, q in enumerate(doomed[50:]):
        _send_grpc_with_deadline(grpc, model.name, q, 150 + i, outcomes, deadline_s=0.3)

    # every doomed request ends while the gate holds the queue: by our drop (timeout, cancellation),
    # or in the client (its deadline) before or after Triton hands it to the model
    assert outcomes.wait_for(range(100, 200)), "the doomed requests did not end while queued"
    def dropped() -> float:
        return sum(_metric(server, "dvabatch_refused_queries_total", model.name, reason=r) for r in ("timeout", "cancelled"))

    # the doomed requests that reached the model are all dropped before the gate opens
    assert _settle(lambda: dropped() - (admitted_requests(server, model.name) - 100), lambda v: v >= 0) >= 0
    assert _metric(server, "dvabatch_refused_queries_total", model.name, reason="timeout") == 50
    (gates / "cancel").touch()  # now the policy batches what is left
    assert outcomes.wait(200), f"only {len(outcomes.results)} of 200 requests ended"
    for thread in threads:
        thread.join(SETTLE)
    grpc.close()

    for i, query in enumerate(good):
        _check_answer(model, query, outcomes.results[i])
    for key in range(100, 200):
        assert isinstance(outcomes.results[key], Exception), f"request {key} should have ended in an error"
    timed_out = [outcomes.results[k] for k in range(100, 150)]
    assert all("Request timeout expired" in str(e) for e in timed_out), {str(e) for e in timed_out}
    rows = _settle(lambda: _metric(server, "dvabatch_stage_rows_total", model.name, stage="0"), lambda v: v >= 100)
    assert rows <= 110, f"stage 0 ran {rows} rows: more than 10 of the 100 doomed requests ran"
    cancelled = _metric(server, "dvabatch_refused_queries_total", model.name, reason="cancelled")
    print(f"doomed: 50 timed out in the queue, {cancelled:.0f} cancelled by their gRPC deadline in the queue "
          f"(the rest ended before reaching the model); stage 0 ran {rows:.0f} rows for 100 good requests")
    # and it serves normally afterwards
    after = Outcomes()
    _send_http(server, model.name, good[0], 0, after).join(SETTLE)
    _check_answer(model, good[0], after.results[0])


def test_the_queue_bound_refuses_with_unavailable_and_loses_nothing(served) -> None:
    server, models, gates = served
    model = models["bound"]
    rng = np.random.default_rng(1)
    queries = [model.query(rng) for _ in range(BOUND + 4)]
    outcomes = Outcomes()
    threads = [_send_http(server, model.name, q, i, outcomes) for i, q in enumerate(queries)]
    assert outcomes.wait(4), "the requests over the bound were not refused"  # the rest are held by the gate
    assert _metric(server, "dvabatch_queued_queries", model.name) == BOUND or \
        _settle(lambda: _metric(server, "dvabatch_queued_queries", model.name), lambda v: v == BOUND) == BOUND
    refused = dict(outcomes.results)
    assert len(refused) == 4
    for error in refused.values():
        assert isinstance(error, InferenceServerException), error
        assert "Exceeds maximum queue size" in str(error) and error.status() == "503", (error.status(), str(error))

    (gates / "bound").touch()
    assert outcomes.wait(BOUND + 4)
    for thread in threads:
        thread.join(SETTLE)
    for i, query in enumerate(queries):
        if i not in refused:
            _check_answer(model, query, outcomes.results[i])
    assert _settle(lambda: _metric(server, "dvabatch_refused_queries_total", model.name, reason="queue_full"),
                   lambda v: v == 4) == 4


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_query_that_cannot_meet_the_target_is_refused_unavailable_and_late_ones_are_served(served, protocol) -> None:
    server, models, _ = served
    query = models["slo"].query(np.random.default_rng(2))
    if protocol == "http":
        with httpclient.InferenceServerClient(server.http_url) as client:
            with pytest.raises(InferenceServerException) as refused:
                client.infer(models["slo"].name, infer_inputs(httpclient, query))
            assert refused.value.status() == "503"
            late = client.infer(models["slo_late"].name, infer_inputs(httpclient, query))
            outputs = {o["name"]: late.as_numpy(o["name"])[0] for o in late.get_response()["outputs"]}
    else:
        with grpcclient.InferenceServerClient(server.grpc_url) as client:
            with pytest.raises(InferenceServerException) as refused:
                client.infer(models["slo"].name, infer_inputs(grpcclient, query))
            assert refused.value.status() == "StatusCode.UNAVAILABLE"
            late = client.infer(models["slo_late"].name, infer_inputs(grpcclient, query))
            outputs = {o.name: late.as_numpy(o.name)[0] for o in late.get_response().outputs}
    assert "overloaded: cannot meet" in str(refused.value)
    _check_answer(models["slo_late"], query, outputs)
    # served late: an answer, but not goodput
    assert _metric(server, "dvabatch_goodput_queries_total", models["slo_late"].name) == 0
