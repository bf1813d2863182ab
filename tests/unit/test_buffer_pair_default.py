"""The buffer pairs a served model gets by default: 1 where each stage runs on every CPU core (the
served default: a pool of every core per stage; or the global pool) and on a GPU (its stages share
one device), 2 where each stage has a few CPU cores of its own; the slicer writes that number, and the threads, into config.pbtxt."""
from __future__ import annotations


import pytest

from dvabatch_backend.runtime.settings import default_buffer_pairs
from slicer.triton_files import config_pbtxt
from slicer.model_config import parameters


@pytest.mark.parametrize("device, thread_pool, threads, pairs", [
    ("cpu", "per_stage", 0, 1), ("cpu", "per_stage", 1, 2), ("cpu", "per_stage", 2, 2), ("cpu", "global", 1, 1),
    ("cuda", "per_stage", 0, 1), ("cuda", "per_stage", 1, 1), ("cuda", "global", 1, 1)])
def test_default_buffer_pairs(device: str, thread_pool: str, threads: int, pairs: int) -> None:
    assert default_buffer_pairs(device, thread_pool, threads) == pairs


def _pairs(config: str) -> int:
    return int(parameters(config)["num_buffer_pairs"])


def test_the_slicer_writes_the_default_and_keeps_a_chosen_number(zoo) -> None:
    manifest = zoo.stages("token", 2).manifest
    written = parameters(config_pbtxt(manifest))
    assert (written["thread_pool"], written["threads_per_stage"], written["num_buffer_pairs"]) == ("per_stage", "0", "1")
    assert _pairs(config_pbtxt(manifest, threads_per_stage=1)) == 2
    assert _pairs(config_pbtxt(manifest, thread_pool="global", threads_per_stage=1)) == 1
    assert _pairs(config_pbtxt(manifest, extra={"device": "cuda", "engine": "torch"})) == 1
    assert _pairs(config_pbtxt(manifest, num_buffer_pairs=3)) == 3
