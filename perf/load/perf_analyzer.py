"""Run NVIDIA's real `perf_analyzer` against a Triton server and read its results.

    python -m perf.load.perf_analyzer --model NAME --url 127.0.0.1:8000 [--protocol grpc]
        [--concurrency 1:4:1 | --request-rate 100:400:100 [--poisson]]
        [--input-data data.json] [--shape x:5,16] [--measurement-interval 1000] [-- extra perf_analyzer args]

The binary ships inside the `tritonclient==2.51.0` wheel (`tritonclient-2.51.0.data/data/bin/
perf_analyzer`, which pip installs as `<prefix>/bin/perf_analyzer`). It links against
`libb64.so.0d` (Debian's `libb64-0d`) and `libcudart.so.12` (the PyPI wheel
`nvidia-cuda-runtime-cu12`, whose `nvidia/cuda_runtime/lib` must be on LD_LIBRARY_PATH; no GPU is
needed). `ensure_system_deps()` checks both and installs `libb64-0d` with apt-get when run as root.

Things perf_analyzer does that callers must know:
- Inputs with variable dims (-1) need either `--shape name:d1,d2` (one fixed shape for every
  request) or `--input-data` JSON whose entries carry their own `"shape"` (without the batch dim).
  Entries are sent round-robin, one per request, so a JSON file of varied lengths makes a load of
  varied lengths. Such a file only works with batch size 1 (`-b 1`, the default): with `-b > 1`
  perf_analyzer refuses to batch entries of different shapes.
- The CSV (`-f`) lists rows in order of throughput, not of load; `parse_csv` sorts them by load.
  Average latency is in the CSV only with `--verbose-csv`, which `run_perf_analyzer` always passes.
- A load level whose measurements never become stable (`-s`, within `-r` windows) is left out of
  the CSV, the sweep stops there, and the exit code may still be 0 (request-rate mode exits 2
  with no CSV). `PerfResult.stable` and `PerfResult.missing_levels` tell; a large
  `stability_percentage` (e.g. 1000) turns the check off for short smoke runs.
"""
from __future__ import annotations

import argparse
import csv
import importlib.metadata
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np

BINARY = "perf_analyzer"
APT_PACKAGE = "libb64-0d"
B64_LIBRARY = "libb64.so.0d"
CUDART_LIBRARY = "libcudart.so.12"
UNSTABLE_MARK = "Failed to obtain stable measurement"
TAIL_CHARS = 4000

Range = tuple[float, ...] | Sequence[float] | str


class PerfAnalyzerError(RuntimeError):
    """perf_analyzer is missing, cannot start, or could not run as asked; the message says why."""


# ----------------------------------------------------------------------------------------------
# locating the binary and what it needs


def find_perf_analyzer() -> Path:
    """The perf_analyzer executable: $PERF_ANALYZER, else the one the tritonclient wheel installed."""
    override = os.environ.get("PERF_ANALYZER")
    if override:
        path = Path(override)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise PerfAnalyzerError(f"PERF_ANALYZER={override} is not an executable file")
        return path
    candidates: list[Path] = []
    try:
        dist = importlib.metadata.distribution("tritonclient")
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        for entry in dist.files or []:
            if entry.name == BINARY:
                candidates.append(Path(str(dist.locate_file(entry))).resolve())
    for scheme_path in {sysconfig.get_path("scripts"), os.path.join(sys.prefix, "bin")}:
        candidates.append(Path(scheme_path) / BINARY)
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    # last resort: PATH (may be a pyenv shim, a shell script that runs the real binary)
    found = shutil.which(BINARY)
    if found:
        return Path(found)
    if dist is None:
        raise PerfAnalyzerError("perf_analyzer not found: the tritonclient wheel is not installed "
                                "(pip install 'tritonclient[all]==2.51.0', which ships bin/perf_analyzer)")
    raise PerfAnalyzerError(f"perf_analyzer not found: tritonclient {dist.version} is installed but carries no "
                            f"bin/perf_analyzer (looked at {', '.join(map(str, candidates))}); "
                            "install tritonclient[all]==2.51.0")


def cuda_runtime_lib_dir() -> Path | None:
    """`nvidia/cuda_runtime/lib` of the nvidia-cuda-runtime-cu12 wheel (a namespace package), if installed."""
    try:
        spec = importlib.util.find_spec("nvidia.cuda_runtime")
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    for location in spec.submodule_search_locations or []:
        lib = Path(location) / "lib"
        if (lib / CUDART_LIBRARY).exists():
            return lib
    return None


def perf_analyzer_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment to run perf_analyzer in: `base` (default os.environ) with the CUDA runtime on LD_LIBRARY_PATH."""
    env = dict(os.environ if base is None else base)
    lib = cuda_runtime_lib_dir()
    if lib is not None:
        parts = [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
        if str(lib) not in parts:
            env["LD_LIBRARY_PATH"] = os.pathsep.join([str(lib), *parts])
    return env


def missing_libraries(binary: Path | None = None) -> list[str]:
    """Shared libraries the binary needs that the loader cannot find (per `ldd`, in perf_analyzer_env)."""
    binary = binary or find_perf_analyzer()
    ldd = shutil.which("ldd")
    if ldd is None:
        raise PerfAnalyzerError("ldd is not available to check perf_analyzer's libraries")
    result = subprocess.run([ldd, str(binary)], capture_output=True, text=True, env=perf_analyzer_env(), timeout=60)
    if result.returncode != 0 and "not a dynamic executable" in (result.stdout + result.stderr):
        raise PerfAnalyzerError(f"{binary} is not the perf_analyzer binary (a wrapper script?); set PERF_ANALYZER "
                                "to the real one")
    return sorted({line.split("=>")[0].strip() for line in result.stdout.splitlines() if "not found" in line})


def _apt_install(package: str) -> None:
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", package]
    first = subprocess.run(install, capture_output=True, text=True, env=env)
    if first.returncode == 0:
        return
    update = subprocess.run(["apt-get", "update", "-q"], capture_output=True, text=True, env=env)
    second = subprocess.run(install, capture_output=True, text=True, env=env)
    if second.returncode != 0:
        raise PerfAnalyzerError(f"apt-get install {package} failed (exit {second.returncode}):\n"
                                f"{update.stderr[-1000:]}\n{second.stdout[-1000:]}\n{second.stderr[-2000:]}")


@lru_cache(maxsize=None)
def _ensure(binary: Path, install: bool) -> Path:
    missing = missing_libraries(binary)
    if any(name.startswith("libb64") for name in missing):
        if not install:
            raise PerfAnalyzerError(f"{binary} needs {B64_LIBRARY}: apt-get install -y {APT_PACKAGE} "
                                    "(or call perf.load.perf_analyzer.ensure_system_deps() as root)")
        if shutil.which("apt-get") is None or os.geteuid() != 0:
            raise PerfAnalyzerError(f"{binary} needs {B64_LIBRARY} from the Debian package {APT_PACKAGE}; "
                                    f"install it as root: apt-get update && apt-get install -y {APT_PACKAGE}")
        _apt_install(APT_PACKAGE)
        missing = missing_libraries(binary)
    if missing:
        hints = []
        if CUDART_LIBRARY in missing:
            hints.append(f"{CUDART_LIBRARY} comes from the PyPI wheel nvidia-cuda-runtime-cu12 "
                         "(pip install nvidia-cuda-runtime-cu12); run perf_analyzer with perf_analyzer_env()")
        if any(name.startswith("libb64") for name in missing):
            hints.append(f"{B64_LIBRARY} comes from the Debian package {APT_PACKAGE}")
        raise PerfAnalyzerError(f"{binary} cannot load {', '.join(missing)}" + (": " + "; ".join(hints) if hints else ""))
    return binary


def ensure_system_deps(install: bool = True) -> Path:
    """Make sure perf_analyzer can start: returns its path.

    Missing libb64 is installed with `apt-get install -y libb64-0d` (after `apt-get update` if the
    first try fails) when `install` is true and we are root; anything else missing raises a
    PerfAnalyzerError that names it and where it comes from. Checked once per process.
    """
    return _ensure(find_perf_analyzer(), install)


# ----------------------------------------------------------------------------------------------
# input data


def _content(array: np.ndarray) -> list:
    if array.dtype.kind in "OUS":
        return [x.decode() if isinstance(x, bytes) else str(x) for x in array.ravel().tolist()]
    if array.dtype.kind == "f" and not np.all(np.isfinite(array)):
        raise ValueError("perf_analyzer's JSON input data cannot hold NaN or infinity")
    if array.dtype.kind == "b":
        return [bool(x) for x in array.ravel().tolist()]
    return array.ravel().tolist()


def input_data_json(queries: Sequence[Mapping[str, np.ndarray]]) -> dict:
    """perf_analyzer's JSON input data: one entry per query, each tensor with its own shape."""
    if not queries:
        raise ValueError("input data needs at least one query")
    names = set(queries[0])
    entries = []
    for i, query in enumerate(queries):
        if set(query) != names:
            raise ValueError(f"query {i} has inputs {sorted(query)}, query 0 has {sorted(names)}")
        entries.append({name: {"content": _content(np.asarray(value)), "shape": [int(d) for d in np.shape(value)]}
                        for name, value in query.items()})
    return {"data": entries}


def write_input_data(path: str | Path, queries: Sequence[Mapping[str, np.ndarray]]) -> Path:
    """Write `queries` (input name -> array for ONE request, without the batch dim) as a file for
    `--input-data`. perf_analyzer sends the entries round-robin, one per request, each with its
    own shape: different lengths make a load of different lengths (batch size 1 only)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(input_data_json(queries)))
    return path


def write_request_intervals(path: str | Path, offsets: Sequence[float] | np.ndarray) -> Path:
    """Write send offsets (seconds from the first send, `perf.load.arrivals`) as a `--request-intervals`
    file: the gaps between them in whole microseconds, one per line."""
    gaps = np.rint(np.diff(np.asarray(offsets, dtype=float)) * 1e6).astype(np.int64)
    if gaps.size == 0 or (gaps < 0).any():
        raise ValueError("request intervals need at least two offsets, in order")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(str(int(g)) for g in gaps) + "\n")
    return path


# ----------------------------------------------------------------------------------------------
# results


@dataclass(frozen=True)
class PerfRow:
    """One load level of the sweep. Latencies in microseconds, as perf_analyzer reports them."""

    mode: str  # "concurrency" or "request_rate"
    level: float  # the concurrency or the request rate (requests per second)
    throughput: float  # inferences per second
    p50_us: float
    p90_us: float
    p95_us: float
    p99_us: float
    avg_us: float
    raw: dict[str, float] = field(default_factory=dict, compare=False)  # every column of the CSV row

    @property
    def concurrency(self) -> int | None:
        return int(self.level) if self.mode == "concurrency" else None

    @property
    def request_rate(self) -> float | None:
        return self.level if self.mode == "request_rate" else None


@dataclass
class PerfResult:
    command: list[str]
    returncode: int
    stdout_tail: str
    stderr_tail: str
    rows: list[PerfRow]
    expected_levels: list[float] | None  # None when the sweep's end is open (end 0: until the latency limit)
    stable: bool  # False when perf_analyzer said it failed to obtain a stable measurement
    csv_path: Path | None = None

    @property
    def missing_levels(self) -> list[float]:
        if self.expected_levels is None:
            return []
        seen = {round(r.level, 6) for r in self.rows}
        return [lvl for lvl in self.expected_levels if round(lvl, 6) not in seen]

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.stable and bool(self.rows) and not self.missing_levels

    def describe(self) -> str:
        missing = ", ".join(f"{lvl:g}" for lvl in self.missing_levels) or "none"
        lines = [f"exit {self.returncode}, stable={self.stable}, missing levels: {missing}"]
        for r in self.rows:
            lines.append(f"{r.mode}={r.level:g}: {r.throughput:.1f} infer/s, avg {r.avg_us:.0f} us, "
                         f"p50 {r.p50_us:.0f} us, p90 {r.p90_us:.0f} us, p99 {r.p99_us:.0f} us")
        return "\n".join(lines)


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return float("nan")


def parse_csv(text: str) -> list[PerfRow]:
    """Rows of perf_analyzer's `-f` CSV (with or without --verbose-csv), sorted by load level.

    Without --verbose-csv there is no "Avg latency" column; it is then the sum of the latency
    components (client send, network+server, client recv)."""
    reader = csv.reader(io.StringIO(text))
    header: list[str] | None = None
    rows: list[PerfRow] = []
    for record in reader:
        if not record or not any(cell.strip() for cell in record):
            continue
        if header is None:
            header = [c.strip() for c in record]
            if header[0] not in ("Concurrency", "Request Rate"):
                raise PerfAnalyzerError(f"unexpected perf_analyzer CSV header: {record}")
            continue
        if record[0].strip() in ("Concurrency", "Request Rate"):  # a second table (e.g. metrics) follows
            break
        values = {name: _number(cell) for name, cell in zip(header, record)}
        avg = values.get("Avg latency")
        if avg is None:
            avg = sum(values.get(c, 0.0) for c in ("Client Send", "Network+Server Send/Recv", "Client Recv"))
        rows.append(PerfRow(
            mode="concurrency" if header[0] == "Concurrency" else "request_rate",
            level=values[header[0]],
            throughput=values.get("Inferences/Second", float("nan")),
            p50_us=values.get("p50 latency", float("nan")),
            p90_us=values.get("p90 latency", float("nan")),
            p95_us=values.get("p95 latency", float("nan")),
            p99_us=values.get("p99 latency", float("nan")),
            avg_us=avg,
            raw=values,
        ))
    return sorted(rows, key=lambda r: r.level)


# ----------------------------------------------------------------------------------------------
# running


def parse_range(value: Range) -> tuple[float, float, float]:
    """`(start,)`, `(start, end)`, `(start, end, step)` or "start:end:step" -> (start, end, step); end and step default to start and 1."""
    parts = [float(p) for p in value.split(":")] if isinstance(value, str) else [float(p) for p in value]
    if not 1 <= len(parts) <= 3:
        raise ValueError(f"a range is start[:end[:step]], got {value!r}")
    start = parts[0]
    end = parts[1] if len(parts) > 1 else start
    step = parts[2] if len(parts) > 2 else 1.0
    if start <= 0 or step <= 0 or (end != 0 and end < start):
        raise ValueError(f"bad range {value!r}: need 0 < start <= end (or end 0) and step > 0")
    return start, end, step


def _range_arg(start: float, end: float, step: float, integer: bool) -> str:
    fmt = (lambda x: str(int(x))) if integer else (lambda x: f"{x:g}")
    return f"{fmt(start)}:{fmt(end)}:{fmt(step)}"


def range_levels(start: float, end: float, step: float) -> list[float] | None:
    if end == 0:
        return None
    levels, k = [], 0
    while start + k * step <= end + 1e-9:
        levels.append(round(start + k * step, 6))
        k += 1
    return levels


def build_command(model: str, url: str, *, binary: Path | str, csv_path: Path | str, protocol: str = "http",
                  concurrency_range: Range | None = None, request_rate_range: Range | None = None,
                  request_distribution: str | None = None, request_intervals: str | Path | None = None,
                  input_data: str | Path | None = None,
                  shape: Mapping[str, Sequence[int]] | None = None, batch_size: int = 1,
                  measurement_interval_ms: int = 1000, stability_percentage: float | None = None,
                  max_trials: int | None = None, async_mode: bool = False,
                  extra_args: Sequence[str] = ()) -> tuple[list[str], list[float] | None]:
    """The perf_analyzer command line, and the load levels the sweep should report.

    `request_intervals`: a file of gaps between sends, in microseconds, one per line
    (`write_request_intervals`): any arrival process, looped; its one row is reported by the rate it
    achieved, so no level is expected."""
    if protocol not in ("http", "grpc"):
        raise ValueError(f"protocol must be 'http' or 'grpc', got {protocol!r}")
    if sum(x is not None for x in (concurrency_range, request_rate_range, request_intervals)) > 1:
        raise ValueError("give one of concurrency_range, request_rate_range and request_intervals")
    if request_distribution not in (None, "poisson", "constant"):
        raise ValueError(f"request_distribution must be None, 'poisson' or 'constant', got {request_distribution!r}")
    if request_distribution is not None and request_rate_range is None:
        raise ValueError("request_distribution applies only with request_rate_range")
    if "--streaming" in extra_args:
        raise ValueError("--streaming is not supported: dvabatch answers default-mode requests")
    cmd = [str(binary), "-m", model, "-u", url, "-i", protocol, "-b", str(batch_size),
           "--measurement-interval", str(int(measurement_interval_ms)), "-f", str(csv_path), "--verbose-csv"]
    levels: list[float] | None
    if request_intervals is not None:
        cmd += ["--request-intervals", str(request_intervals)]
        levels = None
    elif request_rate_range is not None:
        start, end, step = parse_range(request_rate_range)
        cmd += ["--request-rate-range", _range_arg(start, end, step, integer=False)]
        if request_distribution is not None:
            cmd += ["--request-distribution", request_distribution]
        levels = range_levels(start, end, step)
    else:
        start, end, step = parse_range(concurrency_range if concurrency_range is not None else (1, 4, 1))
        if not all(float(x).is_integer() for x in (start, end, step)):
            raise ValueError(f"a concurrency range takes whole numbers, got {concurrency_range!r}")
        cmd += ["--concurrency-range", _range_arg(start, end, step, integer=True)]
        levels = range_levels(start, end, step)
    if input_data is not None:
        cmd += ["--input-data", str(input_data)]
    for name, dims in (shape or {}).items():
        cmd += ["--shape", f"{name}:{','.join(str(int(d)) for d in dims)}"]
    if stability_percentage is not None:
        cmd += ["-s", f"{stability_percentage:g}"]
    if max_trials is not None:
        if max_trials < 3:
            raise ValueError("max_trials must be >= 3: perf_analyzer judges stability over 3 measurements")
        cmd += ["-r", str(int(max_trials))]
    if async_mode:
        cmd.append("--async")
    cmd += list(extra_args)
    return cmd, levels


def _tail(text: str) -> str:
    return text[-TAIL_CHARS:]


def run_perf_analyzer(model: str, url: str, *, protocol: str = "http", concurrency_range: Range | None = None,
                      request_rate_range: Range | None = None, request_distribution: str | None = None,
                      request_intervals: str | Path | None = None,
                      input_data: str | Path | None = None, shape: Mapping[str, Sequence[int]] | None = None,
                      batch_size: int = 1, measurement_interval_ms: int = 1000,
                      stability_percentage: float | None = None, max_trials: int | None = None,
                      async_mode: bool = False, extra_args: Sequence[str] = (), timeout: float = 600.0,
                      csv_path: str | Path | None = None, install_deps: bool = False) -> PerfResult:
    """Run perf_analyzer once (a sweep over concurrency, default 1:4:1, or over request rate) and parse its CSV.

    `url` is "host:port" of the HTTP or gRPC endpoint matching `protocol`. `input_data` is "zero",
    "random" or a file from `write_input_data`; models with -1 dims need it or `shape`. A
    non-zero exit does not raise: look at `returncode`, `stable`, `missing_levels`, `ok`.
    Raises PerfAnalyzerError when the binary cannot be run or exceeds `timeout` seconds."""
    binary = ensure_system_deps(install=install_deps)
    with tempfile.TemporaryDirectory(prefix="perf_analyzer-") as tmp:
        out = Path(csv_path) if csv_path is not None else Path(tmp) / "report.csv"
        if out.exists():
            out.unlink()
        cmd, levels = build_command(
            model, url, binary=binary, csv_path=out, protocol=protocol, concurrency_range=concurrency_range,
            request_rate_range=request_rate_range, request_distribution=request_distribution,
            request_intervals=request_intervals, input_data=input_data, shape=shape, batch_size=batch_size,
            measurement_interval_ms=measurement_interval_ms, stability_percentage=stability_percentage,
            max_trials=max_trials, async_mode=async_mode, extra_args=extra_args)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=perf_analyzer_env(), timeout=timeout,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as exc:
            out_text = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            raise PerfAnalyzerError(f"perf_analyzer ran past {timeout:.0f}s: {' '.join(cmd)}\n{_tail(out_text)}") from exc
        except OSError as exc:
            raise PerfAnalyzerError(f"cannot run {binary}: {exc}") from exc
        rows = parse_csv(out.read_text()) if out.is_file() else []
        stable = UNSTABLE_MARK not in proc.stdout and UNSTABLE_MARK not in proc.stderr
        return PerfResult(command=cmd, returncode=proc.returncode, stdout_tail=_tail(proc.stdout),
                          stderr_tail=_tail(proc.stderr), rows=rows, expected_levels=levels, stable=stable,
                          csv_path=Path(csv_path) if csv_path is not None else None)


# ----------------------------------------------------------------------------------------------
# command line


def _shape_arg(text: str) -> tuple[str, list[int]]:
    name, sep, dims = text.rpartition(":")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--shape takes name:d1,d2,..., got {text!r}")
    return name, [int(d) for d in dims.split(",")]


def main(argv: Iterable[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in args_in:
        cut = args_in.index("--")
        args_in, extra = args_in[:cut], args_in[cut + 1:]
    parser = argparse.ArgumentParser(prog="python -m perf.load.perf_analyzer", description=__doc__.split("\n\n")[0],
                                     epilog="arguments after -- go to perf_analyzer unchanged")
    parser.add_argument("--model", "-m", required=True)
    parser.add_argument("--url", "-u", required=True, help="host:port of the HTTP or gRPC endpoint")
    parser.add_argument("--protocol", "-i", choices=("http", "grpc"), default="http")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", default=None, help="start:end:step (default 1:4:1)")
    load.add_argument("--request-rate", default=None, help="start:end:step, requests per second")
    parser.add_argument("--poisson", action="store_true", help="Poisson arrivals (with --request-rate)")
    parser.add_argument("--input-data", default=None, help='"zero", "random" or a JSON file')
    parser.add_argument("--shape", action="append", type=_shape_arg, default=[], help="name:d1,d2 for -1 dims")
    parser.add_argument("--batch-size", "-b", type=int, default=1)
    parser.add_argument("--measurement-interval", "-p", type=int, default=1000, help="ms")
    parser.add_argument("--stability", "-s", type=float, default=None, help="percent (perf_analyzer's default 10)")
    parser.add_argument("--max-trials", "-r", type=int, default=None)
    parser.add_argument("--async", dest="async_mode", action="store_true")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--csv", default=None, help="keep perf_analyzer's CSV report here")
    parser.add_argument("--json", default=None, help="write the parsed rows here")
    parser.add_argument("--no-install", action="store_true", help="do not apt-get install libb64-0d if missing")
    args = parser.parse_args(args_in)
    if args.poisson and args.request_rate is None:
        parser.error("--poisson needs --request-rate")
    try:
        result = run_perf_analyzer(
            args.model, args.url, protocol=args.protocol, concurrency_range=args.concurrency,
            request_rate_range=args.request_rate, request_distribution="poisson" if args.poisson else None,
            input_data=args.input_data, shape=dict(args.shape), batch_size=args.batch_size,
            measurement_interval_ms=args.measurement_interval, stability_percentage=args.stability,
            max_trials=args.max_trials, async_mode=args.async_mode, extra_args=extra, timeout=args.timeout,
            csv_path=args.csv, install_deps=not args.no_install)
    except (PerfAnalyzerError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if result.returncode != 0 or not result.rows:
        sys.stdout.write(result.stdout_tail)
        sys.stderr.write(result.stderr_tail)
    print(result.describe())
    if args.json:
        Path(args.json).write_text(json.dumps({
            "command": result.command, "returncode": result.returncode, "stable": result.stable,
            "missing_levels": result.missing_levels,
            "rows": [{k: v for k, v in r.__dict__.items() if k != "raw"} | {"raw": r.raw} for r in result.rows],
        }, indent=2))
    return result.returncode if result.returncode != 0 else (0 if result.ok else 1)


if __name__ == "__main__":
    sys.exit(main())
