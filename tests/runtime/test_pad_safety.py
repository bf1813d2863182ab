"""A model that zero-padding changes (manifest `pad_safe` false): the runtime batches only queries of
one length and never pads them, whatever the policy decides, so every answer equals the unsliced
model run on the query alone. The model is `slicer.toy.conv_pool` (a conv over the sequence, then a
plain mean: padding changes its answer by far more than any tolerance).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

import numpy as np
import onnxruntime as ort
import pytest

from dvabatch_backend.runtime.decisions import ArrivalPlan, BatchTableView, New, Policy, QueryInfo, Stretch
from policies.input_diversity import InputDiversityPolicy
from policies.load_diversity import LoadDiversityPolicy
from policies.pipelined import PipelinedPolicy
from slicer import cut, toy

from ..conftest import Collector, GatedEngine, SlicedModel, make_scheduler

HIDDEN = 8
MAX_LENGTH = 12
BS_MAX = 8
# lengths mixed within each burst; the first burst's batch is held in stage 0 while the others arrive
ROUNDS = [[12, 3, 7, 3], [5, 12, 1, 7], [2, 2, 9], [12, 6, 1, 6]]


@pytest.fixture(scope="module")
def conv_model(tmp_path_factory: pytest.TempPathFactory) -> SlicedModel:
    """conv_pool cut into 3 stages, its manifest marked not pad-safe."""
    model = toy.conv_pool(hidden=HIDDEN, layers=3)
    out = tmp_path_factory.mktemp("conv_pool")
    manifest = cut.cut_model(model, cut.cut_positions_after(model, ["h1", "h2"]), out, "conv_pool", BS_MAX, MAX_LENGTH)
    full = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    return SlicedModel(out, dataclasses.replace(manifest, pad_safe=False), full)


def _query(rng: np.random.Generator, length: int) -> dict[str, np.ndarray]:
    return {"x": rng.standard_normal((length, HIDDEN)).astype(np.float32)}


def _run(model: SlicedModel, policy: Policy, rounds: Sequence[Sequence[int]] = ROUNDS):
    """Submit the first burst, hold its first batch in stage 0, submit the rest, let it all run."""
    gates = [GatedEngine(e) for e in model.engines()]
    scheduler = make_scheduler(model, policy, gates)
    collector = Collector()
    rng = np.random.default_rng(5)
    sent: dict[int, dict[str, np.ndarray]] = {}
    with scheduler:
        for k, lengths in enumerate(rounds):
            burst = [_query(rng, n) for n in lengths]
            sent.update(zip(scheduler.submit_many([(q, collector) for q in burst]), burst))
            if k == 0:
                gates[0].wait_started()
        for gate in gates:
            gate.open()
        assert collector.wait_for(set(sent), timeout=30), f"unanswered: {set(sent) - set(collector.answers)}"
    wrong = {}
    for qid, inputs in sent.items():
        answer = collector.one(qid)
        assert answer.error is None, answer.error
        for name, ref in model.reference(inputs).items():
            err = float(np.max(np.abs(answer.outputs[name] - ref)))
            if err > 1e-5:  # bitwise equal here; padding would change them by ~0.1
                wrong[qid] = (len(inputs["x"]), err)
    assert scheduler.buffer_violations == []
    assert scheduler.stats.policy_errors == 0
    return scheduler, wrong


class MixingPolicy(Policy):
    """The worst a policy may do here: everything waiting in one New padded to max_length, and later
    arrivals stretched into the latest batch."""

    name = "mixing"

    def on_arrival(self, waiting: Sequence[QueryInfo], table: BatchTableView, now: float) -> ArrivalPlan:
        ids = tuple(q.id for q in waiting)[: self.context.bs_max]
        latest = table.latest()
        if latest is not None and latest.bs + len(ids) <= self.context.bs_max:
            return ArrivalPlan((Stretch(latest.id, ids),))
        return ArrivalPlan((New(ids, pad_length=self.context.max_length),))


POLICIES = {
    "pipelined": PipelinedPolicy,
    "load": lambda: LoadDiversityPolicy(t_comp_wait=60.0),
    "input": InputDiversityPolicy,
    "mixing": MixingPolicy,
}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_pad_unsafe_model_answers_every_query_like_the_model_alone(conv_model, name: str) -> None:
    policy = POLICIES[name]()
    scheduler, wrong = _run(conv_model, policy)
    assert wrong == {}, f"answers that differ from the model run alone (query: (length, max |error|)): {wrong}"
    assert policy.context.pad_safe is False
    stats = scheduler.stats
    assert stats.answered_ok == sum(len(r) for r in ROUNDS)
    if name == "input":
        assert stats.pad_unsafe_splits == 0  # it clusters exactly by length itself: nothing to re-shape
    else:
        assert stats.pad_unsafe_splits > 0
    if name in ("load", "mixing"):
        assert stats.stretch_refused > 0  # stretches across lengths were refused


def test_the_same_run_on_a_manifest_claiming_pad_safety_gets_wrong_answers(conv_model) -> None:
    """The check above has teeth: with pad_safe true the runtime pads, and this model's answers change."""
    claimed = dataclasses.replace(conv_model, manifest=dataclasses.replace(conv_model.manifest, pad_safe=True))
    scheduler, wrong = _run(claimed, MixingPolicy())
    assert wrong, "padding should have changed some answers of conv_pool"
    assert scheduler.stats.pad_unsafe_splits == 0


def test_a_new_mixing_lengths_becomes_one_batch_per_length_in_order_of_first_appearance(conv_model) -> None:
    from dvabatch_backend.runtime.scheduler import Scheduler

    class Once(Policy):
        def on_arrival(self, waiting, table, now):
            return ArrivalPlan((New(tuple(q.id for q in waiting), pad_length=MAX_LENGTH),))

    scheduler = Scheduler(conv_model.manifest, Once(), settings=_settings())
    rng = np.random.default_rng(0)
    lengths = [5, 3, 5, 9, 3]
    scheduler.submit_many([(_query(rng, n), lambda a: None) for n in lengths])
    rows = scheduler.snapshot().rows
    assert [(r.pad_length, r.bs) for r in rows] == [(5, 2), (3, 2), (9, 1)]
    assert scheduler.stats.new == 3 and scheduler.stats.pad_unsafe_splits == 1
    scheduler.stop()


def test_a_pad_length_longer_than_the_queries_is_ignored(conv_model) -> None:
    from dvabatch_backend.runtime.scheduler import Scheduler

    class Padded(Policy):
        def on_arrival(self, waiting, table, now):
            return ArrivalPlan((New(tuple(q.id for q in waiting), pad_length=MAX_LENGTH),))

    scheduler = Scheduler(conv_model.manifest, Padded(), settings=_settings())
    scheduler.submit_many([(_query(np.random.default_rng(0), 4), lambda a: None)] * 2)
    assert [(r.pad_length, r.bs) for r in scheduler.snapshot().rows] == [(4, 2)]
    assert scheduler.stats.pad_unsafe_splits == 1
    scheduler.stop()


def test_the_input_policy_clusters_exactly_by_length_when_not_pad_safe() -> None:
    from dvabatch_backend.runtime.decisions import PolicyContext

    queries = [QueryInfo(i, n, 0.0) for i, n in enumerate([10, 11, 12, 10, 3, 11])]
    safe, unsafe = InputDiversityPolicy(pad_tolerance=0.5), InputDiversityPolicy(pad_tolerance=0.5)
    safe.bind(PolicyContext(3, 8, 12, 2))
    unsafe.bind(PolicyContext(3, 8, 12, 2, pad_safe=False))
    assert sorted(sorted(q.length for q in c) for c in safe.clusters(queries)) == [[3], [10, 10, 11, 11, 12]]
    assert sorted(sorted(q.length for q in c) for c in unsafe.clusters(queries)) == [[3], [10, 10], [11, 11], [12]]


def _settings():
    from dvabatch_backend.runtime.settings import RuntimeSettings

    return RuntimeSettings(bs_max=BS_MAX)


def test_manifest_pad_safe_round_trips_and_defaults_to_true(conv_model, tmp_path: Path) -> None:
    from dvabatch_backend.runtime.manifest import Manifest, ManifestError

    doc = conv_model.manifest.to_json()
    assert doc["pad_safe"] is False
    assert Manifest.from_json(doc).pad_safe is False
    old = {k: v for k, v in doc.items() if k != "pad_safe"}  # written before pad safety was measured
    assert Manifest.from_json(old).pad_safe is True
    with pytest.raises(ManifestError, match="pad_safe"):
        Manifest.from_json({**doc, "pad_safe": "no"})
