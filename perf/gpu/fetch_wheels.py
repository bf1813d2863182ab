"""Download the wheels the GPU machine needs (perf/gpu/wheels.txt) into work/wheels/ (ignored by git).

    python -m perf.gpu.fetch_wheels [--dest work/wheels]

The GPU machine runs Python 3.12 on x86-64 and reaches no network, so the wheels are fetched here
for that interpreter (pip download --only-binary=:all: --python-version 3.12 ... --no-deps: each
wheel's own needs are already on the machine) and travel in the working tree (`carry`).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WHEELS_TXT = REPO / "perf" / "gpu" / "wheels.txt"
DEFAULT_DEST = REPO / "work" / "wheels"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")


def requirements(path: Path = WHEELS_TXT) -> list[str]:
    """The pinned requirements (NAME==VERSION) of wheels.txt, comments and blank lines left out."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    specs = [line for line in lines if line]
    for spec in specs:
        if "==" not in spec:
            raise ValueError(f"{path}: {spec!r} is not pinned (NAME==VERSION)")
    return specs


def download_command(specs: list[str], dest: Path) -> list[str]:
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
            "--implementation", "cp", *platforms, "--dest", str(dest), *specs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=DEFAULT_DEST)
    args = parser.parse_args(argv)
    args.dest.mkdir(parents=True, exist_ok=True)
    command = download_command(requirements(), args.dest)
    print(" ".join(command), flush=True)
    return subprocess.call(command)


if __name__ == "__main__":
    raise SystemExit(main())
