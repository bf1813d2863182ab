"""Multi-entry multi-exit, observed from a client of the real tritonserver:
- input diversity: short queries sent in the same burst as long ones are batched apart from them
  and answered first (pipelined new-only makes one batch of them all);
- load diversity: a query arriving while a batch is in flight joins it (stretch counter moves; the
  batch is held in stage 0 by an engine wrapper, tests/server/gate_engine.py, until the test lets it go);
- the custom early-exit example: confident queries come back with the exit head's result, and the
  early-exit counter counts exactly them;
- the fast path under Triton: requests that queued while `execute` ran are handed over together
  and run as one batch of the load policy, every answer right, counted by the fast-path metrics.

No assertion rests on how long anything took: a gate policy (tests/server/gate_policy.py) holds
a burst until every request has reached the model, and the counters are read once they settle.
That confident queries are also faster is a speed claim, for a benchmark, not asserted here."""
from __future__ import annotations

import json
import re
import shutil
import threading
import urllib.request
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from dvabatch_backend.tools.serve import TritonServer
from policies.examples.early_exit import confidence
from slicer import toy
from slicer.profiler import int_bounds
from slicer.slice_model import SliceOptions, slice_model

from dvabatch_backend.runtime.admission import QUEUE_BATCHES

from ..triton_support import Clients, ServedModel, add_variant, admitted_requests, settle

HIDDEN, LONG, SHORT = 256, 256, 8
GATE_POLICY = Path(__file__).with_name("gate_policy.py")
GATE_ENGINE = Path(__file__).with_name("gate_engine.py")
SETTLE = 30.0  # seconds to wait for a counter to reach its value (sampled every 0.25 s); only a failure bound


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("policies")
    sliced = tmp_path_factory.mktemp("sliced")
    gates = tmp_path_factory.mktemp("gates")
    token = toy.token_mlp(HIDDEN, 8)
    # one profiled length: the input policy clusters by the length tolerance alone (no merging by
    # profiled cost, which would rest on timings measured while slicing)
    report = slice_model(token, sliced / "tm", SliceOptions(stages=4, max_batch_size=8, max_length=LONG, repeats=3,
                                                            batch_sizes=(1, 8), lengths=(LONG,),
                                                            calibration_rounds=1))
    shutil.copy(GATE_POLICY, report.out_dir / "1" / GATE_POLICY.name)
    shutil.copy(GATE_ENGINE, report.out_dir / "1" / GATE_ENGINE.name)
    base = ServedModel("tm", report.out_dir / "1", report.manifest, int_bounds(token), LONG)
    gated = f"{GATE_POLICY.name}:GatePolicy"
    models = {
        "input": add_variant(repo, base, "tm_input", policy=gated,
                             policy_params={"gate": gates / "input", "inner": "input", "window": 0}),
        "pipelined": add_variant(repo, base, "tm_pipelined", policy=gated,
                                 policy_params={"gate": gates / "pipelined", "inner": "pipelined"}),
        # T_comp_wait far beyond a batch's time in the pipeline: a batch in flight always may stretch;
        # no fast path, which would run the batch of 4 inline while the late query waits in Triton's
        # queue; stage 0 holds its first run until the test opens the gate
        "load": add_variant(repo, base, "tm_load", policy="load", policy_params={"t_comp_wait": 600},
                            extra={"fast_path": "false", "engine_wrapper": f"{GATE_ENGINE.name}:hold_first"}),
    }
    cascade = toy.cascade_mlp(features=1024, classes=4, layers=12)
    report = slice_model(cascade, sliced / "cascade", SliceOptions(stages=4, max_batch_size=8, repeats=3,
                                                                   batch_sizes=(1, 8), calibration_rounds=1))
    early = ServedModel("cascade", report.out_dir / "1", report.manifest, {}, 0)
    models["early"] = add_variant(repo, early, "cascade_early", policy="policies.examples.early_exit:EarlyExitPolicy",
                                  policy_params={"threshold": 0.6, "exit_stage": 0, "head": "early_logits"})
    dense = toy.dense_mlp(64, 6)
    report = slice_model(dense, sliced / "dense", SliceOptions(stages=1, max_batch_size=8, repeats=3,
                                                               batch_sizes=(1, 8), calibration_rounds=1))
    shutil.copy(GATE_ENGINE, report.out_dir / "1" / GATE_ENGINE.name)
    fixed = ServedModel("dense", report.out_dir / "1", report.manifest, {}, 0)
    models["fixed"] = add_variant(repo, fixed, "dense_load", policy="load",
                                  extra={"engine_wrapper": f"{GATE_ENGINE.name}:hold_first"})
    # Triton's queue holds 2 requests: what queues behind an inline run past them is refused
    bounded_dir = sliced / "dense_bounded"
    shutil.copytree(report.out_dir, bounded_dir)  # its own gate files
    bounded = ServedModel("dense", bounded_dir / "1", report.manifest, {}, 0)
    models["bounded"] = add_variant(repo, bounded, "dense_bounded", policy="load", queue_size=2,
                                    extra={"engine_wrapper": f"{GATE_ENGINE.name}:hold_first"})
    # the runtime's queue holds 2 rows (a configured bound), Triton's is unbounded: a request may
    # wait there as long as 2 rows take the stages (`Admission.caller_bound`)
    standing_dir = sliced / "dense_standing"
    shutil.copytree(report.out_dir, standing_dir)  # its own gate files
    standing = ServedModel("dense", standing_dir / "1", report.manifest, {}, 0)
    models["standing"] = add_variant(repo, standing, "dense_standing", policy="load",
                                     extra={"max_queue_size": 2, "engine_wrapper": f"{GATE_ENGINE.name}:hold_each"})
    # Triton's queue unbounded and no queue policy configured (the slicer's config): a call whose
    # oldest request waited there past the derived bound is refused; the profile scaled down so far
    # that the bound is a few nanoseconds, without the test waiting on a clock
    derived_dir = sliced / "dense_derived"
    shutil.copytree(report.out_dir, derived_dir)  # its own gate files
    _scale_profile(derived_dir / "1" / "manifest.json", 1e-9)
    derived = ServedModel("dense", derived_dir / "1", report.manifest, {}, 0)
    models["derived"] = add_variant(repo, derived, "dense_derived", policy="load",
                                    extra={"engine_wrapper": f"{GATE_ENGINE.name}:hold_each"})
    # the pipeline forced, the derived bound: once the runtime's queue is at it, arrivals are refused
    door_dir = sliced / "dense_door"
    shutil.copytree(report.out_dir, door_dir)
    door = ServedModel("dense", door_dir / "1", report.manifest, {}, 0)
    models["door"] = add_variant(repo, door, "dense_door", policy="load",
                                 extra={"fast_path": "false", "engine_wrapper": f"{GATE_ENGINE.name}:hold_each"})
    with TritonServer(repo) as triton:
        for model in models.values():
            triton.wait_model_ready(model.name, timeout=120)
        yield triton, models, gates


def _scale_profile(manifest: Path, seconds: float) -> None:
    """Scale the manifest's stage times so that a bs_max batch passes the stages in `seconds`. Only
    what the runtime predicts changes (the bound), not what runs."""
    data = json.loads(manifest.read_text())
    times = data["stage_times"]
    passage = sum(max(t.items(), key=lambda kv: int(kv[0]))[1] for t in times)
    data["stage_times"] = [{bs: t * seconds / passage for bs, t in stage.items()} for stage in times]
    data.pop("stage_times_by_length", None)
    manifest.write_text(json.dumps(data))


def _metrics_text(server: TritonServer) -> str:
    return urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()


def _sample(family: str, labels: dict[str, str], text: str) -> float | None:
    """The value of the `family` sample whose labels include every one of `labels`, or None."""
    for m in re.finditer(rf"{family}{{([^}}]*)}} ([0-9.e+]+)", text):
        if all(f'{key}="{value}"' in m.group(1) for key, value in labels.items()):
            return float(m.group(2))
    return None


def _metric(server: TritonServer, model: str, operation: str, text: str | None = None) -> float:
    """The model's dvabatch_meta_operations_total for `operation`; missing is a failure, not 0."""
    text = _metrics_text(server) if text is None else text
    found = _sample("dvabatch_meta_operations_total", {"model": model, "operation": operation}, text)
    assert found is not None, f"no dvabatch_meta_operations_total for model {model!r}, operation {operation!r}"
    return found


def _stage0(server: TritonServer, model: str) -> tuple[float, float]:
    """(batches, rows) stage 0 has run for the model."""
    text = _metrics_text(server)
    values = []
    for family in ("dvabatch_stage_batches_total", "dvabatch_stage_rows_total"):
        found = _sample(family, {"model": model, "stage": "0"}, text)
        assert found is not None, f"no {family} for model {model!r}, stage 0"
        values.append(found)
    return values[0], values[1]


def _settle(read: Callable[[], object], done: Callable[[object], bool], timeout: float = SETTLE) -> object:
    return settle(read, done, timeout)


class _Answers:
    """Async gRPC answers by query index (result, error), and the order they came in."""

    def __init__(self) -> None:
        self.got: dict[int, tuple] = {}
        self.order: list[int] = []
        self._lock = threading.Lock()
        self._done = threading.Semaphore(0)

    def callback(self, i: int) -> Callable[[object, object], None]:
        def on_answer(result, error) -> None:
            with self._lock:
                self.got[i] = (result, error)
                self.order.append(i)
            self._done.release()
        return on_answer

    def wait(self, n: int) -> None:
        for _ in range(n):
            assert self._done.acquire(timeout=120), "an answer did not come"


def _gated_burst(triton: TritonServer, gate: Path, model: str, queries: list[dict]) -> list[int]:
    """Send every query (async gRPC, one request each) while the model's gate is shut; open it once
    all have reached the model. Returns the query indices in the order their answers came."""
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    answers = _Answers()
    gate.unlink(missing_ok=True)
    before = admitted_requests(triton, model)
    for i, query in enumerate(queries):
        client.async_infer(model, Clients.inputs(grpcclient, query), answers.callback(i), client_timeout=120)
    admitted = _settle(lambda: admitted_requests(triton, model), lambda n: n >= before + len(queries))
    assert admitted == before + len(queries), admitted
    assert answers.order == [], "answered before the gate opened"
    gate.touch()
    answers.wait(len(queries))
    client.close()
    assert [error for _, error in answers.got.values() if error is not None] == []
    return answers.order


def test_short_queries_in_a_burst_with_long_ones_are_batched_apart_and_exit_first(server) -> None:
    triton, models, gates = server
    rng = np.random.default_rng(1)
    longs = [models["input"].query(rng, LONG) for _ in range(4)]
    shorts = [models["input"].query(rng, SHORT) for _ in range(4)]

    new, (batches, rows) = _metric(triton, "tm_input", "new"), _stage0(triton, "tm_input")
    order = _gated_burst(triton, gates / "input", "tm_input", longs + shorts)  # the long ones are sent first
    # two batches, one per length cluster; FIFO stages then let the short one, sent into the
    # pipeline first, leave first
    assert _settle(lambda: _metric(triton, "tm_input", "new"), lambda v: v >= new + 2) == new + 2
    assert _settle(lambda: _stage0(triton, "tm_input"), lambda v: v[1] >= rows + 8) == (batches + 2, rows + 8)
    assert sorted(order[:4]) == [4, 5, 6, 7], order

    # the same burst with pipelined new-only: one batch of all eight, padded to the longest
    new, (batches, rows) = _metric(triton, "tm_pipelined", "new"), _stage0(triton, "tm_pipelined")
    _gated_burst(triton, gates / "pipelined", "tm_pipelined", longs + shorts)
    assert _settle(lambda: _metric(triton, "tm_pipelined", "new"), lambda v: v >= new + 1) == new + 1
    assert _settle(lambda: _stage0(triton, "tm_pipelined"), lambda v: v[1] >= rows + 8) == (batches + 1, rows + 8)


def test_a_query_arriving_while_a_batch_is_in_flight_joins_it(server) -> None:
    """A request of 4 rows enters stage 0, which holds it (gate_engine.py) until the test opens the
    gate; a query sent meanwhile joins that batch in flight (one stretch, none refused), and every
    answer equals the unsliced model's. The order is set by the gate, not by timing."""
    triton, models, _ = server
    model = models["load"]
    held, gate = model.version_dir / "held", model.version_dir / "open"
    rng = np.random.default_rng(2)
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    before = _metric(triton, "tm_load", "stretch")
    first = [model.query(rng, LONG) for _ in range(4)]  # one request of 4 rows: one batch
    late = model.query(rng, 100)
    answers: dict[str, list] = {"first": [], "late": []}
    done = threading.Semaphore(0)

    def keep(key: str) -> Callable[[object, object], None]:
        return lambda result, error: (answers[key].append((result, error)), done.release())

    inputs = Clients.inputs(grpcclient, {name: np.stack([q[name] for q in first]) for name in first[0]},
                            add_batch_dim=False)
    try:
        client.async_infer("tm_load", inputs, keep("first"), client_timeout=120)
        assert _settle(held.exists, bool), "stage 0 never took the first batch"
        client.async_infer("tm_load", Clients.inputs(grpcclient, late), keep("late"), client_timeout=120)
        assert _settle(lambda: _metric(triton, "tm_load", "stretch"), lambda v: v >= before + 1) == before + 1
    finally:
        gate.touch()
    assert done.acquire(timeout=120) and done.acquire(timeout=120)
    (result, error), = answers["first"]
    assert error is None, error
    for i, query in enumerate(first):
        for out, ref in model.reference(query).items():
            np.testing.assert_allclose(result.as_numpy(out)[i], ref, atol=1e-4, err_msg=f"row {i} {out}")
    (result, error), = answers["late"]
    assert error is None, error
    for out, ref in model.reference(late).items():
        np.testing.assert_allclose(result.as_numpy(out)[0], ref, atol=1e-4, err_msg=f"late {out}")
    assert _metric(triton, "tm_load", "stretch_refused") == 0


def test_early_exit_policy_answers_confident_queries_early(server) -> None:
    triton, models, _ = server
    model = models["early"]
    rng = np.random.default_rng(3)
    pool = [model.query(rng) for _ in range(200)]
    conf = [float(confidence(model.reference(q)["early_logits"][None])[0]) for q in pool]
    # threshold 0.6; a margin either side, so numerical noise cannot flip a query
    sure = [q for q, c in zip(pool, conf) if c >= 0.7][:4]
    unsure = [q for q, c in zip(pool, conf) if c <= 0.5][:4]
    assert len(sure) == 4 and len(unsure) == 4
    clients = Clients(triton.http_url, triton.grpc_url)
    before = _metric(triton, "cascade_early", "early_exits")
    for q in sure:  # answered with the exit head's result
        got = clients.grpc_sync("cascade_early", q)
        np.testing.assert_allclose(got["logits"], model.reference(q)["early_logits"], atol=1e-4)
    for q in unsure:  # the full model
        got = clients.http_sync("cascade_early", q)
        np.testing.assert_allclose(got["logits"], model.reference(q)["logits"], atol=1e-4)
    # each confident query, and no other, left early
    exits = _settle(lambda: _metric(triton, "cascade_early", "early_exits"), lambda v: v >= before + len(sure))
    assert exits == before + len(sure), (before, exits)


def _pending(server: TritonServer, model: str) -> float:
    """Requests waiting in Triton's queue for the model (nv_inference_pending_request_count)."""
    found = _sample("nv_inference_pending_request_count", {"model": model}, _metrics_text(server))
    assert found is not None, f"no nv_inference_pending_request_count for model {model!r}"
    return found


def _served(server: TritonServer, model: str) -> tuple[float, float]:
    """(batches made, queries answered from them) by the model's batch table (0 until the first sample)."""
    text = _metrics_text(server)
    batches = _sample("dvabatch_meta_operations_total", {"model": model, "operation": "new"}, text) or 0.0
    return batches, _sample("dvabatch_table_answered_queries_total", {"model": model}, text) or 0.0


def test_requests_that_queued_during_a_call_are_handed_over_together_and_run_as_one_batch(server) -> None:
    """A lone request holds the model's stage (gate_engine.py) inside `execute`, which runs the
    loop's steps; 8 requests sent meanwhile wait in Triton's queue (its pending count says so), so
    the next `execute` gets all 8 and the load policy batches them as one: 2 rows of the batch
    table for 9 queries, as ZeroBatch would run them, and every answer the unsliced model's."""
    triton, models, _ = server
    model = models["fixed"]
    held, gate = model.version_dir / "held", model.version_dir / "open"
    rng = np.random.default_rng(4)
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    before = _served(triton, "dense_load")
    queries = [model.query(rng) for _ in range(9)]
    answers = _Answers()
    try:
        client.async_infer("dense_load", Clients.inputs(grpcclient, queries[0]), answers.callback(0), client_timeout=120)
        assert _settle(held.exists, bool), "the stage never took the first request"
        for i in range(1, 9):
            client.async_infer("dense_load", Clients.inputs(grpcclient, queries[i]), answers.callback(i),
                               client_timeout=120)
        assert _settle(lambda: _pending(triton, "dense_load"), lambda n: n >= 8) == 8
    finally:
        gate.touch()
    answers.wait(len(queries))
    client.close()
    for i, query in enumerate(queries):
        result, error = answers.got[i]
        assert error is None, error
        for out, ref in model.reference(query).items():
            np.testing.assert_allclose(result.as_numpy(out)[0], ref, atol=1e-4, err_msg=f"query {i} {out}")
    assert _settle(lambda: _served(triton, "dense_load"),
                   lambda v: v[1] >= before[1] + 9) == (before[0] + 2, before[1] + 9)


def test_requests_past_the_queue_bound_behind_an_inline_run_are_refused_at_once(server) -> None:
    """Overload is refused on the fast path too. A lone request holds the model's stage inside
    `execute` (gate_engine.py); of 4 requests sent meanwhile, 2 wait in Triton's queue (its bound is 2
    here; the slicer derives one from the profile) and 2 are refused UNAVAILABLE "Exceeds maximum
    queue size" while the gate is still shut. When it opens, the held request and the 2 queued ones
    are answered, and only those 3 ran."""
    triton, models, _ = server
    model = models["bounded"]
    held, gate = model.version_dir / "held", model.version_dir / "open"
    rng = np.random.default_rng(5)
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    queries = [model.query(rng) for _ in range(5)]
    answers = _Answers()
    try:
        client.async_infer(model.name, Clients.inputs(grpcclient, queries[0]), answers.callback(0), client_timeout=120)
        assert _settle(held.exists, bool), "the stage never took the first request"
        for i in range(1, 5):
            client.async_infer(model.name, Clients.inputs(grpcclient, queries[i]), answers.callback(i),
                               client_timeout=120)
        answers.wait(2)  # the refusals come while the gate is shut
        refused = list(answers.order)
        assert _pending(triton, model.name) == 2
    finally:
        gate.touch()
    answers.wait(3)
    client.close()
    for i in range(5):
        result, error = answers.got[i]
        if i in refused:
            assert result is None and error.status() == "StatusCode.UNAVAILABLE", (i, error.status(), error.message())
            assert "Exceeds maximum queue size" in error.message(), error
            continue
        assert error is None, error
        for out, ref in model.reference(queries[i]).items():
            np.testing.assert_allclose(result.as_numpy(out)[0], ref, atol=1e-4, err_msg=f"query {i} {out}")
    assert 0 not in refused and len(refused) == 2
    assert _settle(lambda: _served(triton, model.name)[1], lambda v: v >= 3) == 3  # the refused never ran


@pytest.mark.parametrize("variant, queue_rows", [("derived", None), ("standing", 2)])
def test_a_call_whose_oldest_waited_past_the_bound_in_tritons_queue_is_refused(server, variant: str,
                                                                              queue_rows: int | None) -> None:
    """Overload is refused in Triton's queue, which markers measure (queue_marker.py: requests the
    model sends itself, answered unrun; a wait is counted in calls served), as the slicer
    configures it (the derived bound: QUEUE_BATCHES calls) and with a bound of 2 rows configured
    for the runtime's queue (a quarter of a call; Triton's own queue unbounded). Each run of the
    stage is held until the test opens it (gate_engine.py:hold_each). Behind the lone request's
    run, 12 calls' worth wait in Triton's queue. The first full call (run 2) sends a marker,
    which joins the back, behind them all: every request that comes out before it arrived before
    it was sent, so a call served as run k has waited through k - 2 calls. Runs up to the bound
    + 2 serve their calls; every call after them is refused whole, UNAVAILABLE "Exceeds maximum
    queue size", unrun. Each request has exactly one answer: a result equal to the unsliced
    model's, or that refusal; the markers are no request's."""
    triton, models, _ = server
    model = models[variant]
    gates = model.version_dir
    bs = model.manifest.max_batch_size
    n = 1 + 12 * bs
    bound = QUEUE_BATCHES if queue_rows is None else queue_rows / bs  # in calls (`Admission.caller_bound`)
    runs = 2 + int(bound)  # runs that serve: the lone request's, then full calls
    rng = np.random.default_rng(11)
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    queries = [model.query(rng) for _ in range(n)]
    answers = _Answers()
    try:
        _backlog_behind_a_held_run(triton, model, client, queries, answers, n)
        for k in range(1, runs):
            (gates / f"open-{k}").touch()
            assert _settle((gates / f"held-{k + 1}").exists, bool), f"run {k + 1} never came"
        (gates / f"open-{runs}").touch()
        assert _settle(lambda: len(answers.got), lambda v: v == n) == n
        assert not (gates / f"held-{runs + 1}").exists()  # the calls after never ran
    finally:
        (gates / "open").touch()
    answers.wait(n)
    client.close()
    refused = _results_or_refusals(model, queries, answers, ("Exceeds maximum queue size: overloaded",))
    assert len(refused) == n - 1 - (runs - 1) * bs and 0 not in refused, refused
    drains = _settle(lambda: _sample("dvabatch_caller_drains_total", {"model": model.name},
                                     _metrics_text(triton)) or 0.0, lambda v: v >= len(refused))
    assert drains == len(refused)


def test_at_the_bound_arrivals_are_refused(server) -> None:
    """The bound on the runtime's queue (admission.py) through the real server, the pipeline
    forced. A lone request's batch is held at stage 0 (gate_engine.py:hold_each); the backlog sent
    meanwhile waits in the runtime's queue (Triton's pending count falls to 0) up to the derived
    bound, QUEUE_BATCHES batches of work, and what comes past it is refused. Requests sent then are
    refused UNAVAILABLE "Exceeds maximum queue size: overloaded, ... wait" at arrival while that
    batch is still held. Once every gate opens, each request has exactly one answer, a result equal to the
    unsliced model's or a refusal."""
    triton, models, _ = server
    model = models["door"]
    gates = model.version_dir
    bs = model.manifest.max_batch_size
    backlog = 1 + bs * QUEUE_BATCHES + 2  # 2 past the bound
    late = 3
    n = backlog + late
    rng = np.random.default_rng(13)
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    queries = [model.query(rng) for _ in range(n)]
    answers = _Answers()
    try:
        _send(client, model, queries, answers, 0)
        assert _settle((gates / "held-1").exists, bool), "the stage never took the first request"
        for i in range(1, backlog):
            _send(client, model, queries, answers, i)
        assert _settle(lambda: _pending(triton, model.name), lambda v: v == 0) == 0  # all in the runtime's queue
        assert _settle(lambda: len(answers.got), lambda v: v >= 2) >= 2  # the 2 past the bound
        for i in range(backlog, n):
            _send(client, model, queries, answers, i)
        assert _settle(lambda: all(i in answers.got for i in range(backlog, n)), bool), "the late ones were not answered"
        for i in range(backlog, n):
            result, error = answers.got[i]
            assert result is None and error.status() == "StatusCode.UNAVAILABLE", (i, error)
            assert "Exceeds maximum queue size: overloaded" in error.message() and "would make a request wait" in error.message(), error
        assert not (gates / "open-1").exists()  # the first batch is still held
    finally:
        (gates / "open").touch()
    answers.wait(n)
    client.close()
    refused = _results_or_refusals(model, queries, answers)
    assert len(refused) == 2 + late, refused


def _send(client: grpcclient.InferenceServerClient, model: ServedModel, queries: list, answers: "_Answers",
          i: int) -> None:
    client.async_infer(model.name, Clients.inputs(grpcclient, queries[i]), answers.callback(i), client_timeout=120)


def _backlog_behind_a_held_run(triton: TritonServer, model: ServedModel, client: grpcclient.InferenceServerClient,
                               queries: list, answers: "_Answers", count: int) -> None:
    """Query 0 sent and its run held (gate_engine.py:hold_each), then queries 1..count-1 sent: all
    of them waiting in Triton's queue (its pending count says so)."""
    _send(client, model, queries, answers, 0)
    assert _settle((model.version_dir / "held-1").exists, bool), "the stage never took the first request"
    for i in range(1, count):
        _send(client, model, queries, answers, i)
    assert _settle(lambda: _pending(triton, model.name), lambda v: v == count - 1) == count - 1


def _results_or_refusals(model: ServedModel, queries: list, answers: "_Answers",
                         refusals: tuple[str, ...] = ("Exceeds maximum queue size",)) -> list[int]:
    """Each query's one answer: a result equal to the unsliced model's, or a refusal (UNAVAILABLE,
    its message naming one of `refusals`); the refused queries' indices."""
    refused = []
    for i in range(len(queries)):
        result, error = answers.got[i]
        if error is not None:
            assert result is None and error.status() == "StatusCode.UNAVAILABLE", (i, error.status(), error.message())
            assert any(r in error.message() for r in refusals), error
            refused.append(i)
            continue
        for out, ref in model.reference(queries[i]).items():
            np.testing.assert_allclose(result.as_numpy(out)[0], ref, atol=1e-4, err_msg=f"query {i} {out}")
    return refused
