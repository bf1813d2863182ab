"""`policy: auto`: the built-in policy a model's diversity calls for (paper §7.2).

The rule, from the slicer's diversity report (`slicer.stage_profile.diversity`) or, for a
manifest that records no choice, from the manifest itself:

1. input diversity (a variable-length input axis) -> `input`: queries are clustered by length, so
   none pays for another's padding, with the adaptive batch window (`policies.window`). Padding is
   what a variable-length model loses most to (on a CPU a batch costs about rows x padded length),
   so it comes first even where operator diversity shows too (a stage's preferred batch size is
   the noisier signal).
2. otherwise operator diversity (a stage runs the batch size another stage prefers at least
   `SPLIT_GAIN` slower per query than its own: `operator_diversity`) -> `hybrid`: stretch
   (Policy III) and split (Policy II) together.
3. otherwise -> `load`: stretch the batch that waits for stage 0 (Policy III).

The slicer writes the chosen name in config.pbtxt and records it in the manifest
(`"policy": {"choice": ..., "why": ...}`); `auto` as a policy name at load takes the manifest's
recorded choice, or applies the rule to the manifest's profile.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

from dvabatch_backend.runtime.manifest import is_length_dim

AUTO = "auto"
# as the slicer's profile: the preferred bs is the smallest whose per-query time is within this
# fraction of the best
PREFERRED_WITHIN = 0.05
# operator diversity is a stage at least this fraction slower per query at a size another stage
# prefers: below it, identical stages' preferred sizes differ by measurement noise alone
SPLIT_GAIN = 0.10


def choose(input_diversity: bool, operator_diversity: bool) -> tuple[str, str]:
    """The policy name the rule picks, and why (one line)."""
    if input_diversity:
        return "input", "input diversity (variable-length input): cluster by length, adaptive window"
    if operator_diversity:
        return "hybrid", "operator diversity (stages prefer different batch sizes): stretch and split"
    return "load", "no input or operator diversity: stretch the batch waiting for stage 0"


def preferred_batch_size(seconds: Mapping[int, float]) -> int:
    per_query = {bs: t / bs for bs, t in seconds.items()}
    best = min(per_query.values())
    return min(bs for bs, t in per_query.items() if t <= best * (1 + PREFERRED_WITHIN))


def split_gains(stage_times: Sequence[Mapping[int, float]]) -> list[float]:
    """Per stage, how much worse its per-query time is at the largest batch size another stage
    prefers than at its own preferred size, as a fraction of the latter: what a split before it
    would save."""
    prefs = [preferred_batch_size(s) if s else 0 for s in stage_times]
    gains = []
    for times, own in zip(stage_times, prefs):
        bigger = [p for p in prefs if p > own and p in times]
        gains.append((times[max(bigger)] / max(bigger)) / (times[own] / own) - 1 if times and bigger else 0.0)
    return gains


def operator_diversity(stage_times: Sequence[Mapping[int, float]]) -> bool:
    """Some stage runs a batch of the size another stage prefers materially slower per query than
    its own preferred size (`SPLIT_GAIN`): a split between them pays. Preferred sizes that differ
    within that margin are measurement noise, not operator diversity."""
    return any(gain >= SPLIT_GAIN for gain in split_gains(stage_times))


def resolve(manifest_doc: Mapping[str, Any]) -> str:
    """The policy name for `auto` from a manifest (its JSON document): its recorded choice, else the
    rule on what it shows (a length axis; its stage times)."""
    recorded = manifest_doc.get("policy")
    if isinstance(recorded, Mapping) and isinstance(recorded.get("choice"), str):
        return str(recorded["choice"])
    has_seq = bool(manifest_doc.get("stage_times_by_length")) or _has_length_axis(manifest_doc)
    times = [{int(bs): float(t) for bs, t in stage.items()} for stage in manifest_doc.get("stage_times") or []]
    return choose(has_seq, operator_diversity(times))[0]


def resolve_in(model_dir: Path, manifest_file: str = "manifest.json") -> str:
    """`resolve` on the manifest in `model_dir` (a version folder); ValueError when there is none."""
    path = Path(model_dir) / manifest_file
    if not path.is_file():
        raise ValueError(f"policy 'auto': no manifest at {path} to choose the policy from")
    return resolve(json.loads(path.read_text()))


def _has_length_axis(doc: Mapping[str, Any]) -> bool:
    return any(is_length_dim(d) for spec in doc.get("inputs", []) for d in list(spec.get("dims", []))[1:])
