"""The early-exit example policy on the runtime: confident queries leave after the exit head,
answered with the head's result; the others run the whole model."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from policies.examples.early_exit import EarlyExitPolicy, confidence, runs
from slicer import cut, toy

from ..conftest import Collector, SlowEngine, make_scheduler, SlicedModel


@pytest.fixture(scope="module")
def cascade(tmp_path_factory) -> SlicedModel:
    model = toy.cascade_mlp(features=16, classes=4, layers=4)
    out = tmp_path_factory.mktemp("cascade")
    manifest = cut.cut_model(model, cut.cut_positions_after(model, ["early_logits", "h3"]), out, "cascade", 8, 0)
    return SlicedModel(out, manifest, ort.InferenceSession(str(out / "model.onnx")))


def test_runs() -> None:
    assert runs(np.array([True, True, False, True])) == ((2, 1, 1), (True, False, True))


def test_confident_queries_exit_early_with_the_head_result(cascade: SlicedModel) -> None:
    rng = np.random.default_rng(0)
    queries = [{"x": rng.standard_normal(16).astype(np.float32) * 2} for _ in range(16)]
    refs = [cascade.reference(q) for q in queries]
    conf = np.array([confidence(r["early_logits"][None])[0] for r in refs])
    threshold = float(np.median(conf))
    leaves = conf >= threshold
    assert 0 < leaves.sum() < len(queries)

    # later stages are slow, so an early answer is visibly early
    engines = [cascade.engines()[0]] + [SlowEngine(e, 0.02) for e in cascade.engines()[1:]]
    scheduler = make_scheduler(cascade, EarlyExitPolicy(threshold=threshold, exit_stage=0), engines)
    collector = Collector()
    with scheduler:
        sent = scheduler.submit_many([(q, collector) for q in queries])  # one batch of 8 and another
        sent_at = {q: __import__("time").perf_counter() for q in sent}
        assert collector.wait_for(sent)
    early, late = [], []
    for qid, ref, out in zip(sent, refs, leaves):
        answer = collector.one(qid)
        assert answer.ok
        latency = collector.times[qid] - sent_at[qid]
        if out:
            np.testing.assert_allclose(answer.outputs["logits"], ref["early_logits"], atol=1e-5)
            np.testing.assert_allclose(answer.outputs["early_logits"], ref["early_logits"], atol=1e-5)
            early.append(latency)
        else:
            np.testing.assert_allclose(answer.outputs["logits"], ref["logits"], atol=1e-4)
            late.append(latency)
    assert max(early) < min(late)  # confident queries never waited for the slow stages
    assert scheduler.stats.early_exits == int(leaves.sum())
    assert scheduler.buffer_violations == []
