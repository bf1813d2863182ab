"""`policy: auto` (policies/auto.py): the rule, the manifest's recorded choice, load_policy("auto")."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from policies import load_policy
from policies.auto import choose, operator_diversity, resolve
from policies.hybrid import HybridPolicy
from policies.input_diversity import InputDiversityPolicy
from policies.load_diversity import LoadDiversityPolicy

SEQ_INPUTS = [{"name": "ids", "dtype": "int64", "dims": ["batch", "seq"]}]
IMAGE_INPUTS = [{"name": "x", "dtype": "float32", "dims": ["batch", 3, 32, 32]}]
SAME_PREFERENCE = [{"1": 1.0, "2": 2.0}, {"1": 1.0, "2": 2.0}]  # both prefer 1
DIFFERENT = [{"1": 1.0, "2": 2.4}, {"1": 1.0, "2": 1.0}]  # 1 (20 % slower per query at 2), then 2


def test_the_rule() -> None:
    assert choose(True, True)[0] == "input"  # input diversity first
    assert choose(True, False)[0] == "input"
    assert choose(False, True)[0] == "hybrid"
    assert choose(False, False)[0] == "load"
    assert operator_diversity([{1: 1.0, 2: 1.0}, {1: 1.0, 2: 2.4}])  # the second stage: +20 % per query at 2
    assert not operator_diversity([{1: 1.0, 2: 2.0}] * 3)
    assert not operator_diversity([{1: 1.0, 2: 1.0}, {1: 1.0, 2: 2.0}])  # flat per query: a split saves nothing
    # a residual MLP's four identical stages, profiled on 2 cores: "preferred" 64, 16, 16, 64 by noise
    mlp = [{16: 16 * 0.0678, 64: 64 * 0.0575}, {16: 16 * 0.0575, 64: 64 * 0.0578},
           {16: 16 * 0.0573, 64: 64 * 0.0544}, {16: 16 * 0.0657, 64: 64 * 0.0558}]
    assert not operator_diversity(mlp)


def test_resolve_takes_the_recorded_choice_else_the_rule_on_the_manifest() -> None:
    assert resolve({"policy": {"choice": "hybrid", "why": "..."}, "inputs": SEQ_INPUTS}) == "hybrid"
    assert resolve({"inputs": SEQ_INPUTS, "stage_times": DIFFERENT}) == "input"
    assert resolve({"inputs": IMAGE_INPUTS, "stage_times": DIFFERENT}) == "hybrid"
    assert resolve({"inputs": IMAGE_INPUTS, "stage_times": SAME_PREFERENCE}) == "load"
    assert resolve({"inputs": IMAGE_INPUTS}) == "load"


@pytest.mark.parametrize("doc, kind", [
    ({"policy": {"choice": "input"}}, InputDiversityPolicy),
    ({"inputs": IMAGE_INPUTS, "stage_times": DIFFERENT}, HybridPolicy),
    ({"inputs": IMAGE_INPUTS, "stage_times": SAME_PREFERENCE}, LoadDiversityPolicy),
])
def test_auto_loads_the_chosen_policy(tmp_path: Path, doc: dict, kind: type) -> None:
    (tmp_path / "manifest.json").write_text(json.dumps(doc))
    policy = load_policy("auto", {}, tmp_path)
    assert type(policy) is kind


def test_auto_passes_parameters_and_needs_a_manifest(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text(json.dumps({"policy": {"choice": "input"}}))
    policy = load_policy("auto", {"pad_tolerance": "0.5"}, tmp_path)
    assert isinstance(policy, InputDiversityPolicy) and policy.pad_tolerance == 0.5
    with pytest.raises(ValueError, match="no manifest"):
        load_policy("auto", {}, tmp_path / "nowhere")
