"""Clients for tests against the real tritonserver: `Sender` (one connection in one mode, one query
per send, every call with a client timeout) and `SteadyLoad` (client threads sending one query
after another until told to stop, each outcome recorded with when it was sent and answered)."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from dvabatch_backend.tools.serve import TritonServer, infer_inputs

from ..triton_support import ServedModel

TIMEOUT = 30.0  # client timeout of every request: a request that hangs fails the test, it never hangs it
MODES = ("http", "http-async", "grpc", "grpc-async")


def poll(condition: Callable[[], bool], timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


class Sender:
    """A client in one mode, connected on creation; one query (one row) per `send`, 30 s timeout."""

    def __init__(self, server: TritonServer, mode: str, timeout: float = TIMEOUT) -> None:
        self.mode = mode
        self.timeout = timeout
        self._module = httpclient if mode.startswith("http") else grpcclient
        if self._module is httpclient:
            self._client = httpclient.InferenceServerClient(server.http_url, connection_timeout=timeout,
                                                            network_timeout=timeout)
        else:
            self._client = grpcclient.InferenceServerClient(server.grpc_url)
        assert self._client.is_server_live()  # the connection is up before any query

    def send(self, model: str, query: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        inputs = infer_inputs(self._module, query)
        if self.mode == "http":
            result = self._client.infer(model, inputs)
        elif self.mode == "http-async":
            result = self._client.async_infer(model, inputs).get_result(timeout=self.timeout)
        elif self.mode == "grpc":
            result = self._client.infer(model, inputs, client_timeout=self.timeout)
        else:
            done = threading.Event()
            box: list = []

            def callback(result, error) -> None:  # tritonclient passes these by keyword
                box.append((result, error))
                done.set()

            self._client.async_infer(model, inputs, callback, client_timeout=self.timeout)
            if not done.wait(self.timeout + 5):
                raise TimeoutError(f"no gRPC answer within {self.timeout + 5:.0f} s")
            result, error = box[0]
            if error is not None:
                raise error
        response = result.get_response()
        names = [o["name"] for o in response["outputs"]] if isinstance(response, dict) else [o.name for o in response.outputs]
        return {name: result.as_numpy(name)[0] for name in names}

    def close(self) -> None:
        self._client.close()


def infer(server: TritonServer, mode: str, model: str, query: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One query with a fresh client, closed afterwards (an open HTTP connection delays server shutdown)."""
    sender = Sender(server, mode)
    try:
        return sender.send(model, query)
    finally:
        sender.close()


def assert_reference(model: ServedModel, query: Mapping[str, np.ndarray], got: Mapping[str, np.ndarray], what: str) -> None:
    ref = model.reference(query)
    assert set(got) == set(ref), what
    for name, value in ref.items():
        np.testing.assert_allclose(got[name], value, atol=1e-4, rtol=0, err_msg=f"{what} {name}")


@dataclass
class Outcome:
    """One request: 'ok' (outputs), 'error' (the server's message), 'timeout' (the client's timeout
    ended it) or 'broken' (anything else: never expected), with when it was sent and answered
    (time.monotonic)."""

    mode: str
    query: dict[str, np.ndarray]
    sent: float
    done: float
    kind: str
    value: object


def outcome_of(sender: Sender, model: str, query: dict[str, np.ndarray]) -> Outcome:
    sent = time.monotonic()
    try:
        kind, value = "ok", sender.send(model, query)
    except InferenceServerException as exc:
        message = exc.message() or str(exc)
        kind, value = ("timeout" if "Deadline Exceeded" in message else "error"), message
    except BaseException as exc:  # noqa: BLE001 - recorded (gevent's Timeout is no Exception)
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        timed_out = isinstance(exc, TimeoutError) or "timeout" in type(exc).__name__.lower()
        kind, value = ("timeout" if timed_out else "broken"), f"{type(exc).__name__}: {exc}"
    return Outcome(sender.mode, query, sent, time.monotonic(), kind, value)


class SteadyLoad:
    """`threads` clients (modes in turn), each sending one query after another to `model` from
    `start` until `stop`; `outcomes` holds every request's outcome."""

    def __init__(self, server: TritonServer, model: ServedModel, threads: int, seed: int = 0,
                 timeout: float = TIMEOUT) -> None:
        self.server, self.model, self.timeout = server, model, timeout
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i, seed + i), name=f"steady-load-{i}", daemon=True)
                         for i in range(threads)]

    def start(self) -> "SteadyLoad":
        for thread in self._threads:
            thread.start()
        return self

    def _run(self, index: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        sender = Sender(self.server, MODES[index % len(MODES)], self.timeout)
        try:
            while not self._stop.is_set():
                outcome = outcome_of(sender, self.model.name, self.model.query(rng))
                with self._lock:
                    self.outcomes.append(outcome)
                if outcome.kind != "ok":
                    self._stop.wait(0.02)  # a refused request returns at once: do not spin
        finally:
            sender.close()

    def count(self, kind: str, after: float = float("-inf")) -> int:
        """Requests of this kind sent after `after`."""
        with self._lock:
            return sum(o.kind == kind and o.sent > after for o in self.outcomes)

    def stop(self) -> None:
        """Stop sending and join every client (each request has its client timeout: none hangs)."""
        self._stop.set()
        for thread in self._threads:
            thread.join(self.timeout + 10)
        assert not any(t.is_alive() for t in self._threads), "a client hung"

    def assert_answers_correct(self, timeouts_allowed: bool = False) -> None:
        """No request broke (`timeouts_allowed`: or timed out), and every result equals the unsliced model."""
        unexpected = ("broken",) if timeouts_allowed else ("broken", "timeout")
        broken = [(o.mode, o.kind, o.value) for o in self.outcomes if o.kind in unexpected]
        assert broken == [], broken
        for i, outcome in enumerate(self.outcomes):
            if outcome.kind == "ok":
                assert_reference(self.model, outcome.query, outcome.value, f"request {i} ({outcome.mode})")  # type: ignore[arg-type]

    def summary(self) -> str:
        kinds = [o.kind for o in self.outcomes]
        return (f"{len(kinds)} requests: {kinds.count('ok')} ok, {kinds.count('error')} failed with an error, "
                f"{kinds.count('timeout')} ended by the client's timeout, {kinds.count('broken')} broken")
