"""The stub watchdog on the real tritonserver: `kill -9` of a model's Python-backend stub under
concurrent load. The requests sent while the stub is dead get an error at once; those it held
(in flight at the kill) are never answered by the server and end by their client's timeout
(none hangs),
the model stops answering ready (observed while the watchdog is held in its model-down hook,
before it loads the model again), and then the model serves answers equal to the unsliced model
again (a generous bound catches a hang; how fast it recovers is not asserted); nothing of the server
is left after it stops."""
from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from dvabatch_backend.tools.serve import SHM_DIR, TritonServer, is_zombie

from ..triton_support import add_variant, slice_zoo_model, stub_pids
from .load_clients import Sender, SteadyLoad, outcome_of, poll

MODEL = "watched"
POLLED = "polled"  # served by a second server whose watchdog polls only when the test says
CLIENTS = 4
RECOVERY_BOUND = 90.0  # a bound on a hang, not a speed requirement
HOLD = 30.0  # longest the model-down hook holds the watchdog
CLIENT_TIMEOUT = 15.0  # ends the requests the dead stub held


class Episode:
    """What the watchdog's hooks saw: readiness when the model was down, and when it came back."""

    def __init__(self) -> None:
        self.down = threading.Event()
        self.resume = threading.Event()
        self.recovered = threading.Event()
        self.recovered_at = float("inf")
        self.down_at = float("inf")
        self.ready_when_down: list[bool] = []
        self.server: TritonServer | None = None

    def on_model_down(self, model: str) -> None:
        assert self.server is not None
        self.ready_when_down.append(self.server.model_ready(model))
        self.down_at = time.monotonic()
        self.down.set()
        self.resume.wait(HOLD)  # the test looks at the unloaded model before the watchdog loads it again

    def on_model_recovered(self, model: str) -> None:
        self.recovered_at = time.monotonic()
        self.recovered.set()


@pytest.fixture(scope="module")
def watched(tmp_path_factory):
    repo = tmp_path_factory.mktemp("watchdog_repository")
    model = add_variant(repo, slice_zoo_model(repo / ".sliced", "minilm"), MODEL)
    add_variant(repo, model, POLLED)
    episode = Episode()
    server = TritonServer(repo, explicit=True, load=[MODEL], watch_stubs=True,
                          on_model_down=episode.on_model_down, on_model_recovered=episode.on_model_recovered)
    episode.server = server
    server.start()
    try:
        yield server, model, episode
    finally:
        episode.resume.set()
        regions = set(server.watchdog.shm_regions) if server.watchdog else set()
        server.stop()
        assert not [t for t in threading.enumerate() if t.name == "dvabatch-stub-watchdog"], "watchdog thread left"
        assert stub_pids(repo / MODEL) == [], "stub left after stop"
        assert regions and not [r for r in regions if (SHM_DIR / r).exists()], "shared memory left after stop"


def test_kill_9_of_the_stub_under_load_is_recovered(watched) -> None:
    server, model, episode = watched
    server.wait_model_ready(MODEL, timeout=60)
    [stub] = stub_pids(server.model_repository / MODEL)
    load = SteadyLoad(server, model, CLIENTS, timeout=CLIENT_TIMEOUT).start()
    try:
        assert poll(lambda: load.count("ok") >= 2 * CLIENTS, 60), load.summary()  # all clients under way
        killed_at = time.monotonic()
        os.kill(stub, signal.SIGKILL)

        assert episode.down.wait(RECOVERY_BOUND), "the watchdog did not notice the dead stub"
        # held in the hook: the model is unloaded, not ready, and a request to it fails at once
        assert episode.ready_when_down == [False]
        assert not server.model_ready(MODEL)
        probe = Sender(server, "grpc")
        try:
            refused = outcome_of(probe, MODEL, model.query(np.random.default_rng(7)))
        finally:
            probe.close()
        assert refused.kind == "error", (refused.kind, refused.value)
        episode.resume.set()

        assert episode.recovered.wait(max(0.0, killed_at + RECOVERY_BOUND - time.monotonic())), \
            f"not serving again within {RECOVERY_BOUND:.0f} s of the kill:\n{server.log_tail()}"
        assert server.model_ready(MODEL) and server.stub_restarts == 1
        new_stubs = stub_pids(server.model_repository / MODEL)
        assert len(new_stubs) == 1 and new_stubs != [stub]
        # every client gets answers again
        recovered_at = episode.recovered_at
        assert poll(lambda: load.count("ok", after=recovered_at) >= 2 * CLIENTS, 60), load.summary()
    finally:
        episode.resume.set()
        load.stop()

    load.assert_answers_correct(timeouts_allowed=True)
    outcomes = load.outcomes
    failed = [o for o in outcomes if o.kind != "ok"]
    # only requests in flight at the kill, or sent before the model was back, failed; each with a message
    assert all(o.done > killed_at and o.sent < episode.recovered_at for o in failed), \
        [(o.sent - killed_at, o.done - killed_at, o.value) for o in failed]
    assert all(isinstance(o.value, str) and o.value for o in failed)
    # a client's timeout ends only a request the dead stub held: sent before the watchdog unloaded it
    assert all(o.sent < episode.down_at for o in failed if o.kind == "timeout")
    assert all(o.kind == "ok" for o in outcomes if o.sent > episode.recovered_at)
    before = sum(o.kind == "ok" and o.done <= killed_at for o in outcomes)
    after = sum(o.kind == "ok" and o.sent > episode.recovered_at for o in outcomes)
    messages = sorted({str(o.value)[:70] for o in failed})
    print(f"\nkill -9 episode: {load.summary()} ({before} ok before the kill, {after} ok after the recovery; "
          f"+1 probe refused while down: {refused.value!r}); noticed {episode.down_at - killed_at:.2f} s, "
          f"serving again {episode.recovered_at - killed_at:.2f} s after the kill; ready when down: "
          f"{episode.ready_when_down}; restarts {server.stub_restarts}; failures: {messages}")


def test_polls_restart_a_stub_killed_before_any_poll_saw_it_and_leave_deliberate_unloads_alone(watched) -> None:
    """The watchdog's own thread never polls here (an hour's interval): the test polls, so the
    order is fixed. A stub killed before any poll saw it alive is found by its zombie; a deliberate
    unload and load are not restarts."""
    repo = watched[0].model_repository
    server = TritonServer(repo, explicit=True, watch_stubs=True, stub_poll_interval=3600.0).start()
    watchdog = server.watchdog
    assert watchdog is not None
    try:
        assert server.load_model(POLLED, timeout=120), server.log_tail()
        [stub] = stub_pids(repo / POLLED)
        os.kill(stub, signal.SIGKILL)  # no poll has seen it
        assert poll(lambda: is_zombie(stub), 10), "the killed stub is not a zombie"  # it has exited
        watchdog.poll()  # suspected once: not yet
        assert server.stub_restarts == 0 and server.model_ready(POLLED)
        watchdog.poll()  # confirmed: unloaded and loaded again
        assert server.stub_restarts == 1 and server.model_ready(POLLED)
        [new_stub] = stub_pids(repo / POLLED)
        assert new_stub != stub

        for _ in range(3):
            watchdog.poll()  # the zombie of the restarted stub is no news
        assert server.stub_restarts == 1

        # deliberate: an unload (polled while and after it goes), then a load
        assert server.unload_model(POLLED)
        for _ in range(3):
            watchdog.poll()
        assert server.load_model(POLLED, timeout=120)
        for _ in range(3):
            watchdog.poll()
        assert server.stub_restarts == 1 and server.model_ready(POLLED)
    finally:
        server.stop()
    assert stub_pids(repo / POLLED) == []
