"""`perf.costs.queue_policy` writes the queue policy it measures into the model's own config."""
from __future__ import annotations

from perf.costs.queue_policy import policy_text, with_policy
from slicer import model_config

CONFIG = 'name: "m"\nmax_batch_size: 16\ndynamic_batching {\n  max_queue_delay_microseconds: 0\n}\nbackend: "python"\n'


def test_a_timeout_policy_parses_as_triton_reads_it_and_keeps_the_rest() -> None:
    config = model_config.parse(with_policy(CONFIG, policy_text(583_000, 0)))
    policy = config.dynamic_batching.default_queue_policy
    assert policy.default_timeout_microseconds == 583_000 and policy.allow_timeout_override
    assert policy.max_queue_size == 0 and config.max_batch_size == 16 and config.backend == "python"


def test_a_queue_size_policy_replaces_the_timeout() -> None:
    policy = model_config.parse(with_policy(CONFIG, policy_text(583_000, 128))).dynamic_batching.default_queue_policy
    assert policy.max_queue_size == 128 and policy.default_timeout_microseconds == 0
