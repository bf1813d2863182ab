"""config.pbtxt's string parameters, read and checked by one reader (the adapter's and the
baselines'): each kind of bad value is named with the parameter, the value and what it must be."""
from __future__ import annotations

import re

import pytest

from dvabatch_backend.triton_adapter import parameters as p

PARSERS = {"pairs": p.integer(1), "queue": p.integer(0), "slo_ms": p.positive_float,
           "engine": p.choice("onnxruntime", "torch"), "fast_path": p.boolean, "manifest": p.text}


def test_good_values_parse() -> None:
    got = p.read({"pairs": "2", "queue": "0", "slo_ms": "12.5", "engine": " Torch ", "fast_path": "no",
                  "manifest": "m.json", "policy.window": "0.002", "FORCE_CPU_ONLY_INPUT_TENSORS": "yes"},
                 PARSERS, also={"FORCE_CPU_ONLY_INPUT_TENSORS"}, prefixes=("policy.",))
    assert got == {"pairs": 2, "queue": 0, "slo_ms": 12.5, "engine": "torch", "fast_path": False, "manifest": "m.json"}


@pytest.mark.parametrize("key, raw, message", [
    ("pairs", "two", "parameter 'pairs': 'two' is not an integer"),
    ("pairs", "0", "parameter 'pairs': must be >= 1, got 0"),
    ("queue", "-1", "parameter 'queue': must be >= 0, got -1"),
    ("slo_ms", "soon", "parameter 'slo_ms': 'soon' is not a number"),
    ("slo_ms", "0", "parameter 'slo_ms': must be > 0, got 0"),
    ("engine", "tensorrt", "parameter 'engine': 'tensorrt' is not one of ['onnxruntime', 'torch']"),
    ("fast_path", "maybe", "parameter 'fast_path': 'maybe' is not one of"),
])
def test_each_bad_value_is_named(key: str, raw: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        p.read({key: raw}, PARSERS)


def test_an_unknown_name_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match=re.escape("unknown parameter(s) ['pair']; known: ['engine', 'fast_path'")):
        p.read({"pair": "2"}, PARSERS, prefixes=("policy.",))


def test_the_parameters_of_tritons_model_config() -> None:
    config = {"name": "m", "parameters": {"policy": {"string_value": "load"}, "bs_max": {"string_value": "8"}}}
    assert p.string_parameters(config) == {"policy": "load", "bs_max": "8"}
    assert p.string_parameters({"name": "m"}) == {}


def test_the_configs_queue_policy_is_the_runtimes_default_and_an_unset_one_changes_nothing() -> None:
    """The timeout the slicer writes into Triton's default_queue_policy (config JSON as the backend
    gets it) is the runtime queue's too; a config without one leaves the runtime's defaults."""
    from dvabatch_backend.runtime.settings import QueuePolicy

    written = {"dynamic_batching": {"default_queue_policy": {
        "timeout_action": "REJECT", "default_timeout_microseconds": "750000", "allow_timeout_override": True,
        "max_queue_size": 0}}}
    assert p.triton_queue_policy(written) == QueuePolicy(max_queue_size=None, default_timeout_us=750000,
                                                         allow_timeout_override=True, timeout_action="reject")
    bounded = {"dynamic_batching": {"default_queue_policy": {"timeout_action": "DELAY", "max_queue_size": 9}}}
    assert p.triton_queue_policy(bounded) == QueuePolicy(max_queue_size=9, default_timeout_us=0,
                                                         allow_timeout_override=False, timeout_action="delay")
    unset = {"dynamic_batching": {"default_queue_policy": {"timeout_action": "REJECT", "max_queue_size": 0,
                                                           "default_timeout_microseconds": 0}}}
    assert p.triton_queue_policy(unset) == QueuePolicy() == p.triton_queue_policy({})


@pytest.mark.parametrize("name", ["run_on", "lone_calls"])
def test_a_parameter_no_longer_read_fails_the_load_saying_why(name: str, tmp_path) -> None:
    from dvabatch_backend.triton_adapter.config import REMOVED_PARAMETERS, parse_parameters

    with pytest.raises(ValueError, match=re.escape(f"{name!r} ({REMOVED_PARAMETERS[name]})")):
        parse_parameters({name: "true", "policy": "load"}, tmp_path, check_files=False)
