"""The built-in diversity policies (paper §7.2): input (I), operator (II), load (III), hybrid.

Unit tests: hand-made waiting queries, a real batch table and a synthetic profile, no threads
and no engines (the end-to-end runs are in tests/runtime/test_policies_e2e.py).
"""
from __future__ import annotations

import dataclasses

import itertools
import random
import re
from pathlib import Path
from typing import Mapping, Sequence

import pytest

from dvabatch_backend.runtime.batch_table import BatchTable
from dvabatch_backend.runtime.decisions import (
    ArrivalPlan, BatchTableView, New, Policy, PolicyContext, QueryInfo, Split, Stretch,
)
from dvabatch_backend.runtime.query import Query
from policies import load_policy
from policies._profile import StageProfile
from policies.hybrid import HybridPolicy
from policies.input_diversity import InputDiversityPolicy
from policies.load_diversity import DEFAULT_T_COMP_WAIT, LoadDiversityPolicy
from policies.operator_diversity import OperatorDiversityPolicy

MS = 1e-3
# Saturates at bs 2: T(1) = T(2), then per-query time is flat (T linear in bs). Splitting pays
# down to 2: T(8) = 2 T(4), T(4) = 2 T(2), but T(2) < 2 T(1).
SPLITS = {1: 1 * MS, 2: 1 * MS, 4: 2 * MS, 8: 4 * MS}
# A large fixed cost per batch: T(bs) < 2 T(bs/2) everywhere, never worth splitting.
NO_SPLIT = {1: 1 * MS, 2: 1.1 * MS, 4: 1.3 * MS, 8: 1.7 * MS}


# -- helpers ------------------------------------------------------------------------------

def context(num_stages: int = 4, bs_max: int = 8, max_length: int = 12,
            stage_times: Sequence[Mapping[int, float]] = (),
            stage_times_by_length: Mapping[int, Sequence[Mapping[int, float]]] | None = None,
            num_buffer_pairs: int = 2) -> PolicyContext:
    by_length = {n: tuple(dict(s) for s in stages) for n, stages in (stage_times_by_length or {}).items()}
    return PolicyContext(num_stages, bs_max, max_length, num_buffer_pairs, tuple(dict(s) for s in stage_times),
                         stage_times_by_length=by_length)


def bound(policy: Policy, **ctx: object) -> Policy:
    policy.bind(context(**ctx))  # type: ignore[arg-type]
    return policy


def queries(lengths: Sequence[int], arrival: float = 0.0, first_id: int = 100, gap: float = 0.0) -> list[QueryInfo]:
    return [QueryInfo(first_id + i, n, arrival + i * gap) for i, n in enumerate(lengths)]


class Table:
    """A real batch table, grown by hand, seen through the policies' read-only view."""

    def __init__(self, num_stages: int = 4, bs_max: int = 8) -> None:
        self.table = BatchTable(num_stages, bs_max)
        self.view = BatchTableView(self.table)
        self._qids = itertools.count(10_000)

    def new(self, bs: int, pad: int = 12, created: float = 0.0, no_stretch: bool = False, exited: int = 0,
            started: bool = True) -> int:
        qs = [Query(next(self._qids), {}, pad, created, lambda a: None) for _ in range(bs)]
        item = self.table.new(qs, pad, pair=0, now=created, no_stretch=no_stretch)
        self.table.get(item.batch_id).status_map[-1] = exited
        self.table.get(item.batch_id).started = started
        return item.batch_id


def news(plan: ArrivalPlan) -> list[New]:
    return [d for d in plan.decisions if isinstance(d, New)]


def stretches(plan: ArrivalPlan) -> list[Stretch]:
    return [d for d in plan.decisions if isinstance(d, Stretch)]


def covered(plan: ArrivalPlan) -> list[int]:
    return sorted(q for d in plan.decisions for q in d.query_ids)


# -- the profile --------------------------------------------------------------------------

def test_profile_interpolates_extrapolates_and_is_flat_below() -> None:
    p = StageProfile([{2: 1.0, 4: 3.0}, {1: 1.0}], 2)
    assert p.available
    assert p.time(0, 2) == 1.0 and p.time(0, 4) == 3.0
    assert p.time(0, 3) == pytest.approx(2.0)  # linear between profiled sizes
    assert p.time(0, 8) == pytest.approx(6.0)  # proportional beyond the largest
    assert p.time(0, 1) == 1.0  # flat below the smallest
    assert p.remaining(0, 5) == pytest.approx(5.0)  # only the stages after 0
    assert p.remaining(1, 5) == 0.0
    assert not StageProfile([], 2).available
    assert not StageProfile([{1: 1.0}, {}], 2).available
    assert not StageProfile([{1: 1.0}], 2).available


# -- Policy I: input diversity --------------------------------------------------------------

def test_input_clusters_by_length_within_the_padding_bound() -> None:
    policy = bound(InputDiversityPolicy(pad_tolerance=0.25))
    waiting = queries([3, 12, 4, 10, 5, 11, 3])
    plan = policy.on_arrival(waiting, Table().view, now=0.0)
    length = {q.id: q.length for q in waiting}
    groups = [sorted(length[q] for q in d.query_ids) for d in news(plan)]
    assert sorted(groups) == [[3, 3], [4, 5], [10, 11, 12]]
    for d in news(plan):
        lengths = [length[q] for q in d.query_ids]
        assert d.pad_length == max(lengths)
        assert d.pad_length <= 1.25 * min(lengths)
    assert covered(plan) == sorted(length) and plan.wake_at is None


@pytest.mark.parametrize("tolerance", [0.0, 0.1, 0.5, 1.0])
def test_input_padding_bound_holds_for_random_lengths(tolerance: float) -> None:
    rng = random.Random(int(tolerance * 10))
    policy = bound(InputDiversityPolicy(pad_tolerance=tolerance), bs_max=64, max_length=200)
    for _ in range(50):
        waiting = queries([rng.randint(1, 200) for _ in range(rng.randint(1, 64))])
        plan = policy.on_arrival(waiting, Table(bs_max=64).view, now=0.0)
        length = {q.id: q.length for q in waiting}
        assert covered(plan) == sorted(length)
        for d in news(plan):
            lengths = [length[q] for q in d.query_ids]
            assert len(lengths) <= 64 and d.pad_length == max(lengths) <= (1 + tolerance) * min(lengths)


def test_input_cluster_is_cut_at_bs_max_and_lengths_zero_cluster_together() -> None:
    policy = bound(InputDiversityPolicy(), bs_max=4)
    assert [len(c) for c in policy.clusters(queries([5] * 6))] == [4, 2]  # type: ignore[attr-defined]
    assert [len(c) for c in policy.clusters(queries([0] * 3))] == [3]  # type: ignore[attr-defined]
    clusters = policy.clusters(queries([0, 0, 1, 1]))  # type: ignore[attr-defined]
    assert sorted([q.length for q in c] for c in clusters) == [[0, 0], [1, 1]]


def test_input_clusters_go_shortest_first_when_all_fit() -> None:
    policy = bound(InputDiversityPolicy())
    waiting = [QueryInfo(1, 10, 0.3), QueryInfo(2, 2, 0.2), QueryInfo(3, 10, 0.1), QueryInfo(4, 2, 0.4)]
    plan = policy.on_arrival(waiting, Table().view, now=1.0)
    assert [sorted(d.query_ids) for d in news(plan)] == [[2, 4], [1, 3]]


def test_input_clusters_go_oldest_first_when_room_is_short() -> None:
    policy = bound(InputDiversityPolicy(), bs_max=3)
    waiting = [QueryInfo(1, 10, 0.3), QueryInfo(2, 2, 0.2), QueryInfo(3, 10, 0.1), QueryInfo(4, 2, 0.4)]
    plan = policy.on_arrival(waiting, Table(bs_max=3).view, now=1.0)
    assert [sorted(d.query_ids) for d in news(plan)] == [[1, 3], [2]]


def test_input_clusters_go_largest_first_in_a_backlog() -> None:
    """More than bs_max waiting and too little room: the largest clusters go first (the most rows a
    run, what a backlog needs), the oldest among clusters of one size."""
    policy = bound(InputDiversityPolicy(), bs_max=3)
    waiting = [QueryInfo(1, 2, 0.1), QueryInfo(2, 10, 0.2), QueryInfo(3, 10, 0.3), QueryInfo(4, 40, 0.4),
               QueryInfo(5, 40, 0.5)]
    plan = policy.on_arrival(waiting, Table(bs_max=3).view, now=1.0)
    # oldest first would have been [1] then [2, 3]; a cluster that does not fit gives its oldest
    assert [sorted(d.query_ids) for d in news(plan)] == [[2, 3], [4]]


def test_input_clusters_due_by_the_admissions_bound_go_before_larger_ones_in_a_backlog() -> None:
    """In a backlog, a cluster whose oldest query has waited half the admission's bound
    (`PolicyContext.wait_bound`) goes before larger ones, oldest first: a query admitted within
    the bound does not starve behind larger clusters. Younger than that, the largest go first."""
    policy = InputDiversityPolicy()
    policy.bind(dataclasses.replace(context(bs_max=3), wait_bound=1.0))
    waiting = [QueryInfo(1, 2, 0.1), QueryInfo(2, 10, 0.2), QueryInfo(3, 10, 0.3), QueryInfo(4, 40, 0.4),
               QueryInfo(5, 40, 0.5)]
    young = policy.on_arrival(waiting, Table(bs_max=3).view, now=0.55)  # query 1 waited 0.45 s: not due
    assert [sorted(d.query_ids) for d in news(young)] == [[2, 3], [4]]
    due = policy.on_arrival(waiting, Table(bs_max=3).view, now=0.65)  # query 1 waited 0.55 s: due
    assert [sorted(d.query_ids) for d in news(due)] == [[1], [2, 3]]


def test_input_window_is_stage0_time_at_bs_max_from_the_oldest_arrival() -> None:
    profile = [{1: 1 * MS, 8: 4 * MS}] * 4
    # the paper's window: the adaptive window's upper bound by default (tests/unit/test_window.py),
    # the window itself when given as a fixed one
    assert bound(InputDiversityPolicy(), stage_times=profile).window == pytest.approx(4 * MS)  # type: ignore[attr-defined]
    policy = bound(InputDiversityPolicy(window=4 * MS), stage_times=profile)
    waiting = queries([3, 4], arrival=10.0, gap=1 * MS)
    early = policy.on_arrival(waiting, Table().view, now=10.002)
    assert early.decisions == () and early.wake_at == pytest.approx(10.004)
    due = policy.on_arrival(waiting, Table().view, now=10.004)
    assert covered(due) == [100, 101] and due.wake_at is None


def test_input_window_when_bs_max_is_not_profiled() -> None:
    between = bound(InputDiversityPolicy(), stage_times=[{1: 1 * MS, 4: 2 * MS, 16: 8 * MS}] * 4)
    assert between.window == pytest.approx(4 * MS)  # type: ignore[attr-defined]  # interpolated at 8
    beyond = bound(InputDiversityPolicy(), stage_times=[{1: 1 * MS, 4: 3 * MS}] * 4)
    assert beyond.window == pytest.approx(3 * MS)  # type: ignore[attr-defined]  # the largest profiled
    unprofiled = bound(InputDiversityPolicy(window=0.01))
    assert unprofiled.window == 0.01  # type: ignore[attr-defined]
    plan = unprofiled.on_arrival(queries([3], arrival=5.0), Table().view, now=5.0)
    assert plan.decisions == () and plan.wake_at == pytest.approx(5.01)
    assert bound(InputDiversityPolicy()).window == 0.0  # type: ignore[attr-defined]
    at_one = bound(InputDiversityPolicy(window_bs=1), stage_times=[{1: 1 * MS, 4: 3 * MS}] * 4)
    assert at_one.window == pytest.approx(1 * MS)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="window_bs"):
        InputDiversityPolicy(window_bs=0)


def test_input_full_cluster_goes_at_once_inside_the_window() -> None:
    policy = bound(InputDiversityPolicy(window=1.0), bs_max=4)
    waiting = queries([5, 5, 5, 5, 12], arrival=0.0)
    plan = policy.on_arrival(waiting, Table(bs_max=4).view, now=0.0)
    assert [sorted(d.query_ids) for d in news(plan)] == [[100, 101, 102, 103]]
    assert plan.wake_at is None  # the pipeline is full: the last query waits for an exit
    # a full cluster with less room than bs_max: its oldest queries fill the room
    table = Table(bs_max=4)
    table.new(2)
    plan = policy.on_arrival(queries([5, 5, 5, 5], gap=0.01), table.view, now=0.05)
    assert [d.query_ids for d in news(plan)] == [(100, 101)] and plan.wake_at is None
    # a cluster short of bs_max waits for the window
    plan = policy.on_arrival(queries([5, 5, 5]), Table(bs_max=4).view, now=0.0)
    assert plan.decisions == () and plan.wake_at == 1.0


def test_input_keeps_queries_in_flight_at_most_bs_max() -> None:
    policy = bound(InputDiversityPolicy())
    table = Table()
    table.new(6)
    waiting = queries([3, 3, 3, 3, 3], gap=0.1)
    plan = policy.on_arrival(waiting, table.view, now=1.0)
    assert [d.query_ids for d in news(plan)] == [(100, 101)]  # the two oldest fit
    assert plan.wake_at is None  # the rest are offered again when queries exit
    table.new(8, exited=8)  # exited queries no longer count
    assert covered(policy.on_arrival(waiting, table.view, now=1.0)) == [100, 101]
    full = Table()
    full.new(8, exited=3)
    full.new(3)
    assert policy.on_arrival(waiting, full.view, now=1.0) == ArrivalPlan()


def test_input_never_asks_for_a_wake_up_in_the_past() -> None:
    rng = random.Random(3)
    policy = bound(InputDiversityPolicy(), stage_times=[{1: 1 * MS, 8: 5 * MS}] * 4)
    for _ in range(500):
        table = Table()
        if rng.random() < 0.5:
            table.new(rng.randint(1, 8), exited=0)
        waiting = [QueryInfo(i, rng.randint(1, 12), rng.uniform(0, 0.01)) for i in range(rng.randint(1, 12))]
        now = max(q.arrival for q in waiting) + rng.uniform(0, 0.01)
        plan = policy.on_arrival(waiting, table.view, now)
        assert plan.wake_at is None or plan.wake_at > now
        assert table.view.queries_in_flight() + len(covered(plan)) <= 8
        assert plan.decisions or plan.wake_at is not None or len(table.view) > 0  # nobody waits forever


# -- Policy II: operator diversity ------------------------------------------------------------

def test_operator_splits_recursively_while_it_pays() -> None:
    policy = bound(OperatorDiversityPolicy(), stage_times=[SPLITS] * 4)
    view = Table().view

    def done(stage: int, bs: int) -> Split | None:
        t = Table()
        bid = t.new(bs)
        return policy.on_stage_done(stage, t.table.info(t.table.get(bid)), view, 0.0)

    assert done(0, 8) == Split((2, 2, 2, 2))
    assert done(2, 8) == Split((2, 2, 2, 2))
    assert done(0, 4) == Split((2, 2))
    assert done(0, 6) == Split((3, 3))  # T(6) = 3 ms = T(3) + T(3); 3 -> 2 + 1 does not pay
    assert done(0, 2) is None and done(0, 1) is None
    assert done(3, 8) is None  # nothing after the last stage


def test_operator_splits_to_ones_when_per_query_time_is_flat_from_bs_1() -> None:
    linear = {1: 1 * MS, 2: 2 * MS, 4: 4 * MS, 8: 8 * MS}
    policy = bound(OperatorDiversityPolicy(), stage_times=[linear] * 4)
    assert policy.split_sizes(0, 8) == (1,) * 8  # type: ignore[attr-defined]
    assert policy.split_sizes(0, 5) == (1,) * 5  # type: ignore[attr-defined]


def test_operator_extrapolates_proportionally_beyond_the_profile() -> None:
    policy = bound(OperatorDiversityPolicy(), bs_max=64, stage_times=[{1: 1 * MS, 2: 1 * MS}] * 4)
    assert policy.split_sizes(0, 64) == (2,) * 32  # type: ignore[attr-defined]


def test_operator_does_not_split_when_it_does_not_pay_or_without_a_profile() -> None:
    for times in ([NO_SPLIT] * 4, [], [SPLITS, SPLITS, {}, SPLITS]):
        policy = bound(OperatorDiversityPolicy(), stage_times=times)
        assert all(policy.split_sizes(s, bs) == (bs,) for s in range(4) for bs in range(1, 9))  # type: ignore[attr-defined]
    zero = bound(OperatorDiversityPolicy(), stage_times=[{1: 0.0, 8: 0.0}] * 4)
    assert zero.split_sizes(0, 8) == (8,)  # type: ignore[attr-defined]


def test_operator_t_remain_counts_only_the_stages_after() -> None:
    flat = {1: 1 * MS, 8: 1 * MS}
    linear = {1: 1 * MS, 8: 8 * MS}
    policy = bound(OperatorDiversityPolicy(), stage_times=[flat, flat, flat, linear])
    assert policy.split_sizes(2, 8) == (1,) * 8  # type: ignore[attr-defined]  # only the linear stage remains
    assert policy.split_sizes(0, 8) == (8,)  # type: ignore[attr-defined]  # 1+1+8 < 2 * (1+1+4)


def test_operator_arrivals_are_new_batches_marked_when_a_split_is_foreseen() -> None:
    policy = bound(OperatorDiversityPolicy(), stage_times=[SPLITS] * 4)
    plan = policy.on_arrival(queries([3] * 10), Table().view, now=0.0)
    assert [(len(d.query_ids), d.no_stretch, d.pad_length) for d in news(plan)] == [(8, True, None), (2, False, None)]
    plain = bound(OperatorDiversityPolicy())
    assert [d.no_stretch for d in news(plain.on_arrival(queries([3] * 8), Table().view, 0.0))] == [False]


# -- Policy III: load diversity ---------------------------------------------------------------

def test_load_stretches_the_latest_batch_with_the_queries_that_fit() -> None:
    policy = bound(LoadDiversityPolicy(t_comp_wait=0.01))
    table = Table()
    bid = table.new(2, pad=10, created=0.0)
    plan = policy.on_arrival(queries([3, 11, 5]), table.view, now=0.005)
    assert stretches(plan) == [Stretch(bid, (100, 102))]  # the 11 is longer than the pad
    assert [d.query_ids for d in news(plan)] == [(101,)]
    assert plan.decisions[0] == stretches(plan)[0]  # stretch first: a new batch becomes the latest


def test_load_stretch_is_bounded_by_bs_max() -> None:
    policy = bound(LoadDiversityPolicy(t_comp_wait=1.0))
    table = Table()
    bid = table.new(7)
    plan = policy.on_arrival(queries([3] * 10), table.view, now=0.0)
    assert stretches(plan) == [Stretch(bid, (100,))]
    assert [len(d.query_ids) for d in news(plan)] == [8, 1]
    table.new(8)
    plan = policy.on_arrival(queries([3]), table.view, now=0.0)
    assert stretches(plan) == [] and covered(plan) == [100]


def test_load_no_stretch_after_t_comp_wait_or_when_marked() -> None:
    policy = bound(LoadDiversityPolicy(t_comp_wait=0.01))
    table = Table()
    table.new(2, created=1.0)
    assert stretches(policy.on_arrival(queries([3]), table.view, now=1.0099))
    assert not stretches(policy.on_arrival(queries([3]), table.view, now=1.01))  # has run T_comp_wait
    assert not stretches(policy.on_arrival(queries([3]), table.view, now=2.0))
    marked = Table()
    marked.new(2, created=1.0, no_stretch=True)
    plan = policy.on_arrival(queries([3]), marked.view, now=1.0)
    assert not stretches(plan) and covered(plan) == [100]


def test_load_stretches_a_batch_no_stage_has_begun_whatever_its_age() -> None:
    policy = bound(LoadDiversityPolicy(t_comp_wait=0.01))
    waiting = Table()
    bid = waiting.new(2, created=1.0, started=False)  # queued behind a busy stage 0
    assert stretches(policy.on_arrival(queries([3]), waiting.view, now=5.0)) == [Stretch(bid, (100,))]
    marked = Table()
    marked.new(2, created=1.0, no_stretch=True, started=False)
    assert not stretches(policy.on_arrival(queries([3]), marked.view, now=1.0))


def test_load_without_a_batch_starts_new_ones() -> None:
    policy = bound(LoadDiversityPolicy())
    plan = policy.on_arrival(queries([3] * 9), Table().view, now=0.0)
    assert [len(d.query_ids) for d in news(plan)] == [8, 1] and not stretches(plan)


def test_load_t_comp_wait_defaults() -> None:
    assert bound(LoadDiversityPolicy()).t_comp_wait == DEFAULT_T_COMP_WAIT  # type: ignore[attr-defined]
    profiled = bound(LoadDiversityPolicy(), stage_times=[{1: 3 * MS, 8: 9 * MS}] + [SPLITS] * 3)
    assert profiled.t_comp_wait == 3 * MS  # type: ignore[attr-defined]
    assert bound(LoadDiversityPolicy(t_comp_wait=0.5), stage_times=[SPLITS] * 4).t_comp_wait == 0.5  # type: ignore[attr-defined]


# -- hybrid ---------------------------------------------------------------------------------

def test_hybrid_stretches_and_splits() -> None:
    policy = bound(HybridPolicy(t_comp_wait=1.0), stage_times=[SPLITS] * 4)
    table = Table()
    bid = table.new(2, pad=12)  # 2 foresees no split: it may be stretched
    plan = policy.on_arrival(queries([3, 4, 5, 6]), table.view, now=0.0)
    assert stretches(plan) == [Stretch(bid, (100, 101, 102, 103))]
    grown = Table()
    grown.new(4, pad=12)  # a stretch grew it to a size that foresees a split: no further stretch
    plan = policy.on_arrival(queries([3]), grown.view, now=0.0)
    assert not stretches(plan) and covered(plan) == [100]
    marked = Table()
    marked.new(1, pad=12, no_stretch=True)
    assert not stretches(policy.on_arrival(queries([3]), marked.view, now=0.0))
    plan = policy.on_arrival(queries([3] * 10), Table().view, now=0.0)
    assert [(len(d.query_ids), d.no_stretch) for d in news(plan)] == [(8, True), (2, False)]
    t = Table()
    b = t.new(8)
    assert policy.on_stage_done(0, t.table.info(t.table.get(b)), t.view, 0.0) == Split((2, 2, 2, 2))


def test_hybrid_without_a_profile_is_load_diversity() -> None:
    policy = bound(HybridPolicy(t_comp_wait=1.0))
    table = Table()
    bid = table.new(4)
    assert stretches(policy.on_arrival(queries([3]), table.view, now=0.0)) == [Stretch(bid, (100,))]
    assert policy.on_stage_done(0, table.table.info(table.table.get(bid)), table.view, 0.0) is None


def test_policies_load_from_config_params(tmp_path: Path) -> None:
    """config.pbtxt passes string params; they become ints or floats where they parse, else stay strings."""
    (tmp_path / "kinds.py").write_text(
        "from policies.api import ArrivalPlan, Policy\n"
        "class Kinds(Policy):\n"
        "    name = 'kinds'\n"
        "    def __init__(self, **params):\n"
        "        self.params = params\n"
        "    def on_arrival(self, waiting, table, now):\n"
        "        return ArrivalPlan()\n")
    kinds = load_policy("kinds.py:Kinds", {"n": "3", "x": "0.5", "tag": "abc", "neg": "-2"}, tmp_path)
    assert kinds.params == {"n": 3, "x": 0.5, "tag": "abc", "neg": -2}
    assert [type(v) for v in kinds.params.values()] == [int, float, str, int]
    cases = {
        "policies.input_diversity:InputDiversityPolicy": ({"pad_tolerance": "0.5", "window": "0.003"}, "input"),
        "policies.operator_diversity:OperatorDiversityPolicy": ({"factor": "2"}, "operator"),
        "policies.load_diversity:LoadDiversityPolicy": ({"t_comp_wait": "0.004"}, "load"),
        "policies.hybrid:HybridPolicy": ({"t_comp_wait": "0.004", "factor": "2.5"}, "hybrid"),
    }
    for spec, (params, name) in cases.items():
        policy = load_policy(spec, params, tmp_path)
        assert policy.name == name
        policy.bind(context())
    assert load_policy("input", {"pad_tolerance": "0.5"}, tmp_path).pad_tolerance == 0.5
    assert load_policy("hybrid", {"factor": "2.5"}, tmp_path).splitter.factor == 2.5


def test_input_merges_neighbouring_clusters_while_the_profile_says_it_saves_time() -> None:
    # a CPU-like profile: a batch costs 2 ms + 0.1 ms per (query x 16 tokens), in each of 2 stages
    def stage(length: int) -> dict[int, float]:
        return {bs: (2 + 0.1 * bs * length / 16) * MS for bs in (1, 2, 4, 8)}

    by_length = {n: (stage(n), stage(n)) for n in (16, 64, 128)}
    policy = bound(InputDiversityPolicy(pad_tolerance=0.0, window=0), num_stages=2, stage_times_by_length=by_length)
    assert policy.cost.available  # type: ignore[attr-defined]
    assert policy.cost.seconds(2, 40) == pytest.approx(2 * (2 + 0.1 * 2 * 40 / 16) * MS)  # type: ignore[attr-defined]
    # short queries: padding 10 -> 14 costs far less than a second batch's 2 ms; 120 stays alone
    # (joining it would pad four short queries to 120 tokens: 4 x 0.1 x 106/16 ms > 2 ms per stage)
    plan = policy.on_arrival(queries([10, 12, 14, 11, 120]), Table(num_stages=2).view, now=0.0)
    groups = sorted(sorted(d.query_ids) for d in news(plan))
    assert groups == [[100, 101, 102, 103], [104]]
    assert {d.pad_length for d in news(plan)} == {14, 120}
    # without a per-length profile, the length tolerance alone decides
    plain = bound(InputDiversityPolicy(pad_tolerance=0.0, window=0), num_stages=2)
    assert not plain.cost.available  # type: ignore[attr-defined]
    assert len(news(plain.on_arrival(queries([10, 12, 14, 11, 120]), Table(num_stages=2).view, now=0.0))) == 5


# -- Policy III under overload: the padding rule ----------------------------------------------

def _by_length(per_row_and_token: float, per_batch: float) -> dict[int, list[dict[int, float]]]:
    """A per-length profile: T(bs, n) = per_batch + per_row_and_token * bs * n, every stage alike."""
    return {n: [{bs: per_batch + per_row_and_token * bs * n for bs in (1, 2, 4, 8)}] * 4 for n in (16, 128)}


def test_load_short_queries_do_not_join_a_long_batch_when_padding_costs_more() -> None:
    # no gain from batching (time proportional to rows x tokens): padding 16 to 128 is pure loss
    policy = bound(LoadDiversityPolicy(), max_length=128, stage_times_by_length=_by_length(1e-5, 0.0))
    table = Table()
    bid = table.new(1, pad=128, started=False)
    plan = policy.on_arrival(queries([16, 16, 128]), table.view, now=0.0)
    assert stretches(plan) == [Stretch(bid, (102,))]  # the 128 joins: it costs the same inside
    assert [d.query_ids for d in news(plan)] == [(100, 101)]  # the short ones batch together


def test_load_short_queries_join_when_a_batch_costs_mostly_per_batch() -> None:
    # a large fixed cost per batch: one padded batch is cheaper than two
    policy = bound(LoadDiversityPolicy(), max_length=128, stage_times_by_length=_by_length(1e-7, 1e-2))
    table = Table()
    bid = table.new(1, pad=128, started=False)
    plan = policy.on_arrival(queries([16, 16, 120]), table.view, now=0.0)
    assert stretches(plan) == [Stretch(bid, (100, 101, 102))] and not news(plan)


def test_load_new_batches_are_length_clusters_shortest_first() -> None:
    policy = bound(LoadDiversityPolicy(), max_length=128, stage_times_by_length=_by_length(1e-5, 0.0))
    plan = policy.on_arrival(queries([100, 10, 11, 12, 110]), Table().view, now=0.0)
    assert [d.query_ids for d in news(plan)] == [(101, 102, 103), (100, 104)]


@pytest.mark.parametrize("spec, message", [
    ("no_such_builtin", "unknown policy 'no_such_builtin'; built-in policies are"),
    (":Thing", "expected 'module:name' or 'file.py:name'"),
    ("missing.py:Policy", "not found"),
    ("no_such_package.mod:Thing", "cannot import 'no_such_package.mod'"),
    ("policies.pipelined:NoSuchClass", "no 'NoSuchClass' in 'policies.pipelined'"),
    ("policies.api:length_clusters", "is not a Policy subclass"),
])
def test_a_policy_that_cannot_be_loaded_is_named_with_why(tmp_path: Path, spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        load_policy(spec, {}, tmp_path)
    assert spec in str(info.value)
