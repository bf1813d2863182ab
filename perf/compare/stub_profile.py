"""Where a served model's time goes: py-spy over the model's backend stub while a load runs.

Triton runs each Python-backend model instance in a process of its own
(`triton_python_backend_stub`, its command line naming the model's folder); py-spy's
`--subprocesses` does not reach it through the tritonserver binary, so each stub is found by
its command line (psutil) and sampled by pid: every thread, idle ones too (a thread waiting on the
device or a lock is where latency goes), raw stacks into OUT/PHASE.LABEL.txt.
"""
from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path

import psutil

RATE_HZ = 200


def stub_pids(model: str) -> list[int]:
    """The backend stubs serving `model` (an argument of theirs names its folder)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        argv = proc.info["cmdline"] or []
        if argv and "triton_python_backend_stub" in argv[0] and any(f"/{model}/" in a for a in argv[1:]):
            found.append(proc.pid)
    return found


def py_spy() -> str | None:
    return shutil.which("py-spy")


@contextlib.contextmanager
def profiled_stubs(models: Mapping[str, str], out: Path | None, phase: str) -> Iterator[None]:
    """py-spy over each of `models`' stubs ({label: model name}) for the body's duration; nothing
    where `out` is None or py-spy is not installed."""
    program = py_spy()
    if out is None or program is None:
        yield
        return
    out.mkdir(parents=True, exist_ok=True)
    spies = []
    for label, model in models.items():
        for pid in stub_pids(model):
            spies.append(subprocess.Popen(
                [program, "record", "-p", str(pid), "-r", str(RATE_HZ), "--idle", "--threads", "--nonblocking", "-f", "raw",
                 "-o", str(out / f"{phase}.{label}.txt")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    try:
        yield
    finally:
        for spy in spies:  # py-spy writes what it sampled on an interrupt
            spy.send_signal(signal.SIGINT)
        for spy in spies:
            try:
                spy.wait(timeout=20)
            except subprocess.TimeoutExpired:
                spy.kill()
