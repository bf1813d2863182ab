"""Profile each stage over batch sizes and length buckets; preferred batch sizes; diversity.

`profile.json` (schema 1):
  {"schema_version": 1, "threads": T, "batch_sizes": [...], "lengths": [...],
   "stages": [{"file": ..., "seconds": {"<length>": {"<bs>": s}}, "preferred_bs": {"<length>": bs}}],
   "diversity": {"input": bool, "operator": bool, "load": true, "notes": [...]}}
For models without a sequence dimension the only length is 0.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from dvabatch_backend.runtime.manifest import Manifest

from .profiler import Setting, time_stage

PROFILE_SCHEMA_VERSION = 1
# a batch size is preferred once its per-query time is within this fraction of the best
PREFERRED_WITHIN = 0.05


def default_batch_sizes(bs_max: int) -> list[int]:
    sizes = [1]
    while sizes[-1] * 2 <= min(bs_max, 64):
        sizes.append(sizes[-1] * 2)
    return sizes


def default_lengths(max_length: int) -> list[int]:
    """Length buckets: powers of two from 16 (or the max, if smaller) up to the max."""
    if max_length <= 0:
        return [0]
    lengths = [min(16, max_length)]
    while lengths[-1] * 2 < max_length:
        lengths.append(lengths[-1] * 2)
    if lengths[-1] != max_length:
        lengths.append(max_length)
    return lengths


def preferred_batch_size(seconds: Mapping[int, float], within: float = PREFERRED_WITHIN) -> int:
    """The smallest batch size whose time per query is within `within` of the best."""
    per_query = {bs: t / bs for bs, t in seconds.items()}
    best = min(per_query.values())
    return min(bs for bs, t in per_query.items() if t <= best * (1 + within))


def profile_stages(model_dir: Path, manifest: Manifest, batch_sizes: Sequence[int], lengths: Sequence[int],
                   threads: int, repeats: int, int_high: Mapping[str, int],
                   progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    stages = []
    for k, stage in enumerate(manifest.stages):
        seconds: dict[str, dict[str, float]] = {}
        preferred: dict[str, int] = {}
        for length in lengths:
            if progress:
                progress(f"profiling stage {k} at length {length}")
            row = {bs: time_stage(model_dir / stage.file, stage.inputs, Setting(bs, length), threads, repeats,
                                  int_high, min_seconds=0.02)
                   for bs in batch_sizes}
            seconds[str(length)] = {str(bs): t for bs, t in row.items()}
            preferred[str(length)] = preferred_batch_size(row)
        stages.append({"file": stage.file, "seconds": seconds, "preferred_bs": preferred})
    profile: dict[str, Any] = {
        "schema_version": PROFILE_SCHEMA_VERSION, "threads": threads,
        "batch_sizes": list(batch_sizes), "lengths": list(lengths), "stages": stages,
    }
    profile["diversity"] = diversity(manifest, profile)
    return profile


def diversity(manifest: Manifest, profile: Mapping[str, Any]) -> dict[str, Any]:
    """Which of the paper's diversities the model shows, by its stage profile (`profile`)."""
    from policies.auto import SPLIT_GAIN, split_gains

    notes = []
    operator = False
    for length in map(str, profile["lengths"]):
        prefs = [s["preferred_bs"][length] for s in profile["stages"]]
        gains = split_gains([{int(bs): t for bs, t in s["seconds"][length].items()} for s in profile["stages"]])
        operator = operator or any(g >= SPLIT_GAIN for g in gains)
        label = f"length {length}: " if manifest.has_seq else ""
        notes.append(f"{label}preferred batch size per stage {prefs}; per stage, per-query time at the largest size "
                     f"another prefers vs its own: {', '.join(f'+{g:.0%}' for g in gains)}")
    if not operator:
        notes.append(f"operator diversity: no - no stage is {SPLIT_GAIN:.0%} slower per query at a size another "
                     "stage prefers (a split would not pay)")
    return {"input": manifest.has_seq, "operator": operator, "load": True, "notes": notes}


def stage_times_at(profile: Mapping[str, Any], length: int) -> list[dict[str, float]]:
    """Per stage, seconds by batch size at the profiled length nearest `length` (for the manifest)."""
    lengths = profile["lengths"]
    nearest = str(min(lengths, key=lambda x: abs(x - length)))
    return [dict(s["seconds"][nearest]) for s in profile["stages"]]
