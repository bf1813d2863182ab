"""Hybrid: Policy II (operator diversity) and Policy III (load diversity) together (paper §7.2).

"For operator diversity, Policy III and Policy II work together due to the co-existence of
stretch and split" (§7.2). Arrivals stretch the latest batch as Policy III does (while no stage
has begun it or it has run less than T_comp_wait, stays <= bs_max and is padded long enough) and
the rest start new batches; finished stages split batches as Policy II does (T_remain(bs) >=
`factor` x T_remain(bs/2), recursively).

Stretch and split co-exist as §5.2.2 says: a split that can be foreseen when a batch is made
by new or stretch disables further stretch of that batch. So a new batch whose size already
foresees a split is created with `no_stretch`; a batch marked `no_stretch` is never
stretched; and a batch that a stretch has grown to a size that foresees a split is not
stretched again (the policy cannot set the flag on an existing batch, so it checks the size).

Parameters (`policy.NAME` in config.pbtxt): see `HybridPolicy.__init__`.
"""
from __future__ import annotations

from .api import BatchInfo, BatchTableView, New, PolicyContext, Split

from .load_diversity import LoadDiversityPolicy
from .operator_diversity import OperatorDiversityPolicy


class HybridPolicy(LoadDiversityPolicy):
    name = "hybrid"
    runs_inline = True  # its splits change how a batch runs, never an answer

    def __init__(self, t_comp_wait: float | None = None, factor: float = 2.0, pad_tolerance: float = 0.25) -> None:
        """Policy III's stretch and Policy II's split together.

        Args:
            t_comp_wait: seconds after its creation during which a batch that has started may still be stretched
                (T_comp_wait); one no stage has begun always may. Default: the profiled time of stage 0 at batch
                size 1, or 0.002 s without a profile.
            factor: a batch is split after a stage where the remaining stages take at least `factor` times as long
                at its size as at half of it (T_remain(bs) >= factor x T_remain(bs/2)); > 0. Default 2.0.
            pad_tolerance: with a per-length profile, the queries that start new batches are clustered by length, a
                cluster taking queries up to (1 + pad_tolerance) times its shortest one's length (a fraction;
                exact lengths where the model is not pad-safe). Default 0.25.
        """
        super().__init__(t_comp_wait, pad_tolerance)
        self.splitter = OperatorDiversityPolicy(factor)

    def bind(self, context: PolicyContext) -> None:
        super().bind(context)
        self.splitter.bind(context)

    def can_stretch(self, batch: BatchInfo, now: float) -> bool:
        return super().can_stretch(batch, now) and not self.splitter.split_foreseeable(batch.bs)

    def new_batch(self, query_ids: tuple[int, ...]) -> New:
        return New(query_ids, no_stretch=self.splitter.split_foreseeable(len(query_ids)))

    def on_stage_done(self, stage: int, batch: BatchInfo, table: BatchTableView, now: float) -> Split | None:
        return self.splitter.on_stage_done(stage, batch, table, now)
