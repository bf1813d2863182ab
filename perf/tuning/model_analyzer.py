"""Tune a dvabatch model with Triton's Model Analyzer: sweep its `policy` (and concurrency) for real.

    python -m perf.tuning.model_analyzer MODEL_REPO MODEL [--policies input,load,pipelined]
        [--concurrency 1,4,8] [--measurement-interval 3000] [--lengths rte] [--out work/model-analyzer/MODEL]

What it does, in order:
1. creates (or reuses) Model Analyzer's own virtualenv, `work/model-analyzer-venv` (MA pins a newer
   tritonclient and protobuf than this project's: it cannot share `.venv`);
2. writes perf_analyzer input data: seeded queries of GLUE-like lengths (`perf.load.lengths`), token ids
   below the manifest's `input_bounds` (MA's random data indexes past an embedding table) and masks
   of ones, one JSON entry per request, each with its own shape (`perf.load.perf_analyzer.write_input_data`);
3. writes MA's config: remote launch mode, one model with `cpu_only`, `model_config_parameters`
   sweeping `parameters: {policy: {string_value: [...]}}`, the concurrencies, and
   `perf_analyzer_flags` for time windows long enough to rank configs;
4. starts tritonserver bound to 127.0.0.1 in explicit model control with nothing loaded (MA's remote
   mode loads each variant itself, its config sent with the load request);
5. runs `model-analyzer profile` with OUR perf_analyzer (the tritonclient wheel's, first on PATH and
   named by `perf_analyzer_path`) and prints every measured config: its settings, throughput, p99.

Results are under OUT: `ma_config.yaml`, `input_data.json`, MA's `export/` (results CSVs),
`output_repo/` (each variant's config.pbtxt), `model_analyzer.log` and `report.json`.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import time
import venv
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dvabatch_backend.runtime.manifest import Manifest

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VENV = REPO_ROOT / "work" / "model-analyzer-venv"
DEFAULT_OUT_ROOT = REPO_ROOT / "work" / "model-analyzer"
MA_PACKAGE = "triton-model-analyzer"
MA_EXECUTABLE = "model-analyzer"
DEFAULT_POLICIES = ("input", "load", "pipelined")
DEFAULT_CONCURRENCY = (1, 4, 8)
# time windows, not MA's default count windows: a window of a fixed number of requests is a fraction
# of a second at concurrency 1 here, too short for configs a few percent apart to rank steadily
DEFAULT_MEASUREMENT_INTERVAL_MS = 3000
DEFAULT_QUERIES = 200
DEFAULT_LENGTHS = "rte"
CONFIG_FILE = "ma_config.yaml"
INPUT_DATA_FILE = "input_data.json"
# a string parameter in protobuf text, as the slicer writes it (one line, colons) or MA (multi-line, none)


class ModelAnalyzerError(RuntimeError):
    """Model Analyzer could not be installed, started, or produced no results; the message says why."""


# ----------------------------------------------------------------------------------------------
# Model Analyzer's virtualenv


def ma_executable(venv_dir: Path) -> Path:
    return venv_dir / "bin" / MA_EXECUTABLE


def ensure_venv(venv_dir: Path = DEFAULT_VENV) -> Path:
    """`model-analyzer` in its own virtualenv, created and installed with pip when missing."""
    executable = ma_executable(venv_dir)
    if executable.is_file():
        return executable
    print(f"creating {venv_dir} and installing {MA_PACKAGE} (a few minutes)...", flush=True)
    venv.EnvBuilder(with_pip=True, clear=False).create(venv_dir)
    pip = [str(venv_dir / "bin" / "python"), "-m", "pip", "install", "-q", MA_PACKAGE]
    result = subprocess.run(pip, capture_output=True, text=True)
    if result.returncode != 0 or not executable.is_file():
        raise ModelAnalyzerError(f"{' '.join(pip)} failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    return executable


# ----------------------------------------------------------------------------------------------
# input data and config


def input_queries(manifest: Manifest, n: int, preset: str = DEFAULT_LENGTHS, seed: int = 0) -> list[dict]:
    """n seeded queries (arrays without the batch dim): lengths from `preset` up to max_length,
    integer ids below the manifest's input_bounds, masks all ones."""
    from perf.baselines.bench import sample_queries

    queries, _ = sample_queries(manifest, dict(manifest.input_bounds), n, seed, preset)
    return queries


def write_ma_input_data(path: Path, manifest: Manifest, n: int = DEFAULT_QUERIES, preset: str = DEFAULT_LENGTHS,
                        seed: int = 0) -> Path:
    from perf.load.perf_analyzer import write_input_data

    return write_input_data(path, input_queries(manifest, n, preset, seed))


@dataclass(frozen=True)
class Endpoints:
    """Where MA finds the server (host:port each)."""

    http: str
    grpc: str
    metrics_url: str  # http://host:port/metrics


def ma_config(model: str, policies: Sequence[str], concurrency: Sequence[int], endpoints: Endpoints, out: Path,
              input_data: Path, perf_analyzer: Path, measurement_interval_ms: int) -> dict[str, Any]:
    """Model Analyzer's profile config: a brute sweep (run_config_search_disable) of `policies`
    crossed with `concurrency`, in remote mode against the server at `endpoints`."""
    return {
        "triton_launch_mode": "remote",
        "triton_http_endpoint": endpoints.http,
        "triton_grpc_endpoint": endpoints.grpc,
        "triton_metrics_url": endpoints.metrics_url,
        "client_protocol": "grpc",
        "perf_analyzer_path": str(perf_analyzer),
        "dcgm_disable": True,  # no GPU to monitor; remote mode allows it
        "run_config_search_disable": True,  # exactly the configs asked for, no automatic search
        "skip_summary_reports": True,  # the PDF summary needs GPU metrics; our report reads the CSVs
        "override_output_model_repository": True,
        "output_model_repository_path": str(out / "output_repo"),
        "export_path": str(out / "export"),
        "checkpoint_directory": str(out / "checkpoints"),
        "batch_sizes": [1],  # input data of varied shapes works with batch size 1 only
        "inference_output_fields": ["model_name", "batch_size", "concurrency", "model_config_path",
                                    "perf_throughput", "perf_latency_p50", "perf_latency_p99"],
        "profile_models": {
            model: {
                "cpu_only": True,
                "parameters": {"concurrency": [int(c) for c in concurrency]},
                "model_config_parameters": {"parameters": {"policy": {"string_value": list(policies)}}},
                "perf_analyzer_flags": {
                    "input-data": str(input_data),
                    "measurement-mode": "time_windows",
                    "measurement-interval": int(measurement_interval_ms),
                },
            }
        },
    }


def write_ma_config(path: Path, config: Mapping[str, Any]) -> Path:
    """The config as YAML. Written as JSON, which YAML reads as it is: no YAML writer needed here."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2) + "\n")
    return path


# ----------------------------------------------------------------------------------------------
# running


def ma_environment(perf_analyzer: Path) -> dict[str, str]:
    """MA's environment: our perf_analyzer's folder first on PATH, the CUDA runtime it links on
    LD_LIBRARY_PATH; none of this project's virtualenv (MA runs with its own)."""
    from perf.load.perf_analyzer import perf_analyzer_env

    env = perf_analyzer_env()
    env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHONPATH", None)
    env["PATH"] = os.pathsep.join([str(perf_analyzer.parent), env.get("PATH", "")])
    return env


def run_model_analyzer(executable: Path, config_path: Path, perf_analyzer: Path, log_path: Path,
                       timeout: float) -> None:
    """`model-analyzer profile -f CONFIG`, its output into `log_path`; raises with the log's tail on failure."""
    cmd = [str(executable), "profile", "-f", str(config_path)]
    with open(log_path, "w") as log:
        try:
            code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=ma_environment(perf_analyzer),
                                  timeout=timeout, stdin=subprocess.DEVNULL).returncode
        except subprocess.TimeoutExpired as exc:
            raise ModelAnalyzerError(f"model-analyzer ran past {timeout:.0f} s; see {log_path}") from exc
    if code != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
        raise ModelAnalyzerError(f"model-analyzer exited with {code}:\n{tail}")


# ----------------------------------------------------------------------------------------------
# the report


@dataclass(frozen=True)
class ConfigResult:
    """One measured (config variant, concurrency): its settings, throughput and latencies (ms)."""

    variant: str
    settings: dict[str, str]
    concurrency: int
    throughput: float
    p50_ms: float
    p99_ms: float


def variant_settings(output_repo: Path, variant: str) -> dict[str, str]:
    """A variant's string parameters (MA writes each variant's config.pbtxt as protobuf text)."""
    from slicer.model_config import parameters

    path = output_repo / variant / "config.pbtxt"
    return parameters(path.read_text()) if path.is_file() else {}


def _column(row: Mapping[str, str], prefix: str) -> str:
    """A CSV cell by its header's start ("p99 Latency" matches "p99 Latency (ms)")."""
    for key, value in row.items():
        if key and key.strip().lower().startswith(prefix.lower()):
            return value
    raise ModelAnalyzerError(f"no column starting with {prefix!r} in {sorted(row)}")


def read_results(export_path: Path, output_repo: Path) -> list[ConfigResult]:
    """Every measurement of MA's inference CSV, ranked by throughput (highest first)."""
    csv_path = export_path / "results" / "metrics-model-inference.csv"
    if not csv_path.is_file():
        raise ModelAnalyzerError(f"Model Analyzer wrote no {csv_path}")
    results = []
    with open(csv_path, newline="") as handle:
        for row in csv.DictReader(handle):
            variant = _column(row, "Model Config Path").strip()
            results.append(ConfigResult(
                variant=variant, settings=variant_settings(output_repo, variant),
                concurrency=int(float(_column(row, "Concurrency"))),
                throughput=float(_column(row, "Throughput")), p50_ms=float(_column(row, "p50 Latency")),
                p99_ms=float(_column(row, "p99 Latency"))))
    return sorted(results, key=lambda r: -r.throughput)


def report_lines(results: Sequence[ConfigResult]) -> list[str]:
    """A table of every config and concurrency, best throughput first, then the best config per concurrency."""
    lines = [f"{'rank':>4}  {'config':<24} {'policy':<10} {'conc':>4} {'infer/s':>9} {'p50 ms':>8} {'p99 ms':>8}"]
    for rank, r in enumerate(results, 1):
        lines.append(f"{rank:>4}  {r.variant:<24} {r.settings.get('policy', '?'):<10} {r.concurrency:>4} "
                     f"{r.throughput:>9.1f} {r.p50_ms:>8.2f} {r.p99_ms:>8.2f}")
    for concurrency in sorted({r.concurrency for r in results}):
        best = max((r for r in results if r.concurrency == concurrency), key=lambda r: r.throughput)
        lines.append(f"concurrency {concurrency}: best {best.variant} (policy {best.settings.get('policy', '?')}), "
                     f"{best.throughput:.1f} infer/s, p99 {best.p99_ms:.2f} ms")
    return lines


# ----------------------------------------------------------------------------------------------
# command line


def prepare(repo: Path, model: str, out: Path, policies: Sequence[str], concurrency: Sequence[int],
            endpoints: Endpoints, perf_analyzer: Path, measurement_interval_ms: int, queries: int,
            lengths: str) -> Path:
    """Writes OUT/input_data.json and OUT/ma_config.yaml (clearing MA's earlier output, whose
    checkpoint would otherwise replay old measurements); returns the config's path."""
    manifest = Manifest.load(repo / model / "1" / "manifest.json")
    for stale in ("output_repo", "export", "checkpoints"):
        shutil.rmtree(out / stale, ignore_errors=True)
    data = write_ma_input_data(out / INPUT_DATA_FILE, manifest, queries, lengths)
    config = ma_config(model, policies, concurrency, endpoints, out, data, perf_analyzer, measurement_interval_ms)
    return write_ma_config(out / CONFIG_FILE, config)


def _csv_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _csv_words(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.tuning.model_analyzer", description=__doc__.split("\n\n")[0])
    parser.add_argument("repo", type=Path, metavar="MODEL_REPO", help="the model repository (left as it is)")
    parser.add_argument("model", metavar="MODEL", help="the dvabatch model's name in it")
    parser.add_argument("--policies", type=_csv_words, default=list(DEFAULT_POLICIES), help="default: %(default)s")
    parser.add_argument("--concurrency", type=_csv_ints, default=list(DEFAULT_CONCURRENCY), help="default: %(default)s")
    parser.add_argument("--measurement-interval", type=int, default=DEFAULT_MEASUREMENT_INTERVAL_MS, metavar="MS",
                        help="perf_analyzer's time window (default: %(default)s)")
    parser.add_argument("--queries", type=int, default=DEFAULT_QUERIES, help="input data entries (default: %(default)s)")
    parser.add_argument("--lengths", default=DEFAULT_LENGTHS, help="perf.load.lengths preset (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=None, help="default: work/model-analyzer/MODEL")
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="MA's virtualenv (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds for the whole MA run")
    args = parser.parse_args(argv)
    try:
        return profile(args)
    except (ModelAnalyzerError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def profile(args: argparse.Namespace) -> int:
    from dvabatch_backend.tools.serve import TritonServer
    from perf.load.perf_analyzer import ensure_system_deps

    out = (args.out or DEFAULT_OUT_ROOT / args.model).resolve()
    out.mkdir(parents=True, exist_ok=True)
    executable = ensure_venv(args.venv)
    perf_analyzer = ensure_system_deps()
    # explicit model control with nothing loaded: MA's remote mode loads each variant itself
    with TritonServer(args.repo, explicit=True, load=(), host="127.0.0.1") as server:
        endpoints = Endpoints(http=server.http_url, grpc=server.grpc_url,
                              metrics_url=server.metrics_url)
        config_path = prepare(args.repo, args.model, out, args.policies, args.concurrency, endpoints,
                              perf_analyzer, args.measurement_interval, args.queries, args.lengths)
        print(f"tritonserver on {server.grpc_url}; model-analyzer profile -f {config_path} "
              f"({len(args.policies)} policies x {len(args.concurrency)} concurrencies + the default config)",
              flush=True)
        began = time.perf_counter()
        run_model_analyzer(executable, config_path, perf_analyzer, out / "model_analyzer.log", args.timeout)
    results = read_results(out / "export", out / "output_repo")
    (out / "report.json").write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
    print(f"Model Analyzer took {time.perf_counter() - began:.0f} s; results in {out}")
    for line in report_lines(results):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
