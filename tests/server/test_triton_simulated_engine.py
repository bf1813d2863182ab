"""Served from the real tritonserver on the GPU stand-in (`engine: simulated`), as `perf.compare
--device simulated` serves it: the sliced model with the Docker image's GPU config on the
stand-in's engine, ZeroBatch and a DelayBatch beside it on the same engine. With a device profile
that has the values computed, every system answers concurrent queries of mixed lengths as the
unsliced model; the dvabatch model re-profiled its CPU-profiled stages on the stand-in at load and
kept the times beside its manifest, and its metrics give the device's time of the work it ran (from
the stand-in's events, as from CUDA's on a GPU). On a device the adapter hands calls to the engine
loop (`hand_off_calls`, on by default there) where `Pipeline.hands_over` says so, and runs a lone
request at an idle loop itself: a request the fast path does not take (longer than any profiled
length) goes to the pipeline and gets its own error, while the queries sent with it are answered as
the unsliced model."""
from __future__ import annotations

import json
import threading
from dataclasses import replace

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from dvabatch_backend.tools.serve import TritonServer
from perf.compare.on_device import build_repository
from perf.compare.served_metrics import scrape
from slicer.model_config import parameters

from ..triton_support import Clients, ServedModel, settle, slice_zoo_model, unequal_answers

STAGES = 3


def test_a_model_and_its_baselines_served_on_the_stand_in_answer_as_the_unsliced_model(tmp_path) -> None:
    base = slice_zoo_model(tmp_path / "sliced", "bert", STAGES)
    profile = tmp_path / "device.json"
    times = [{"1": 2e-4, "2": 3e-4, "4": 5e-4, "8": 9e-4} for _ in range(STAGES)]
    profile.write_text(json.dumps({"measured_on": "a served test device", "stage_times": times,
                                   "stage_times_by_length": {"16": times, "32": times}, "values": "computed"}))
    repo = tmp_path / "repository"
    systems = build_repository(repo, base.version_dir.parent, "simulated", str(profile), delays_us=(500,))
    written = parameters((repo / systems["DVABatch"] / "config.pbtxt").read_text())
    assert (written["engine"], written["device_profile"]) == ("simulated", str(profile))
    assert "hand_off_calls" not in written  # the device's default, not a setting
    with TritonServer(repo) as server:
        for name in systems.values():
            server.wait_model_ready(name, timeout=180)
        clients = Clients(server.http_url, server.grpc_url)
        modes = clients.modes()
        rng = np.random.default_rng(11)
        for name in systems.values():
            model: ServedModel = replace(base, name=name)
            work = [(mode, model.query(rng)) for mode in modes for _ in range(3)]  # 12 queries, mixed lengths
            assert unequal_answers(modes, model, work, rtol=1e-3) == [], name
        _over_long_beside_good_queries(clients, replace(base, name=systems["DVABatch"]), rng)
        _lone_queries_run_on_executes_thread(server, clients, replace(base, name=systems["DVABatch"]), rng)
        device_seconds = settle(lambda: _device_seconds(scrape(server.metrics_url), systems["DVABatch"]),
                                lambda seconds: seconds > 0, timeout=10)
        assert device_seconds > 0, "no device time in the dvabatch model's metrics"
        loaded = [v for (name, m, _), v in scrape(server.metrics_url).items()
                  if name == "dvabatch_load_seconds" and m == systems["DVABatch"]]
        assert len(loaded) == 1 and loaded[0] > 0
    kept = list(base.version_dir.glob("stage_times.a-served-test-device-simulated.json"))
    assert kept and json.loads(kept[0].read_text())["device"] == "a served test device (simulated)"


def _device_seconds(snapshot: dict, model: str) -> float:
    """The device time the model's metrics report: its stages' and its fast path's."""
    names = ("dvabatch_stage_device_seconds_total", "dvabatch_whole_model_device_seconds_total")
    return sum(v for (name, m, _), v in snapshot.items() if name in names and m == model)


def _lone_queries_run_on_executes_thread(server: TritonServer, clients: Clients, model: ServedModel,
                                         rng: np.random.Generator) -> None:
    """Queries one after another, each call a lone request: every call is counted once, by who ran
    it, and the answers are the unsliced model's. Each is sent once the one before was answered, so
    it finds the loop idle (its answer leaves after the step that made it), and runs on `execute`'s
    thread."""
    def calls() -> dict[str, float]:
        return {labels: v for (name, m, labels), v in scrape(server.metrics_url).items()
                if name == "dvabatch_device_calls_total" and m == model.name}

    def counted() -> dict[str, float]:  # every execute call so far is in the sampled counts
        return settle(calls, lambda c: sum(c.values()) == executions(server, model.name), timeout=10)

    before = counted()
    lone = 6
    work = [("grpc", model.query(rng)) for _ in range(lone)]
    assert unequal_answers(clients.modes(), model, work, concurrent=False, rtol=1e-3) == []
    after = counted()
    here = after.get("path=here", 0.0) - before.get("path=here", 0.0)
    handed = after.get("path=handed", 0.0) - before.get("path=handed", 0.0)
    assert here == lone and handed == 0, (before, after)


def executions(server: TritonServer, model: str) -> int:
    """The `execute` calls Triton has made to the model."""
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        stats = client.get_inference_statistics(model, as_json=True)["model_stats"][0]
    return int(stats.get("execution_count", 0))


def _over_long_beside_good_queries(clients: Clients, model: ServedModel, rng: np.random.Generator) -> None:
    """An over-long request sent among good ones: it alone gets an error, naming its length."""
    longest = model.manifest.max_length
    too_long = {name: np.ones(longest + 8, np.int64) for name in ("input_ids", "attention_mask")}
    modes = clients.modes()
    work = [(mode, model.query(rng)) for mode in modes for _ in range(2)]
    failures: list[str] = []
    good = threading.Thread(target=lambda: failures.extend(unequal_answers(modes, model, work, rtol=1e-3)))
    good.start()
    with pytest.raises(InferenceServerException, match=f"length {longest + 8}, longer than the largest profiled"):
        clients.grpc_sync(model.name, too_long)
    good.join(60)
    assert not good.is_alive() and failures == []
