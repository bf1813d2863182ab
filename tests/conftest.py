"""Shared fixtures: small sliced models, the unsliced reference, and engines tests can steer; and the
markers given by folder (tests/server -> server, tests/perf_smoke -> perf_smoke, tests/gpu -> gpu)."""
from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import onnxruntime as ort
import psutil
import pytest

from dvabatch_backend import Answer, Manifest, OrtStageEngine, Pipeline, RuntimeSettings
from dvabatch_backend.runtime.decisions import Policy
from dvabatch_backend.runtime.settings import QueuePolicy
from dvabatch_backend.runtime.work import Launch, Step, current_launch
from slicer import cut, toy

TESTS = Path(__file__).resolve().parent
# folder under tests/ -> markers every test in it gets
FOLDER_MARKERS = {"server": ("server",), "perf_smoke": ("perf_smoke",), "gpu": ("gpu",)}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(str(item.fspath)).resolve()
        folder = path.relative_to(TESTS).parts[0] if path.is_relative_to(TESTS) else ""
        for name in FOLDER_MARKERS.get(folder, ()):
            item.add_marker(name)
    _guard_server_start()


# -- the server marker tells the truth: a test not marked `server` that starts tritonserver fails --

_running: list[pytest.Item] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    _running.append(item)
    try:
        yield
    finally:
        _running.pop()


def _guard_server_start() -> None:
    """Wrap TritonServer.start (if a test module imported it) to refuse a test without the marker;
    a perf_smoke test that starts the server says so with @pytest.mark.server."""
    serve = sys.modules.get("dvabatch_backend.tools.serve")
    server = getattr(serve, "TritonServer", None)
    if server is None or getattr(server.start, "_guarded", False):
        return
    start = server.start

    def guarded(self, *args, **kwargs):
        item = _running[-1] if _running else None
        if item is not None and item.get_closest_marker("server") is None:
            raise AssertionError(f"{item.nodeid} starts tritonserver but is not marked `server`")
        return start(self, *args, **kwargs)

    guarded._guarded = True  # type: ignore[attr-defined]
    server.start = guarded


# -- a test run leaves no /tmp/dvabatch-* folder behind -------------------------------------------
# A folder made during the session and still there at its end fails it when it is this session's:
# made by this process (tempfile.mkdtemp, which TemporaryDirectory uses too, is watched), or used
# by a process this session started (its environment carries the session's mark: a server left
# running). Other engineers' test runs share /tmp: other new folders are only reported. A child
# that exits leaving an unused folder is not caught here; the tests that run `dvabatch serve`
# check its work folder themselves.

LEFTOVER_GLOB = "dvabatch-*"
SESSION_MARK = "DVABATCH_TEST_SESSION"
_tmp_at_start: set[Path] = set()
_made_here: set[Path] = set()


def pytest_sessionstart(session: pytest.Session) -> None:
    _tmp_at_start.update(Path(tempfile.gettempdir()).glob(LEFTOVER_GLOB))
    os.environ.setdefault(SESSION_MARK, f"{os.getpid()}-{time.time_ns()}")
    _watch_mkdtemp()


def _watch_mkdtemp() -> None:
    original = tempfile.mkdtemp
    if getattr(original, "_watched", False):
        return

    def watched(suffix: str | None = None, prefix: str | None = None, dir: str | None = None) -> str:  # noqa: A002
        path = original(suffix, prefix, dir)
        if Path(path).name.startswith("dvabatch-"):
            _made_here.add(Path(path))
        return path

    watched._watched = True  # type: ignore[attr-defined]
    tempfile.mkdtemp = watched  # type: ignore[assignment]


def _used_by_this_session(folders: list[Path]) -> set[Path]:
    """The folders named on the command line of a live process that carries this session's mark."""
    mark = os.environ[SESSION_MARK]
    used = set()
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            if proc.environ().get(SESSION_MARK) != mark:
                continue
            cmdline = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        used.update(f for f in folders if str(f) in cmdline)
    return used


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    support = sys.modules.get("tests.triton_support")
    if support is not None:
        support.remove_slices()  # the zoo slices the server tests shared: this session's own, removed here
    left = sorted(p for p in Path(tempfile.gettempdir()).glob(LEFTOVER_GLOB) if p not in _tmp_at_start)
    if not left:
        return
    used = _used_by_this_session(left)
    ours = [p for p in left if p in _made_here or p in used]
    others = [p for p in left if p not in ours]
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")

    def write(line: str, **markup: bool) -> None:
        reporter.write_line(line, **markup) if reporter is not None else print(line)

    if others:
        write(f"note: {len(others)} /tmp/dvabatch-* folder(s) appeared during the session that are not this "
              f"session's (another test run's?): {[str(p) for p in others]}")
    if ours:
        write(f"ERROR: the test session left {len(ours)} folder(s) behind: {[str(p) for p in ours]}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


HIDDEN = 8
MAX_LENGTH = 12
MAX_BS = 8
TOKEN_LAYERS = 6  # cut points h1..h5: up to 6 stages
DENSE_LAYERS = 6  # cut points h1..h5


@dataclass
class SlicedModel:
    """A model directory plus its unsliced reference, run on each query alone."""

    dir: Path
    manifest: Manifest
    full: ort.InferenceSession = field(repr=False)

    def reference(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        names = [o.name for o in self.full.get_outputs()]
        return dict(zip(names, (r[0] for r in self.full.run(None, {k: v[None] for k, v in inputs.items()}))))

    def engines(self) -> list[OrtStageEngine]:
        return [OrtStageEngine(self.dir / s.file) for s in self.manifest.stages]

    def query(self, rng: np.random.Generator, length: int | None = None) -> dict[str, np.ndarray]:
        if "mask" in {t.name for t in self.manifest.inputs}:
            length = int(rng.integers(1, MAX_LENGTH + 1)) if length is None else length
            return {"x": rng.standard_normal((length, HIDDEN)).astype(np.float32), "mask": np.ones(length, np.float32)}
        return {"x": rng.standard_normal(16).astype(np.float32)}


class ModelZoo:
    """Sliced toy models, made once per test session and cached by (kind, cut tensors)."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._cache: dict[tuple[str, tuple[str, ...]], SlicedModel] = {}

    def get(self, kind: str, cuts: tuple[str, ...]) -> SlicedModel:
        key = (kind, cuts)
        if key not in self._cache:
            model = toy.token_mlp(hidden=HIDDEN, layers=TOKEN_LAYERS) if kind == "token" else toy.dense_mlp(16, DENSE_LAYERS)
            out = self._root / f"{kind}-{'-'.join(cuts) or 'whole'}"
            manifest = cut.cut_model(model, cut.cut_positions_after(model, list(cuts)), out, kind, MAX_BS, MAX_LENGTH)
            full = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
            self._cache[key] = SlicedModel(out, manifest, full)
        return self._cache[key]

    def stages(self, kind: str, n: int) -> SlicedModel:
        """`n` stages cut after evenly spread hidden layers."""
        layers = [f"h{k}" for k in range(1, 6)]
        return self.get(kind, tuple(cut.even_cuts(layers, n)))


@pytest.fixture(scope="session")
def zoo_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `--out` folder of the perf commands that slice a zoo model at its test size: a finished
    slice there is reused (`perf.baselines.bench.sliced`), so each is made once per session."""
    return tmp_path_factory.mktemp("zoo_out")


@pytest.fixture(scope="session")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> ModelZoo:
    return ModelZoo(tmp_path_factory.mktemp("zoo"))


class Collector:
    """A reply callback that records every answer, and waits for a number of them."""

    def __init__(self) -> None:
        self.answers: dict[int, list[Answer]] = defaultdict(list)
        self.times: dict[int, float] = {}
        self._cond = threading.Condition()

    def __call__(self, answer: Answer) -> None:
        with self._cond:
            self.answers[answer.query_id].append(answer)
            self.times.setdefault(answer.query_id, time.perf_counter())
            self._cond.notify_all()

    def wait_for(self, ids: list[int] | set[int], timeout: float = 20.0) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: all(i in self.answers for i in ids), timeout)

    def one(self, qid: int) -> Answer:
        got = self.answers[qid]
        assert len(got) == 1, f"query {qid} answered {len(got)} times: {got}"
        return got[0]


class GatedEngine:
    """A real engine that runs only when the test lets it: steps are ordered by events, not sleeps."""

    def __init__(self, inner: OrtStageEngine) -> None:
        self.inner = inner
        self.started = threading.Semaphore(0)
        self._permits = threading.Semaphore(0)

    def run(self, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
        self.started.release()
        if not self._permits.acquire(timeout=20):
            raise TimeoutError("the test never let this stage run")
        self.inner.run(inputs, outputs)

    def wait_started(self, timeout: float = 10.0) -> None:
        assert self.started.acquire(timeout=timeout), "stage did not start"

    def release(self, runs: int = 1) -> None:
        """Let the next `runs` runs through."""
        self._permits.release(runs)

    def open(self) -> None:
        """Stop gating: every later run goes through."""
        self.release(1_000_000)


class SlowEngine:
    """A real engine that also takes `delay` seconds, to widen the windows in which stages overlap."""

    def __init__(self, inner: OrtStageEngine, delay: float) -> None:
        self.inner, self.delay = inner, delay

    def run(self, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
        self.inner.run(inputs, outputs)
        time.sleep(self.delay)


class LaunchLedger:
    """Wraps every engine it is given (`wrap`) and records each launch that breaks the engine loop's
    ownership (runtime/engine_loop.py): a launch outside a step, a launch on a step's thread by a
    thread that does not hold the loop's step (two steps at once), or a launch of an engine that is
    still running one. `violations` names each; `watch(pipeline)` gives it the pipeline's step, and
    with `tabled` also a launch whose batch is not a row of the pipeline's batch table holding the
    launch's queries (`snapshot()`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[int, str] = {}  # engine index -> the thread running it
        self.step: Step | None = None
        self.table: Pipeline | None = None  # whose batch table every launch's batch must be a row of
        self.launches = 0
        self.violations: list[str] = []

    def wrap(self, engines: Sequence[Any]) -> list["LedgeredEngine"]:
        return [LedgeredEngine(self, index, engine) for index, engine in enumerate(engines)]

    def watch(self, pipeline: Pipeline, tabled: bool = False) -> Pipeline:
        self.step = pipeline.loop.step
        self.table = pipeline if tabled else None
        return pipeline

    def begin(self, index: int) -> None:
        me = threading.current_thread().name
        launch = current_launch()
        with self._lock:
            self.launches += 1
            if launch is None:
                self.violations.append(f"engine {index}: launched on {me} outside a step")
            elif launch.on_step_thread and self.step is not None and not self.step.is_mine():
                self.violations.append(f"engine {index}: launched on {me} in a step another thread holds")
            if index in self._running:
                self.violations.append(f"engine {index}: launched on {me} while {self._running[index]} runs it")
            if self.table is not None and launch is not None and not self._tabled(launch):
                self.violations.append(f"engine {index}: launched on {me} batch {launch.batch} of queries "
                                       f"{list(launch.queries)}, which the batch table does not hold")
            self._running[index] = me

    def end(self, index: int) -> None:
        with self._lock:
            self._running.pop(index, None)

    def _tabled(self, launch: Launch) -> bool:
        assert self.table is not None
        rows = {row.id: set(row.query_ids) for row in self.table.snapshot().rows}
        return launch.batch in rows and bool(launch.queries) and set(launch.queries) <= rows[launch.batch]


class LedgeredEngine:
    def __init__(self, ledger: LaunchLedger, index: int, inner: Any) -> None:
        self.ledger, self.index, self.inner = ledger, index, inner

    def run(self, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
        self.ledger.begin(self.index)
        try:
            self.inner.run(inputs, outputs)
        finally:
            self.ledger.end(self.index)


def make_scheduler(model: SlicedModel, policy: Policy, engines: list | None = None, clock: Callable[[], float] | None = None,
                   **settings: object) -> Pipeline:
    """A pipeline over the model (tracing on); `clock` replaces the wall clock (e.g. a frozen one).
    Its queue is unbounded unless `queue` says otherwise: these pipelines study the schedules, and
    a random schedule's burst may pass the derived bound (admission tests set their own)."""
    options = {"record_trace": True, "queue": QueuePolicy(max_queue_size=0), **settings}
    extra = {} if clock is None else {"clock": clock}
    return Pipeline.create(model.manifest, engines or model.engines(), policy, RuntimeSettings(**options), **extra)  # type: ignore[arg-type]


def call(pipeline: Pipeline, queries: list[dict[str, np.ndarray]], collector: Collector) -> tuple[list[int], bool]:
    """A caller's call: its queries submitted, and the loop's steps run here until they are answered
    (`Pipeline.serve_here`); their ids, and whether they were answered by its return."""
    ids: list[int] = []
    answered = pipeline.serve_here(lambda _: ids.extend(pipeline.submit_many([(q, collector) for q in queries])),
                                   lambda: all(i in collector.answers for i in ids))
    return ids, answered


def assert_all_answered_correctly(model: SlicedModel, scheduler, collector: "Collector",
                                  sent: Mapping[int, Mapping[str, np.ndarray]]) -> None:
    """Every query sent answered exactly once, equal to the unsliced model; no buffer-rule violation,
    no policy error."""
    assert collector.wait_for(set(sent), timeout=30), f"unanswered: {set(sent) - set(collector.answers)}"
    assert set(collector.answers) == set(sent)
    for qid, inputs in sent.items():
        assert_matches_reference(model, inputs, collector.one(qid))
    assert scheduler.buffer_violations == []
    assert scheduler.stats.policy_errors == 0
    assert scheduler.stats.answered_ok == len(sent)


def assert_matches_reference(model: SlicedModel, inputs: Mapping[str, np.ndarray], answer: Answer) -> None:
    assert answer.error is None, answer.error
    assert answer.outputs is not None
    for name, ref in model.reference(inputs).items():
        np.testing.assert_allclose(answer.outputs[name], ref, atol=1e-4, rtol=0, err_msg=f"output {name}")


# -- an exit head: the early-exit policy's model ------------------------------------------------


def sliced_cascade(out: Path) -> SlicedModel:
    """toy.cascade_mlp cut after its exit head ("early_logits") and after h3: 3 stages, bs_max 8."""
    model = toy.cascade_mlp(features=16, classes=4, layers=4)
    manifest = cut.cut_model(model, cut.cut_positions_after(model, ["early_logits", "h3"]), out, "cascade", 8, 0)
    return SlicedModel(out, manifest, ort.InferenceSession(str(out / "model.onnx")))


@dataclass
class ExitQueries:
    """Queries for the cascade, their unsliced answers, and a confidence threshold at the median
    of their exit-head confidences: `leaves[i]` says whether query i exits at the head."""

    queries: list[dict[str, np.ndarray]]
    refs: list[dict[str, np.ndarray]]
    threshold: float
    leaves: np.ndarray

    @classmethod
    def make(cls, cascade: SlicedModel, n: int, seed: int) -> "ExitQueries":
        from policies.examples.early_exit import confidence

        rng = np.random.default_rng(seed)
        queries = [{"x": rng.standard_normal(16).astype(np.float32) * 2} for _ in range(n)]
        refs = [cascade.reference(q) for q in queries]
        conf = np.array([confidence(r["early_logits"][None])[0] for r in refs])
        threshold = float(np.median(conf))
        leaves = conf >= threshold
        assert 0 < leaves.sum() < n
        return cls(queries, refs, threshold, leaves)

    def assert_answered(self, collector: "Collector", sent: list[int], atol: float = 1e-4,
                        exit_atol: float = 1e-5) -> None:
        """Each query answered: the head's result where it left there (within `exit_atol`), the whole
        model's otherwise (within `atol`)."""
        for qid, ref, out in zip(sent, self.refs, self.leaves):
            answer = collector.one(qid)
            assert answer.error is None, answer.error
            if out:
                np.testing.assert_allclose(answer.outputs["logits"], ref["early_logits"], atol=exit_atol)
                np.testing.assert_allclose(answer.outputs["early_logits"], ref["early_logits"], atol=exit_atol)
            else:
                np.testing.assert_allclose(answer.outputs["logits"], ref["logits"], atol=atol)
