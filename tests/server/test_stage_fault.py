"""An injected stage error stays where it happens, on the real tritonserver: stage 1 of a sliced
MiniLM raises for the rows of marked queries (tests/server/fault_engine.py, the `engine_wrapper`
parameter). Concurrent requests are held behind the gate policy so that they form one batch with
the marked ones, deterministically:
  - a per-row fault: exactly the marked requests fail, with an error that names stage 1; every
    other request of the batch (rerun row by row) and of a steady load beside them is answered
    equal to the unsliced model, and the model keeps serving;
  - a fault of the whole batch only (more than one row): the row-by-row rerun answers every
    request correctly, the marked one included."""
from __future__ import annotations

import json
import shutil
import threading
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from dvabatch_backend.tools.serve import TritonServer

from ..triton_support import ServedModel, add_variant, slice_zoo_model
from .fault_engine import MARKER
from .load_clients import MODES, TIMEOUT, Outcome, Sender, SteadyLoad, assert_reference, outcome_of, poll

HERE = Path(__file__).parent
GATE_POLICY, FAULT_ENGINE = HERE / "gate_policy.py", HERE / "fault_engine.py"
ROW, BATCH = "fault_rows", "fault_batch"
WRAPPERS = {ROW: "per_row_fault", BATCH: "batch_fault"}
FAULT_LOGS = {ROW: "faults-row.log", BATCH: "faults-batch.log"}
BATCH_SIZE = 8  # the sliced model's bs_max: the gate lets them through as one batch


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    repo = tmp_path_factory.mktemp("fault_repository")
    gates = tmp_path_factory.mktemp("fault_gates")
    minilm = slice_zoo_model(repo / ".sliced", "minilm")
    for helper in (GATE_POLICY, FAULT_ENGINE):
        shutil.copy(helper, minilm.version_dir / helper.name)
    models = {}
    for name, wrapper in WRAPPERS.items():
        models[name] = add_variant(repo, minilm, name, policy=f"{GATE_POLICY.name}:GatePolicy",
                                   policy_params={"gate": gates / name, "inner": "pipelined"})
        with open(repo / name / "config.pbtxt", "a") as config:
            config.write(f'parameters: {{ key: "engine_wrapper" value: {{ string_value: "{FAULT_ENGINE.name}:{wrapper}" }} }}\n')
    server = TritonServer(repo, explicit=True, load=list(WRAPPERS)).start()
    try:
        yield server, models, gates
    finally:
        server.stop()


def marked(query: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    query = {k: v.copy() for k, v in query.items()}
    query["input_ids"][0] = MARKER
    return query


def is_marked(query: dict[str, np.ndarray]) -> bool:
    return int(query["input_ids"][0]) == MARKER


def admitted(server: TritonServer, model: str) -> int:
    """Requests Triton has handed to the model's `execute` (which returns at once: they are in flight)."""
    with urllib.request.urlopen(f"http://{server.http_url}/v2/models/{model}/stats", timeout=5) as response:
        return int(json.load(response)["model_stats"][0]["inference_count"])


def gated_round(server: TritonServer, name: str, gate: Path, queries: list[dict[str, np.ndarray]]) -> list[Outcome]:
    """Send every query at once (a client thread each, every mode) behind the shut gate; once all
    are in the model, open the gate: they go through together. Returns their outcomes."""
    if gate.exists():
        gate.unlink()
    n = len(queries)
    outcomes: list[Outcome | None] = [None] * n
    connected = threading.Barrier(n + 1)

    def send(i: int) -> None:
        sender = Sender(server, MODES[i % len(MODES)])
        try:
            connected.wait(30)
            outcomes[i] = outcome_of(sender, name, queries[i])
        finally:
            sender.close()

    before = admitted(server, name)
    threads = [threading.Thread(target=send, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    connected.wait(30)
    assert poll(lambda: admitted(server, name) >= before + n, TIMEOUT), server.log_tail()
    assert all(o is None for o in outcomes), "answered behind a shut gate"
    gate.touch()
    for thread in threads:
        thread.join(TIMEOUT + 10)
    assert not any(t.is_alive() for t in threads), "a request hung"
    assert all(o is not None for o in outcomes)
    return outcomes  # type: ignore[return-value]


def fault_lines(model: ServedModel, name: str) -> list[str]:
    log = model.version_dir / FAULT_LOGS[name]
    return log.read_text().splitlines() if log.exists() else []


def assert_stage_1_failure(outcome: Outcome) -> None:
    assert outcome.kind == "error", (outcome.kind, outcome.value)
    assert "at stage 1" in str(outcome.value) and "injected row fault" in str(outcome.value), outcome.value


def test_a_per_row_fault_fails_exactly_the_marked_requests(faulty) -> None:
    server, models, gates = faulty
    model: ServedModel = models[ROW]
    rng = np.random.default_rng(21)
    queries = [model.query(rng) for _ in range(BATCH_SIZE)]
    queries[2], queries[5] = marked(queries[2]), marked(queries[5])
    outcomes = gated_round(server, ROW, gates / ROW, queries)
    for query, outcome in zip(queries, outcomes):
        if is_marked(query):
            assert_stage_1_failure(outcome)
        else:
            assert outcome.kind == "ok", (outcome.kind, outcome.value)
            assert_reference(model, query, outcome.value, outcome.mode)  # type: ignore[arg-type]
    # the batch raised, then each marked row alone: the others of the batch were saved by the rerun
    runs = fault_lines(model, ROW)
    assert any(int(line.split()[0]) > 1 for line in runs), runs
    batch_failed, ok = sum(o.kind == "error" for o in outcomes), sum(o.kind == "ok" for o in outcomes)

    # under a steady load beside them, marked requests fail alone, again and again
    load = SteadyLoad(server, model, threads=3, seed=22).start()
    try:
        assert poll(lambda: load.count("ok") >= 6, 60), load.summary()
        probe = Sender(server, "grpc")
        try:
            marked_outcomes = [outcome_of(probe, ROW, marked(model.query(rng))) for _ in range(4)]
        finally:
            probe.close()
        after = max(o.done for o in marked_outcomes)
        assert poll(lambda: load.count("ok", after=after) >= 6, 60), load.summary()  # it keeps serving
    finally:
        load.stop()
    for outcome in marked_outcomes:
        assert_stage_1_failure(outcome)
    load.assert_answers_correct()
    assert load.count("error") == 0, load.summary()
    print(f"\nper-row fault: batch of {BATCH_SIZE} with 2 marked: {batch_failed} failed (the marked), {ok} ok; "
          f"steady load: {load.summary()}, beside it 4 marked requests: "
          f"{sum(o.kind == 'error' for o in marked_outcomes)} failed; stage 1 raised {len(fault_lines(model, ROW))} "
          f"time(s); an error: {marked_outcomes[0].value!r}")


def test_a_batch_only_fault_is_saved_by_the_row_by_row_rerun(faulty) -> None:
    server, models, gates = faulty
    model: ServedModel = models[BATCH]
    rng = np.random.default_rng(31)
    queries = [model.query(rng) for _ in range(BATCH_SIZE)]
    queries[3] = marked(queries[3])
    outcomes = gated_round(server, BATCH, gates / BATCH, queries)
    for query, outcome in zip(queries, outcomes):
        assert outcome.kind == "ok", (outcome.kind, outcome.value)
        assert_reference(model, query, outcome.value, outcome.mode)  # type: ignore[arg-type]
    runs = fault_lines(model, BATCH)
    assert runs and all(int(line.split()[0]) > 1 for line in runs), runs  # the batch did fail, then was rerun
    print(f"\nbatch-only fault: batch of {BATCH_SIZE} with 1 marked: stage 1 raised {len(runs)} time(s) "
          f"({runs}); {sum(o.kind == 'ok' for o in outcomes)} of {BATCH_SIZE} answered correctly by the rerun")
