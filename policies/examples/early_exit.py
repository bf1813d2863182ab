"""Early exit: a custom policy that answers confident queries from an intermediate exit head.

After stage `exit_stage`, it reads the exit head's logits for the batch's rows
(`table.stage_outputs()`), and splits the batch into runs of consecutive rows: rows whose
softmax confidence reaches `threshold` exit at once, answered with the head's logits for every
model output; the others go on through the rest of the pipeline.

Name it in config.pbtxt as `policies.examples.early_exit:EarlyExitPolicy` with parameters
`policy.threshold`, `policy.exit_stage` and `policy.head` (the head's tensor name).
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from policies.api import ArrivalPlan, BatchInfo, BatchTableView, New, Policy, QueryInfo, Split


class EarlyExitPolicy(Policy):
    name = "early-exit"

    def __init__(self, threshold: float = 0.9, exit_stage: int = 0, head: str = "early_logits") -> None:
        self.threshold, self.exit_stage, self.head = float(threshold), int(exit_stage), head

    def on_arrival(self, waiting: Sequence[QueryInfo], table: BatchTableView, now: float) -> ArrivalPlan:
        ids = [q.id for q in waiting]
        bs = self.context.bs_max
        return ArrivalPlan(tuple(New(tuple(ids[i:i + bs])) for i in range(0, len(ids), bs)))

    def on_stage_done(self, stage: int, batch: BatchInfo, table: BatchTableView, now: float) -> Split | None:
        if stage != self.exit_stage:
            return None
        outputs = table.stage_outputs()
        head = _find(outputs, self.head)
        if head is None:
            return None
        leaves = confidence(head) >= self.threshold
        if not leaves.any():
            return None
        sizes, flags = runs(leaves)
        source = next(name for name in outputs if name.split("__")[0] == self.head)
        # every model output is answered from the head (the model's outputs share its shape)
        return Split(sizes, flags, {name: source for name in self.context.output_names})


def _find(outputs: Mapping[str, np.ndarray], base: str) -> np.ndarray | None:
    return next((arr for name, arr in outputs.items() if name.split("__")[0] == base), None)


def confidence(logits: np.ndarray) -> np.ndarray:
    """Softmax probability of the top class, per row."""
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return (shifted / shifted.sum(axis=-1, keepdims=True)).max(axis=-1)


def runs(flags: np.ndarray) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """Lengths and values of the runs of equal consecutive flags."""
    sizes: list[int] = []
    values: list[bool] = []
    for flag in flags.tolist():
        if values and values[-1] == flag:
            sizes[-1] += 1
        else:
            sizes.append(1)
            values.append(bool(flag))
    return tuple(sizes), tuple(values)
