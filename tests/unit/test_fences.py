"""The fence plumbing of the buffer pool on the CPU: a factory gives each buffer its fence, the pool
drives reset/record/wait and the read fences, and a reader before its writer's record is a
violation. Real pools over a real sliced model; the CUDA fence is tested in tests/gpu."""
from __future__ import annotations

import numpy as np
import pytest

from dvabatch_backend.runtime.buffers import BufferPool, PairUse
from dvabatch_backend.runtime.fences import CudaEventFence, HostFence, host_fences, install_fences
from policies import create_policy

from ..conftest import Collector, assert_all_answered_correctly, make_scheduler


class CountingFence(HostFence):
    """A HostFence that counts what the pool called: the host fence's behaviour, observed."""

    def __init__(self, boundary: int, pair: int) -> None:
        super().__init__()
        self.where = (boundary, pair)
        self.calls: dict[str, int] = {"reset": 0, "record": 0, "wait": 0, "record_read": 0, "wait_read": 0}

    def reset(self) -> None:
        self.calls["reset"] += 1
        super().reset()

    def record(self) -> None:
        self.calls["record"] += 1
        super().record()

    def wait(self) -> bool:
        self.calls["wait"] += 1
        return super().wait()

    def record_read(self) -> None:
        self.calls["record_read"] += 1

    def wait_read(self) -> None:
        self.calls["wait_read"] += 1


def test_default_pool_has_host_fences(zoo) -> None:
    model = zoo.stages("token", 3)
    pool = BufferPool(model.manifest, num_pairs=2, bs_max=4)
    assert all(type(b.fence) is HostFence for row in pool.buffers for b in row)
    assert isinstance(host_fences(0, 0), HostFence)


def test_factory_gets_every_boundary_and_pair(zoo) -> None:
    model = zoo.stages("token", 3)
    pool = BufferPool(model.manifest, num_pairs=2, bs_max=4, fence_factory=CountingFence)
    wheres = [b.fence.where for row in pool.buffers for b in row]  # type: ignore[attr-defined]
    assert wheres == [(k, j) for k in range(4) for j in range(2)]


def test_pool_drives_the_fences_through_one_batch(zoo) -> None:
    model = zoo.stages("token", 2)
    pool = BufferPool(model.manifest, num_pairs=1, bs_max=4, fence_factory=CountingFence)
    first, second = PairUse(0, 0, range(0, 2), group=0), PairUse(1, 0, range(0, 2), group=0)
    pool.begin(first)
    pool.finish(first, handed_on=True)
    pool.begin(second)
    pool.finish(second, handed_on=False)  # the last stage answers: it hands nothing on
    assert pool.legitimate_upstream(1) == [0]
    b0, b1, b2 = (pool.buffers[k][0].fence for k in range(3))
    assert b1.calls == {"reset": 1, "record": 1, "wait": 1, "record_read": 1, "wait_read": 1}  # type: ignore[attr-defined]
    assert b0.calls["wait_read"] == 1 and b0.calls["record_read"] == 1  # type: ignore[attr-defined]
    assert b2.calls["record"] == 1 and b2.calls["wait"] == 0  # type: ignore[attr-defined]
    assert pool.violations == []


def test_reader_before_the_writers_record_is_a_violation(zoo) -> None:
    model = zoo.stages("token", 2)
    pool = BufferPool(model.manifest, num_pairs=1, bs_max=4)
    first, second = PairUse(0, 0, range(0, 1), group=0), PairUse(1, 0, range(0, 1), group=0)
    pool.begin(first)
    pool.finish(first, handed_on=True)
    pool.buffers[1][0].fence.reset()  # as if the writer had started again and not recorded yet
    pool.begin(second)
    assert any("fence" in str(v) for v in pool.violations)


def test_install_fences_only_before_work(zoo) -> None:
    model = zoo.stages("token", 2)
    pool = BufferPool(model.manifest, num_pairs=2, bs_max=4)
    pool.install_fences(CountingFence)
    assert all(isinstance(b.fence, CountingFence) for row in pool.buffers for b in row)
    pool.begin(PairUse(0, 0, range(0, 1), group=0))
    with pytest.raises(RuntimeError, match="before any work"):
        pool.install_fences(host_fences)


def test_pipeline_with_installed_fences_answers_correctly(zoo) -> None:
    """The scheduler's own pool, given counting host fences: every answer right, no violation, and
    the fences were driven (the pipeline really used them)."""
    model = zoo.stages("token", 3)
    made: list[CountingFence] = []

    def factory(boundary: int, pair: int) -> CountingFence:
        made.append(CountingFence(boundary, pair))
        return made[-1]

    pipeline = make_scheduler(model, create_policy("pipelined"), num_buffer_pairs=2, bs_max=4)
    install_fences(pipeline, factory)
    rng = np.random.default_rng(0)
    sent = {}
    collector = Collector()
    with pipeline:
        for _ in range(12):
            q = model.query(rng)
            sent[pipeline.submit(q, collector)] = q
        assert_all_answered_correctly(model, pipeline, collector, sent)
    assert len(made) == 4 * 2
    assert sum(f.calls["record"] for f in made) >= 3 * len(sent) // 4  # every stage recorded its writes
    assert sum(f.calls["wait"] for f in made if f.where[0] in (1, 2)) > 0


def test_cuda_fence_without_a_gpu_says_so() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: tests/gpu covers the CUDA fence")
    with pytest.raises(RuntimeError, match="no CUDA device"):
        CudaEventFence()
