"""`dvabatch serve` stops cleanly on SIGTERM and SIGINT: with requests held in flight (behind the
gate policy), every one is answered (a result or an error, none hangs), the command exits 0, and
no server process, stub, shared-memory region or work folder of that server is left. `--host`
sets the address every endpoint listens on.

Triton unloads a model only once the requests it holds are answered (it calls `finalize` after
that), so a stop drains what is in flight: the test opens the gate once the unload has begun."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import pytest

from dvabatch_backend.tools.serve import (SHM_DIR, TritonServer, backend_shm_regions, children, connect_host,
                                          free_ports, is_zombie, mapped_shm_regions)

from ..triton_support import ServedModel, add_variant, slice_zoo_model, stub_pids
from .load_clients import Outcome, Sender, assert_reference, outcome_of, poll

MODEL = "gated"
GATE_POLICY = Path(__file__).with_name("gate_policy.py")  # holds arrivals until a file exists
IN_FLIGHT = 8
CLIENT_TIMEOUT = 60.0
UP_TIMEOUT = 180.0  # slicing is done; loading a model takes seconds, on a busy machine more


@pytest.fixture(scope="module")
def gated(tmp_path_factory) -> tuple[ServedModel, Path]:
    repo = tmp_path_factory.mktemp("stops_repository")
    gate = tmp_path_factory.mktemp("stops_gate") / "open"
    minilm = slice_zoo_model(repo / ".sliced", "minilm")
    shutil.copy(GATE_POLICY, minilm.version_dir / GATE_POLICY.name)
    model = add_variant(repo, minilm, MODEL, policy=f"{GATE_POLICY.name}:GatePolicy",
                        policy_params={"gate": gate, "inner": "pipelined"})
    return model, gate


@dataclass
class ServeProcess:
    """`dvabatch serve` run as a command, on free ports, and what it started (read with psutil)."""

    process: subprocess.Popen[bytes]
    http_port: int
    grpc_port: int
    output: Path

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    def text(self) -> str:
        return self.output.read_text(errors="replace")


def start_serve(repo: Path, out: Path, *extra: str) -> ServeProcess:
    http, grpc, metrics = free_ports(3)
    command = [sys.executable, "-m", "dvabatch_backend.tools.cli", "serve", "--model-repository", str(repo),
               "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
               "--explicit", "--load", MODEL, *extra]
    with open(out, "wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    serve = ServeProcess(process, http, grpc, out)
    if not poll(lambda: "tritonserver is up" in serve.text() or process.poll() is not None, UP_TIMEOUT):
        process.kill()
        process.wait(30)
    assert "tritonserver is up" in serve.text(), serve.text()
    return serve


def server_children(pid: int) -> list[int]:
    return [child for child, _, _ in children(pid)]


def backend_directory(pid: int) -> Path | None:
    """The `--backend-directory` of the tritonserver `pid` started, once it has exec'd."""
    for child in server_children(pid):
        try:
            arguments = psutil.Process(child).cmdline()
        except psutil.Error:
            continue
        for argument in arguments:
            if argument.startswith("--backend-directory="):
                return Path(argument.partition("=")[2])
    return None


def alive(pid: int) -> bool:
    return psutil.pid_exists(pid) and not is_zombie(pid)


def admitted(http_url: str, model: str) -> int:
    """Requests Triton has handed to the model's `execute` (which returns at once: they are in flight)."""
    with urllib.request.urlopen(f"http://{http_url}/v2/models/{model}/stats", timeout=5) as response:
        return int(json.load(response)["model_stats"][0]["inference_count"])


def model_state(http_url: str, model: str) -> str | None:
    request = urllib.request.Request(f"http://{http_url}/v2/repository/index", data=b"{}", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            states = [m.get("state") for m in json.load(response) if m["name"] == model]
    except OSError:
        return None
    return states[0] if states else None


class _Target:
    """What `Sender` needs of a server: its URLs."""

    def __init__(self, serve: ServeProcess) -> None:
        self.http_url, self.grpc_url = serve.http_url, f"127.0.0.1:{serve.grpc_port}"


def send_in_flight(serve: ServeProcess, model: ServedModel, n: int) -> tuple[list[threading.Thread], list[Outcome | None]]:
    """`n` requests, one per client thread (each makes its own client: they are not shared across
    threads), over every mode; returns once every client is connected and sending."""
    rng = np.random.default_rng(5)
    queries = [model.query(rng) for _ in range(n)]
    outcomes: list[Outcome | None] = [None] * n
    connected = threading.Barrier(n + 1)

    def send(i: int) -> None:
        sender = Sender(_Target(serve), ("http", "grpc", "grpc-async", "http-async")[i % 4], CLIENT_TIMEOUT)  # type: ignore[arg-type]
        try:
            connected.wait(30)
            outcomes[i] = outcome_of(sender, MODEL, queries[i])
        finally:
            sender.close()

    threads = [threading.Thread(target=send, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    connected.wait(30)
    return threads, outcomes


@dataclass
class Started:
    """What a `dvabatch serve` started, found while it runs: for the checks, and for cleaning up
    after a failed test (a serve killed hard leaves its tritonserver, which runs in its own session)."""

    triton: int
    work: Path
    region: str

    @classmethod
    def find(cls, serve: ServeProcess, repo: Path) -> "Started":
        [triton] = [pid for pid in server_children(serve.process.pid) if alive(pid)]
        [stub] = stub_pids(repo / MODEL)
        argv = psutil.Process(stub).cmdline()
        work = Path(argv[0]).parents[2]  # <work>/backends/python/triton_python_backend_stub
        return cls(triton, work, argv[2])


def clean_up(serve: ServeProcess, started: Started | None, repo: Path) -> None:
    """After the test, pass or fail: stop the command (a signal, then a kill) and remove whatever of
    its server is left (nothing, when the test passed)."""
    if serve.process.poll() is None:
        serve.process.terminate()
        try:
            serve.process.wait(150)
        except subprocess.TimeoutExpired:
            serve.process.kill()
            serve.process.wait(30)
    if started is None:
        return
    for pid in [started.triton] * alive(started.triton) + stub_pids(repo / MODEL):
        os.kill(pid, signal.SIGKILL)
    (SHM_DIR / started.region).unlink(missing_ok=True)
    shutil.rmtree(started.work, ignore_errors=True)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_answers_what_is_in_flight_and_leaves_nothing(gated, tmp_path, sig) -> None:
    model, gate = gated
    repo = model.version_dir.parent.parent.parent  # <repo>/.sliced/minilm/1
    if gate.exists():
        gate.unlink()  # requests wait in the model
    serve = start_serve(repo, tmp_path / "serve.out")
    started = None
    try:
        started = Started.find(serve, repo)
        assert started.work.name.startswith("dvabatch-triton-") and (SHM_DIR / started.region).exists()
        assert "listening on 127.0.0.1" in serve.text()

        start = admitted(serve.http_url, MODEL)
        threads, outcomes = send_in_flight(serve, model, IN_FLIGHT)
        # every request is in the model, and none can be answered behind the shut gate
        assert poll(lambda: admitted(serve.http_url, MODEL) >= start + IN_FLIGHT, CLIENT_TIMEOUT), serve.text()
        assert all(o is None for o in outcomes)
        serve.process.send_signal(sig)
        # the stop has begun (the model is unloading) before the held requests may go on
        assert poll(lambda: model_state(serve.http_url, MODEL) == "UNLOADING", 30), serve.text()
        assert all(o is None for o in outcomes)
        gate.touch()
        code = serve.process.wait(120)
        for thread in threads:
            thread.join(CLIENT_TIMEOUT + 10)
        assert not any(t.is_alive() for t in threads), "a request hung across the stop"

        assert code == 0, serve.text()
        kinds = [o.kind if o else "none" for o in outcomes]
        assert all(k in ("ok", "error") for k in kinds), [(o.kind, o.value) if o else None for o in outcomes]
        errors = {str(o.value) for o in outcomes if o and o.kind == "error"}
        assert all("shutting down" in e for e in errors), errors
        for outcome in outcomes:
            if outcome is not None and outcome.kind == "ok":
                assert_reference(model, outcome.query, outcome.value, outcome.mode)  # type: ignore[arg-type]
        # nothing of that server is left
        assert not alive(started.triton), "tritonserver left running"
        assert poll(lambda: stub_pids(repo / MODEL) == [], 10), stub_pids(repo / MODEL)
        assert not (SHM_DIR / started.region).exists(), f"shared memory {started.region} left"
        assert not started.work.exists(), f"{started.work} left"
    finally:
        clean_up(serve, started, repo)
    print(f"\n{signal.Signals(sig).name}: {IN_FLIGHT} requests in flight, {kinds.count('ok')} answered with a "
          f"result, {kinds.count('error')} with an error ({sorted(e[:60] for e in errors)}); exit {code}")


def test_sigterm_while_starting_stops_it_too(gated, tmp_path) -> None:
    """SIGTERM as soon as tritonserver runs (it is loading the model): exit 0, nothing left (its
    stub's region, whose name no one may have seen: no region made meanwhile is left unused)."""
    model, _ = gated
    regions_before = backend_shm_regions()
    repo = model.version_dir.parent.parent.parent
    out = tmp_path / "serve.out"
    ports = free_ports(3)
    command = [sys.executable, "-m", "dvabatch_backend.tools.cli", "serve", "--model-repository", str(repo),
               "--http-port", str(ports[0]), "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]),
               "--explicit", "--load", MODEL]
    with open(out, "wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    serve = ServeProcess(process, 0, 0, out)
    try:
        # Between fork and exec the child still shows python's command line: wait for tritonserver's.
        assert poll(lambda: backend_directory(process.pid) is not None, UP_TIMEOUT), serve.text()
        [triton] = server_children(process.pid)
        work = backend_directory(process.pid).parent
        process.send_signal(signal.SIGTERM)
        code = process.wait(150)
        assert code == 0, serve.text()
        assert not alive(triton), "tritonserver left running"
        assert poll(lambda: stub_pids(repo / MODEL) == [], 10), stub_pids(repo / MODEL)
        assert not work.exists(), f"{work} left"
        left = (backend_shm_regions() - regions_before) - mapped_shm_regions()
        assert not left, f"shared memory left: {left}"
    finally:
        clean_up(serve, None, repo)
    print(f"\nSIGTERM while starting: {serve.text().strip().splitlines()[-2:]}; exit {code}")


def test_host_sets_every_address() -> None:
    server = TritonServer("/nonexistent", host="0.0.0.0")
    command = server.command()
    try:
        for flag in ("--http-address", "--grpc-address", "--metrics-address"):
            assert f"{flag}=0.0.0.0" in command
        assert server.http_url.startswith("127.0.0.1:") and server.grpc_url.startswith("127.0.0.1:")
        assert re.match(r"http://127\.0\.0\.1:\d+/metrics$", server.metrics_url)
    finally:
        server.stop()  # removes the backends folder `command` assembled
    assert connect_host("10.1.2.3") == "10.1.2.3" and connect_host("::") == "[::1]"
    default = TritonServer("/nonexistent")
    assert "--http-address=127.0.0.1" in default.command() and default.http_url.startswith("127.0.0.1:")
    default.stop()
