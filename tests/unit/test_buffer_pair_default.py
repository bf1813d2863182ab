"""The buffer pairs a served model gets by default: 1 where the stages share every CPU core (the
served default, global pool), 2 where each stage has cores or a device of its own; the slicer writes
that number into config.pbtxt."""
from __future__ import annotations


import pytest

from dvabatch_backend.runtime.settings import default_buffer_pairs
from slicer.triton_files import config_pbtxt
from slicer.model_config import parameters


@pytest.mark.parametrize("device, thread_pool, pairs", [
    ("cpu", "global", 1), ("cpu", "per_stage", 2), ("cuda", "global", 2), ("cuda", "per_stage", 2)])
def test_default_buffer_pairs(device: str, thread_pool: str, pairs: int) -> None:
    assert default_buffer_pairs(device, thread_pool) == pairs


def _pairs(config: str) -> int:
    return int(parameters(config)["num_buffer_pairs"])


def test_the_slicer_writes_the_default_and_keeps_a_chosen_number(zoo) -> None:
    manifest = zoo.stages("token", 2).manifest
    assert _pairs(config_pbtxt(manifest)) == 1
    assert _pairs(config_pbtxt(manifest, thread_pool="per_stage")) == 2
    assert _pairs(config_pbtxt(manifest, extra={"device": "cuda", "engine": "torch"})) == 2
    assert _pairs(config_pbtxt(manifest, num_buffer_pairs=3)) == 3
