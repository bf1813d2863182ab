"""`python -m perf.tuning.model_analyzer`'s files, checked without installing or running Model Analyzer:
the profile config (YAML: remote mode, the policy sweep under `model_config_parameters`, the
concurrencies, our perf_analyzer, time windows, our input data) and the input data (every entry
a valid query: token ids inside the manifest's input_bounds, lengths within max_length, masks of
ones, varied lengths)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dvabatch_backend.runtime.manifest import Manifest
from perf.tuning import model_analyzer

from ..triton_support import slice_zoo_model

MODEL = "bert"
ENDPOINTS = model_analyzer.Endpoints(http="127.0.0.1:18000", grpc="127.0.0.1:18001",
                                     metrics_url="http://127.0.0.1:18002/metrics")
PERF_ANALYZER = Path("/opt/tritonclient/bin/perf_analyzer")


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Manifest, Path]:
    repo = tmp_path_factory.mktemp("ma_repo")
    served = slice_zoo_model(repo, MODEL)
    out = tmp_path_factory.mktemp("ma_out")
    config_path = model_analyzer.prepare(repo, MODEL, out, ["input", "load"], [1, 4], ENDPOINTS, PERF_ANALYZER,
                                         measurement_interval_ms=2500, queries=50, lengths="rte")
    return config_path, served.manifest, out


def _load_yaml(path: Path) -> dict:
    try:
        import yaml
    except ImportError:  # the file is JSON, which YAML reads as it is
        return json.loads(path.read_text())
    return yaml.safe_load(path.read_text())


def test_the_config_sweeps_the_policies_in_remote_mode(generated: tuple[Path, Manifest, Path]) -> None:
    config_path, _, out = generated
    config = _load_yaml(config_path)
    assert config["triton_launch_mode"] == "remote"
    assert config["triton_grpc_endpoint"] == ENDPOINTS.grpc and config["triton_http_endpoint"] == ENDPOINTS.http
    assert config["triton_metrics_url"] == ENDPOINTS.metrics_url
    assert config["perf_analyzer_path"] == str(PERF_ANALYZER)
    assert config["run_config_search_disable"] is True and config["batch_sizes"] == [1]
    assert Path(config["export_path"]).parent == out and Path(config["checkpoint_directory"]).parent == out
    model = config["profile_models"][MODEL]
    assert model["cpu_only"] is True
    assert model["parameters"] == {"concurrency": [1, 4]}
    assert model["model_config_parameters"] == {"parameters": {"policy": {"string_value": ["input", "load"]}}}
    flags = model["perf_analyzer_flags"]
    assert flags["measurement-mode"] == "time_windows" and flags["measurement-interval"] == 2500
    assert Path(flags["input-data"]) == out / model_analyzer.INPUT_DATA_FILE
    assert Path(flags["input-data"]).is_file()


def test_the_input_data_holds_valid_queries(generated: tuple[Path, Manifest, Path]) -> None:
    _, manifest, out = generated
    bounds = manifest.input_bounds
    assert bounds.get("input_ids", 0) >= 2, "the slicer records the embedding table's rows"
    entries = json.loads((out / model_analyzer.INPUT_DATA_FILE).read_text())["data"]
    assert len(entries) == 50
    lengths = set()
    for entry in entries:
        assert set(entry) == {t.name for t in manifest.inputs}
        shapes = {tuple(tensor["shape"]) for tensor in entry.values()}
        assert len(shapes) == 1, "every input of a query has its length"
        (length,) = shapes.pop()
        assert 1 <= length <= manifest.max_length
        lengths.add(length)
        for name, tensor in entry.items():
            values = np.asarray(tensor["content"])
            assert values.size == length
            if "mask" in name:
                assert np.all(values == 1)
            elif name in bounds:
                assert values.min() >= 0 and values.max() < bounds[name], name
    assert len(lengths) > 1, "GLUE-like lengths vary"


def test_the_report_names_each_config_policy(tmp_path: Path) -> None:
    """read_results on files shaped as MA writes them: the CSV row's config is named with its policy."""
    (tmp_path / "export" / "results").mkdir(parents=True)
    (tmp_path / "export" / "results" / "metrics-model-inference.csv").write_text(
        "Model,Batch,Concurrency,Model Config Path,Throughput (infer/sec),p50 Latency (ms),p99 Latency (ms)\n"
        "bert,1,4,bert_config_0,120.5,20.1,31.0\n"
        "bert,1,4,bert_config_1,140.0,18.0,29.5\n")
    for variant, policy in (("bert_config_0", "input"), ("bert_config_1", "load")):
        (tmp_path / "repo" / variant).mkdir(parents=True)
        (tmp_path / "repo" / variant / "config.pbtxt").write_text(
            f'name: "bert"\nparameters {{\n  key: "policy"\n  value {{\n    string_value: "{policy}"\n  }}\n}}\n')
    results = model_analyzer.read_results(tmp_path / "export", tmp_path / "repo")
    assert [(r.variant, r.settings.get("policy"), r.throughput) for r in results] == [
        ("bert_config_1", "load", 140.0), ("bert_config_0", "input", 120.5)]
    assert "best bert_config_1 (policy load)" in "\n".join(model_analyzer.report_lines(results))
