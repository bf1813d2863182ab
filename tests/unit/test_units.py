"""Unit tests without threads: manifest, batch table, buffer-pair rules, policies, cutter."""
from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest

from dvabatch_backend import BatchItem, BatchTable, BufferPool, BufferState, Manifest, ManifestError
from dvabatch_backend.runtime.buffers import PairUse
from dvabatch_backend.runtime.query import Query
from policies import create_policy
from slicer import cut, toy


def _queries(n: int, length: int = 3) -> list[Query]:
    return [Query(i, {}, length, 0.0, lambda a: None) for i in range(n)]


# -- manifest -----------------------------------------------------------------------------

def test_manifest_round_trips(zoo) -> None:
    model = zoo.stages("token", 3)
    again = Manifest.from_json(json.loads(json.dumps(model.manifest.to_json())))
    assert again == model.manifest


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda d: d.update(schema_version=99), "schema_version"),
        (lambda d: d.pop("max_batch_size"), "max_batch_size"),
        (lambda d: d.update(max_batch_size=0), "max_batch_size"),
        (lambda d: d["inputs"][0].update(dtype="floaty"), "inputs[0].dtype"),
        (lambda d: d["stages"][1]["inputs"][0].update(dims=["seq", 8]), "stages[1].inputs[0].dims"),
        (lambda d: d["stages"][1]["inputs"].pop(), "stages[1].inputs"),
        (lambda d: d["stages"][0].pop("file"), "stages[0].file"),
        (lambda d: d.update(stages=[]), "stages"),
    ],
)
def test_manifest_edited_into_nonsense_is_refused_naming_the_field(zoo, tmp_path, edit, field) -> None:
    doc = zoo.stages("token", 3).manifest.to_json()
    edit(doc)
    (tmp_path / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(ManifestError) as info:
        Manifest.load(tmp_path / "manifest.json")
    assert info.value.field == field and field in str(info.value)


def test_manifest_missing_or_unreadable(tmp_path) -> None:
    with pytest.raises(ManifestError, match="not found"):
        Manifest.load(tmp_path / "manifest.json")
    (tmp_path / "manifest.json").write_text("{ not json")
    with pytest.raises(ManifestError, match="not a readable JSON"):
        Manifest.load(tmp_path / "manifest.json")


# -- batch table --------------------------------------------------------------------------

def test_stretch_rows_wait_at_the_stage_where_they_catch_up_then_merge() -> None:
    table = BatchTable(num_stages=3, bs_max=4)
    qs = _queries(4)
    first = table.new(qs[:2], pad_length=3, pair=0, now=0.0, no_stretch=False)
    assert first == BatchItem(0, 0, 2)
    assert table.complete(first, 0) == BatchItem(0, 0, 2)
    assert table.stretch_refusal(0, [3, 3]) is None
    late = table.stretch(0, qs[2:])
    assert late == BatchItem(0, 2, 2) and table.get(0).bs == 4
    assert table.complete(BatchItem(0, 0, 2), 1) is None  # held: 2 of 4 at stage 1
    assert table.complete(late, 0) == BatchItem(0, 2, 2)
    assert table.complete(late, 1) == BatchItem(0, 0, 4)  # merged
    assert table.get(0).status_map == [4, 4, 0]


def test_stretch_refusals_name_the_reason() -> None:
    table = BatchTable(num_stages=2, bs_max=3)
    table.new(_queries(2), pad_length=3, pair=0, now=0.0, no_stretch=False)
    assert "bs_max" in table.stretch_refusal(0, [1, 1])
    assert "padded to 3" in table.stretch_refusal(0, [5])
    table.new(_queries(1), pad_length=3, pair=0, now=0.0, no_stretch=True)
    assert "not the latest" in table.stretch_refusal(0, [1])
    assert "stretch disabled" in table.stretch_refusal(1, [1])


def test_split_children_take_consecutive_rows_and_inherit_status() -> None:
    table = BatchTable(num_stages=4, bs_max=8)
    item = table.new(_queries(5), pad_length=3, pair=1, now=0.0, no_stretch=False)
    for stage in (0, 1):
        item = table.complete(item, stage)
    assert "partition" in table.split_refusal(item, 1, (2, 2))
    assert "last stage" in table.split_refusal(item, 3, (2, 3))
    children = table.split(item.batch_id, 1, (2, 3))
    rows = [table.get(c.batch_id) for c in children]
    assert [(r.row_start, r.bs, r.pair, r.group) for r in rows] == [(0, 2, 1, 0), (2, 3, 1, 0)]
    assert [r.status_map for r in rows] == [[2, 2, 0, 0], [3, 3, 0, 0]]
    assert all(r.no_stretch for r in rows) and 0 not in table


# -- buffer pairs -------------------------------------------------------------------------

def test_buffer_pair_legitimation_makes_one_pair_serial(zoo) -> None:
    pool = BufferPool(zoo.stages("dense", 3).manifest, num_pairs=1, bs_max=4)
    rows = range(0, 2)
    for stage in range(3):
        use = PairUse(stage, 0, rows, group=0)
        assert pool.is_legitimate(stage, 0)
        pool.begin(use)
        pool.finish(use, handed_on=stage < 2)
        pool.legitimate_upstream(stage)
        if stage < 2:  # inactive until the last stage has run: nobody upstream may start
            assert not pool.is_active(stage) and not pool.is_legitimate(0, 0)
    assert [b[0].state for b in pool.buffers[:3]] == [BufferState.AVAILABLE] * 3
    assert pool.violations == []


def test_buffer_checks_fire_on_an_illegal_use(zoo) -> None:
    pool = BufferPool(zoo.stages("dense", 2).manifest, num_pairs=1, bs_max=4)
    pool.begin(PairUse(1, 0, range(0, 2), group=0))  # reads rows nobody wrote
    assert any("hold no data" in str(v) for v in pool.violations)
    pool.begin(PairUse(0, 0, range(0, 2), group=0))  # its output is being read
    assert any("not legitimate" in str(v) for v in pool.violations)


# -- policies -----------------------------------------------------------------------------

def test_unknown_policy_name_fails_with_the_bad_value() -> None:
    with pytest.raises(ValueError, match="'nope'.*pipelined"):
        create_policy("nope")


# -- cutter -------------------------------------------------------------------------------

@pytest.mark.parametrize("cuts", [("h1",), ("h2", "h4"), ("h1", "h2", "h3", "h4", "h5")])
def test_cut_stages_run_in_order_equal_the_full_model(tmp_path, cuts) -> None:
    model = toy.token_mlp(hidden=8, layers=6)
    manifest = cut.cut_model(model, cut.cut_positions_after(model, list(cuts)), tmp_path, "t", 4, 10)
    assert manifest.num_stages == len(cuts) + 1
    rng = np.random.default_rng(0)
    feed = {"x": rng.standard_normal((3, 10, 8)).astype(np.float32), "mask": (rng.random((3, 10)) < 0.7).astype(np.float32)}
    full = ort.InferenceSession(str(tmp_path / "model.onnx")).run(None, feed)
    values = dict(feed)
    for stage in manifest.stages:
        session = ort.InferenceSession(str(tmp_path / stage.file))
        names = [o.name for o in session.get_outputs()]
        values = dict(zip(names, session.run(None, {t.name: values[t.name] for t in stage.inputs})))
    for ref, name in zip(full, ["tokens", "pooled"]):
        np.testing.assert_allclose(values[name], ref, atol=1e-5)
    mask_copies = [t.name for s in manifest.stages[1:] for t in s.inputs if t.name.startswith("mask")]
    assert len(mask_copies) == len(cuts)  # the mask is forwarded to every later stage


def test_cut_refuses_bad_positions(tmp_path) -> None:
    model = toy.dense_mlp(16, 4)
    with pytest.raises(ValueError):
        cut.cut_model(model, [3, 1], tmp_path / "out", "d", 4, 0)
    with pytest.raises(ValueError, match="nope"):
        cut.cut_positions_after(model, ["nope"])
    assert not (tmp_path / "out").exists()
