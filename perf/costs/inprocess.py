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
    """The runtime (a Pipeline: a `scheduler_cls` Scheduler and a thread per timed OrtStageEngine),
    queried closed loop, one query at a time. `policy` defaults to the PipelinedPolicy; `threads`
    onnxruntime threads per stage (`thread_pool` "per_stage"), or the size of the global pool
    (`thread_pool` "global"; 0: every core); `run_on` as `RuntimeSettings.run_on`."""

    def __init__(self, model_dir: Path, pairs: int, scheduler_cls: type[Scheduler] = Scheduler,
                 engine_marks: bool = False, policy: Policy | None = None, threads: int = 1,
                 thread_pool: str = PER_STAGE, run_on: bool = True) -> None:
        if policy is None:
            from policies.pipelined import PipelinedPolicy

            policy = PipelinedPolicy()
        manifest = Manifest.load(model_dir / "manifest.json")
        self.engines = [TimedEngine(OrtStageEngine(model_dir / s.file, threads, thread_pool=thread_pool),
                                    [] if engine_marks else None)
                        for s in manifest.stages]
        settings = RuntimeSettings(num_buffer_pairs=pairs, threads_per_stage=threads, thread_pool=thread_pool,
                                   run_on=run_on)
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


# --- open loop -------------------------------------------------------------------------


@dataclass
class OpenLoopResult:
    """An open-loop run in this process: every answered query's latency, what was sent and answered
    (ok) in the run, the runtime's meta operations, and how long sending took."""

    latencies: list[float]
    sent: int
    answered: int
    errors: int
    send_seconds: float
    stats: dict[str, int]

    def summary(self) -> dict[str, float]:
        lat = np.asarray(self.latencies) * 1e3
        return {"sent": self.sent, "answered": self.answered, "errors": self.errors,
                "offered_qps": self.sent / self.send_seconds if self.send_seconds > 0 else 0.0,
                "mean_ms": float(lat.mean()) if lat.size else float("nan"),
                "p99_ms": q(lat, 99) if lat.size else float("nan"),
                "stage0_mean_bs": self.stats["stage0_rows"] / max(self.stats["stage0_batches"], 1), **self.stats}


def open_loop(pipeline: Pipeline, queries: Sequence[Inputs], offsets: Sequence[float], drain_s: float = 5.0) -> OpenLoopResult:
    """Submit `queries[i]` at `offsets[i]` seconds from now (a started pipeline), whatever is still
    unanswered; wait at most `drain_s` after the last send for the answers."""
    sent_at = [0.0] * len(queries)
    latencies: list[float] = []
    lock = threading.Lock()
    outcome = {"ok": 0, "error": 0}
    all_done = threading.Event()

    def reply_for(i: int):
        def reply(answer: Answer) -> None:
            t = perf()
            with lock:
                if answer.error is None:
                    outcome["ok"] += 1
                    latencies.append(t - sent_at[i])
                else:
                    outcome["error"] += 1
                if outcome["ok"] + outcome["error"] == len(queries):
                    all_done.set()
        return reply

    before = _counts(pipeline)
    start = perf()
    for i, (inputs, offset) in enumerate(zip(queries, offsets)):
        delay = start + offset - perf()
        if delay > 0:
            time.sleep(delay)
        sent_at[i] = perf()
        pipeline.submit(inputs, reply_for(i))
    send_seconds = perf() - start
    all_done.wait(drain_s)
    after = _counts(pipeline)
    counts = {name: after[name] - before[name] for name in after}
    with lock:
        return OpenLoopResult(list(latencies), len(queries), outcome["ok"], outcome["error"], send_seconds, counts)


def _counts(pipeline: Pipeline) -> dict[str, int]:
    """The runtime's meta operations so far, and stage 0's batches and rows (its mean batch size)."""
    stats, _ = pipeline.scheduler.observe()
    counts = {name: int(getattr(stats, name)) for name in ("new", "stretch", "stretch_refused", "split")}
    counts.update(stage0_batches=stats.stages[0].batches, stage0_rows=stats.stages[0].rows)
    return counts


def open_loop_run(version_dir: Path, policy: Policy, rate: float, seconds: float, seed: int = 0,
                  settings: RuntimeSettings = RuntimeSettings()) -> OpenLoopResult:
    """A seeded Poisson schedule at `rate` for `seconds` of RTE-like queries against the runtime
    over `version_dir` with `policy` (a short warm-up first)."""
    import onnx

    from dvabatch_backend.runtime.loading import load_pipeline
    from perf.load.arrivals import poisson
    from perf.baselines.bench import sample_queries
    from slicer.profiler import int_bounds

    manifest = Manifest.load(version_dir / "manifest.json")
    full = onnx.load(str(version_dir / (manifest.full_model or "model.onnx")), load_external_data=False)
    n = max(1, int(rate * seconds))
    queries, _ = sample_queries(manifest, int_bounds(full), n, seed)
    pipeline = load_pipeline(version_dir, policy, settings).start()
    try:
        warm = open_loop(pipeline, queries[:20], [0.005 * i for i in range(min(20, n))])
        if warm.errors:
            raise RuntimeError(f"warm-up: {warm.errors} queries failed")
        return open_loop(pipeline, queries, poisson(rate, n, rng=seed + 1))
    finally:
        pipeline.stop()


# --- simulated open loop ---------------------------------------------------------------


class _NoEngine:
    """A stage engine that computes nothing: in a simulation its time is the profile's."""

    def run(self, inputs: Inputs, outputs: Inputs) -> None:
        pass


def simulate_open_loop(version_dir: Path, policy: Policy, rate: float, seconds: float, seed: int = 0,
                       handoff_s: float = 1e-4, pairs: int = 2) -> OpenLoopResult:
    """The runtime's real scheduler and `policy` on a simulated clock: each stage a server that runs
    one item at a time for its profiled time at the item's rows and padded length (the manifest's
    per-length profile, `policies._profile.BatchCost`) plus `handoff_s`; a seeded Poisson schedule
    of RTE-like queries at `rate` for `seconds`. Deterministic and free of the machine's noise: what
    it shows is the policy's batching (batch sizes, padding, waits), not the engines' speed."""
    import heapq
    import itertools

    import onnx

    from dvabatch_backend.runtime.executor import run_work
    from dvabatch_backend.runtime.settings import QueuePolicy
    from perf.load.arrivals import poisson
    from perf.baselines.bench import sample_queries
    from policies._profile import BatchCost
    from slicer.profiler import int_bounds

    manifest = Manifest.load(version_dir / "manifest.json")
    full = onnx.load(str(version_dir / (manifest.full_model or "model.onnx")), load_external_data=False)
    n = max(1, int(rate * seconds))
    queries, _ = sample_queries(manifest, int_bounds(full), n, seed)
    offsets = poisson(rate, n, rng=seed + 1)
    cost = BatchCost(manifest.stage_times_by_length(), manifest.num_stages)
    clock = [0.0]
    settings = RuntimeSettings(num_buffer_pairs=pairs, queue=QueuePolicy(max_queue_size=0))
    scheduler = Scheduler(manifest, policy, settings, clock=lambda: clock[0])
    engine = _NoEngine()
    sent_at = [float(t) for t in offsets]
    latencies: list[float] = []
    errors = [0]
    events: list[tuple[float, int, str, object]] = []
    order = itertools.count()
    for i, t in enumerate(sent_at):
        heapq.heappush(events, (t, next(order), "arrive", i))
    busy: list[object | None] = [None] * manifest.num_stages

    def reply_for(i: int):
        def reply(answer: Answer) -> None:
            if answer.error is None:
                latencies.append(clock[0] - sent_at[i])
            else:
                errors[0] += 1
        return reply

    def start_idle_stages() -> None:
        for stage in range(manifest.num_stages):
            if busy[stage] is None and (work := scheduler.next_work(stage)) is not None:
                result = run_work(work, engine, scheduler)
                rows = len(work.queries)
                length = next(iter(work.inputs.values())).shape[1] if manifest.has_seq else 0
                done = clock[0] + cost.stage_seconds(stage, rows, length) + handoff_s
                busy[stage] = work
                heapq.heappush(events, (done, next(order), "done", (work, result)))

    scheduled_wake: float | None = None
    while events:
        t, _, kind, data = heapq.heappop(events)
        clock[0] = t
        if kind == "arrive":
            scheduler.submit(queries[data], reply_for(data))  # type: ignore[index]
        elif kind == "done":
            work, result = data  # type: ignore[misc]
            busy[work.stage] = None
            scheduler.finish_work(work, result)
        elif kind == "wake":
            scheduled_wake = None
            scheduler.on_window()
        start_idle_stages()
        wake = scheduler.wake_at
        if wake is not None and wake != scheduled_wake:
            scheduled_wake = wake
            heapq.heappush(events, (max(wake, t), next(order), "wake", None))
    stats = scheduler.stats
    counts = {name: int(getattr(stats, name)) for name in ("new", "stretch", "stretch_refused", "split")}
    counts.update(stage0_batches=stats.stages[0].batches, stage0_rows=stats.stages[0].rows,
                  end_ms=int(clock[0] * 1e3))
    return OpenLoopResult(latencies, n, len(latencies), errors[0], float(sent_at[-1]) or 1e-9, counts)


# --- statistics --------------------------------------------------------------------------


def us(x: float) -> float:
    return x * 1e6


def q(values: Sequence[float] | np.ndarray, p: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), p))


def summary(values: Sequence[float] | np.ndarray, scale: float = 1e6) -> dict[str, float]:
    a = np.asarray(values, dtype=float) * scale
    return {"mean": float(a.mean()), "p50": float(np.median(a)), "p90": q(a, 90), "p99": q(a, 99)}
