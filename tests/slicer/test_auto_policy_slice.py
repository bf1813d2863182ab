"""The slicer writes the policy its diversity report calls for in config.pbtxt, records it in the
manifest, and `auto` loads it (policies/auto.py)."""
from __future__ import annotations

import json
from pathlib import Path

from policies import load_policy
from policies.auto import choose
from policies.input_diversity import InputDiversityPolicy
from slicer.slice_model import SliceOptions, slice_model
from slicer.triton_files import config_pbtxt
from slicer.model_config import parameters
from slicer.zoo import build


def test_the_slicer_writes_the_chosen_policy_and_auto_loads_it(tmp_path: Path) -> None:
    options = SliceOptions(stages=2, max_batch_size=4, max_length=32, repeats=2, batch_sizes=(1, 2, 4))
    report = slice_model(build("bert", "test"), tmp_path / "bert", options)
    recorded = json.loads((report.chosen.dir / "manifest.json").read_text())["policy"]
    div = report.profile["diversity"]
    assert recorded["choice"] == choose(div["input"], div["operator"])[0] == "input"  # a length axis
    written = parameters((tmp_path / "bert" / "config.pbtxt").read_text())
    assert written["policy"] == "input" and (written["thread_pool"], written["threads_per_stage"]) == ("per_stage", "0")
    assert isinstance(load_policy("auto", {}, report.chosen.dir), InputDiversityPolicy)
    assert parameters(config_pbtxt(report.manifest, policy="auto"))["policy"] == "auto"  # auto may be written too


def test_the_slicer_records_which_engine_runs_the_fast_path_and_the_pipeline_loads_it(tmp_path: Path) -> None:
    """The manifest's fast_path names the unsliced model unless the stages in a row were FAST_PATH_MARGIN
    faster for one query, from the times it records; the loaded pipeline runs that engine."""
    from dvabatch_backend.runtime.loading import load_pipeline
    from slicer.slice_model import FAST_PATH_MARGIN

    options = SliceOptions(stages=2, max_batch_size=4, max_length=32, repeats=2, batch_sizes=(1, 2, 4))
    report = slice_model(build("bert", "test"), tmp_path / "bert", options)
    fast = report.manifest.extra["fast_path"]
    model, stages = (sum(t[k] for t in fast["seconds"].values()) for k in ("model", "stages"))
    assert fast["engine"] == ("stages" if stages < (1 - FAST_PATH_MARGIN) * model else "model")
    assert report.manifest.fast_path_engine == fast["engine"] and fast["why"]
    assert "fast path" in report.summary()
    pipeline = load_pipeline(tmp_path / "bert", load_policy("auto", {}, report.chosen.dir))
    assert pipeline.fast_path_engine == fast["engine"]
    pipeline.stop()


def test_stages_auto_tries_one_stage_for_a_fixed_shape_model_and_says_why(tmp_path: Path) -> None:
    """--stages auto measures 1 stage (the whole model, served by the same runtime) beside the sliced
    candidates for a fixed-shape model; the manifest records each throughput and the choice, which
    is the fewest stages within the tie margin of the fastest; the model serves either way."""
    from dvabatch_backend.runtime.loading import load_pipeline
    from slicer import toy
    from slicer.slice_model import STAGE_COUNT_TIE

    options = SliceOptions(candidates=(1, 2), max_batch_size=8, repeats=2, batch_sizes=(1, 2, 4, 8),
                           calibration_rounds=0)
    report = slice_model(toy.residual_mlp(width=64, blocks=4), tmp_path / "mlp", options)
    record = report.manifest.extra["slicing"]["stage_count"]
    measured = {int(n): q for n, q in record["queries_per_second"].items()}
    assert set(measured) == {1, 2} and record["why"]
    fastest = max(measured.values())
    assert record["chosen"] == min(n for n, q in measured.items() if q >= (1 - STAGE_COUNT_TIE) * fastest)
    assert report.manifest.num_stages == record["chosen"]
    # one stage is the whole model: nothing to time against it, and no second copy loaded
    if record["chosen"] == 1:
        assert report.manifest.fast_path_engine == "stages" and report.manifest.extra["fast_path"]["seconds"] == {}
    pipeline = load_pipeline(tmp_path / "mlp", load_policy("auto", {}, report.chosen.dir))
    pipeline.stop()


def test_stages_auto_keeps_a_variable_length_model_sliced(tmp_path: Path) -> None:
    """1 stage is not a candidate where the input has a length: the stages let short queries exit early."""
    options = SliceOptions(candidates=(1, 2), max_batch_size=4, max_length=32, repeats=2, batch_sizes=(1, 2, 4),
                           calibration_rounds=0)
    report = slice_model(build("bert", "test"), tmp_path / "bert", options)
    assert report.manifest.num_stages == 2 and len(report.candidates) == 1
