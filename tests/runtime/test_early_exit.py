"""The early-exit example policy on the runtime: confident queries leave after the exit head,
answered with the head's result; the others run the whole model."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from policies.examples.early_exit import EarlyExitPolicy, confidence, runs
from slicer import cut, toy

from ..conftest import Collector, GatedEngine, SlicedModel, make_scheduler


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

    # the later stages are held until the confident queries are answered: they never wait for them
    gates = [GatedEngine(e) for e in cascade.engines()[1:]]
    engines = [cascade.engines()[0], *gates]
    scheduler = make_scheduler(cascade, EarlyExitPolicy(threshold=threshold, exit_stage=0), engines,
                               num_buffer_pairs=2)
    collector = Collector()
    with scheduler:
        sent = scheduler.submit_many([(q, collector) for q in queries])  # one batch of 8 and another
        early_ids = [q for q, out in zip(sent, leaves) if out]
        late_ids = [q for q, out in zip(sent, leaves) if not out]
        assert collector.wait_for(early_ids)
        assert not any(q in collector.answers for q in late_ids)
        gates[0].wait_started()  # the others are held in the later stages, not lost
        for gate in gates:
            gate.open()
        assert collector.wait_for(sent)
    for qid, ref, out in zip(sent, refs, leaves):
        answer = collector.one(qid)
        assert answer.ok
        if out:
            np.testing.assert_allclose(answer.outputs["logits"], ref["early_logits"], atol=1e-5)
            np.testing.assert_allclose(answer.outputs["early_logits"], ref["early_logits"], atol=1e-5)
        else:
            np.testing.assert_allclose(answer.outputs["logits"], ref["logits"], atol=1e-4)
    assert scheduler.stats.early_exits == int(leaves.sum())
    assert scheduler.buffer_violations == []
