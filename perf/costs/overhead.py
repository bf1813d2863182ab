"""Runtime overhead benchmark (not a test): what the dvabatch runtime adds on top of the stage engines.

    python -m perf.costs.overhead [--quick] [--json OUT] [--no-breakdown]

1. Scheduling overhead per stage hand-off. dense_mlp(features=16, layers=8) is sliced into
   1, 2, 4 and 8 stages and served with the PipelinedPolicy, 1 and 2 buffer pairs, one
   onnxruntime thread per stage. Queries are sent closed loop, one at a time (submit, wait for
   the reply on a threading.Event, repeat). Every stage engine is wrapped in `TimedEngine`,
   which adds up the perf_counter time spent in the real `OrtStageEngine.run` (io_binding
   included), so per query

       runtime overhead = (submit -> reply callback) - (time inside the stage engines)

   and per hand-off, for each query of an N-stage pipeline,

       hand-off = (overhead of that query - median overhead of the 1-stage pipeline) / (N - 1)

   of which the median and p90 over queries are reported. The target (<= 50 us) is judged
   on the median.

2. End-to-end cost of slicing. token_mlp(hidden=128, layers=8), length-16 queries, cut into
   2 and 4 stages (2 buffer pairs; 4 stages also with 1 pair), against onnxruntime run
   directly on the unsliced model.onnx at batch size 1 with the same session options
   (`ort_session_options(1)`). Both are timed per query, inputs copy included: dvabatch from
   `submit` to the reply callback, the baseline around `np.copy` of the inputs + `session.run`.
   Target: <= 0.3 ms added per query (mean and median) for 4 stages. The 4 stages also run one
   after another without the runtime, for the overhead breakdown figure 21 reports too
   (`perf.costs.inprocess.breakdown_ms`: unsliced + slicing + hand-offs = runtime, medians).

3. Breakdown (skip with --no-breakdown): where a hand-off's time goes. The 8-stage pipeline is
   (a) driven synchronously from one thread through `Scheduler.next_work`/`finish_work` (the
   pure CPU cost of the bookkeeping, no thread switch: the scheduler owns no thread), (b) served
   by a `Pipeline` around a `Scheduler` subclass that timestamps those calls (engine end ->
   finish_work -> wake-up and next_work of the next stage -> engine start), with the executors'
   own wake-up counts, plus (c) a bare CPython thread-to-thread wake-up through a Condition over
   a shared lock, (d) the cost of one onnxruntime call with and without building the
   IOBinding each time, and (e) the Triton adapter's own per-request work (`_rows`, the reply
   callback, building the response), with a stand-in for `triton_python_backend_utils`.

Every configuration of a part runs in the same process; blocks of queries alternate between
them in shuffled order (rounds), so machine noise falls on all of them alike. The figures are
wall-clock on a shared machine: on a small VM other processes and vCPU
wake-up latency move them by tens of percent between runs; compare configurations within one
run rather than across runs.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Mapping, Sequence

import numpy as np

from dvabatch_backend.runtime.engine import OrtStageEngine, ort_session_options
from dvabatch_backend.runtime.manifest import Manifest
from dvabatch_backend.runtime.query import Answer, gather_inputs, scatter_outputs
from dvabatch_backend.runtime.scheduler import Scheduler
from dvabatch_backend.runtime.settings import RuntimeSettings
from dvabatch_backend.runtime.work import WorkResult
from perf.costs.inprocess import (
    IN_A_ROW,
    DirectRunner,
    Inputs,
    Runner,
    ServedRunner,
    StagesRunner,
    breakdown_ms,
    run_interleaved,
)
from perf.load.stats import latency_stats
from policies.pipelined import PipelinedPolicy
from slicer import cut, toy

HANDOFF_TARGET_US = 50.0
ADDED_TARGET_MS = 0.3

perf = time.perf_counter


# --- models ----------------------------------------------------------------------------


def slice_model(model, layer_tensors: Sequence[str], num_stages: int, out_dir: Path, name: str,
                bs_max: int, max_length: int) -> Path:
    """Cut `model` into `num_stages` stages of about equal numbers of layers (as the demo does)."""
    at = cut.even_cuts(layer_tensors, num_stages)
    cut.cut_model(model, cut.cut_positions_after(model, at), out_dir, name, bs_max, max_length)
    return out_dir


# --- runners (perf.costs.inprocess) ----------------------------------------------------------


def check_answers(runners: Mapping[str, Runner], queries: Sequence[Inputs], ref: DirectRunner,
                  tol: float = 1e-4) -> None:
    for label, runner in runners.items():
        for query in queries[:3]:
            got, want = runner.answer_of(query), ref.answer_of(query)
            err = max(float(np.max(np.abs(got[k] - want[k]))) for k in want)
            if not err <= tol:
                raise RuntimeError(f"{label}: answer differs from the unsliced model by {err:.2e}")


# --- part 1: per hand-off --------------------------------------------------------------

STAGE_COUNTS = (1, 2, 4, 8)
PAIRS = (1, 2)


def part_handoff(tmp: Path, rounds: int, block: int, warmup: int) -> dict:
    features = 16
    model = toy.dense_mlp(features=features, layers=8)
    layer_tensors = [f"h{k}" for k in range(1, 8)] + ["y"]
    dirs = {n: slice_model(model, layer_tensors, n, tmp / f"dense{n}", "dense_mlp", 4, 1) for n in STAGE_COUNTS}
    rng = np.random.default_rng(1)
    queries = [{"x": rng.standard_normal(features).astype(np.float32)} for _ in range(64)]
    ref = DirectRunner(dirs[1] / "model.onnx")
    runners = {(n, p): ServedRunner(dirs[n], p).start() for p in PAIRS for n in STAGE_COUNTS}
    try:
        check_answers({f"{n} stages/{p} pairs": r for (n, p), r in runners.items()}, queries, ref)
        samples = run_interleaved(runners, queries, rounds, block, warmup, seed=1)
    finally:
        for r in runners.values():
            r.stop()
    result: dict = {"model": f"dense_mlp(features={features}, layers=8)", "queries_per_config": rounds * block,
                    "warmup": warmup, "rounds": rounds, "configs": [], "handoff": []}
    overhead = {}
    for (n, p), ss in samples.items():
        lat = np.array([s.latency for s in ss])
        eng = np.array([s.engine for s in ss])
        cli = np.array([s.client for s in ss])
        overhead[n, p] = lat - eng
        result["configs"].append({
            "stages": n, "pairs": p, "latency_us": latency_stats(lat, 1e6), "engine_us": latency_stats(eng, 1e6),
            "overhead_us": latency_stats(lat - eng, 1e6), "client_latency_us": latency_stats(cli, 1e6),
        })
    for p in PAIRS:
        base = float(np.median(overhead[1, p]))
        for n in STAGE_COUNTS[1:]:
            per = (overhead[n, p] - base) / (n - 1)
            med, p90 = float(np.median(per)) * 1e6, float(np.percentile(per, 90)) * 1e6
            result["handoff"].append({"stages": n, "pairs": p, "p50_us": med, "p90_us": p90,
                                      "target_us": HANDOFF_TARGET_US, "holds": med <= HANDOFF_TARGET_US})
    return result


def print_handoff(res: dict) -> None:
    print(f"\n== 1. Scheduling overhead per stage hand-off: {res['model']}, PipelinedPolicy, 1 thread/stage,")
    print(f"      closed loop (concurrency 1), {res['queries_per_config']} queries per config "
          f"after {res['warmup']} warm-up, {res['rounds']} interleaved rounds; times in us")
    print(f"{'stages':>6} {'pairs':>5} | {'e2e p50':>8} {'engines p50':>11} | {'overhead p50':>12} {'p90':>7} "
          f"{'mean':>7} | {'client-side e2e p50':>19}")
    for c in sorted(res["configs"], key=lambda c: (c["pairs"], c["stages"])):
        o = c["overhead_us"]
        print(f"{c['stages']:>6} {c['pairs']:>5} | {c['latency_us']['p50']:>8.1f} {c['engine_us']['p50']:>11.1f} | "
              f"{o['p50']:>12.1f} {o['p90']:>7.1f} {o['mean']:>7.1f} | {c['client_latency_us']['p50']:>19.1f}")
    print("per hand-off = (overhead of the N-stage query - median overhead with 1 stage) / (N - 1)")
    print(f"{'stages':>6} {'pairs':>5} | {'hand-off p50 us':>15} {'p90 us':>8} | target p50 <= {HANDOFF_TARGET_US:.0f} us")
    for h in res["handoff"]:
        print(f"{h['stages']:>6} {h['pairs']:>5} | {h['p50_us']:>15.1f} {h['p90_us']:>8.1f} | "
              f"{'holds' if h['holds'] else 'MISSED'}")


# --- part 2: end to end vs the unsliced model ------------------------------------------

E2E_CONFIGS = (("2 stages, 2 pairs", 2, 2), ("4 stages, 2 pairs", 4, 2), ("4 stages, 1 pair", 4, 1))
E2E_TARGET_CONFIG = "4 stages, 2 pairs"


def part_end_to_end(tmp: Path, rounds: int, block: int, warmup: int) -> dict:
    hidden, layers, length = 128, 8, 16
    model = toy.token_mlp(hidden=hidden, layers=layers)
    layer_tensors = [f"h{k}" for k in range(1, layers + 1)]
    dirs = {n: slice_model(model, layer_tensors, n, tmp / f"token{n}", "token_mlp", 16, 64) for n in (2, 4)}
    rng = np.random.default_rng(2)
    queries = [{"x": rng.standard_normal((length, hidden)).astype(np.float32), "mask": np.ones(length, np.float32)}
               for _ in range(64)]
    baseline = DirectRunner(dirs[4] / "model.onnx")
    in_a_row = f"4 {IN_A_ROW}"  # the slicing alone, for the breakdown of the target config
    runners: dict[str, Runner] = {"unsliced onnxruntime": baseline, in_a_row: StagesRunner(dirs[4])}
    runners.update({label: ServedRunner(dirs[n], p).start() for label, n, p in E2E_CONFIGS})
    try:
        check_answers(runners, queries, baseline)
        samples = run_interleaved(runners, queries, rounds, block, warmup, seed=2)
    finally:
        for r in runners.values():
            r.stop()
    base_lat = np.array([s.latency for s in samples["unsliced onnxruntime"]])
    result: dict = {"model": f"token_mlp(hidden={hidden}, layers={layers}), length {length}",
                    "queries_per_config": rounds * block, "warmup": warmup, "rounds": rounds,
                    "baseline_ms": latency_stats(base_lat), "configs": []}
    for label, n, p in E2E_CONFIGS:
        ss = samples[label]
        lat = np.array([s.latency for s in ss])
        eng = np.array([s.engine for s in ss])
        cli = np.array([s.client for s in ss])
        # per round: median difference, robust to drift between rounds
        per_round = [float(np.median(lat[r * block:(r + 1) * block]) - np.median(base_lat[r * block:(r + 1) * block]))
                     for r in range(rounds)]
        added_mean = float(lat.mean() - base_lat.mean()) * 1e3
        added_p50 = float(np.median(lat) - np.median(base_lat)) * 1e3
        entry = {
            "config": label, "stages": n, "pairs": p, "latency_ms": latency_stats(lat), "engine_ms": latency_stats(eng),
            "overhead_ms": latency_stats(lat - eng), "client_latency_ms": latency_stats(cli),
            "added_mean_ms": added_mean, "added_p50_ms": added_p50,
            "added_p50_per_round_median_ms": float(np.median(per_round)) * 1e3,
            "extra_engine_p50_ms": float(np.median(eng) - np.median(base_lat)) * 1e3,
        }
        if label == E2E_TARGET_CONFIG:
            entry["target_ms"] = ADDED_TARGET_MS
            entry["holds"] = added_mean <= ADDED_TARGET_MS and added_p50 <= ADDED_TARGET_MS
        result["configs"].append(entry)
    result["breakdown"] = {"config": E2E_TARGET_CONFIG, **breakdown_ms(
        samples["unsliced onnxruntime"], samples[in_a_row], samples[E2E_TARGET_CONFIG])}
    return result


def print_end_to_end(res: dict) -> None:
    print(f"\n== 2. End to end vs the unsliced model at batch size 1: {res['model']},")
    print(f"      closed loop (concurrency 1), {res['queries_per_config']} queries per config after "
          f"{res['warmup']} warm-up, {res['rounds']} interleaved rounds; times in ms")
    b = res["baseline_ms"]
    print(f"{'config':<22} | {'mean':>6} {'p50':>6} {'p90':>6} | {'added mean':>10} {'added p50':>9} | "
          f"{'engines p50':>11} {'runtime p50':>11} | {'client p50':>10}")
    print(f"{'unsliced onnxruntime':<22} | {b['mean']:>6.3f} {b['p50']:>6.3f} {b['p90']:>6.3f} | {'':>10} {'':>9} | "
          f"{b['p50']:>11.3f} {'':>11} | {b['p50']:>10.3f}")
    for c in res["configs"]:
        lat = c["latency_ms"]
        print(f"{c['config']:<22} | {lat['mean']:>6.3f} {lat['p50']:>6.3f} {lat['p90']:>6.3f} | "
              f"{c['added_mean_ms']:>10.3f} {c['added_p50_ms']:>9.3f} | {c['engine_ms']['p50']:>11.3f} "
              f"{c['overhead_ms']['p50']:>11.3f} | {c['client_latency_ms']['p50']:>10.3f}")
    for c in res["configs"]:
        if "holds" in c:
            print(f"target: {c['config']} adds <= {ADDED_TARGET_MS} ms per query (mean and p50): "
                  f"{'holds' if c['holds'] else 'MISSED'} (mean {c['added_mean_ms']:.3f}, p50 {c['added_p50_ms']:.3f})")
    d = res["breakdown"]
    print(f"breakdown of {d['config']} (medians, as figure 21's): unsliced {d['unsliced_ms']:.3f} + slicing "
          f"{d['slicing_ms']:.3f} (stages in a row {d['stages_in_a_row_ms']:.3f}) + hand-offs {d['handoffs_ms']:.3f} "
          f"= runtime {d['runtime_ms']:.3f}")
    print("engines = time inside the stage engines (the baseline: its whole call); runtime = e2e - engines;")
    print("client = submit until the submitting thread runs again (adds the Event wake-up to e2e)")


# --- part 3: breakdown -----------------------------------------------------------------


def _instrumented_scheduler(num_stages: int) -> type[Scheduler]:
    """A Scheduler subclass that timestamps submit calls, next_work returns and finish_work calls, per stage."""

    class InstrumentedScheduler(Scheduler):
        def __init__(self, *args, **kwargs) -> None:
            self.nw_marks: list[list[float]] = [[] for _ in range(num_stages)]
            self.fw_marks: list[list[tuple[float, float]]] = [[] for _ in range(num_stages)]
            self.submit_marks: list[tuple[float, float]] = []
            super().__init__(*args, **kwargs)

        def submit(self, inputs, reply):
            t0 = perf()
            qid = super().submit(inputs, reply)
            self.submit_marks.append((t0, perf()))
            return qid

        def next_work(self, stage):
            work = super().next_work(stage)
            if work is not None:
                self.nw_marks[stage].append(perf())
            return work

        def finish_work(self, work, result):
            t0 = perf()
            super().finish_work(work, result)
            self.fw_marks[work.stage].append((t0, perf()))

    return InstrumentedScheduler


def _sync_drive(model_dir: Path, pairs: int, queries: Sequence[Inputs], n_queries: int) -> dict:
    """Run queries through next_work / engine / finish_work from this one thread: no thread switches."""
    manifest = Manifest.load(model_dir / "manifest.json")
    n = manifest.num_stages
    engines = [OrtStageEngine(model_dir / s.file, 1) for s in manifest.stages]
    sched = Scheduler(manifest, PipelinedPolicy(), RuntimeSettings(num_buffer_pairs=pairs))  # no thread at all
    got: list[Answer] = []
    submit_t, nw_t, fw_t, gather_t, scatter_t = [], [[] for _ in range(n)], [[] for _ in range(n)], [], []
    for i in range(n_queries):
        t0 = perf()
        sched.submit(queries[i % len(queries)], got.append)
        submit_t.append(perf() - t0)
        for k in range(n):
            t0 = perf()
            work = sched.next_work(k)
            t1 = perf()
            nw_t[k].append(t1 - t0)
            if work is None:
                raise RuntimeError(f"synchronous drive: stage {k} had no work")
            if k == 0:
                gather_inputs(work.queries, work.inputs, sched.input_specs)
                gather_t.append(perf() - t1)
            engines[k].run(work.inputs, work.outputs)
            answers = None
            if k == n - 1:
                t2 = perf()
                answers = scatter_outputs(work.queries, work.outputs, sched.output_specs)
                scatter_t.append(perf() - t2)
            t3 = perf()
            sched.finish_work(work, WorkResult(answers=answers))
            fw_t[k].append(perf() - t3)
    if len(got) != n_queries or any(a.error is not None for a in got):
        raise RuntimeError("synchronous drive: not every query was answered ok")
    skip = min(200, n_queries // 4)
    med = lambda xs: float(np.median(xs[skip:])) * 1e6  # noqa: E731
    nw = [med(x) for x in nw_t]
    fw = [med(x) for x in fw_t]
    return {
        "submit_us": med(submit_t), "gather_us": med(gather_t), "scatter_us": med(scatter_t),
        "next_work_us": nw, "finish_work_us": fw,
        # a hand-off between two middle stages: finish_work of the one, next_work of the next
        "bookkeeping_per_handoff_us": float(np.median([fw[k] + nw[k + 1] for k in range(n - 2)])) if n > 2 else None,
    }


def _threaded_breakdown(model_dir: Path, pairs: int, queries: Sequence[Inputs], n_queries: int, warmup: int) -> dict:
    manifest = Manifest.load(model_dir / "manifest.json")
    n = manifest.num_stages
    runner = ServedRunner(model_dir, pairs, _instrumented_scheduler(n), engine_marks=True)
    sched = runner.scheduler

    def wakeups() -> int:
        return runner.pipeline.loop.wakeups

    runner.start()
    client, reply_t = [], []
    try:
        for i in range(warmup + n_queries):
            if i == warmup:
                wakeups0 = wakeups()
            s = runner.query(queries[i % len(queries)])
            client.append(s.client - s.latency)
            reply_t.append(runner._t_answer)
        wakeups_per_query = (wakeups() - wakeups0) / n_queries
    finally:
        runner.stop()
    nw = np.array(sched.nw_marks)  # [stage, query]
    fw = np.array(sched.fw_marks)  # [stage, query, enter/exit]
    eng = np.array([e.marks for e in runner.engines])  # [stage, query, start/end]
    sub = np.array(sched.submit_marks)
    sl = slice(warmup, None)
    nw, fw, eng, sub = nw[:, sl], fw[:, sl], eng[:, sl], sub[sl]
    reply = np.array(reply_t)[sl]
    mid = range(0, n - 1)  # boundaries between stage k and k + 1
    gap = np.concatenate([eng[k + 1, :, 0] - eng[k, :, 1] for k in mid])
    to_fw = np.concatenate([fw[k, :, 0] - eng[k, :, 1] for k in mid])
    in_fw = np.concatenate([fw[k, :, 1] - fw[k, :, 0] for k in mid])
    wake = np.concatenate([nw[k + 1] - fw[k, :, 1] for k in mid])
    to_eng = np.concatenate([eng[k + 1, :, 0] - nw[k + 1] for k in mid])
    med = lambda a: float(np.median(a)) * 1e6  # noqa: E731
    p90 = lambda a: float(np.percentile(a, 90)) * 1e6  # noqa: E731
    return {
        "pairs": pairs,
        "loop_wakeups_per_query": wakeups_per_query,
        "stage_runs_per_query": n,
        "handoff_gap_us": {"p50": med(gap), "p90": p90(gap)},
        "engine_end_to_finish_work_us": med(to_fw),
        "finish_work_us": med(in_fw),
        "finish_work_exit_to_next_work_return_us": {"p50": med(wake), "p90": p90(wake)},
        "next_work_return_to_engine_us": med(to_eng),
        "submit_call_us": med(sub[:, 1] - sub[:, 0]),
        "submit_to_stage0_engine_us": med(eng[0, :, 0] - sub[:, 0]),
        "submit_return_to_stage0_next_work_us": med(nw[0] - sub[:, 1]),
        "last_engine_end_to_reply_us": med(reply - eng[n - 1, :, 1]),
        "reply_to_client_resume_us": med(np.array(client)[sl]),
    }


def _wakeup_pingpong(n: int, idle_s: float = 0.0) -> dict:
    """One-way latency of a thread hand-off through a Condition over a shared lock, as in the runtime.

    With `idle_s`, the notifying thread sleeps that long before each notify, so that both
    threads have been blocked a while (as a stage executor between queries at low load).
    """
    lock = threading.Lock()
    cond_a, cond_b = threading.Condition(lock), threading.Condition(lock)
    state = SimpleNamespace(turn="a", t_notify=0.0, stop=False)
    one_way: list[float] = []

    def b_loop() -> None:
        with lock:
            while True:
                while state.turn != "b" and not state.stop:
                    cond_b.wait()
                if state.stop:
                    return
                one_way.append(perf() - state.t_notify)
                state.turn = "a"
                cond_a.notify()

    thread = threading.Thread(target=b_loop, daemon=True)
    thread.start()
    with lock:
        for _ in range(n):
            if idle_s:
                lock.release()
                time.sleep(idle_s)
                lock.acquire()
            state.turn = "b"
            state.t_notify = perf()
            cond_b.notify()
            while state.turn != "a":
                cond_a.wait()
        state.stop = True
        cond_b.notify()
    thread.join()
    a = np.array(one_way[min(100, n // 4):])
    return {"p50_us": float(np.median(a)) * 1e6, "p90_us": float(np.percentile(a, 90)) * 1e6}


def _ort_call_costs(model_dir: Path, n: int) -> dict:
    """One stage of the 8-stage dense model: the cost of an OrtStageEngine.run and its parts."""
    import onnxruntime as ort

    manifest = Manifest.load(model_dir / "manifest.json")
    stage = manifest.stages[1]
    session = ort.InferenceSession(str(model_dir / stage.file), ort_session_options(1), providers=["CPUExecutionProvider"])
    inputs = {s.name: np.zeros(s.shape(1, 1), s.np_dtype) for s in stage.inputs}
    outputs = {s.name: np.zeros(s.shape(1, 1), s.np_dtype) for s in stage.outputs}
    engine = OrtStageEngine(model_dir / stage.file, 1)

    def bind():
        binding = session.io_binding()
        for name, arr in inputs.items():
            binding.bind_input(name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)
        for name, arr in outputs.items():
            binding.bind_output(name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)
        return binding

    cached = bind()
    arr = next(iter(inputs.values()))
    cases: dict[str, Callable[[], object]] = {
        "OrtStageEngine.run": lambda: engine.run(inputs, outputs),
        "io_binding() + bind_input/bind_output": bind,
        "run_with_iobinding (binding reused)": lambda: session.run_with_iobinding(cached),
        "session.run (numpy in/out)": lambda: session.run(None, inputs),
        "arr.ctypes.data": lambda: arr.ctypes.data,
    }
    return _median_us(cases, n)


def _pb_utils_stand_in() -> None:
    """Outside Triton there is no `triton_python_backend_utils`: a stand-in with the names the adapter
    uses, whose Tensor/InferenceResponse only hold what they are given (Triton's own serialization is
    not measured here; the adapter's numpy work and bookkeeping are)."""
    import types

    if "triton_python_backend_utils" in sys.modules:
        return
    pb = types.ModuleType("triton_python_backend_utils")

    class Holder:
        def __init__(self, *args, **kwargs) -> None:
            self.args, self.kwargs = args, kwargs

    class TritonError(Holder):
        INVALID_ARG, UNAVAILABLE, INTERNAL, CANCELLED = 1, 2, 3, 4

    pb.Tensor = pb.InferenceResponse = Holder
    pb.TritonError = TritonError
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    pb.Logger = SimpleNamespace(log_error=print, log_warn=print, log_info=print)
    pb.get_input_tensor_by_name = lambda request, name: request.tensors.get(name)
    sys.modules["triton_python_backend_utils"] = pb


def _adapter_costs(model_dir: Path, queries: Sequence[Inputs], n: int) -> dict:
    """The adapter's per-request work in this process, one row per request: `_rows` (request tensors to
    query dicts), one answer's reply callback, and `send` (the response tensors; the sender is a no-op)."""
    _pb_utils_stand_in()
    from dvabatch_backend.triton_adapter import model as adapter

    manifest = Manifest.load(model_dir / "manifest.json")
    host = SimpleNamespace(_manifest=manifest)
    requests = [SimpleNamespace(tensors={k: SimpleNamespace(as_numpy=lambda v=v: v[None]) for k, v in q.items()})
                for q in queries]
    outputs = [{t.name: np.zeros(t.sample_shape(1), t.np_dtype) for t in manifest.outputs}]
    sender = SimpleNamespace(send=lambda response, flags: None)
    inline = SimpleNamespace(submit=lambda request_answer: None)
    names = [t.name for t in manifest.outputs]

    def respond() -> object:
        answer = adapter._RequestAnswer(sender, 1, names, inline, manifest.output_batch_axes)  # type: ignore[arg-type]
        answer.reply_for(0)(Answer(0, dict(outputs[0]), None))
        return answer

    made = respond()
    cases: dict[str, Callable[[], object]] = {
        "_rows": lambda: adapter.TritonPythonModel._rows(host, requests[0]),  # type: ignore[arg-type]
        "_RequestAnswer + reply": respond,
        "send": made.send,
    }
    return _median_us(cases, n)


def part_breakdown(tmp: Path, n_queries: int, warmup: int) -> dict:
    model_dir = tmp / "dense8"
    if not model_dir.exists():
        slice_model(toy.dense_mlp(16, 8), [f"h{k}" for k in range(1, 8)] + ["y"], 8, model_dir, "dense_mlp", 4, 1)
    rng = np.random.default_rng(3)
    queries = [{"x": rng.standard_normal(16).astype(np.float32)} for _ in range(64)]
    return {
        "model": "dense_mlp(features=16, layers=8), 8 stages",
        "sync": _sync_drive(model_dir, 2, queries, n_queries),
        "threaded": [_threaded_breakdown(model_dir, p, queries, n_queries, warmup) for p in PAIRS],
        "condition_wakeup": _wakeup_pingpong(n_queries),
        "condition_wakeup_after_idle": _wakeup_pingpong(n_queries // 3, idle_s=200e-6),
        "ort_call": _ort_call_costs(model_dir, n_queries),
        "adapter": _adapter_costs(model_dir, queries, n_queries),
    }


def print_breakdown(res: dict) -> None:
    s, w, o = res["sync"], res["condition_wakeup"], res["ort_call"]
    wi = res["condition_wakeup_after_idle"]
    print(f"\n== 3. Where a hand-off goes: {res['model']} (medians, us)")
    print("(a) bookkeeping alone, driven from one thread (no thread switch), 2 pairs:")
    print(f"    submit {s['submit_us']:.1f}, gather_inputs {s['gather_us']:.1f}, scatter_outputs {s['scatter_us']:.1f}")
    print("    next_work per stage  " + " ".join(f"{x:5.1f}" for x in s["next_work_us"]))
    print("    finish_work per stage" + " ".join(f"{x:6.1f}" for x in s["finish_work_us"]) + "  (last: + dispatch, reply)")
    if s["bookkeeping_per_handoff_us"] is not None:
        print(f"    => finish_work(k) + next_work(k+1), middle stages: {s['bookkeeping_per_handoff_us']:.1f}")
    print("(b) served by the stage threads (engine end of stage k -> engine start of stage k+1):")
    for t in res["threaded"]:
        gap, wake = t["handoff_gap_us"], t["finish_work_exit_to_next_work_return_us"]
        print(f"  {t['pairs']} pair(s): hand-off gap {gap['p50']:.1f} (p90 {gap['p90']:.1f}) = engine end -> finish_work "
              f"{t['engine_end_to_finish_work_us']:.1f} + finish_work {t['finish_work_us']:.1f} + "
              f"exit -> next_work returns in stage k+1 {wake['p50']:.1f} (p90 {wake['p90']:.1f}) + "
              f"-> engine {t['next_work_return_to_engine_us']:.1f}")
        print(f"    entry: submit() call {t['submit_call_us']:.1f}, submit -> stage 0 engine "
              f"{t['submit_to_stage0_engine_us']:.1f}; exit: last engine end -> reply "
              f"{t['last_engine_end_to_reply_us']:.1f}; reply -> client thread runs {t['reply_to_client_resume_us']:.1f}")
        print(f"    engine-loop wake-ups per query: {t['loop_wakeups_per_query']:.2f} for "
              f"{t['stage_runs_per_query']} stage runs")
    print(f"(c) bare CPython thread wake-up, Condition.notify -> waiter runs (shared lock): back to back "
          f"p50 {w['p50_us']:.1f} (p90 {w['p90_us']:.1f}); after 200 us idle p50 {wi['p50_us']:.1f} "
          f"(p90 {wi['p90_us']:.1f})")
    print("(d) one onnxruntime call, a middle stage (batch 1): " +
          ", ".join(f"{k} {v:.1f}" for k, v in o.items()))
    print("(e) the Triton adapter per one-row request (pb_utils stood in for; sender a no-op): " +
          ", ".join(f"{k} {v:.1f}" for k, v in res["adapter"].items()))


# --- main ------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.costs.overhead", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer queries: about 20 s")
    parser.add_argument("--json", type=Path, metavar="OUT", help="also write the figures as JSON")
    parser.add_argument("--no-breakdown", action="store_true", help="skip part 3 (where a hand-off goes)")
    args = parser.parse_args(argv)

    if args.quick:
        p1 = dict(rounds=6, block=150, warmup=150)
        p2 = dict(rounds=6, block=200, warmup=150)
        p3 = dict(n_queries=600, warmup=100)
    else:
        p1 = dict(rounds=24, block=250, warmup=300)
        p2 = dict(rounds=20, block=250, warmup=300)
        p3 = dict(n_queries=3000, warmup=300)

    import onnxruntime as ort

    t_start = perf()
    env = {"python": platform.python_version(), "onnxruntime": ort.__version__, "numpy": np.__version__,
           "machine": platform.machine(), "cpus": _cpu_count(), "quick": args.quick}
    print(f"dvabatch runtime overhead benchmark: python {env['python']}, onnxruntime {env['onnxruntime']}, "
          f"{env['cpus']} CPUs{', --quick' if args.quick else ''}")
    report: dict = {"env": env}
    with tempfile.TemporaryDirectory(prefix="dvabatch-overhead-") as tmp_name:
        tmp = Path(tmp_name)
        report["handoff"] = part_handoff(tmp, **p1)
        print_handoff(report["handoff"])
        report["end_to_end"] = part_end_to_end(tmp, **p2)
        print_end_to_end(report["end_to_end"])
        if not args.no_breakdown:
            report["breakdown"] = part_breakdown(tmp, **p3)
            print_breakdown(report["breakdown"])
    report["seconds"] = perf() - t_start
    handoff_ok = all(h["holds"] for h in report["handoff"]["handoff"])
    e2e_ok = all(c.get("holds", True) for c in report["end_to_end"]["configs"])
    report["targets"] = {"handoff": handoff_ok, "end_to_end": e2e_ok}
    print(f"\n== targets: per hand-off <= {HANDOFF_TARGET_US:.0f} us: {'holds' if handoff_ok else 'MISSED'}; "
          f"4 stages add <= {ADDED_TARGET_MS} ms: {'holds' if e2e_ok else 'MISSED'}  ({report['seconds']:.0f} s)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def _cpu_count() -> int:
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _median_us(cases: dict, n: int) -> dict:
    """Each case's median time over `n` calls after 200 warm-up calls, in µs."""
    out = {}
    for label, fn in cases.items():
        for _ in range(200):
            fn()
        ts = []
        for _ in range(n):
            t0 = perf()
            fn()
            ts.append(perf() - t0)
        out[label] = float(np.median(ts)) * 1e6
    return out


if __name__ == "__main__":
    sys.exit(main())

