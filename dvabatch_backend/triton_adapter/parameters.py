"""config.pbtxt's string parameters, read and checked: one reader for every Python-backend model here
(the dvabatch adapter, and the ZeroBatch/DelayBatch baseline model in perf.baselines).

A model declares each parameter it reads with its parser (`integer`, `positive_float`, `choice`,
`boolean`, or `text`); `read` parses what config.pbtxt gives, refusing an unknown name, and a
ValueError names the parameter, the bad value and what it must be.
"""
from __future__ import annotations

from typing import Any, Callable, Collection, Mapping

from ..runtime.settings import QueuePolicy

Parser = Callable[[str, str], Any]  # (parameter name, raw string) -> value


def string_parameters(model_config: Mapping[str, Any]) -> dict[str, str]:
    """The parameters of the model config Triton hands `initialize` (its JSON form)."""
    return {key: value["string_value"] for key, value in model_config.get("parameters", {}).items()}


def read(params: Mapping[str, str], parsers: Mapping[str, Parser], also: Collection[str] = (),
         prefixes: tuple[str, ...] = ()) -> dict[str, Any]:
    """Each parameter in `parsers` parsed; names in `also` or starting with one of `prefixes` are
    allowed and left to the caller; any other name is refused, with the known ones."""
    unknown = sorted(k for k in params if k not in parsers and k not in also and not k.startswith(prefixes))
    if unknown:
        known = sorted(parsers) + [f"{p}*" for p in prefixes]
        raise ValueError(f"unknown parameter(s) {unknown}; known: {known}")
    return {k: parsers[k](k, v) for k, v in params.items() if k in parsers}


def text(key: str, raw: str) -> str:
    return raw


def integer(minimum: int) -> Parser:
    def parse(key: str, raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"parameter {key!r}: {raw!r} is not an integer") from None
        if value < minimum:
            raise ValueError(f"parameter {key!r}: must be >= {minimum}, got {value}")
        return value
    return parse


def positive_float(key: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"parameter {key!r}: {raw!r} is not a number") from None
    if not value > 0:
        raise ValueError(f"parameter {key!r}: must be > 0, got {raw}")
    return value


def choice(*choices: str) -> Parser:
    def parse(key: str, raw: str) -> str:
        value = raw.strip().lower()
        if value not in choices:
            raise ValueError(f"parameter {key!r}: {raw!r} is not one of {list(choices)}")
        return value
    return parse


def boolean(key: str, raw: str) -> bool:
    return choice("true", "false", "1", "0", "yes", "no")(key, raw) in ("true", "1", "yes")


def triton_queue_policy(config: Mapping[str, Any]) -> QueuePolicy:
    """The model's queue policy from Triton's `dynamic_batching.default_queue_policy` (the model
    config as the backend gets it, JSON), for the runtime's queue too: where a config sets one,
    Triton applies it to requests waiting for `execute` and the runtime to queries waiting for
    stage 0. A config that sets neither a timeout nor a bound (the slicer's) leaves the runtime's
    defaults. The parameters of the same names, where given, override it for the
    runtime's queue only; each `max_queue_size` bounds its own queue (Triton's counts requests, the
    runtime's rows)."""
    section = (config.get("dynamic_batching") or {}).get("default_queue_policy") or {}
    timeout_us, size = int(section.get("default_timeout_microseconds") or 0), int(section.get("max_queue_size") or 0)
    base = QueuePolicy()
    if not (timeout_us or size):
        return base
    return QueuePolicy(max_queue_size=size or base.max_queue_size, default_timeout_us=timeout_us,
                       allow_timeout_override=bool(section.get("allow_timeout_override")),
                       timeout_action="delay" if section.get("timeout_action") == "DELAY" else "reject")
