"""Batching policies built on the meta operations new, stretch and split.

`create_policy(name, **params)` makes a built-in policy by name; an unknown name fails with
the bad value and the known ones in the message.
"""
from __future__ import annotations

from typing import Any, Callable

from dvabatch_backend.decisions import Policy

from .pipelined import PipelinedPolicy
from .random_legal import RandomLegalPolicy

BUILTIN: dict[str, Callable[..., Policy]] = {
    PipelinedPolicy.name: PipelinedPolicy,
    RandomLegalPolicy.name: RandomLegalPolicy,
}


def create_policy(name: str, **params: Any) -> Policy:
    try:
        factory = BUILTIN[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; built-in policies are {sorted(BUILTIN)}") from None
    return factory(**params)


__all__ = ["BUILTIN", "PipelinedPolicy", "RandomLegalPolicy", "create_policy"]
