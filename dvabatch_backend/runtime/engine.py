"""Stage engines: run one stage on views of the preallocated buffers.

The protocol is one method, `run(inputs, outputs)`: both are dicts of C-contiguous arrays
whose shapes are the actual ones (rows of the batch, padded length). The engine writes its
results into `outputs` in place.

Threads (onnxruntime): a stage session either has its own intra-op pool (`thread_pool
"per_stage"`, `threads` threads each; served, every core each, the stages in turn) or uses the
process's one global pool (`"global"`): a lone stage then runs on every core, and stages running at
the same time share them.
onnxruntime makes the global pool once per process (`set_global_thread_pool_sizes`, which takes
sizes only: no spin setting, and per-session `allow_spinning` entries do not reach it), so
`use_global_thread_pool` makes it the first time and reports the size in effect afterwards;
spin-waiting is bounded by `session.force_spinning_stop`: the pool's threads stop spinning as soon
as a run returns.

Spinning (`SPINNING`, per-stage pools): onnxruntime's threads spin-wait for work by default, before
and after a run. Within a run that saves each parallel operator a thread wake-up, which a small
stage's run feels; after it, the spin only takes the cores from the server, the clients and the
next stage. The runtime's engines spin within a run and stop when it returns (`IN_RUN`: allowed,
and `session.force_spinning_stop`); `OFF` never spins, `ON` is onnxruntime's own default (the
baselines serve both as a user's would).
"""
from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Mapping, Protocol

import numpy as np

log = logging.getLogger(__name__)

PER_STAGE, GLOBAL = "per_stage", "global"
THREAD_POOLS = (PER_STAGE, GLOBAL)
IN_RUN, OFF, ON = "in_run", "off", "on"  # onnxruntime's threads spin-wait for work (module docstring)
SPINNING = (IN_RUN, OFF, ON)


class StageEngine(Protocol):
    def run(self, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
        ...


def available_cores() -> int:
    """The cores this process may run on (its affinity, not the machine's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


_global_pool_lock = threading.Lock()
_global_pool_threads: int | None = None  # the size of the global pool once this process made it


def use_global_thread_pool(threads: int | None = None) -> int:
    """Make onnxruntime's global intra-op pool (`threads`, default every available core) unless this
    process already has one; return the size in effect. A second call asking another size gets the
    first size (onnxruntime cannot replace the pool) and a warning."""
    global _global_pool_threads
    wanted = threads or available_cores()
    with _global_pool_lock:
        if _global_pool_threads is None:
            from onnxruntime.capi import _pybind_state

            try:
                _pybind_state.set_global_thread_pool_sizes(wanted, 1)
            except Exception as exc:  # made by someone else in this process: its size is unknown
                if "already been created" not in str(exc):
                    raise
                log.warning("onnxruntime's global thread pool was made outside dvabatch; its size stays")
            _global_pool_threads = wanted
        elif _global_pool_threads != wanted:
            log.warning("onnxruntime's global thread pool has %d threads; %d asked for later is ignored",
                        _global_pool_threads, wanted)
        return _global_pool_threads


def ort_session_options(threads: int, thread_pool: str = PER_STAGE, spinning: str = OFF) -> "object":
    """Session options for engines that share a few cores: either `threads` threads of the
    session's own (`per_stage`), spin-waiting for work as `spinning` says (module docstring), or the
    global pool (`global`: `threads` is the pool's size when this makes it, 0 every core; its
    threads stop spinning when a run returns)."""
    import onnxruntime as ort

    if thread_pool not in THREAD_POOLS:
        raise ValueError(f"thread_pool must be one of {THREAD_POOLS}, got {thread_pool!r}")
    if spinning not in SPINNING:
        raise ValueError(f"spinning must be one of {SPINNING}, got {spinning!r}")
    options = ort.SessionOptions()
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 3
    if thread_pool == PER_STAGE and _global_pool_threads is not None:
        # onnxruntime refuses a session with threads of its own once the process has the global pool
        log.debug("this process has onnxruntime's global thread pool: a per-stage session uses it too")
        thread_pool = GLOBAL
    if thread_pool == GLOBAL:
        use_global_thread_pool(threads or None)
        options.use_per_session_threads = False
        # the global pool ignores the allow_spinning entries: unless it may spin on, stop its
        # spinning when a run returns
        if spinning != ON:
            options.add_session_config_entry("session.force_spinning_stop", "1")
        return options
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    if spinning == IN_RUN:
        options.add_session_config_entry("session.force_spinning_stop", "1")
    elif spinning == OFF:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return options


class OrtStageEngine:
    """onnxruntime on the CPU provider, with I/O bound directly onto the buffers.

    Buffers are preallocated and the runtime hands the same view dicts for the same rows, so a
    binding made once per (inputs, outputs) pair is reused: binding costs more than a small
    stage runs. Used by one executor thread at a time. `thread_pool` (module docstring): "per_stage"
    gives the session `threads` threads of its own; "global" runs it on the process's shared pool.
    """

    _CACHED_BINDINGS = 512

    def __init__(self, path: str | Path, threads: int = 1, providers: tuple[str, ...] = ("CPUExecutionProvider",),
                 thread_pool: str = PER_STAGE, spinning: str = IN_RUN) -> None:
        import onnxruntime as ort

        self.path = Path(path)
        options = ort_session_options(threads, thread_pool, spinning)
        self._session = ort.InferenceSession(str(path), options, providers=list(providers))
        # keyed by the dicts' ids; each entry keeps its dicts alive so an id cannot be reused
        self._bindings: OrderedDict[tuple[int, int], tuple[Any, Any, Any]] = OrderedDict()

    def run(self, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
        key = (id(inputs), id(outputs))
        entry = self._bindings.get(key)
        if entry is None or entry[0] is not inputs or entry[1] is not outputs:
            entry = (inputs, outputs, self._bind(inputs, outputs))
            self._bindings[key] = entry
            if len(self._bindings) > self._CACHED_BINDINGS:
                self._bindings.popitem(last=False)
        self._session.run_with_iobinding(entry[2])

    def _bind(self, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> Any:
        binding = self._session.io_binding()
        for name, arr in inputs.items():
            binding.bind_input(name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)
        for name, arr in outputs.items():
            binding.bind_output(name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)
        return binding
