"""Start and stop the real `tritonserver` that ships in the nvidia-pytriton wheel.

The wheel carries the server binary, the Python backend and one backend stub per Python
version; `TritonServer` assembles a backend directory from the backend and the stub for the
running Python, starts the server on free local ports, waits until it is ready, and stops it
(SIGTERM, then SIGKILL after a grace period). The stub embeds its own libpython, so the
server is given this interpreter's import path: models import dvabatch and its dependencies
from the same environment.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np


class ServerError(RuntimeError):
    """The server could not be started or did not become ready; carries its log's tail."""


def pytriton_root() -> Path:
    try:
        import pytriton
    except ImportError as exc:
        raise ServerError("the nvidia-pytriton wheel is not installed (pip install nvidia-pytriton==0.7.0)") from exc
    root = Path(pytriton.__file__).parent / "tritonserver"
    if not (root / "bin" / "tritonserver").is_file():
        raise ServerError(f"no tritonserver binary under {root}")
    return root


def assemble_backends(target: Path) -> Path:
    """A backend directory with the Python backend and this Python's stub; returns it."""
    root = pytriton_root()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise ServerError(f"the wheel has no Python backend stub for Python {version}")
    python_dir = target / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    # links, not copies: the binaries find the wheel's bundled libraries relative to where they lie
    for item in (root / "backends" / "python").iterdir():
        if item.is_file():
            _link(item, python_dir / item.name)
    _link(stub, python_dir / "triton_python_backend_stub")
    return target


def _link(source: Path, link: Path) -> None:
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(source)


def stub_processes(match: Callable[[list[bytes]], bool]) -> list[int]:
    """Pids of Python-backend stub processes whose command line (argv as bytes) `match` accepts."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[0].endswith(b"triton_python_backend_stub") and match(argv):
            pids.append(int(entry))
    return pids


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class TritonServer:
    def __init__(self, model_repository: str | Path, *, http_port: int | None = None, grpc_port: int | None = None,
                 metrics_port: int | None = None, explicit: bool = False, load: Sequence[str] = (),
                 shm_bytes: int = 64 << 20, extra_args: Sequence[str] = (), log_path: Path | None = None,
                 exit_timeout: int = 2) -> None:
        self.model_repository = Path(model_repository).resolve()
        self.http_port = http_port or free_port()
        self.grpc_port = grpc_port or free_port()
        self.metrics_port = metrics_port or free_port()
        self._explicit = explicit
        self._load = list(load)
        self._shm_bytes = shm_bytes
        self._extra = list(extra_args)
        # Triton waits this long for open client connections before unloading models on SIGTERM;
        # `stop` waits longer, so models always unload (finalize answers what is in flight)
        self.exit_timeout = exit_timeout
        self._work = Path(tempfile.mkdtemp(prefix="dvabatch-triton-"))
        self.log_path = log_path or self._work / "tritonserver.log"
        self._process: subprocess.Popen[bytes] | None = None
        self._last_log = ""

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def command(self) -> list[str]:
        backends = assemble_backends(self._work / "backends")
        shm = f"python,shm-default-byte-size={self._shm_bytes},shm-growth-byte-size={self._shm_bytes}"
        cmd = [
            str(pytriton_root() / "bin" / "tritonserver"),
            f"--model-repository={self.model_repository}", f"--backend-directory={backends}",
            f"--http-port={self.http_port}", f"--grpc-port={self.grpc_port}", f"--metrics-port={self.metrics_port}",
            "--allow-metrics=true", "--allow-gpu-metrics=false", "--exit-on-error=false", "--strict-readiness=false",
            f"--backend-config={shm}", "--log-info=true", f"--exit-timeout-secs={self.exit_timeout}",
        ]
        # always explicit model control, so that `stop` can unload the models first; without
        # `explicit`, every model of the repository is loaded at start, as in Triton's default mode
        cmd.append("--model-control-mode=explicit")
        cmd += [f"--load-model={name}" for name in self._load] if self._explicit else ["--load-model=*"]
        return cmd + self._extra

    def start(self, timeout: float = 120.0) -> "TritonServer":
        self._work.mkdir(parents=True, exist_ok=True)  # `stop` removes it: a server may start again
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and Path(p).exists())
        libs = pytriton_root().parent.parent / "nvidia_pytriton.libs"
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(libs), env.get("LD_LIBRARY_PATH")]))
        env.setdefault("PYTHONUNBUFFERED", "1")
        log = open(self.log_path, "wb")
        self._process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise ServerError(f"tritonserver exited with {self._process.returncode}:\n{self.log_tail()}")
            if self._get("/v2/health/live") == 200:
                return self
            time.sleep(0.1)
        self.stop()
        raise ServerError(f"tritonserver did not become live within {timeout:.0f}s:\n{self.log_tail()}")

    def exited(self) -> bool:
        return self._process is None or self._process.poll() is not None

    def model_ready(self, name: str) -> bool:
        return self._get(f"/v2/models/{name}/ready") == 200

    def wait_model_ready(self, name: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.model_ready(name):
                return
            if self._process is not None and self._process.poll() is not None:
                break
            time.sleep(0.1)
        raise ServerError(f"model {name!r} did not become ready within {timeout:.0f}s:\n{self.log_tail()}")

    def _unload_all(self, deadline: float) -> None:
        loaded = [m["name"] for m in self._index() if m.get("state") == "READY"]
        for name in loaded:
            self._post(f"/v2/repository/models/{name}/unload")
        while time.monotonic() < deadline and any(m.get("state") in ("READY", "UNLOADING") for m in self._index()):
            time.sleep(0.05)

    def _index(self) -> list[dict]:
        body = self._post("/v2/repository/index")
        return json.loads(body) if body else []

    def _post(self, path: str) -> bytes | None:
        request = urllib.request.Request(f"http://{self.http_url}{path}", data=b"{}", method="POST")
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.read()
        except OSError:
            return None

    def _get(self, path: str) -> int | None:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}{path}", timeout=2) as response:
                return int(response.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)
        except OSError:
            return None

    def stop(self, grace: float | None = None) -> int | None:
        """Unload every model (each model's finalize answers what is in flight and joins its
        threads), then SIGTERM, then SIGKILL after `grace` seconds (default: exit timeout + 30).

        Models are unloaded first because on SIGTERM Triton spends its exit timeout waiting for
        open client connections, and then exits without unloading anything."""
        grace = self.exit_timeout + 30.0 if grace is None else grace
        process, code = self._process, None
        if process is not None and process.poll() is None:
            self._unload_all(deadline=time.monotonic() + grace)
        self._process = None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                code = process.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                code = process.wait()
        elif process is not None:
            code = process.returncode
        self._kill_orphaned_stubs()
        self._last_log = self.log_tail(200)
        shutil.rmtree(self._work, ignore_errors=True)  # backends and default log: nothing left behind
        return code

    def _kill_orphaned_stubs(self) -> None:
        """Backend stubs outlive a server that was killed hard (and ignore SIGTERM): kill ours."""
        marker = str(self._work / "backends").encode()
        for pid in stub_processes(lambda argv: any(marker in a for a in argv)):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def log_tail(self, lines: int = 40) -> str:
        """The end of the server's log (after `stop`, what it was when the server stopped)."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "\n".join(self._last_log.splitlines()[-lines:]) if self._last_log else "(no log)"

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def infer_inputs(client_module: Any, query: Mapping[str, np.ndarray], add_batch_dim: bool = True) -> list[Any]:
    """A request's inputs for `tritonclient.http` or `tritonclient.grpc` (`client_module`): one
    query's arrays sent as one row (`add_batch_dim`), or arrays that already have their batch dim."""
    from tritonclient.utils import np_to_triton_dtype

    inputs = []
    for name, arr in query.items():
        batch = np.ascontiguousarray(arr[None] if add_batch_dim else arr)
        tensor = client_module.InferInput(name, list(batch.shape), np_to_triton_dtype(batch.dtype))
        tensor.set_data_from_numpy(batch)
        inputs.append(tensor)
    return inputs
