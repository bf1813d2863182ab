"""onnxruntime's threads spin as each session is meant to (runtime/engine.py): the runtime's stages
within a run, the unsliced model on the fast path as onnxruntime does by default, everything as the
`spinning` parameter says where it is set; and the baselines both ways."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dvabatch_backend.runtime.engine import IN_RUN, OFF, ON, ort_session_options
from dvabatch_backend.runtime.loading import MODEL_SPINNING, STAGE_SPINNING, load_pipeline
from dvabatch_backend.runtime.settings import RuntimeSettings
from policies import load_policy


def _entries(options: object) -> dict[str, str | None]:
    keys = ("session.intra_op.allow_spinning", "session.inter_op.allow_spinning", "session.force_spinning_stop")
    out = {}
    for key in keys:
        try:
            out[key] = options.get_session_config_entry(key)  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - onnxruntime raises for a key never set
            out[key] = None
    return out


def test_each_spinning_setting_makes_its_session_options() -> None:
    assert _entries(ort_session_options(2, spinning=OFF)) == {
        "session.intra_op.allow_spinning": "0", "session.inter_op.allow_spinning": "0",
        "session.force_spinning_stop": None}
    assert _entries(ort_session_options(2, spinning=IN_RUN)) == {
        "session.intra_op.allow_spinning": None, "session.inter_op.allow_spinning": None,
        "session.force_spinning_stop": "1"}
    assert set(_entries(ort_session_options(2, spinning=ON)).values()) == {None}  # onnxruntime's own default
    with pytest.raises(ValueError, match="spinning must be one of"):
        ort_session_options(2, spinning="sometimes")


class _Recorder:
    """Stands in for `OrtStageEngine` only to record the spinning each engine was made with."""

    made: list[tuple[str, str]] = []

    def __init__(self, path: Path, threads: int = 1, thread_pool: str = "per_stage", spinning: str = IN_RUN) -> None:
        _Recorder.made.append((Path(path).name, spinning))

    def run(self, inputs: object, outputs: object) -> None:  # pragma: no cover - never run here
        raise AssertionError


@pytest.mark.parametrize("setting, model, stages", [(None, MODEL_SPINNING, STAGE_SPINNING), (OFF, OFF, OFF)])
def test_the_fast_paths_model_and_the_stages_spin_as_set(zoo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          setting: str | None, model: str, stages: str) -> None:
    """A manifest whose fast path runs the unsliced model: its engine spins as onnxruntime's do by
    default, the stages' within a run; a `spinning` setting applies to all of them."""
    import dvabatch_backend.runtime.loading as loading

    sliced = zoo.stages("dense", 2)
    folder = tmp_path / "m"
    shutil.copytree(sliced.dir, folder)
    doc = json.loads((folder / "manifest.json").read_text())
    doc["full_model"], doc["fast_path"] = "model.onnx", {"engine": "model", "why": "this test"}
    (folder / "manifest.json").write_text(json.dumps(doc))
    _Recorder.made = []
    monkeypatch.setattr(loading, "OrtStageEngine", _Recorder)
    pipeline = load_pipeline(folder, load_policy("load", {}, folder), RuntimeSettings(spinning=setting))
    pipeline.stop()
    made = dict(_Recorder.made)
    assert made.pop("model.onnx") == model
    assert made and set(made.values()) == {stages}


def test_a_one_stage_models_stage_spins_only_within_a_run(zoo, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model cut into one stage runs every batch on that stage, under load too: it spins only
    within a run, as every stage does (runtime/loading.py says what spinning on cost)."""
    import dvabatch_backend.runtime.loading as loading

    monkeypatch.setattr(loading, "OrtStageEngine", _Recorder)
    for stages in (1, 2):
        sliced = zoo.stages("dense", stages)
        _Recorder.made = []
        load_pipeline(sliced.dir, load_policy("load", {}, sliced.dir), RuntimeSettings()).stop()
        assert len(_Recorder.made) == stages and {s for _, s in _Recorder.made} == {STAGE_SPINNING}
