"""One query at a time in this process: the unsliced model, its stages run one after another, and
the dvabatch runtime over the stages; blocks of queries interleaved between them; and the overhead
breakdown both `perf.costs.overhead` and `perf.paper.experiments.figure21` report.

    breakdown = overhead_breakdown(version_dir, queries, create_policy("pipelined"))
    # {"unsliced_ms", "stages_in_a_row_ms", "runtime_ms", "slicing_ms", "handoffs_ms"}

`slicing_ms` is what cutting the model costs by itself (the stages in a row against the unsliced
model: boundary copies, lost fusion), `handoffs_ms` what the runtime adds on top (queues, buffer
pairs, hand-offs between stage threads, the reply). Every figure is a median of per-query
latencies (`Sample.latency`): for the runtime, submit until the reply callback runs.

A runner's `query(inputs)` runs one query of one row (arrays without the batch dim) and returns
its `Sample`; `answer_of(inputs)` its outputs. The runners take the runtime's public API only
(`Pipeline(Scheduler(manifest, policy, settings), engines)`, start/stop, `submit`).
"""
from __future__ import annotations

import random
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from dvabatch_backend.runtime.engine import PER_STAGE, OrtStageEngine, ort_session_options
from dvabatch_backend.runtime.decisions import Policy
from dvabatch_backend.runtime.manifest import Manifest
from dvabatch_backend.runtime.pipeline import Pipeline
from dvabatch_backend.runtime.query import Answer
from dvabatch_backend.runtime.scheduler import Scheduler
from dvabatch_backend.runtime.settings import RuntimeSettings

perf = time.perf_counter
Inputs = Mapping[str, np.ndarray]

UNSLICED, IN_A_ROW, RUNTIME = "unsliced", "stages in a row", "runtime"


@dataclass
class Sample:
    latency: float  # submit -> answer (the runtime: its reply callback); the others: copy + onnxruntime calls
    engine: float  # time inside the stage engines (the others: = latency)
    client: float  # submit -> the submitting thread runs again with the answer


class Runner(Protocol):
    def start(self) -> Runner: ...

    def stop(self) -> None: ...

    def query(self, inputs: Inputs) -> Sample: ...

    def answer_of(self, inputs: Inputs) -> dict[str, np.ndarray]: ...


class TimedEngine:
    """A stage engine that adds up the time spent in the real engine's `run`.

    With `marks` set, also keeps (start, end) of every call (for perf.costs.overhead's breakdown).
    """

    def __init__(self, engine, marks: list | None = None) -> None:
        self.engine = engine
        self.seconds = 0.0
        self.calls = 0
        self.marks = marks

    def run(self, inputs: Inputs, outputs: Inputs) -> None:
        t0 = perf()
        try:
            self.engine.run(inputs, outputs)
        finally:
            t1 = perf()
            self.seconds += t1 - t0
            self.calls += 1
            if self.marks is not None:
                self.marks.append((t0, t1))


class ServedRunner:
    """The runtime (a Pipeline: a `scheduler_cls` Scheduler and the engine loop over timed OrtStageEngines),
    queried closed loop, one query at a time. `policy` defaults to the PipelinedPolicy; `threads`
    onnxruntime threads per stage (`thread_pool` "per_stage"), or the size of the global pool
    (`thread_pool` "global"; 0: every core)."""

    def __init__(self, model_dir: Path, pairs: int, scheduler_cls: type[Scheduler] = Scheduler,
                 engine_marks: bool = False, policy: Policy | None = None, threads: int = 1,
                 thread_pool: str = PER_STAGE) -> None:
        if policy is None:
            from policies.pipelined import PipelinedPolicy

            policy = PipelinedPolicy()
        manifest = Manifest.load(model_dir / "manifest.json")
        self.engines = [TimedEngine(OrtStageEngine(model_dir / s.file, threads, thread_pool=thread_pool),
                                    [] if engine_marks else None)
                        for s in manifest.stages]
        settings = RuntimeSettings(num_buffer_pairs=pairs, threads_per_stage=threads, thread_pool=thread_pool)
        self.pipeline = Pipeline(scheduler_cls(manifest, policy, settings), self.engines)
        self.scheduler = self.pipeline.scheduler
        self.num_stages = manifest.num_stages
        self._done = threading.Event()
        self._answer: Answer | None = None
        self._t_answer = 0.0

    def start(self) -> ServedRunner:
        self.pipeline.start()
        return self

    def stop(self) -> None:
        self.pipeline.stop()

    def _reply(self, answer: Answer) -> None:
        self._t_answer = perf()
        self._answer = answer
        self._done.set()

    def query(self, inputs: Inputs) -> Sample:
        engines = self.engines
        e0 = sum(e.seconds for e in engines)
        self._done.clear()
        t0 = perf()
        self.pipeline.submit(inputs, self._reply)
        if not self._done.wait(60.0):
            raise RuntimeError("the runtime did not answer within 60 s")
        t2 = perf()
        answer = self._answer
        if answer is None or answer.error is not None:
            raise RuntimeError(f"the runtime answered with an error: {answer}")
        return Sample(self._t_answer - t0, sum(e.seconds for e in engines) - e0, t2 - t0)

    def answer_of(self, inputs: Inputs) -> dict[str, np.ndarray]:
        self.query(inputs)
        assert self._answer is not None and self._answer.outputs is not None
        return self._answer.outputs


class DirectRunner:
    """onnxruntime on the unsliced model at batch size 1, the runtime's session options."""

    def __init__(self, model_path: Path, threads: int = 1, thread_pool: str = PER_STAGE) -> None:
        import onnxruntime as ort

        self.session = ort.InferenceSession(str(model_path), ort_session_options(threads, thread_pool),
                                            providers=["CPUExecutionProvider"])

    def start(self) -> DirectRunner:
        return self

    def stop(self) -> None:
        pass

    def query(self, inputs: Inputs) -> Sample:
        t0 = perf()
        feeds = {k: v[None].copy() for k, v in inputs.items()}
        self.session.run(None, feeds)
        t = perf() - t0
        return Sample(t, t, t)

    def answer_of(self, inputs: Inputs) -> dict[str, np.ndarray]:
        names = [o.name for o in self.session.get_outputs()]
        return {n: r[0] for n, r in zip(names, self.session.run(None, {k: v[None] for k, v in inputs.items()}))}


class StagesRunner:
    """The sliced model's stages run one after another on this thread at batch size 1 (onnxruntime
    with numpy in and out, no runtime): the cost of the slicing alone. `threads` and `thread_pool`
    as `ServedRunner`'s."""

    def __init__(self, model_dir: Path, threads: int = 1, thread_pool: str = PER_STAGE) -> None:
        import onnxruntime as ort

        manifest = Manifest.load(model_dir / "manifest.json")
        self.sessions = [ort.InferenceSession(str(model_dir / s.file), ort_session_options(threads, thread_pool),
                                              providers=["CPUExecutionProvider"]) for s in manifest.stages]
        self.outputs = [o.name for o in manifest.outputs]

    def start(self) -> StagesRunner:
        return self

    def stop(self) -> None:
        pass

    def _run(self, inputs: Inputs) -> dict[str, np.ndarray]:
        tensors = {k: v[None].copy() for k, v in inputs.items()}
        for session in self.sessions:
            outputs = session.run(None, {i.name: tensors[i.name] for i in session.get_inputs()})
            tensors.update({o.name: v for o, v in zip(session.get_outputs(), outputs)})
        return tensors

    def query(self, inputs: Inputs) -> Sample:
        t0 = perf()
        self._run(inputs)
        t = perf() - t0
        return Sample(t, t, t)

    def answer_of(self, inputs: Inputs) -> dict[str, np.ndarray]:
        tensors = self._run(inputs)
        return {name: tensors[name][0] for name in self.outputs}


def run_interleaved(runners: Mapping[str, Runner], queries: Sequence[Inputs], rounds: int, block: int,
                    warmup: int, seed: int = 0) -> dict[str, list[Sample]]:
    """Warm every runner up, then run `rounds` rounds of one `block` per runner, in shuffled order,
    so that whatever else the machine does falls on all of them alike. Every runner gets the same
    query sequence."""
    rng = random.Random(seed)
    for runner in runners.values():
        for i in range(warmup):
            runner.query(queries[i % len(queries)])
    samples: dict[str, list[Sample]] = {label: [] for label in runners}
    for r in range(rounds):
        order = list(runners)
        rng.shuffle(order)
        for label in order:
            runner, out = runners[label], samples[label]
            for i in range(block):
                out.append(runner.query(queries[(r * block + i) % len(queries)]))
    return samples


def breakdown_ms(unsliced: Sequence[Sample], in_a_row: Sequence[Sample], runtime: Sequence[Sample]) -> dict[str, float]:
    """Median latencies (ms) of the three and their differences: the slicing (stages in a row -
    unsliced) and the runtime's hand-offs (runtime - stages in a row)."""
    a, b, c = (float(np.median([s.latency for s in samples]) * 1e3) for samples in (unsliced, in_a_row, runtime))
    return {"unsliced_ms": a, "stages_in_a_row_ms": b, "runtime_ms": c, "slicing_ms": b - a, "handoffs_ms": c - b}


def overhead_breakdown(version_dir: Path, queries: Sequence[Inputs], policy: Policy | None = None, pairs: int = 2,
                       threads: int = 1, unsliced_threads: int = 1, rounds: int = 3, repeats: int = 20,
                       seed: int = 0) -> dict[str, float]:
    """Where a single query's latency goes (`breakdown_ms`), measured in this process one query at
    a time: the unsliced model of `version_dir` (`unsliced_threads`), its stages in a row and the
    runtime with `policy` and `pairs` buffer pairs (`threads` per stage); `rounds` interleaved
    rounds of `repeats` passes over `queries` each, after two passes of warm-up."""
    version_dir = Path(version_dir)
    manifest = Manifest.load(version_dir / "manifest.json")
    runners: dict[str, Runner] = {
        UNSLICED: DirectRunner(version_dir / (manifest.full_model or "model.onnx"), unsliced_threads),
        IN_A_ROW: StagesRunner(version_dir, threads),
    }
    runners[RUNTIME] = ServedRunner(version_dir, pairs, policy=policy, threads=threads).start()
    try:
        samples = run_interleaved(runners, queries, rounds, repeats * len(queries), 2 * len(queries), seed)
    finally:
        for runner in runners.values():
            runner.stop()
    return breakdown_ms(samples[UNSLICED], samples[IN_A_ROW], samples[RUNTIME])
