"""Download the wheels the GPU machine needs (perf/gpu/wheels.txt) into work/wheels/ (ignored by git).

    python -m perf.gpu.fetch_wheels [--dest work/wheels] [--no-server-bundle]

The GPU machine runs Python 3.12 on x86-64 and reaches no network, so the wheels are fetched here
for that interpreter (pip download --only-binary=:all: --python-version 3.12 ... --no-deps: each
wheel's own needs are already on the machine) and travel in the working tree (`carry`).

Beside them, the real Triton server as the device runs it (perf.gpu.serve_check),
`tritonserver-bundle.tar.gz`, unpacked there into the import path: the nvidia-pytriton wheel's
`tritonserver` (installed here) with only the Python 3.12 backend stub, its libraries without the
other Pythons' libpython, the `tritonclient` package, and python-rapidjson for 3.12 (the gRPC
client imports it; the machine has grpcio and protobuf). About 40 MiB of the 64 a call carries.
And in `stub-site/`, the numpy the package requires (setup.py: below 2; `STUB_NUMPY`, 17 MiB), which the
device installs apart, for the backend stubs alone (`run_device.STUB_SITE`): the machine's numpy is 2,
under which the stub builds each response tensor by DLPack at about 110 us a tensor against 4 us by numpy
(timed in a stub here), where a user's install of this package serves with numpy 1.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WHEELS_TXT = REPO / "perf" / "gpu" / "wheels.txt"
DEFAULT_DEST = REPO / "work" / "wheels"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
SERVER_BUNDLE = "tritonserver-bundle.tar.gz"
DEVICE_PYTHON = "3.12"
RAPIDJSON = "python-rapidjson==1.25"
STUB_NUMPY = "numpy==1.26.4"
STUB_SITE_DIR = "stub-site"


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


def _bundled(path: Path, root: Path) -> bool:
    """What the bundle leaves out of the pytriton install: other Pythons' stubs and libpython, caches."""
    rel = path.relative_to(root).parts
    if "__pycache__" in rel:
        return False
    if "python_backend_stubs" in rel and len(rel) > rel.index("python_backend_stubs") + 1:
        return rel[rel.index("python_backend_stubs") + 1] == DEVICE_PYTHON
    return not (rel[0].endswith(".libs") and path.name.startswith("libpython3"))


def server_bundle(dest: Path) -> Path:
    """dest/tritonserver-bundle.tar.gz: the server, its libraries, the client, rapidjson (see above)."""
    import pytriton
    import tritonclient

    site = Path(pytriton.__file__).parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.check_call(download_command([RAPIDJSON], Path(tmp)))
        bundle = dest / SERVER_BUNDLE
        with tarfile.open(bundle, "w:gz") as tar:
            for top in (site / "pytriton" / "tritonserver", site / "nvidia_pytriton.libs",
                        Path(tritonclient.__file__).parent):
                for path in sorted(top.rglob("*")):
                    if path.is_file() and _bundled(path, site):
                        tar.add(path, arcname=str(path.relative_to(site)))
            marker = Path(tmp) / "__init__.py"  # `import pytriton` finds the server; its client is not carried
            marker.write_text('"""The nvidia-pytriton wheel\'s tritonserver, carried without its Python client."""\n')
            tar.add(marker, arcname="pytriton/__init__.py")
            import zipfile

            for wheel in Path(tmp).glob("*.whl"):
                with zipfile.ZipFile(wheel) as z:
                    z.extractall(Path(tmp) / "rapidjson")
            for path in sorted((Path(tmp) / "rapidjson").rglob("*")):
                if path.is_file():
                    tar.add(path, arcname=str(path.relative_to(Path(tmp) / "rapidjson")))
    return bundle


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=DEFAULT_DEST)
    parser.add_argument("--no-server-bundle", dest="server_bundle", action="store_false",
                        help="only the wheels (no tritonserver-bundle.tar.gz)")
    args = parser.parse_args(argv)
    args.dest.mkdir(parents=True, exist_ok=True)
    command = download_command(requirements(), args.dest)
    print(" ".join(command), flush=True)
    code = subprocess.call(command)
    if code == 0:
        (args.dest / STUB_SITE_DIR).mkdir(exist_ok=True)
        code = subprocess.call(download_command([STUB_NUMPY], args.dest / STUB_SITE_DIR))
    if code == 0 and args.server_bundle:
        bundle = server_bundle(args.dest)
        print(f"{bundle}: {bundle.stat().st_size / 2**20:.1f} MiB", flush=True)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
