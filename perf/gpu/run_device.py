"""The GPU suite as steps, one command each on a GPU host: plan them here, run each there.

The GPU host is any machine with a CUDA device and the repository's working tree: one at hand, or
a remote one reached through a job runner with limits. The plan is checked against a runner's
limits, kept as constants below: a time limit per command (`CALL_LIMIT_S`), a total time budget
with machine starts included (`DEVICE_BUDGET_S`, `START_S`), a size limit on what a command
sends (`TRANSFER_LIMIT`: the working tree plus the carried paths), a length limit on one command
(`COMMAND_LIMIT`), and the files a command may bring back (`OUT_FILES` plain files from $OUT, each
at most `OUT_FILE_LIMIT`).

Here (no GPU):

    python -m perf.gpu.fetch_wheels          # the wheels of perf/gpu/wheels.txt -> work/wheels/
    python -m perf.gpu.run_device --dry-run  # every call printed and checked; exit 1 on a problem

There (on the GPU host, in the repository root with work/wheels carried, once per call the dry run
prints; perf/README.md lists them):

    python3 -m pip install ... --target /tmp/site work/wheels/*.whl; export PYTHONPATH=/tmp/site:$PWD
    python3 -m perf.gpu.run_device step gpu --out $OUT
    python3 -m perf.gpu.run_device step experiments --out $OUT

The total budget counts one call with its machine start: the one step not marked `rerun`. A step
marked `rerun` is a further call, made where the budget has room for it (`step NAME --seconds S`
fits a step to a shorter call).

Steps:
- `handoff` (the call the budget counts): BERT-base sliced on the GPU as a user slices it,
  served beside ZeroBatch and DelayBatch with the adapter's hand-off of calls and without it
  (`sync`), each one's sustained rate, the stubs under py-spy;
- `resnet`: ResNet-152 at the paper's size sliced on the GPU and served the same way;
- `slice`: `dvabatch slice --device cuda` on BERT-base and ResNet-152, then the GPU-sliced
  BERT-base served;
- `standin`: the stand-in's device profile and the side by side it is judged against, in one call;
- `served`: the stand-in's device profile measured on the GPU host (perf.gpu.device_profile),
  then BERT-base sliced and served with the Docker image's GPU config beside ZeroBatch and
  DelayBatch on the same engine (perf.compare --device cuda), every process of the server under
  py-spy;
- `diagnose`: the default config beside the load policy and ZeroBatch, each stub under py-spy:
  where the served path's time goes;
- `confirm`: the served comparison with the baselines answering, both stubs under py-spy;
- `gpu`: nvidia-smi and the versions in use, then the GPU test module (tests/gpu: the torch
  engine on CUDA against onnxruntime, CUDA graphs, the fence, the property test on CUDA, the
  overlap check) with the runtime's own property test and the fence plumbing tests beside it (on
  the host's CPU, with its own numpy and onnx), the overlap figure (perf.gpu.overlap), the real
  server (perf.gpu.serve_check), and DVABatch beside ZeroBatch on the torch engine on CUDA
  (perf.gpu.side_by_side);
- `experiments`: the GPU tests, the real server, and DVABatch beside ZeroBatch with one buffer
  pair and two and with `load`'s first stage running ahead of the device.

A step runs its commands one after another in the repository root, each with what is left of the
step's time, every line of output echoed and kept; then it collects into OUT at most `OUT_FILES`
plain files (no folders): STEP.log (every command's output), the figures and JSON, junit XML, and
STEP-raw.tar.gz of everything else the step wrote (models left out).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from perf.gpu.fetch_wheels import DEFAULT_DEST, REPO, STUB_SITE_DIR, WHEELS_TXT, requirements

MiB = 1 << 20
TRANSFER_LIMIT = 64 * MiB  # what a runner sends per call: the working tree plus carried paths
COMMAND_LIMIT = 2000  # characters of one runner command
CALL_LIMIT_S = 600  # a runner's time limit for one command
DEVICE_BUDGET_S = 15 * 60  # the total time budget of a run of the suite, machine starts included
START_S = 120  # a fresh GPU host's start, counted against the budget per call
# the real tritonserver, carried beside the wheels (it is not a wheel the GPU host's pip could take):
# the nvidia-pytriton wheel's server with the stub of the GPU host's Python, its libraries, the
# tritonclient package and protobuf 4 (python -m perf.gpu.fetch_wheels --server-bundle)
SERVER_BUNDLE = "tritonserver-bundle.tar.gz"
OUT_FILES = 8  # files a runner brings back from $OUT
OUT_FILE_LIMIT = 16 * MiB  # the largest file a runner brings back
PY = "python3"  # the GPU host's interpreter, the one with torch
WORK = "/tmp/dvabatch-gpu"  # where a step writes before collecting into OUT

ENV_REPORT = ("import json, sys, torch, numpy, onnx, onnxruntime, hypothesis; print(json.dumps({"
              "'python': sys.version.split()[0], 'torch': torch.__version__, 'cuda': torch.version.cuda, "
              "'gpu': torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "
              "'numpy': numpy.__version__, 'onnx': onnx.__version__, 'onnxruntime': onnxruntime.__version__, "
              "'hypothesis': hypothesis.__version__}, indent=1))")


@dataclass(frozen=True)
class Step:
    """One call's work on the GPU host: commands (argv; "{out}" and "{work}" filled in), the
    repository files they name, and the time the call is given."""

    name: str
    timeout_s: int
    commands: tuple[tuple[str, ...], ...]
    needs: tuple[str, ...]
    # a further call, made only where the total budget has room for it after the first: not
    # counted in the plan's budget
    rerun: bool = False


def capped(seconds: int, *argv: str) -> tuple[str, ...]:
    """argv under coreutils' `timeout`: a hung command costs its own cap, not the call."""
    return ("timeout", "-k", "5", str(seconds), *argv)


PY_SPY = "/tmp/site/bin/py-spy"  # the carried py-spy wheel's program, once installed there


def profiled(out: str, *argv: str, subprocesses: bool = False) -> tuple[str, ...]:
    """argv under py-spy (raw stacks of every thread into `out`, 50 samples a second; with
    `subprocesses`, of its child processes too: the tritonserver's backend stubs), or alone where
    py-spy cannot run: the figures come back either way."""
    plain = shlex.join(argv)
    children = " --subprocesses" if subprocesses else ""
    return ("bash", "-c", f"if {PY_SPY} --version >/dev/null 2>&1; then exec {PY_SPY} record -r 50 --nonblocking"
            f"{children} -f raw -o {out} -- {plain}; else exec {plain}; fi")


def sliced_bert(seconds: int, slice_args: str) -> tuple[str, ...]:
    """The zoo's BERT-base at its real size, exported and sliced on the GPU host (`dvabatch slice` with
    `slice_args`, bs_max 16, lengths to 128) into {work}/repo/bert_base, capped."""
    return capped(seconds, "bash", "-c", f"{PY} -m dvabatch_backend.tools.cli zoo bert --size real --out {{work}}/bert.onnx && "
                  f"{PY} -m dvabatch_backend.tools.cli slice {{work}}/bert.onnx {slice_args} --bs-max 16 --max-length 128 "
                  "--repeats 3 --out {work}/repo/bert_base")


STUB_SITE = "/tmp/stub-site"  # the carried numpy 1 (fetch_wheels.STUB_NUMPY), for the backend stubs alone
# whether the stubs can serve with it: what a stub imports (the runtime, onnx, onnxruntime), and the
# torch engine's numpy bridge to CUDA
STUB_SITE_CHECK = ('import numpy, torch, onnx, onnxruntime, dvabatch_backend.runtime.loading; '
                   'assert numpy.__version__ < "2", numpy.__version__; '
                   'torch.from_numpy(numpy.ones(2, "float32")).cuda().cpu().numpy()')


def served_model(seconds: int, compare_args: str, model: str = "bert_base") -> tuple[str, ...]:
    """{work}/repo/MODEL (BERT-base unless named) served on the GPU beside the baselines
    (`perf.compare --device cuda`, 1,000 queries a load, 2 rounds, `compare_args`), the carried
    py-spy on the PATH, capped. The backend stubs import numpy from `STUB_SITE` first, as a user's
    install of this package serves (numpy below 2), where it works with the machine's torch; else
    the machine's numpy 2, and the log says which."""
    check = f"PYTHONPATH={STUB_SITE}:$PYTHONPATH {PY} -c {shlex.quote(STUB_SITE_CHECK)}"
    return capped(seconds, "bash", "-c", f"STUB=; if {check}; then STUB='--stub-site {STUB_SITE}'; fi; "
                  f"echo \"backend stubs: ${{STUB:-numpy of the machine}}\"; "
                  f"PATH=/tmp/site/bin:$PATH {PY} -m perf.compare --model-dir {{work}}/repo/{model} "
                  f"--device cuda --queries 1000 --rounds 2 {compare_args} $STUB --out {{work}}/served")


def sliced_resnet152(seconds: int) -> tuple[str, ...]:
    """ResNet-152 at the paper's size (224x224, 1000 classes: the zoo's `full`) sliced on the
    device (`--device cuda --stages auto`, bs_max 16) into {work}/repo/resnet152, timed, capped."""
    return capped(seconds, "bash", "-c", f"{PY} -m dvabatch_backend.tools.cli zoo resnet152 --size full --out {{work}}/r152.onnx && "
                  f"time {PY} -m dvabatch_backend.tools.cli slice {{work}}/r152.onnx --device cuda --stages auto "
                  "--bs-max 16 --repeats 3 --out {work}/repo/resnet152")


# The total budget (`DEVICE_BUDGET_S`) holds one machine start and one full call: the one step not
# marked `rerun`. The others are further calls, each made where the budget has room for it.
STEPS: tuple[Step, ...] = (
    # the call the budget counts: BERT-base sliced on the GPU as a user slices it, served beside
    # ZeroBatch and DelayBatch with the adapter's hand-over of calls to the engine loop and without it
    # (`sync`: hand_off_calls=false), each one's sustained rate (issue 41, item 2); the stubs under
    # py-spy
    Step("handoff", 560, (
        capped(20, "nvidia-smi"),
        sliced_bert(200, "--device cuda --stages auto --candidates 2,4"),
        served_model(340, "--loads 0.25,0.6,0.9 --delays 500 --variant sync:hand_off_calls=false "
                     "--sustained DVABatch,sync,ZeroBatch,DelayBatch-0.5ms --py-spy DVABatch,ZeroBatch"),
    ), needs=("dvabatch_backend/runtime/engine_loop.py", "perf/compare/on_device.py", "slicer/serving_engine.py")),
    # ResNet-152 at the paper's size (224x224, not the zoo's CPU size of width 16 at 64x64) sliced
    # on the GPU and served as sliced beside ZeroBatch and DelayBatch, with the hand-off of calls
    # and without it (`sync`: the hand-off's input copies compete for the host's cores, the more so
    # the larger the inputs); `standin` after it measures the engine's host time per run
    # (`host_run_s`)
    Step("resnet", 420, (
        capped(20, "nvidia-smi"),
        sliced_resnet152(180),
        served_model(190, "--loads 0.25,0.6,0.9 --delays 500,2000 --variant sync:hand_off_calls=false "
                     "--py-spy DVABatch,ZeroBatch", model="resnet152"),
    ), needs=("slicer/serving_engine.py", "slicer/zoo/__init__.py", "perf/compare/on_device.py"), rerun=True),
    # `dvabatch slice --device cuda` on BERT-base and ResNet-152 (the stage count and buffer pairs
    # measured on the GPU; its time), then the GPU-sliced BERT-base served beside ZeroBatch and
    # DelayBatch on the same engine
    Step("slice", 585, (
        capped(20, "nvidia-smi"),
        sliced_bert(280, "--device cuda --stages auto --candidates 2,3,4"),
        sliced_resnet152(100),
        served_model(160, "--loads 0.25,0.6,0.9 --delays 500 --py-spy DVABatch,ZeroBatch"),
    ), needs=("slicer/serving_engine.py", "slicer/gpu_config.py", "perf/compare/on_device.py",
              "perf/compare/stub_profile.py", "perf/baselines/model.py"), rerun=True),
    # the stand-in's check (issue 40, item 3), from one call on one GPU host: its device profile (the
    # stages and the unsliced model, timed together) and the side by side it is judged against, back
    # to back, since profiles taken apart can disagree on the same stages
    Step("standin", 420, (
        capped(20, "nvidia-smi"),
        capped(110, PY, "-m", "perf.gpu.device_profile", "--model", "bert", "--out", "{work}/profile"),
        capped(260, PY, "-m", "perf.gpu.side_by_side", "--model", "bert", "--device", "cuda", "--pairs", "1,2",
               "--policies", "load", "--host-buffers", "", "--fractions", "0.25,0.6,0.9,1.1", "--out", "{work}/bert"),
    ), needs=("perf/gpu/device_profile.py", "perf/gpu/side_by_side.py"), rerun=True),
    # what the stand-in assumes, measured on the GPU host (its device profile, committed under
    # perf/gpu/profiles/), then BERT-base served as a user serves it (the slicer's CPU profile
    # re-profiled at load on the GPU, the Docker image's GPU config) beside ZeroBatch and DelayBatch
    # on the same engine and graphs, every process of the server under py-spy: where the served
    # path's time goes
    Step("served", 540, (
        capped(20, "nvidia-smi"),
        sliced_bert(150, "--stages 4"),
        # the default GPU config (one buffer pair) beside two buffer pairs (the pipeline)
        capped(300, *profiled("{work}/served/py-spy.txt", PY, "-m", "perf.compare", "--model-dir", "{work}/repo/bert_base",
                              "--device", "cuda", "--queries", "1000", "--rounds", "2", "--loads", "0.25,0.6,0.9",
                              "--variant", "pairs2:num_buffer_pairs=2", "--out", "{work}/served",
                              subprocesses=True)),
        capped(110, PY, "-m", "perf.gpu.device_profile", "--model", "bert", "--out", "{work}/profile"),
    ), needs=("perf/gpu/device_profile.py", "perf/compare/on_device.py", "perf/compare/__main__.py",
              "perf/compare/served_metrics.py", "docker/gpu_config.py"), rerun=True),
    # after `served`: the default config beside the same model with the load policy (one batch per
    # execute call, as ZeroBatch's), and ZeroBatch, each stub under py-spy (every thread, idle too)
    # one query at a time and at 0.6x and 0.9x: where the served path's time goes
    Step("diagnose", 300, (
        sliced_bert(150, "--stages 4"),
        served_model(140, "--loads 0.6,0.9 --delays '' --variant load:policy=load --py-spy DVABatch,load,ZeroBatch"),
    ), needs=("perf/compare/on_device.py", "perf/compare/stub_profile.py", "perf/compare/served_metrics.py"),
       rerun=True),
    # after `diagnose`: the served comparison with the baselines' stubs answering with data (under
    # numpy 2 they answered with none, and so sent nothing), both stubs under py-spy
    Step("confirm", 250, (
        sliced_bert(120, "--stages 4"),
        served_model(150, "--loads 0.25,0.6,0.9 --delays 500,2000 --py-spy DVABatch,ZeroBatch"),
    ), needs=("perf/compare/on_device.py", "perf/compare/stub_profile.py", "perf/baselines/model.py"), rerun=True),
    # the GPU suite's commands in the order the issue ranks them, each capped: the GPU tests (answers,
    # graphs, fence, overlap) with the CPU property tests beside them, the overlap figures, the real
    # server, then the two experiments (BERT under py-spy)
    Step("gpu", 585, (
        capped(20, "nvidia-smi"),
        capped(40, PY, "-c", ENV_REPORT),
        # the runtime's CPU property tests (the GPU host's own numpy and onnx) beside the GPU tests
        capped(150, "bash", "-c", f"timeout 140 {PY} -m pytest -q -o timeout=60 tests/runtime/test_property.py "
               "tests/runtime/test_property_torch.py tests/unit/test_fences.py --junitxml={out}/junit-runtime.xml "
               f"> {{out}}/runtime-tests.log 2>&1 & {PY} -m pytest -q -rs -o timeout=120 tests/gpu/test_gpu.py "
               "--junitxml={out}/junit-gpu.xml; code=$?; wait; exit $code"),
        capped(40, PY, "-m", "perf.gpu.overlap", "--out", "{work}/overlap"),
        # the real server first: quick, and item 5 of the issue; a CPU instance only where the GPU one fails
        capped(110, "bash", "-c", f"{PY} -m perf.gpu.serve_check --out {{work}}/serve || "
               f"{PY} -m perf.gpu.serve_check --instance cpu --out {{work}}/serve-cpu-instance"),
        capped(220, *profiled("{work}/bert/py-spy.txt", PY, "-m", "perf.gpu.side_by_side", "--model", "bert",
                              "--device", "cuda", "--out", "{work}/bert")),
        capped(150, PY, "-m", "perf.gpu.side_by_side", "--model", "resnet152", "--device", "cuda",
               "--out", "{work}/resnet152"),
    ), needs=("tests/gpu/test_gpu.py", "perf/gpu/overlap.py", "perf/gpu/side_by_side.py", "perf/gpu/serve_check.py",
              "tests/runtime/test_property.py", "tests/runtime/test_property_torch.py", "tests/unit/test_fences.py",
              "docker/gpu_config.py", "pytest.ini"), rerun=True),
    Step("experiments", 500, (
        capped(90, PY, "-m", "pytest", "-q", "-rs", "-o", "timeout=80", "tests/gpu/test_gpu.py",
               "--junitxml={out}/junit-gpu.xml"),
        capped(80, PY, "-m", "perf.gpu.serve_check", "--out", "{work}/serve"),
        # one buffer pair beside two, both with device-memory boundaries (`gpu` sets device against
        # host memory), and `load` with its first stage running ahead of the device beside the
        # default, which waits for it (`entry_waits_for_device`)
        capped(240, PY, "-m", "perf.gpu.side_by_side", "--model", "bert", "--device", "cuda", "--pairs", "2,1",
               "--host-buffers", "", "--run-ahead", "load", "--out", "{work}/bert"),
        capped(150, PY, "-m", "perf.gpu.side_by_side", "--model", "resnet152", "--device", "cuda", "--pairs", "2,1",
               "--host-buffers", "", "--run-ahead", "load", "--out", "{work}/resnet152"),
    ), needs=("tests/gpu/test_gpu.py", "perf/gpu/side_by_side.py", "perf/gpu/serve_check.py", "docker/gpu_config.py"),
       rerun=True),
)


# -- planning (here) -----------------------------------------------------------------------


@dataclass(frozen=True)
class Wheel:
    requirement: str
    path: Path | None  # None: not downloaded

    @property
    def size(self) -> int:
        return self.path.stat().st_size if self.path else 0


@dataclass(frozen=True)
class DeviceCall:
    """One call of a job runner on the GPU host: its arguments (time limit, carried paths,
    command), and the repository files its command names."""

    step: Step
    command: str
    carry: tuple[str, ...]
    timeout_s: int
    names: tuple[str, ...]


@dataclass
class Plan:
    wheels: list[Wheel]
    tree_bytes: int
    calls: list[DeviceCall]
    problems: list[str] = field(default_factory=list)
    carried_bytes: int = 0  # the carried folder, all of it

    @property
    def transfer_bytes(self) -> int:
        return self.tree_bytes + self.carried_bytes


def _normalized(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def find_wheel(requirement: str, wheel_dir: Path) -> Wheel:
    """The wheel file in `wheel_dir` for NAME==VERSION (wheel names: NAME-VERSION-TAGS.whl)."""
    name, version = requirement.split("==", 1)
    for path in sorted(wheel_dir.glob("*.whl")) if wheel_dir.is_dir() else []:
        parts = path.name.split("-")
        if len(parts) >= 3 and _normalized(parts[0]) == _normalized(name) and parts[1] == version:
            return Wheel(requirement, path)
    return Wheel(requirement, None)


def tree_size(repo: Path = REPO) -> int:
    """Bytes of the working tree a runner sends: tracked files and untracked ones git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                            check=True, capture_output=True).stdout.decode().split("\0")
    return sum((repo / p).stat().st_size for p in listed if p and (repo / p).is_file())


def install_command(wheels: Sequence[Wheel], repo: Path, bundle: Path | None = None,
                    stub_wheel: Path | None = None) -> str:
    """The GPU host's install of the carried wheels (named one by one), the server bundle unpacked
    beside them, the stubs' numpy unpacked apart (`STUB_SITE`), and the path setting."""
    if not wheels:
        return "export PYTHONPATH=$PWD"
    files = " ".join(shlex.quote(str(w.path.relative_to(repo))) for w in wheels if w.path)
    unpack = f" && tar xzf {shlex.quote(str(bundle.relative_to(repo)))} -C /tmp/site" if bundle else ""
    stub = f" && {PY} -m zipfile -e {shlex.quote(str(stub_wheel.relative_to(repo)))} {STUB_SITE}" if stub_wheel else ""
    return (f"{PY} -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "
            f"{files}{unpack}{stub} && export PYTHONPATH=/tmp/site:$PWD || exit 1")


def device_call(step: Step, wheels: Sequence[Wheel], wheel_dir: Path, repo: Path) -> DeviceCall:
    bundle = wheel_dir / SERVER_BUNDLE if (wheel_dir / SERVER_BUNDLE).is_file() else None
    stub_wheel = next(iter(sorted((wheel_dir / STUB_SITE_DIR).glob("*.whl"))), None) if wheels else None
    command = (f"{install_command(wheels, repo, bundle, stub_wheel)}; set -o pipefail; PYTHONUNBUFFERED=1 "
               f"{PY} -m perf.gpu.run_device step {step.name} --out $OUT")
    carry = (str(wheel_dir.relative_to(repo)),) if wheels else ()
    names = (*(str(w.path.relative_to(repo)) for w in wheels if w.path),
             *([str(stub_wheel.relative_to(repo))] if stub_wheel else []), "perf/gpu/run_device.py", *step.needs)
    return DeviceCall(step, command, carry, step.timeout_s, names)


def plan(repo: Path, wheel_dir: Path, specs: Sequence[str], tree_bytes: int, steps: Sequence[Step] = STEPS) -> Plan:
    """Every call, checked: each wheel present, the transfer under `TRANSFER_LIMIT`, each command
    short enough and naming only files that exist, each call and the whole run inside its time."""
    wheels = [find_wheel(spec, wheel_dir) for spec in specs]
    carried = sum(p.stat().st_size for p in wheel_dir.rglob("*") if p.is_file()) if wheel_dir.is_dir() else 0
    result = Plan(wheels, tree_bytes, [], carried_bytes=carried)
    missing = [w.requirement for w in wheels if w.path is None]
    if missing:
        result.problems.append(f"wheels missing from {wheel_dir} (run python -m perf.gpu.fetch_wheels): {missing}")
    if result.transfer_bytes > TRANSFER_LIMIT:
        result.problems.append(f"the tree ({tree_bytes / MiB:.1f} MiB) and the carried folder ({result.carried_bytes / MiB:.1f} MiB) "
                               f"are over the {TRANSFER_LIMIT // MiB} MiB a call carries")
    result.calls = [device_call(step, wheels, wheel_dir, repo) for step in steps]
    for call in result.calls:
        if len(call.command) > COMMAND_LIMIT:
            result.problems.append(f"step {call.step.name}: command of {len(call.command)} characters (limit {COMMAND_LIMIT})")
        if call.timeout_s > CALL_LIMIT_S:
            result.problems.append(f"step {call.step.name}: {call.timeout_s} s (a call runs at most {CALL_LIMIT_S} s)")
        absent = [name for name in call.names if not (repo / name).is_file()]
        if absent:
            result.problems.append(f"step {call.step.name}: names files that do not exist: {absent}")
    total = sum(c.timeout_s + START_S for c in result.calls if not c.step.rerun)
    if total > DEVICE_BUDGET_S:
        result.problems.append(f"the calls may take {total} s with starts, over the {DEVICE_BUDGET_S} s budget")
    return result


def print_plan(result: Plan, repo: Path) -> None:
    print("wheels (perf/gpu/wheels.txt):")
    for w in result.wheels:
        where = w.path.relative_to(repo) if w.path else "MISSING"
        print(f"  {w.requirement:<28} {w.size / 1024:>9.1f} KiB  {where}")
    print(f"transfer: tree {result.tree_bytes / MiB:.2f} MiB + carried {result.carried_bytes / MiB:.2f} MiB = "
          f"{result.transfer_bytes / MiB:.2f} MiB (limit {TRANSFER_LIMIT // MiB} MiB)")
    for k, call in enumerate(result.calls, 1):
        print(f"\ncall {k}/{len(result.calls)}: step {call.step.name}")
        print("  run(" + json.dumps({"timeout_s": call.timeout_s, "carry": list(call.carry),
                                     "command": call.command}, indent=None) + ")")
        print("  runs there, in the repository root:")
        for argv in call.step.commands:
            work = f"{WORK}/{call.step.name}"  # collected into $OUT when the step ends
            print("    " + shlex.join(_filled(argv, work, work)))
    total = sum(c.timeout_s + START_S for c in result.calls if not c.step.rerun)
    print(f"\ntime at most {total / 60:.1f} min (the first call, {START_S} s start; a rerun only where "
          f"the budget has room), "
          f"budget {DEVICE_BUDGET_S // 60} min")
    print("\n".join(f"PROBLEM: {p}" for p in result.problems) or "plan: OK")


# -- running a step (there) ------------------------------------------------------------------


def _filled(argv: Sequence[str], out: str, work: str) -> list[str]:
    return [a.replace("{out}", out).replace("{work}", work) for a in argv]


def run_step(step: Step, out: Path, seconds: int | None = None) -> int:
    """Run the step's commands with what is left of its time (`seconds` where the call was given
    less than the step plans: a further call on what the total budget has left), then collect into
    `out`."""
    work = Path(WORK) / step.name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + min(step.timeout_s, seconds or step.timeout_s) - 30  # 30 s kept for collecting
    failures = 0
    with open(work / f"{step.name}.log", "w") as log:
        for argv in step.commands:
            failures += _run_logged(_filled(argv, str(work), str(work)), log, deadline)
    collect(work, out, step.name)
    print(f"step {step.name}: {failures} command(s) failed", flush=True)
    return 1 if failures else 0


def _run_logged(argv: list[str], log, deadline: float) -> int:
    """One command, its output echoed and logged; 1 if it failed or ran out of time."""
    header = f"\n$ {shlex.join(argv)}\n"
    print(header, end="", flush=True)
    log.write(header)
    remaining = deadline - time.monotonic()
    if remaining <= 5:
        log.write("(skipped: the step's time is spent)\n")
        return 1
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MPLBACKEND": "Agg"}
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # the step's deadline is checked between lines
            print(line, end="", flush=True)
            log.write(line)
            if time.monotonic() > deadline:
                proc.kill()
                log.write("(killed: the step's time is spent)\n")
        code = proc.wait()
    except OSError as exc:
        log.write(f"(failed to run: {exc})\n")
        return 1
    log.write(f"(exit {code})\n")
    log.flush()
    return 1 if code else 0


DIRECT_ORDER = (".log", ".json", ".xml", ".png")  # what comes back as a file first; the rest is in the tarball


def collect(work: Path, out: Path, name: str) -> list[Path]:
    """At most `OUT_FILES` files into `out` (no folders): the log, junit XML, figures and JSON as
    they are, everything else (models left out) in NAME-raw.tar.gz."""
    out.mkdir(parents=True, exist_ok=True)
    files = sorted(p for p in work.rglob("*") if p.is_file() and p.suffix != ".onnx")
    direct = sorted((p for p in files if p.suffix in DIRECT_ORDER and p.stat().st_size <= OUT_FILE_LIMIT
                     and not {"model", "repository", ".sliced"} & set(p.relative_to(work).parts[:-1])),
                    key=lambda p: (DIRECT_ORDER.index(p.suffix), str(p)))
    direct = direct[: OUT_FILES - 1]
    kept = []
    for p in direct:
        target = out / (p.name if not (out / p.name).exists() else f"{p.parent.name}-{p.name}")
        shutil.copyfile(p, target)
        kept.append(target)
    raw = out / f"{name}-raw.tar.gz"
    with tarfile.open(raw, "w:gz") as tar:
        for p in files:
            if p not in direct:
                tar.add(p, arcname=str(p.relative_to(work)))
    kept.append(raw)
    return kept


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what")
    step_parser = sub.add_parser("step", help="run one step (on the GPU host)")
    step_parser.add_argument("name", choices=[s.name for s in STEPS])
    step_parser.add_argument("--out", type=Path, required=True)
    step_parser.add_argument("--seconds", type=int, help="the call's time where less than the step plans")
    parser.add_argument("--dry-run", action="store_true", help="print and check every call (here)")
    parser.add_argument("--wheels", type=Path, default=DEFAULT_DEST)
    args = parser.parse_args(argv)
    if args.what == "step":
        return run_step(next(s for s in STEPS if s.name == args.name), args.out, args.seconds)
    if not args.dry_run:
        parser.error("give --dry-run (here) or `step NAME --out DIR` (on the GPU host)")
    result = plan(REPO, args.wheels.resolve(), requirements(WHEELS_TXT), tree_size(REPO))
    print_plan(result, REPO)
    return 1 if result.problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
