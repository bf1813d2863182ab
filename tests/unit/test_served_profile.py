"""`perf.costs.served_profile` charges each py-spy sample to one part of the served path."""
from __future__ import annotations

from pathlib import Path

from perf.costs.served_profile import charge, part_of


def test_a_sample_is_charged_to_the_innermost_part_it_names() -> None:
    engine = ["_bootstrap (threading.py:1)", "TritonPythonModel.execute (model.py:3)",
              "gather_rows (query.py:9)", "OrtStageEngine.run (engine.py:4)", "Session.run_with_iobinding (x.py:1)"]
    assert part_of(engine) == "engine (onnxruntime)"
    assert part_of(engine[:3]) == "copies in and out of batches"
    assert part_of(["Thread.run (threading.py:1)", "_Responder._loop (model.py:1)", "_RequestAnswer.send (model.py:2)"]) \
        == "answers: build and send"
    assert part_of(["Thread.run (threading.py:1)", "Scheduler.finish_work (scheduler.py:1)"]) == "batching: policy and scheduler"
    assert part_of(["TritonPythonModel.execute (model.py:1)"]) == "execute, other"
    assert part_of(["<module> (x.py:1)"]) == "other"
    assert part_of(["_CancelWatch._loop (model.py:1)", "Event.wait (threading.py:2)", "Condition.wait (threading.py:3)"]) \
        == "idle"  # a timed wait, which py-spy counts as running


def test_raw_stacks_are_summed_by_part(tmp_path: Path) -> None:
    raw = tmp_path / "raw.txt"
    raw.write_text("thread (1): MainThread;TritonPythonModel.execute (m.py:1);OrtStageEngine.run (e.py:2) 7\n"
                   "thread (2): dvabatch-metrics;StageMetrics._loop (m.py:3) 2\n"
                   "thread (1): MainThread;TritonPythonModel.execute (m.py:1) 1\n")
    assert charge(raw) == {"engine (onnxruntime)": 7, "cancel watch, metrics": 2, "execute, other": 1}
