"""The slicer writes the policy its diversity report calls for in config.pbtxt, records it in the
manifest, and `auto` loads it (policies/auto.py)."""
from __future__ import annotations

import json
from pathlib import Path

from policies import load_policy
from policies.auto import choose
from policies.input_diversity import InputDiversityPolicy
from slicer.slice_model import SliceOptions, slice_model
from slicer.triton_files import config_pbtxt
from slicer.zoo import build


def test_the_slicer_writes_the_chosen_policy_and_auto_loads_it(tmp_path: Path) -> None:
    options = SliceOptions(stages=2, max_batch_size=4, max_length=32, repeats=2, batch_sizes=(1, 2, 4))
    report = slice_model(build("bert", "test"), tmp_path / "bert", options)
    recorded = json.loads((report.chosen.dir / "manifest.json").read_text())["policy"]
    div = report.profile["diversity"]
    assert recorded["choice"] == choose(div["input"], div["operator"])[0] == "input"  # a length axis
    config = (tmp_path / "bert" / "config.pbtxt").read_text()
    assert 'key: "policy" value: { string_value: "input" }' in config
    assert 'key: "thread_pool" value: { string_value: "global" }' in config
    assert isinstance(load_policy("auto", {}, report.chosen.dir), InputDiversityPolicy)
    assert 'string_value: "auto"' in config_pbtxt(report.manifest, policy="auto")  # auto may be written too
