"""Length clusters of waiting queries, shared by the policies that form new batches from them.

Queries sorted by length; a new cluster starts when the next query is longer than (1 +
`tolerance`) x the cluster's shortest, or the cluster has `bs_max` queries. With a per-length
profile (`BatchCost.available`) neighbouring clusters (in length order) are then merged, the most
profitable first, while one merged batch costs less than the two apart and stays within bs_max.
A model that is not pad-safe is clustered exactly by length, never merged. Clusters come back
oldest first (by their oldest query), each sorted by length.
"""
from __future__ import annotations

from typing import Sequence

from .api import QueryInfo

from ._profile import BatchCost


def length_clusters(waiting: Sequence[QueryInfo], bs_max: int, tolerance: float, cost: BatchCost,
                    pad_safe: bool = True) -> list[list[QueryInfo]]:
    tolerance = tolerance if pad_safe else 0.0
    out: list[list[QueryInfo]] = []
    for q in sorted(waiting, key=lambda q: (q.length, q.arrival, q.id)):
        if out and len(out[-1]) < bs_max and q.length <= (1 + tolerance) * out[-1][0].length:
            out[-1].append(q)
        else:
            out.append([q])
    if cost.available and pad_safe:
        out = merge_by_cost(out, bs_max, cost)
    out.sort(key=lambda c: min((q.arrival, q.id) for q in c))
    return out


def batch_seconds(cost: BatchCost, cluster: Sequence[QueryInfo]) -> float:
    return cost.seconds(len(cluster), max(q.length for q in cluster))


def merge_by_cost(clusters: list[list[QueryInfo]], bs_max: int, cost: BatchCost) -> list[list[QueryInfo]]:
    """Merge neighbouring clusters (`clusters` in length order) while it saves profiled time. Each
    pair's gain is computed once and again only for the pairs a merge changed: linear work per
    merge, not quadratic (this runs under the scheduler's lock on every arrival)."""
    def gain(i: int) -> float:
        a, b = clusters[i], clusters[i + 1]
        if len(a) + len(b) > bs_max:
            return 0.0
        return batch_seconds(cost, a) + batch_seconds(cost, b) - batch_seconds(cost, a + b)

    gains = [gain(i) for i in range(len(clusters) - 1)]
    while gains:
        best = max(range(len(gains)), key=gains.__getitem__)
        if gains[best] <= 0:
            break
        clusters[best:best + 2] = [clusters[best] + clusters[best + 1]]
        del gains[best]
        if best < len(gains):
            gains[best] = gain(best)
        if best > 0:
            gains[best - 1] = gain(best - 1)
    return clusters
