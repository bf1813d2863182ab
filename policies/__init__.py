"""Batching policies built on the meta operations new, stretch and split.

`create_policy(name, **params)` makes a built-in policy by name; an unknown name fails with
the bad value and the known ones in the message. `load_policy("auto", ...)` picks the built-in
policy the model's diversity calls for (`policies.auto`: the rule is in its docstring).
"""
from __future__ import annotations

import importlib.util
import pkgutil
from pathlib import Path
from typing import Any, Callable, Mapping

from .api import Policy
from .auto import AUTO, resolve_in

from .hybrid import HybridPolicy
from .input_diversity import InputDiversityPolicy
from .load_diversity import LoadDiversityPolicy
from .operator_diversity import OperatorDiversityPolicy
from .pipelined import PipelinedPolicy
from .random_legal import RandomLegalPolicy

BUILTIN: dict[str, Callable[..., Policy]] = {
    policy.name: policy
    for policy in (PipelinedPolicy, InputDiversityPolicy, OperatorDiversityPolicy, LoadDiversityPolicy,
                   HybridPolicy, RandomLegalPolicy)
}


def create_policy(name: str, **params: Any) -> Policy:
    try:
        factory = BUILTIN[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; built-in policies are {sorted(BUILTIN)}") from None
    return _construct(name, factory, params)


def _construct(label: str, factory: Callable[..., Policy], params: Mapping[str, Any]) -> Policy:
    """Make the policy; a parameter it does not take is named in the error (as policy.NAME)."""
    try:
        return factory(**params)
    except TypeError as exc:
        given = sorted(f"policy.{k}" for k in params)
        raise ValueError(f"policy {label!r} does not accept the parameter(s) {given}: {exc}") from None


def load_object(spec: str, model_dir: Path, what: str) -> Any:
    """The object `spec` names: `package.module:name`, or `file.py:name` (a file in `model_dir`).
    A ValueError says which `what` (parameter) could not be loaded, and why."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ValueError(f"{what} {spec!r}: expected 'module:name' or 'file.py:name'")
    if where.endswith(".py"):
        path = model_dir / where
        if not path.is_file():
            raise ValueError(f"{what} {spec!r}: {path} not found")
        module_spec = importlib.util.spec_from_file_location(f"dvabatch_user_{path.stem}", path)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        try:
            return pkgutil.resolve_name(spec)
        except ImportError as exc:
            raise ValueError(f"{what} {spec!r}: cannot import {where!r}: {exc}") from exc
        except AttributeError:
            raise ValueError(f"{what} {spec!r}: no {name!r} in {where!r}") from None
    if not hasattr(module, name):
        raise ValueError(f"{what} {spec!r}: no {name!r} in {where!r}")
    return getattr(module, name)


def load_policy(spec: str, params: Mapping[str, str], model_dir: Path) -> Policy:
    """A policy named in config.pbtxt: a built-in name, `package.module:Class`, or `file.py:Class`
    (a file in the model directory), or `auto` (the manifest's recorded choice, or the rule of
    `policies.auto` on its profile). String parameters become ints or floats where they parse."""
    kwargs = {k: _number(v) for k, v in params.items()}
    if spec == AUTO:
        spec = resolve_in(model_dir)
    if ":" not in spec:
        return create_policy(spec, **kwargs)
    cls = load_object(spec, model_dir, "policy")
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise ValueError(f"policy {spec!r}: {spec.rpartition(':')[2]!r} is not a Policy subclass")
    return _construct(spec, cls, kwargs)


def _number(value: str) -> Any:
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


__all__ = [
    "BUILTIN", "HybridPolicy", "InputDiversityPolicy", "LoadDiversityPolicy", "OperatorDiversityPolicy",
    "PipelinedPolicy", "RandomLegalPolicy", "create_policy", "load_policy",
]
