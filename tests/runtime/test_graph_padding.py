"""Where the stages replay CUDA graphs of bucket lengths (the torch engine on CUDA), a batch of a
pad-safe model is zero-padded to a bucket before stage 0, on the pipeline and on the fast path alike,
so every stage's inputs have a bucket's length exactly: a later stage's inputs cannot be zero-padded
safely (its graph would attend to the padding through an additive mask of zeros), only the model's
own. Answers are cut back to each query's length and equal the unsliced model's.

Checked here with onnxruntime engines under settings that say the stages replay graphs: the padding
is the scheduler's and the fast path's, whatever engine runs the stages."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import onnxruntime as ort
import pytest

from dvabatch_backend.runtime.loading import reads_model_inputs
from dvabatch_backend.runtime.settings import graph_buckets, graph_length
from policies import create_policy
from slicer import cut, toy

from ..conftest import Collector, SlicedModel, assert_all_answered_correctly, assert_matches_reference, call, make_scheduler

MAX_LENGTH = 40  # buckets 16, 32, 40
GRAPHS = {"engine": "torch", "device": "cuda", "cuda_graphs": True}  # the stages replay graphs


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> SlicedModel:
    onnx_model = toy.token_mlp(hidden=8, layers=4)
    out = tmp_path_factory.mktemp("token40")
    manifest = cut.cut_model(onnx_model, cut.cut_positions_after(onnx_model, ["h1", "h2"]), out, "token40", 8, MAX_LENGTH)
    return SlicedModel(out, manifest, ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"]))


class LengthRecorder:
    """Wraps each stage's engine: records the length of every batch each stage ran."""

    def __init__(self, model: SlicedModel) -> None:
        self.lengths: dict[int, list[int]] = {stage: [] for stage in range(model.manifest.num_stages)}
        self._lock = threading.Lock()
        self.engines = [self._wrap(stage, engine) for stage, engine in enumerate(model.engines())]

    def _wrap(self, stage: int, engine: Any) -> Any:
        recorder = self

        class Recording:
            def run(self, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
                with recorder._lock:
                    recorder.lengths[stage].append(next(iter(inputs.values())).shape[1])  # [batch, seq, ...]
                engine.run(inputs, outputs)

        return Recording()

    def seen(self) -> set[int]:
        return {n for lengths in self.lengths.values() for n in lengths}


def queries(model: SlicedModel, lengths: list[int]) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(len(lengths))
    return [model.query(rng, n) for n in lengths]


LENGTHS = [3, 17, 9, 33, 40, 1, 16, 25]
BUCKETS = set(graph_buckets(8, MAX_LENGTH, True)[1])


def test_graph_length_is_the_smallest_bucket_that_holds_the_batch() -> None:
    assert BUCKETS == {16, 32, 40}
    assert [graph_length(n, MAX_LENGTH) for n in (1, 16, 17, 32, 33, 40)] == [16, 16, 32, 32, 40, 40]


@pytest.mark.parametrize("policy", ["load", "input"])
def test_the_pipeline_runs_every_stage_at_a_bucket_length(model: SlicedModel, policy: str) -> None:
    recorder = LengthRecorder(model)
    pipeline = make_scheduler(model, create_policy(policy), recorder.engines, fast_path=False, **GRAPHS)
    collector = Collector()
    sent = dict(zip(pipeline.submit_many([(q, collector) for q in queries(model, LENGTHS)]), queries(model, LENGTHS)))
    with pipeline:
        assert_all_answered_correctly(model, pipeline, collector, sent)
    assert recorder.seen() <= BUCKETS, recorder.lengths


def test_without_graphs_a_batch_runs_at_its_own_length(model: SlicedModel) -> None:
    """The control: the same queries, the stages not replaying graphs, run at their lengths."""
    recorder = LengthRecorder(model)
    pipeline = make_scheduler(model, create_policy("input"), recorder.engines, fast_path=False)
    collector = Collector()
    sent = dict(zip(pipeline.submit_many([(q, collector) for q in queries(model, LENGTHS)]), queries(model, LENGTHS)))
    with pipeline:
        assert_all_answered_correctly(model, pipeline, collector, sent)
    assert not recorder.seen() <= BUCKETS, recorder.lengths


def test_a_callers_batches_pad_to_a_bucket_and_cut_back(model: SlicedModel) -> None:
    recorder = LengthRecorder(model)
    pipeline = make_scheduler(model, create_policy("load"), recorder.engines, num_buffer_pairs=1, **GRAPHS)
    collector = Collector()
    with pipeline:
        lone = queries(model, [9])
        several = queries(model, [3, 33, 17])
        ids = [call(pipeline, rows, collector)[0] for rows in (lone, several)]
        assert collector.wait_for([i for group in ids for i in group])
    for qid, query in zip([i for group in ids for i in group], [*lone, *several]):
        answer = collector.one(qid)
        for name, ref in model.reference(query).items():
            assert answer.outputs[name].shape == ref.shape  # type: ignore[index]
        assert_matches_reference(model, query, answer)
    assert recorder.seen() <= BUCKETS and recorder.lengths[0], recorder.lengths


def test_only_the_first_stage_and_the_whole_model_read_the_models_inputs(model: SlicedModel) -> None:
    manifest = model.manifest
    assert reads_model_inputs(model.dir / manifest.stages[0].file, manifest)
    assert not any(reads_model_inputs(model.dir / s.file, manifest) for s in manifest.stages[1:])
    if manifest.full_model:
        assert reads_model_inputs(model.dir / manifest.full_model, manifest)


def test_a_lone_answer_through_the_pipeline_matches_the_model(model: SlicedModel) -> None:
    """One query of a length between buckets, through the stage threads: cut back exactly."""
    pipeline = make_scheduler(model, create_policy("load"), fast_path=False, **GRAPHS)
    collector = Collector()
    query = queries(model, [21])[0]
    with pipeline:
        qid = pipeline.submit(query, collector)
        assert collector.wait_for([qid])
    assert_matches_reference(model, query, collector.one(qid))
