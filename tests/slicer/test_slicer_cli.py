"""The slicer as a user meets it: `dvabatch zoo` and `dvabatch slice --stages auto`, and the
profiler's node costs mapping back to the graph."""
from __future__ import annotations

import numpy as np

from dvabatch_backend import Manifest, RuntimeSettings, load_scheduler
from dvabatch_backend.tools.cli import main
from policies import create_policy
from slicer import toy
from slicer.analysis import name_nodes
from slicer.cut import input_specs
from slicer.profiler import Setting, node_costs


def test_zoo_then_slice_auto_then_serve(tmp_path, capsys) -> None:
    assert main(["zoo", "list"]) == 0
    assert "minilm" in capsys.readouterr().out
    onnx_path = tmp_path / "bert.onnx"
    assert main(["zoo", "bert", "--size", "test", "--out", str(onnx_path)]) == 0
    out = tmp_path / "repo" / "bert"
    code = main(["slice", str(onnx_path), "--stages", "auto", "--candidates", "2,3", "--out", str(out),
                 "--bs-max", "8", "--max-length", "16", "--repeats", "3"])
    assert code == 0
    summary = capsys.readouterr().out
    assert "stage-count candidates" in summary and "preferred batch size" in summary
    manifest = Manifest.load(out / "1" / "manifest.json")
    assert manifest.name == "bert" and manifest.num_stages in (2, 3)
    assert 'name: "bert"' in (out / "config.pbtxt").read_text()
    # Triton's own queue left unbounded, as Triton leaves it (a queue policy costs a light load: README)
    from slicer import model_config

    assert not model_config.read(out / "config.pbtxt").dynamic_batching.HasField("default_queue_policy")

    # the directory serves: one query through the runtime equals the original model
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    query = {"input_ids": rng.integers(0, 100, 7).astype(np.int64), "attention_mask": np.ones(7, np.int64)}
    answers = []
    with load_scheduler(out, create_policy("pipelined"), RuntimeSettings()) as scheduler:
        scheduler.submit(query, answers.append)
        assert scheduler.wait_until(lambda s: s.pending_count == 0, 10)
    full = ort.InferenceSession(str(out / "1" / "model.onnx"))
    expected = full.run(["sentence_embedding"], {k: v[None] for k, v in query.items()})[0][0]
    np.testing.assert_allclose(answers[0].outputs["sentence_embedding"], expected, atol=1e-4)


def test_slice_errors_are_reported_not_raised(tmp_path, capsys) -> None:
    (tmp_path / "x.onnx").write_text("nope")
    assert main(["slice", str(tmp_path / "x.onnx"), "--stages", "2", "--out", str(tmp_path / "m")]) == 1
    assert "is not an ONNX model" in capsys.readouterr().err


def test_node_costs_map_back_to_every_compute_node() -> None:
    model = name_nodes(toy.token_mlp(64, 4))
    costs = node_costs(model, list(input_specs(model).values()), [Setting(4, 16), Setting(16, 16)], repeats=3)
    small, large = costs[Setting(4, 16)], costs[Setting(16, 16)]
    matmuls = [i for i, n in enumerate(model.graph.node) if n.op_type == "MatMul"]
    # every compute node is found in the profile by its name, at each setting (no clock comparison:
    # which setting is slower is the machine's business)
    assert all(small[i] > 0 and large[i] > 0 for i in matmuls)
    assert len(small) == len(large) == len(model.graph.node)
