"""`dvabatch slice` as a user meets its failures: one clear line each, never a traceback (unless
--verbose), and nothing left behind. Also external data, unsupported opsets and progress off a terminal."""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnx.external_data_helper import ExternalDataInfo, uses_external_data

from dvabatch_backend.runtime.manifest import Manifest
from dvabatch_backend.tools.cli import main
from dvabatch_backend.tools.progress import StepProgress
from slicer import preflight, toy
from slicer.preflight import newest_ort_opset
from slicer.slice_model import SliceError, SliceOptions, slice_model

QUICK = SliceOptions(max_batch_size=4, max_length=8, repeats=2, calibration_rounds=0, batch_sizes=(1, 2), stages=2)
QUICK_ARGS = ["--stages", "2", "--bs-max", "4", "--max-length", "8", "--repeats", "2"]


def _no_leftovers(parent: Path, out: Path) -> None:
    assert not out.exists()
    assert [p.name for p in parent.iterdir()] == [], "a temporary folder was left behind"


def _one_line_error(err: str) -> str:
    """stderr of a failed `dvabatch slice`: exactly one line, no traceback, no onnxruntime log."""
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("slicing: step")]
    assert len(lines) == 1, f"expected one line, got:\n{err}"
    assert "Traceback" not in err and "[E:onnxruntime" not in err
    return lines[0]


def _save_external(model: onnx.ModelProto, path: Path, location: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=location, size_threshold=64)  # small constants inline, as exporters keep them
    return path


def _relu_model(opset: int) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    nodes = [helper.make_node("Relu", ["x"], ["h"], name="r1"), helper.make_node("Relu", ["h"], ["y"], name="r2")]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y]), opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    return model


# -- the longest length the model takes -------------------------------------------------------------

def test_zoo_bert_without_max_length_names_the_longest_length_it_runs(tmp_path, capsys) -> None:
    onnx_path = tmp_path / "bert.onnx"
    assert main(["zoo", "bert", "--size", "test", "--out", str(onnx_path)]) == 0  # 64 positions
    capsys.readouterr()
    parent = tmp_path / "repo"
    parent.mkdir()
    code = main(["slice", str(onnx_path), "--stages", "2", "--out", str(parent / "bert")])  # --max-length 128
    assert code == 1
    line = _one_line_error(capsys.readouterr().err)
    assert line == "dvabatch slice: the model fails at length 128 (a position table of 64?): pass --max-length <= 64"
    _no_leftovers(parent, parent / "bert")


def test_max_length_probe_finds_an_odd_limit_by_bisection(tmp_path) -> None:
    from slicer import zoo

    model = zoo.build("bert", "test")
    parent = tmp_path / "out"
    parent.mkdir()
    with pytest.raises(SliceError, match=r"fails at length 100 \(a position table of 64\?\): pass --max-length <= 64"):
        slice_model(model, parent / "m", SliceOptions(**{**QUICK.__dict__, "max_length": 100}))
    _no_leftovers(parent, parent / "m")


# -- external data ----------------------------------------------------------------------------------

def test_a_model_with_external_data_slices(tmp_path) -> None:
    path = _save_external(toy.token_mlp(8, 4), tmp_path / "src" / "m.onnx", "m.weights")
    assert (tmp_path / "src" / "m.weights").is_file()
    report = slice_model(path, tmp_path / "out" / "m", QUICK)
    assert Manifest.load(report.out_dir / "1" / "manifest.json").num_stages == 2


def test_a_missing_external_data_file_is_named(tmp_path, capsys) -> None:
    path = _save_external(toy.token_mlp(8, 4), tmp_path / "src" / "m.onnx", "weights.bin")
    (tmp_path / "src" / "weights.bin").unlink()
    parent = tmp_path / "out"
    parent.mkdir()
    with pytest.raises(SliceError, match=r"external data file 'weights.bin' is missing \(expected in .*src"):
        slice_model(path, parent / "m", QUICK)
    _no_leftovers(parent, parent / "m")
    assert main(["slice", str(path), "--out", str(parent / "m"), *QUICK_ARGS]) == 1
    assert "'weights.bin' is missing" in _one_line_error(capsys.readouterr().err)
    _no_leftovers(parent, parent / "m")


def test_a_model_over_2_gb_keeps_its_weights_on_disk(tmp_path, monkeypatch) -> None:
    """Over protobuf's limit (here pretended: the limit lowered) the checker gets the file's path, the
    weights are never loaded into the proto (sessions read them from their folder), each stage gets a
    data file of its own, the unsliced model's data lies beside it, and the stages equal the original."""
    path = _save_external(toy.token_mlp(8, 4), tmp_path / "src" / "m.onnx", "m.weights")
    monkeypatch.setattr(preflight, "PROTO_LIMIT", 100)
    checked, loaded = [], []
    check, load_all = onnx.checker.check_model, preflight.load_external_data_for_model

    def spy_check(model, *args, **kwargs):
        checked.append(model)
        return check(model, *args, **kwargs)

    def spy_load(*args, **kwargs):
        loaded.append(args)
        return load_all(*args, **kwargs)

    monkeypatch.setattr(onnx.checker, "check_model", spy_check)
    monkeypatch.setattr(preflight, "load_external_data_for_model", spy_load)
    report = slice_model(path, tmp_path / "out" / "m", QUICK)
    assert str(path) in checked and loaded == []
    folder = report.out_dir / "1"
    files = []
    for k, stage in enumerate(report.manifest.stages):  # a stage's weights (if any) in a data file of its own
        saved = onnx.load(str(folder / stage.file), load_external_data=False)
        assert all(uses_external_data(t) for t in saved.graph.initializer if t.dims and np.prod(t.dims) > 16)
        mine = {ExternalDataInfo(t).location for t in saved.graph.initializer if uses_external_data(t)}
        assert mine <= {f"stage{k}.onnx.data"}, (k, mine)
        files += sorted(mine)
    assert files and all((folder / f).is_file() for f in files)
    assert (folder / "m.weights").is_file() and report.manifest.pad_safe
    original = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {"x": np.random.default_rng(0).standard_normal((3, 5, 8)).astype(np.float32),
             "mask": np.ones((3, 5), np.float32)}
    values = dict(feeds)
    for stage in report.manifest.stages:
        session = ort.InferenceSession(str(folder / stage.file), providers=["CPUExecutionProvider"])
        values.update(zip([t.name for t in stage.outputs], session.run([t.name for t in stage.outputs],
                                                                       {t.name: values[t.name] for t in stage.inputs})))
    full = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    for out, want in zip([o.name for o in original.get_outputs()], original.run(None, feeds)):
        np.testing.assert_allclose(values[out], want, atol=1e-5)
        np.testing.assert_allclose(full.run([out], feeds)[0], want, atol=1e-5)


# -- opsets -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("opset", [5, 1000])
def test_an_opset_onnxruntime_cannot_run_is_named_with_the_supported_range(tmp_path, capsys, opset: int) -> None:
    path = tmp_path / "m.onnx"
    onnx.save(_relu_model(opset), str(path))
    parent = tmp_path / "out"
    parent.mkdir()
    newest = newest_ort_opset()
    with pytest.raises(SliceError, match=rf"uses ONNX opset {opset}; onnxruntime .* runs opsets 7 to {newest}"):
        slice_model(path, parent / "m", QUICK)
    assert main(["slice", str(path), "--out", str(parent / "m"), *QUICK_ARGS]) == 1
    assert f"opset {opset}" in _one_line_error(capsys.readouterr().err)
    _no_leftovers(parent, parent / "m")


def test_the_newest_opset_onnxruntime_runs_is_accepted() -> None:
    newest = newest_ort_opset()
    assert newest >= 17
    preflight.check_opset(_relu_model(newest))
    with pytest.raises(SliceError):
        preflight.check_opset(_relu_model(newest + 1))


# -- any other failure, and progress --------------------------------------------------------------

def test_an_unexpected_failure_is_one_line_exit_2_and_leaves_nothing(tmp_path, capsys, monkeypatch) -> None:
    import slicer.slice_model as sm

    path = toy.save(toy.token_mlp(8, 4), tmp_path / "m.onnx")
    parent = tmp_path / "out"
    parent.mkdir()

    def broken(*args, **kwargs):
        raise RuntimeError("the profiler broke\n   on a second line")

    monkeypatch.setattr(sm, "profile_stages", broken)  # fails inside the temporary folder
    assert main(["slice", str(path), "--out", str(parent / "m"), *QUICK_ARGS]) == 2
    err = capsys.readouterr().err
    assert _one_line_error(err) == "dvabatch slice: error: RuntimeError: the profiler broke on a second line"
    _no_leftovers(parent, parent / "m")

    assert main(["slice", str(path), "--out", str(parent / "m"), *QUICK_ARGS, "--verbose"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "the profiler broke" in err
    assert err.rstrip().splitlines()[-1] == "dvabatch slice: error: RuntimeError: the profiler broke on a second line"
    _no_leftovers(parent, parent / "m")


def test_progress_off_a_terminal_is_one_line_per_step(tmp_path, capsys) -> None:
    path = toy.save(toy.token_mlp(8, 4), tmp_path / "m.onnx")
    assert main(["slice", str(path), "--out", str(tmp_path / "repo" / "m"), *QUICK_ARGS]) == 0
    captured = capsys.readouterr()
    assert "\r" not in captured.err
    steps = captured.err.splitlines()
    assert len(steps) >= 5 and all(line.startswith("slicing: step ") for line in steps), captured.err
    assert [int(line.split()[2]) for line in steps] == list(range(1, len(steps) + 1))
    # once the stage-count candidates are cut the slicer says how many steps are left: a total and
    # the time left from then on
    totals = [line for line in steps if " of " in line.split(":")[1]]
    assert totals and "s left" in totals[-1], captured.err
    assert "pad-safe: yes" in captured.out


def test_progress_on_a_terminal_is_a_bar() -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Terminal()
    progress = StepProgress("slicing", stream)
    for message in ("finding legal cut points", "profiling nodes", "cutting"):
        progress(message)
    progress.close()
    assert "\r" in stream.getvalue() and "slicing: step" not in stream.getvalue()
    assert "3 steps" in stream.getvalue()


def test_bad_stage_numbers_are_one_line(tmp_path, capsys) -> None:
    path = toy.save(toy.token_mlp(8, 4), tmp_path / "m.onnx")
    assert main(["slice", str(path), "--out", str(tmp_path / "m"), "--stages", "two"]) == 2
    assert "--stages must be a number" in _one_line_error(capsys.readouterr().err)
