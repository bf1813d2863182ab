"""Start and stop the real `tritonserver` that ships in the nvidia-pytriton wheel.

The wheel carries the server binary, the Python backend and one backend stub per Python
version; `TritonServer` assembles a backend directory from the backend and the stub for the
running Python, starts the server on free local ports, waits until it is ready, and stops it
(SIGTERM, then SIGKILL after a grace period). The stub embeds its own libpython, so the
server is given this interpreter's import path: models import dvabatch and its dependencies
from the same environment.

With `watch_stubs`, a `StubWatchdog` thread restarts a model whose stub process died: since
python_backend 24.06 a dead stub is not restarted, every request to the model fails with "Stub
process ... is not healthy" while the model still answers ready, until it is unloaded and
loaded again; the watchdog does exactly that.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import psutil

log = logging.getLogger(__name__)
SHM_DIR = Path("/dev/shm")  # where the Python backend's regions (named in each stub's argv) live
SHM_PREFIX = "triton_python_backend_shm_region_"

class ServerError(RuntimeError):
    """The server could not be started or did not become ready; carries its log's tail."""


class StartCancelled(ServerError):
    """`TritonServer.start` was told to give up (a stop signal while the server was starting)."""


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


def stub_processes(match: Callable[[list[str]], bool]) -> list[int]:
    """Pids of Python-backend stub processes whose command line (argv) `match` accepts."""
    return [proc.info["pid"] for proc in psutil.process_iter(["pid", "cmdline"])
            if (argv := proc.info["cmdline"]) and argv[0].endswith("triton_python_backend_stub") and match(argv)]


@dataclass(frozen=True)
class StubInfo:
    """One Python-backend stub process, read off its command line: the backend starts it as
    `stub <repo>/<model>/<version>/model.py <shm region> <shm size> <growth> <server pid> ... <instance>`."""

    pid: int
    model: str
    version: str
    instance: str
    shm_region: str


def server_stubs(server_pid: int) -> dict[int, StubInfo]:
    """The live stub processes the server `server_pid` started, by pid (a zombie has no command line)."""
    stubs = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        argv = proc.info["cmdline"] or []
        if len(argv) > 8 and argv[0].endswith("triton_python_backend_stub") and argv[5] == str(server_pid):
            model_py = Path(argv[1])
            stubs[proc.info["pid"]] = StubInfo(proc.info["pid"], model_py.parent.parent.name, model_py.parent.name,
                                               argv[8], argv[2])
    return stubs


def children(parent: int) -> list[tuple[int, str, str]]:
    """(pid, name, status) of every process whose parent is `parent` (psutil's names and statuses)."""
    try:
        kids = psutil.Process(parent).children()
    except psutil.Error:
        return []
    found = []
    for kid in kids:
        try:
            found.append((kid.pid, kid.name(), kid.status()))
        except psutil.Error:  # gone in between
            continue
    return found


def is_zombie(pid: int) -> bool:
    """The process exited and its parent has not reaped it (a killed stub stays so until its model unloads)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def zombie_stub_children(parent: int) -> list[int]:
    """Stub processes of `parent` that died unreaped (the kernel keeps 15 characters of a zombie's
    name, and not its command line)."""
    return [pid for pid, name, status in children(parent)
            if status == psutil.STATUS_ZOMBIE and "triton_python_backend_stub".startswith(name)]


def backend_shm_regions() -> set[str]:
    """The Python backend's shared-memory regions in /dev/shm (of every server on the machine)."""
    try:
        return {name for name in os.listdir(SHM_DIR) if name.startswith(SHM_PREFIX)}
    except OSError:
        return set()


def mapped_shm_regions() -> set[str]:
    """Backend regions some live process has mapped (a server or stub that uses it)."""
    marker = f"{SHM_DIR}/{SHM_PREFIX}"
    mapped = set()
    for proc in psutil.process_iter():
        try:
            paths = [m.path for m in proc.memory_maps(grouped=True)]
        except psutil.Error:  # gone, or not ours to read
            continue
        mapped.update(Path(path).name for path in paths if path.startswith(marker))
    return mapped


def remove_shm_regions(names: Sequence[str]) -> list[str]:
    """Unlink the named shared-memory regions that are still there (left by a stub that was killed);
    returns the names removed."""
    removed = []
    for name in names:
        path = SHM_DIR / name
        if name and "/" not in name and path.exists():
            try:
                path.unlink()
                removed.append(name)
            except OSError:
                pass
    return removed


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int, taken: Sequence[int] = ()) -> list[int]:
    """`count` distinct free local ports, none in `taken`: each socket is held open until all are
    picked (ports picked one after another, each closed at once, may be the same one twice: HTTP and
    metrics on one port, and the server refuses to start)."""
    sockets: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < count:
            s = socket.socket()
            sockets.append(s)
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
            if port not in taken:
                ports.append(port)
    finally:
        for s in sockets:
            s.close()
    return ports


def connect_host(host: str) -> str:
    """The address a client on the local host uses for a server bound to `host` (a wildcard address
    is not one to connect to)."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


ModelHook = Callable[[str], None]


class StubWatchdog:
    """One thread that polls the stub processes of a server and restarts a model whose stub died.

    A stub counts as dead when it is a zombie (the backend reaps a stub it stops, not one that was
    killed) or when it is gone and its model version has no stub left, while the model still
    answers READY; seen so on two polls in a row (an instance being replaced by a reload is a
    zombie for a moment at most). Then the model is unloaded at once (readiness turns false),
    `on_model_down(model)` runs, and the model is loaded again, `on_model_recovered(model)`.
    A model unloaded on purpose is not READY by the time its stub exits, so it is left alone.

    What the dead stub held is lost: its in-flight requests are never answered by the server
    (clients need a timeout), and its instance stays UNLOADING until the server exits (`stop`
    then waits Triton's exit timeout for it).
    """

    CONFIRMATIONS = 2  # polls in a row that must see the stub dead

    def __init__(self, server: "TritonServer", interval: float = 0.15, on_model_down: ModelHook | None = None,
                 on_model_recovered: ModelHook | None = None, load_timeout: float = 300.0) -> None:
        self._server = server
        self.interval = interval
        self.on_model_down = on_model_down
        self.on_model_recovered = on_model_recovered
        self._load_timeout = load_timeout
        self.restarts = 0  # models restarted after a stub died
        self.shm_regions: set[str] = set()  # every region a stub of this server used
        self._tracked: dict[int, StubInfo] = {}  # stubs seen alive, by pid
        self._suspects: dict[tuple[str, str], int] = {}  # (model, version) -> polls in a row seen dead
        self._handled: set[int] = set()  # dead stubs restarted already (they stay zombies while their instance lingers)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Look at the stubs once (those of the models loaded at start are known from here on),
        then poll from a thread."""
        self._stop.clear()
        self.poll()
        self._thread = threading.Thread(target=self._loop, name="dvabatch-stub-watchdog", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 600.0) -> None:
        """Stop polling and join the thread (a restart under way finishes its unload, skips its load)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("the stub watchdog did not stop within %.0f s", timeout)
            self._thread = None
        self._tracked.clear()
        self._suspects.clear()
        self._handled.clear()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - the watchdog outlives one bad poll (the server restarting, say)
                log.exception("stub watchdog: a poll failed")

    def poll(self) -> None:
        """One look at the stubs; restarts the model versions whose stub is confirmed dead."""
        pid = self._server.pid
        if pid is None:
            return
        live = server_stubs(pid)
        self.shm_regions.update(info.shm_region for info in live.values())
        dead = self._dead_keys(live) | self._dead_untracked(pid, live)
        self._tracked.update(live)
        self._suspects = {key: self._suspects.get(key, 0) + 1 for key in dead}
        if not dead:
            return
        ready = self._server.ready_versions()
        for key in dead:
            if key not in ready:  # unloaded on purpose, or failed: not ours to restart
                self._forget(key)
            elif self._suspects[key] >= self.CONFIRMATIONS and not self._stop.is_set():
                self._restart(*key)

    def _dead_keys(self, live: Mapping[int, StubInfo]) -> set[tuple[str, str]]:
        """Model versions with a tracked stub that died; stubs replaced by a reload are dropped."""
        alive_keys = {(info.model, info.version) for info in live.values()}
        dead = set()
        for pid, info in list(self._tracked.items()):
            if pid in live:
                continue
            key = (info.model, info.version)
            if is_zombie(pid) or key not in alive_keys:
                dead.add(key)
            else:
                del self._tracked[pid]  # gone and reaped, another stub serves the version: a reload
        return dead

    def _dead_untracked(self, server_pid: int, live: Mapping[int, StubInfo]) -> set[tuple[str, str]]:
        """A stub that died before any poll saw it alive (loaded and killed within one interval) is a
        zombie of unknown model: suspect every READY Python model version with no live stub."""
        known = set(self._tracked) | self._handled
        if not any(pid not in known for pid in zombie_stub_children(server_pid)):
            return set()
        alive_keys = {(info.model, info.version) for info in live.values()}
        repository = self._server.model_repository
        return {key for key in self._server.ready_versions()
                if key not in alive_keys and (repository / key[0] / key[1] / "model.py").is_file()}

    def _forget(self, key: tuple[str, str]) -> None:
        self._tracked = {pid: info for pid, info in self._tracked.items() if (info.model, info.version) != key}
        self._suspects.pop(key, None)

    def _restart(self, model: str, version: str) -> None:
        pids = sorted(pid for pid, info in self._tracked.items() if (info.model, info.version) == (model, version))
        log.warning("stub process %s of model %r version %s died; unloading the model and loading it again",
                    pids, model, version)
        # only until it is not ready: requests the dead stub held are never released (their
        # clients' timeouts end them), and an instance that held some stays UNLOADING until the
        # server exits; the load below makes a new instance beside it
        if not self._server.unload_model(model, timeout=30.0, until_unloaded=False):
            log.error("model %r still READY 30 s after its unload; loading it again anyway", model)
        server_pid = self._server.pid
        self._handled.update(pids + (zombie_stub_children(server_pid) if server_pid is not None else []))
        self._forget((model, version))
        self._call(self.on_model_down, model)
        if self._stop.is_set():  # the server is stopping: leave the model unloaded
            return
        if not self._server.load_model(model, timeout=self._load_timeout):
            log.error("model %r did not load again after its stub died:\n%s", model, self._server.log_tail(20))
            return
        self.restarts += 1
        log.warning("model %r is serving again after its stub died (%d restart(s) so far)", model, self.restarts)
        self._call(self.on_model_recovered, model)

    @staticmethod
    def _call(hook: ModelHook | None, model: str) -> None:
        if hook is None:
            return
        try:
            hook(model)
        except Exception:  # noqa: BLE001 - a hook's failure must not stop the watchdog
            log.exception("stub watchdog: a hook failed for %r", model)


def stub_environment(env: dict[str, str]) -> dict[str, str]:
    """`env` for the server, so that its stubs import what this process imports. The stub's
    interpreter starts isolated: it ignores PYTHONPATH and takes its prefix (stdlib, site-packages)
    from the first `python3` on PATH, which need not be this process's (an activated virtualenv,
    another Python). This interpreter's folder goes first on PATH, and this process's sys.path is
    passed as PYTHONPATH, which the generated `model.py` puts first (`slicer.triton_files.STUB_PATHS`)."""
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and Path(p).exists())
    interpreter = Path(sys.executable).parent
    if (interpreter / "python3").exists():
        env["PATH"] = os.pathsep.join(filter(None, [str(interpreter), env.get("PATH")]))
    return env


class TritonServer:
    def __init__(self, model_repository: str | Path, *, http_port: int | None = None, grpc_port: int | None = None,
                 metrics_port: int | None = None, explicit: bool = False, load: Sequence[str] = (),
                 shm_bytes: int = 64 << 20, extra_args: Sequence[str] = (), log_path: Path | None = None,
                 exit_timeout: int = 2, host: str = "127.0.0.1", watch_stubs: bool = False,
                 stub_poll_interval: float = 0.15, on_model_down: ModelHook | None = None,
                 on_model_recovered: ModelHook | None = None) -> None:
        self.model_repository = Path(model_repository).resolve()
        self.host = host  # the address HTTP, gRPC and metrics listen on (0.0.0.0: every interface)
        given = [p for p in (http_port, grpc_port, metrics_port) if p]
        picked = iter(free_ports(3 - len(given), given))
        self.http_port = http_port or next(picked)
        self.grpc_port = grpc_port or next(picked)
        self.metrics_port = metrics_port or next(picked)
        self._explicit = explicit
        self._load = list(load)
        self._shm_bytes = shm_bytes
        self._extra = list(extra_args)
        # Triton waits this long for open client connections before unloading models on SIGTERM;
        # `stop` waits longer, so models always unload (finalize answers what is in flight)
        self.exit_timeout = exit_timeout
        # a unique name, made by `start` and removed by `stop`: a server never started leaves nothing
        self._work = Path(tempfile.mkdtemp(prefix="dvabatch-triton-"))
        self._work.rmdir()
        self.log_path = log_path or self._work / "tritonserver.log"
        self._process: subprocess.Popen[bytes] | None = None
        self._last_log = ""
        self._shm_at_start: set[str] = set()
        self._exit_code: int | None = None  # what the last stop saw (a later stop returns it again)
        self.watchdog = StubWatchdog(self, stub_poll_interval, on_model_down, on_model_recovered) if watch_stubs else None

    @property
    def http_url(self) -> str:
        return f"{connect_host(self.host)}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{connect_host(self.host)}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{connect_host(self.host)}:{self.metrics_port}/metrics"

    @property
    def pid(self) -> int | None:
        """The server process's pid while it runs."""
        process = self._process
        return process.pid if process is not None and process.poll() is None else None

    @property
    def stub_restarts(self) -> int:
        """Models the stub watchdog restarted because their stub died (0 without the watchdog)."""
        return self.watchdog.restarts if self.watchdog is not None else 0

    def command(self) -> list[str]:
        backends = assemble_backends(self._work / "backends")
        shm = f"python,shm-default-byte-size={self._shm_bytes},shm-growth-byte-size={self._shm_bytes}"
        cmd = [
            str(pytriton_root() / "bin" / "tritonserver"),
            f"--model-repository={self.model_repository}", f"--backend-directory={backends}",
            f"--http-port={self.http_port}", f"--grpc-port={self.grpc_port}", f"--metrics-port={self.metrics_port}",
            f"--http-address={self.host}", f"--grpc-address={self.host}", f"--metrics-address={self.host}",
            "--allow-metrics=true", "--allow-gpu-metrics=false", "--exit-on-error=false", "--strict-readiness=false",
            f"--backend-config={shm}", "--log-info=true", f"--exit-timeout-secs={self.exit_timeout}",
        ]
        # always explicit model control, so that `stop` can unload the models first; without
        # `explicit`, every model of the repository is loaded at start, as in Triton's default mode
        cmd.append("--model-control-mode=explicit")
        cmd += [f"--load-model={name}" for name in self._load] if self._explicit else ["--load-model=*"]
        return cmd + self._extra

    def start(self, timeout: float = 120.0, cancel: threading.Event | None = None) -> "TritonServer":
        """Start the server and wait until it is live (models named to load are loaded by then);
        `cancel`, when set while waiting, stops the server and raises StartCancelled."""
        self._work.mkdir(parents=True, exist_ok=True)  # `stop` removes it: a server may start again
        self._exit_code = None
        self._shm_at_start = backend_shm_regions()
        env = stub_environment(dict(os.environ))
        libs = pytriton_root().parent.parent / "nvidia_pytriton.libs"
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(libs), env.get("LD_LIBRARY_PATH")]))
        env.setdefault("PYTHONUNBUFFERED", "1")
        log_file = open(self.log_path, "wb")
        self._process = subprocess.Popen(self.command(), stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        log_file.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                message = f"tritonserver exited with {self._process.returncode}:\n{self.log_tail()}"
                self.stop()  # its stubs, regions and work folder go too
                raise ServerError(message)
            if self._get("/v2/health/live") == 200:
                if self.watchdog is not None:
                    self.watchdog.start()
                return self
            if cancel is not None and cancel.is_set():
                self.stop()
                raise StartCancelled("stopped while starting")
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

    def ready_versions(self) -> set[tuple[str, str]]:
        """(model, version) of every model version the repository index says is READY."""
        return {(m["name"], str(m.get("version", ""))) for m in self._index() if m.get("state") == "READY"}

    def unload_model(self, name: str, timeout: float = 60.0, until_unloaded: bool = True) -> bool:
        """Unload a model and wait until it is unloaded (or, not `until_unloaded`, until it is no
        longer READY); True when it is."""
        self._post(f"/v2/repository/models/{name}/unload")
        waiting = ("READY", "UNLOADING") if until_unloaded else ("READY",)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not any(m["name"] == name and m.get("state") in waiting for m in self._index()):
                return True
            time.sleep(0.05)
        return False

    def load_model(self, name: str, timeout: float = 300.0) -> bool:
        """Load a model from the repository (Triton answers when the load is done); True when ready."""
        self._post(f"/v2/repository/models/{name}/load", timeout=timeout)
        return self.model_ready(name)

    def _unload_all(self, deadline: float) -> None:
        loaded = [m["name"] for m in self._index() if m.get("state") == "READY"]
        for name in loaded:
            self._post(f"/v2/repository/models/{name}/unload")
        while time.monotonic() < deadline and any(m.get("state") in ("READY", "UNLOADING") for m in self._index()):
            time.sleep(0.05)

    def _index(self) -> list[dict]:
        body = self._post("/v2/repository/index")
        return json.loads(body) if body else []

    def _post(self, path: str, timeout: float = 10.0) -> bytes | None:
        request = urllib.request.Request(f"http://{self.http_url}{path}", data=b"{}", method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
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
        """Unload every model, then SIGTERM, then SIGKILL after `grace` seconds (default: exit
        timeout + 30). Triton unloads a model once the requests it holds are answered and then
        calls its finalize (which answers anything still queued "shutting down" and joins its
        threads): a stop drains what is in flight, for `grace` seconds at most.

        Models are unloaded first because on SIGTERM Triton spends its exit timeout waiting for
        open client connections, and then exits without unloading anything. The stub watchdog
        stops before anything else, so that it takes none of these unloads for a dead stub.
        Shared-memory regions a killed stub left in /dev/shm are removed."""
        grace = self.exit_timeout + 30.0 if grace is None else grace
        if self.watchdog is not None:
            self.watchdog.stop()
        process, code = self._process, self._exit_code
        regions = set(self.watchdog.shm_regions) if self.watchdog is not None else set()
        if process is not None and process.poll() is None:
            regions.update(info.shm_region for info in server_stubs(process.pid).values())
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
        regions.update(self._kill_orphaned_stubs())
        regions.update(self._unused_new_regions())
        left = remove_shm_regions(sorted(regions))
        if left:
            log.warning("removed shared-memory region(s) the server left behind: %s", left)
        self._last_log = self.log_tail(200)
        shutil.rmtree(self._work, ignore_errors=True)  # backends and default log: nothing left behind
        self._exit_code = code
        return code

    def _unused_new_regions(self) -> set[str]:
        """Regions made while the server ran that nobody maps now: a stub that died before anyone
        saw its command line (a stop while a model loads) leaves one whose name was never known.
        Other servers' regions are mapped by them, so they stay."""
        if self._process is not None and self._process.poll() is None:
            return set()
        return (backend_shm_regions() - self._shm_at_start) - mapped_shm_regions()

    def _kill_orphaned_stubs(self) -> set[str]:
        """Backend stubs outlive a server that was killed hard (and ignore SIGTERM): kill ours;
        returns the shared-memory regions they used."""
        marker = str(self._work / "backends")
        regions = set()
        for proc in psutil.process_iter(["cmdline"]):
            argv = proc.info["cmdline"] or []
            if argv and argv[0].endswith("triton_python_backend_stub") and any(marker in a for a in argv):
                regions.add(argv[2] if len(argv) > 2 else "")
                try:
                    proc.kill()
                except psutil.Error:
                    pass
        return regions

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
