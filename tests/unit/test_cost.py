"""One cost model: the policies and admission read the slicer's profile by one rule
(`dvabatch_backend.runtime.cost`), so they price one batch the same."""
from __future__ import annotations

import pytest

from dvabatch_backend.runtime.admission import ServiceModel
from dvabatch_backend.runtime.cost import StageCost
from policies._profile import BatchCost, StageProfile

# a profile that starts above batch size 1, and two profiled lengths
STAGE_TIMES = [{4: 0.004, 16: 0.008}, {4: 0.002, 16: 0.010}]
BY_LENGTH = {16: [{4: 0.001, 16: 0.002}, {4: 0.001, 16: 0.003}], 64: STAGE_TIMES}


def test_policies_and_admission_price_one_batch_the_same() -> None:
    service = ServiceModel(STAGE_TIMES, 2, BY_LENGTH)
    profile, cost = StageProfile(STAGE_TIMES, 2), BatchCost(BY_LENGTH, 2)
    for bs in (1, 2, 4, 7, 16, 20):
        for stage in (0, 1):
            assert service.profiled(stage, bs) == pytest.approx(profile.time(stage, bs)), (stage, bs)
            for length in (8, 16, 40, 64, 100):
                assert service.profiled(stage, bs, length) == pytest.approx(cost.stage_seconds(stage, bs, length))
        assert service.pipeline_time(bs) == pytest.approx(profile.seconds(bs))


def test_the_rule_along_each_axis() -> None:
    cost = StageCost(STAGE_TIMES, 2, BY_LENGTH)
    assert cost.time(0, 1) == cost.time(0, 4) == 0.004  # below the smallest batch: flat, never cheaper
    assert cost.time(0, 10) == pytest.approx(0.006)  # between: linear
    assert cost.time(1, 32) == pytest.approx(0.020)  # beyond the largest: per row of the largest
    assert cost.time(0, 4, length=8) == cost.time(0, 4, length=16) == 0.001  # below the shortest: flat
    assert cost.time(0, 4, length=40) == pytest.approx(0.0025)  # between lengths: linear
    assert cost.time(0, 16, length=128) == pytest.approx(0.016)  # beyond the longest: proportional
    assert cost.available and cost.by_length_available
    assert not StageCost([{4: 0.1}], 2).available and not StageCost(STAGE_TIMES, 2, {16: STAGE_TIMES}).by_length_available
