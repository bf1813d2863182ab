"""Model lifecycle on the real tritonserver (model control mode explicit): a model loads, serves
answers equal to the unsliced model, unloads (its backend stub process exits, the server's
threads go back to what they were), and reloads to serve correctly again, three times over;
unloading while requests are in flight answers every one of them and nothing hangs; unloading and
loading again while clients keep sending answers every request (a result equal to the unsliced
model, or a clear refusal while it is unloaded) and leaves no stub or shared-memory region. The
server runs the stub watchdog: none of these deliberate unloads counts as a dead stub."""
from __future__ import annotations

import json
import shutil
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import psutil
import pytest
from tritonclient.utils import InferenceServerException

from dvabatch_backend.tools.serve import SHM_DIR, TritonServer, children

from ..triton_support import ServedModel, add_variant, control_client, slice_zoo_model, stub_pids
from .load_clients import MODES, TIMEOUT, Sender, SteadyLoad, assert_reference, infer, poll

THREAD_SLACK = 8  # threads the server may keep beyond its count before the first load (it has ~35 more per model)
CYCLE, FLIGHT, STEADY = "bert_cycle", "minilm_flight", "minilm_steady"
CLIENTS = 4
GATE_POLICY = Path(__file__).with_name("gate_policy.py")  # holds arrivals until a file exists


# -- helpers -------------------------------------------------------------------------------------

def server_pid(server: TritonServer) -> int:
    assert server._process is not None and not server.exited(), server.log_tail()
    return server._process.pid


def server_threads(server: TritonServer) -> int:
    return psutil.Process(server_pid(server)).num_threads()


def zombie_children(server: TritonServer) -> list[int]:
    return [pid for pid, _, status in children(server_pid(server)) if status == psutil.STATUS_ZOMBIE]


def admitted(server: TritonServer, model: str) -> int:
    """Requests Triton has handed to the model's `execute` (which returns at once: they are in flight)."""
    with urllib.request.urlopen(f"http://{server.http_url}/v2/models/{model}/stats", timeout=5) as response:
        return int(json.load(response)["model_stats"][0]["inference_count"])


def check_serves(server: TritonServer, model: ServedModel, rng: np.random.Generator, per_mode: int = 2) -> None:
    """Concurrent queries over every mode, mixed lengths: each answer equals the unsliced model."""
    work = [(mode, model.query(rng)) for mode in MODES for _ in range(per_mode)]
    failures: list[str] = []

    def send(mode: str, query: dict) -> None:
        try:
            assert_reference(model, query, infer(server, mode, model.name, query), mode)
        except Exception as exc:  # collected: every query must succeed
            failures.append(f"{mode}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=send, args=w) for w in work]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT + 10)
    assert not any(t.is_alive() for t in threads), "a query hung"
    assert failures == []


def unload_and_check_gone(server: TritonServer, client, model: str, threads_before_load: int) -> None:
    client.unload_model(model)
    assert poll(lambda: not server.model_ready(model)), f"{model} still ready after unload"
    model_dir = server.model_repository / model
    assert poll(lambda: not stub_pids(model_dir)), f"stub(s) {stub_pids(model_dir)} of {model} left after unload"
    # the server itself is fine: alive, live, no zombie children, its threads back to what they were
    assert not server.exited(), server.log_tail()
    assert server._get("/v2/health/live") == 200
    assert poll(lambda: not zombie_children(server), 10), f"zombie children {zombie_children(server)}"
    assert poll(lambda: server_threads(server) <= threads_before_load + THREAD_SLACK, 10), \
        f"server threads {server_threads(server)} after unload, {threads_before_load} before the load"
    # a request to the unloaded model is refused at once, clearly
    with pytest.raises(InferenceServerException) as refused:
        infer(server, "grpc", model, {"input_ids": np.ones(4, np.int64), "attention_mask": np.ones(4, np.int64)})
    assert model in (refused.value.message() or "")


# -- the repository and server -------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(tmp_path_factory) -> dict:
    repo = tmp_path_factory.mktemp("lifecycle_repository")
    gate = tmp_path_factory.mktemp("gates") / "flight"
    minilm = slice_zoo_model(repo / ".sliced", "minilm")
    shutil.copy(GATE_POLICY, minilm.version_dir / GATE_POLICY.name)
    models = {
        CYCLE: add_variant(repo, slice_zoo_model(repo / ".sliced", "bert"), CYCLE),
        # pipelined behind a gate: the test holds the requests in the model until it unloads it (its
        # queue unbounded: every one waits there, none past a bound)
        FLIGHT: add_variant(repo, minilm, FLIGHT, policy=f"{GATE_POLICY.name}:GatePolicy",
                            policy_params={"gate": gate, "inner": "pipelined"}, extra={"max_queue_size": 0}),
        STEADY: add_variant(repo, minilm, STEADY),
    }
    server = TritonServer(repo, explicit=True, watch_stubs=True).start()
    try:
        yield {"server": server, "models": models, "gate": gate}
        assert server.stub_restarts == 0, "the watchdog took a deliberate unload for a dead stub"
    finally:
        server.stop()


# -- tests ---------------------------------------------------------------------------------------

def test_load_serve_unload_reload_three_times(served) -> None:
    server: TritonServer = served["server"]
    model: ServedModel = served["models"][CYCLE]
    model_dir = server.model_repository / CYCLE
    rng = np.random.default_rng(1)
    assert not server.model_ready(CYCLE) and stub_pids(model_dir) == []
    threads_before_load = server_threads(server)
    counts = []
    for cycle, protocol in enumerate(("http", "grpc", "http")):
        client = control_client(server, protocol)
        try:
            client.load_model(CYCLE)
            server.wait_model_ready(CYCLE, timeout=60)
            assert len(stub_pids(model_dir)) == 1, f"cycle {cycle}: stubs {stub_pids(model_dir)}"
            check_serves(server, model, rng)
            unload_and_check_gone(server, client, CYCLE, threads_before_load)
            counts.append(server_threads(server))
        finally:
            client.close()
    # no thread leak from cycle to cycle
    assert max(counts) <= min(counts) + THREAD_SLACK // 2, counts


def test_unload_with_requests_in_flight_answers_every_request(served) -> None:
    server: TritonServer = served["server"]
    model: ServedModel = served["models"][FLIGHT]
    model_dir = server.model_repository / FLIGHT
    rng = np.random.default_rng(2)
    gate: Path = served["gate"]
    threads_before_load = server_threads(server)
    client = control_client(server, "http")
    try:
        gate.touch()
        client.load_model(FLIGHT)
        server.wait_model_ready(FLIGHT, timeout=60)
        check_serves(server, model, rng, per_mode=1)
        gate.unlink()  # from now on the requests wait in the model

        n = 64
        queries = [model.query(rng, model.max_length) for _ in range(n)]
        outcomes: list[tuple[str, object, float] | None] = [None] * n
        ready = threading.Barrier(n + 1)
        go = threading.Event()

        def send(i: int) -> None:
            sender = Sender(server, MODES[i % len(MODES)])
            try:
                ready.wait(30)
                go.wait(30)
                try:
                    outcomes[i] = ("ok", sender.send(FLIGHT, queries[i]), time.monotonic())
                except InferenceServerException as exc:
                    outcomes[i] = ("error", exc.message() or str(exc), time.monotonic())
                except Exception as exc:  # a timeout or anything else: recorded, and fails the test below
                    outcomes[i] = ("broken", f"{type(exc).__name__}: {exc}", time.monotonic())
            finally:
                sender.close()

        before = admitted(server, FLIGHT)
        threads = [threading.Thread(target=send, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        ready.wait(30)  # every client connected
        go.set()
        # every request has reached the model before the unload, and none can have been answered
        assert poll(lambda: admitted(server, FLIGHT) >= before + n, TIMEOUT), admitted(server, FLIGHT) - before
        unload_at = time.monotonic()
        in_flight = sum(o is None for o in outcomes)
        assert in_flight == n, "answered behind a shut gate"
        gate.touch()  # they start through the pipeline: the unload finds some mid-run, others waiting
        client.unload_model(FLIGHT)  # returns at once; Triton finishes the unload in the background
        for t in threads:
            t.join(TIMEOUT + 10)
        assert not any(t.is_alive() for t in threads), "a request hung across the unload"
        assert all(o is not None for o in outcomes)

        unclear = []
        for i, (kind, value, at) in enumerate(outcomes):  # type: ignore[misc]
            if kind == "ok":
                assert_reference(model, queries[i], value, f"request {i} ({MODES[i % len(MODES)]})")  # type: ignore[arg-type]
            elif kind == "broken" or "shutting down" not in value:  # type: ignore[operator]
                unclear.append((i, kind, value))
        assert unclear == [], unclear
        assert sum(o[2] > unload_at for o in outcomes) >= in_flight  # type: ignore[index]

        assert poll(lambda: not server.model_ready(FLIGHT))
        assert poll(lambda: not stub_pids(model_dir)), f"stub(s) {stub_pids(model_dir)} left after unload"
        assert not server.exited() and server._get("/v2/health/live") == 200
        assert poll(lambda: server_threads(server) <= threads_before_load + THREAD_SLACK, 10)

        # it loads again and serves correctly
        client.load_model(FLIGHT)
        server.wait_model_ready(FLIGHT, timeout=60)
        check_serves(server, model, rng, per_mode=2)
        unload_and_check_gone(server, client, FLIGHT, threads_before_load)
    finally:
        client.close()


def stub_regions(model_dir: Path) -> set[str]:
    """The shared-memory regions of the model's stubs (each stub's third argument)."""
    regions = set()
    for pid in stub_pids(model_dir):
        try:
            regions.add(psutil.Process(pid).cmdline()[2])
        except (psutil.Error, IndexError):
            pass
    return regions


def test_unload_and_reload_under_steady_load(served) -> None:
    server: TritonServer = served["server"]
    model: ServedModel = served["models"][STEADY]
    model_dir = server.model_repository / STEADY
    threads_before_load = server_threads(server)
    client = control_client(server, "grpc")
    load = None
    try:
        client.load_model(STEADY)
        server.wait_model_ready(STEADY, timeout=60)
        regions = stub_regions(model_dir)
        assert len(regions) == 1 and all((SHM_DIR / r).exists() for r in regions)
        load = SteadyLoad(server, model, CLIENTS, seed=11).start()
        assert poll(lambda: load.count("ok") >= 2 * CLIENTS, 60), load.summary()

        unload_at = time.monotonic()
        client.unload_model(STEADY)
        assert poll(lambda: not server.model_ready(STEADY)), f"{STEADY} still ready after unload"
        assert poll(lambda: not stub_pids(model_dir)), f"stub(s) {stub_pids(model_dir)} left after unload"
        # Triton unlinks a stub's region after the stub has exited, so the region outlives the pid briefly
        assert poll(lambda: not [r for r in regions if (SHM_DIR / r).exists()], 10), "shared memory left after unload"
        # the clients go on sending: refused while it is unloaded
        assert poll(lambda: load.count("error", after=unload_at) >= CLIENTS, 30), load.summary()

        client.load_model(STEADY)
        server.wait_model_ready(STEADY, timeout=60)
        loaded_at = time.monotonic()
        assert len(stub_pids(model_dir)) == 1
        assert poll(lambda: load.count("ok", after=loaded_at) >= 2 * CLIENTS, 60), load.summary()
    finally:
        if load is not None:
            load.stop()
        client.close()

    load.assert_answers_correct()
    failed = [o for o in load.outcomes if o.kind == "error"]
    assert all(unload_at < o.done and o.sent < loaded_at for o in failed), "a request failed outside the unload"
    unclear = {str(o.value) for o in failed if STEADY not in str(o.value) and "shutting down" not in str(o.value)}
    assert unclear == set(), unclear
    assert all(o.kind == "ok" for o in load.outcomes if o.sent > loaded_at)
    print(f"\nunload + load under {CLIENTS} clients: {load.summary()}; "
          f"refusals: {sorted({str(o.value)[:70] for o in failed})}")
    control = control_client(server, "http")
    try:
        unload_and_check_gone(server, control, STEADY, threads_before_load)
    finally:
        control.close()
    assert server.stub_restarts == 0
