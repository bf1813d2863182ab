"""The GPU suite as steps, one command each on a GPU host: plan them here, run each there.

The GPU host is any machine with a CUDA device and the repository's working tree: one at hand, or
a remote one reached through a job runner with limits, offline included (what it needs is fetched
beforehand: `perf.gpu.fetch_wheels`). The plan is checked against a runner's limits, options of the
dry run whose defaults are the constants below: a time limit per command (`CALL_LIMIT_S`), a total
time budget with machine starts included (`DEVICE_BUDGET_S`, `START_S`), a size limit on what a
command sends (`TRANSFER_LIMIT`: the working tree plus the carried paths), a length limit on one
command (`COMMAND_LIMIT`); and the files a command may bring back (`OUT_FILES` plain files from
$OUT, each at most `OUT_FILE_LIMIT`).

Here (no GPU):

    python -m perf.gpu.fetch_wheels          # the wheels of perf/gpu/wheels.txt -> work/wheels/
    python -m perf.gpu.run_device --dry-run  # every call printed and checked; exit 1 on a problem
    python -m perf.gpu.run_device step tier1 --standin --out DIR   # a tier rehearsed on the stand-in

There (on the GPU host, in the repository root with work/wheels carried, once per call the dry run
prints; perf/README.md lists them):

    python3 -m pip install ... --target /tmp/site work/wheels/*.whl; export PYTHONPATH=/tmp/site:$PWD
    python3 -m perf.gpu.run_device step tier1 --out $OUT
    python3 -m perf.gpu.run_device step tier2 --out $OUT

The total budget counts tier 1 with its machine start and tier 2 after it on the machine it left up
(`follows`). A step marked `rerun` is a further call, made where the budget has room for it (`step
NAME --seconds S` fits a step to a shorter call).

Steps (`tiers`, the order a GPU host runs them; every model sliced on the device, bs_max 16):
- `tier1`, at most 5 minutes: versions; BERT-base fp16 sliced (stage counts 2 and 4 tried);
  DVABatch against ZeroBatch at the lone query and 9/10, one round; the device profile the
  stand-in needs, of that slice;
- `tier2`: fp32 sliced beside it; both at 1/4, 3/5 and 9/10 with DelayBatch, two rounds; the
  hand-off of calls off beside (`sync`); py-spy of DVABatch's and ZeroBatch's stubs;
- `tier3`: ResNet-152 224x224 fp16 sliced and served; the sustained rates; the pipeline against
  the one-stage route;
- `gpu`: the GPU test module beside the runtime's CPU property tests, the overlap figures, the real
  server's check.

A step runs its commands one after another in the repository root, each with what is left of the
step's time, every line of output echoed and kept with each command's wall time; after each command
it collects into OUT at most `OUT_FILES` plain files (no folders): STEP.log (every command's
output), the figures and JSON, junit XML, and STEP-raw.tar.gz of everything else the step wrote
(models left out).
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
    # made right after the step before, on the machine it left up (no start): counted in the budget
    follows: bool = False


def capped(seconds: int, *argv: str) -> tuple[str, ...]:
    """argv under coreutils' `timeout`: a hung command costs its own cap, not the call."""
    return ("timeout", "-k", "5", str(seconds), *argv)


STUB_SITE = "/tmp/stub-site"  # the carried numpy 1 (fetch_wheels.STUB_NUMPY), for the backend stubs alone
# whether the stubs can serve with it: what a stub imports (the runtime, onnx, onnxruntime), and the
# torch engine's numpy bridge to CUDA
STUB_SITE_CHECK = ('import numpy, torch, onnx, onnxruntime, dvabatch_backend.runtime.loading; '
                   'assert numpy.__version__ < "2", numpy.__version__; '
                   'torch.from_numpy(numpy.ones(2, "float32")).cuda().cpu().numpy()')



MODELS = "{work}/../models"  # slices kept between steps on a host that stays up: a later tier reuses them


@dataclass(frozen=True)
class Target:
    """Where the tiers serve: a GPU (`cuda`: sliced on the device, served with the GPU config), or
    the GPU stand-in (`simulated`: sliced on the host's CPU into the stage count of its device
    profiles, served with `engine: simulated` charged from them), which rehearses the tiers with the
    same caps where there is no GPU."""

    device: str  # "cuda" or "simulated"
    profiles: tuple[tuple[str, str], ...] = ()  # the stand-in's device profile per zoo model (repository paths)
    sizes: tuple[tuple[str, str], ...] = ()  # the zoo size per model, where not the paper's

    def size(self, zoo: str, paper: str) -> str:
        return dict(self.sizes).get(zoo, paper)

    def slice_args(self, candidates: str) -> str:
        return f"--device cuda --stages auto --candidates {candidates}" if self.device == "cuda" else "--stages 4"

    def compare_args(self, zoo: str) -> str:
        if self.device == "cuda":
            return "--device cuda"
        return f"--device simulated --device-profile $PWD/{dict(self.profiles)[zoo]}"


GPU = Target("cuda")
# the profiles the stand-in replays: the H200's BERT-base (4 stages), the H100's ResNet-152 stage
# times (4 stages); ResNet-152 at the zoo's `real` size (64x64), as the stand-in charges its stages
# from the profile and the paper's size takes the host's two cores minutes to slice
STANDIN = Target("simulated", (("bert", "perf/gpu/profiles/h200-bert-device-profile.json"),
                               ("resnet152", "perf/gpu/profiles/h100-resnet152-stage-times.json")),
                 (("resnet152", "real"),))


def sliced(seconds: int, target: Target, zoo: str, paper_size: str, precision: str, name: str,
           candidates: str = "2,4", extra: str = "") -> tuple[str, ...]:
    """The zoo model sliced in `precision` into MODELS/NAME (bs_max 16, lengths to 128 where it has
    them), unless a step before left it there; capped."""
    size = target.size(zoo, paper_size)
    folder = f"{MODELS}/{name}"
    return capped(seconds, "bash", "-c", f"test -f {folder}/config.pbtxt && echo 'reused {folder}' || "
                  f"({PY} -m dvabatch_backend.tools.cli zoo {zoo} --size {size} --out {MODELS}/{zoo}-{size}.onnx && "
                  f"time {PY} -m dvabatch_backend.tools.cli slice {MODELS}/{zoo}-{size}.onnx {target.slice_args(candidates)} "
                  f"--precision {precision} --bs-max 16 --repeats 3 {extra}--force --out {folder})")


def served(seconds: int, target: Target, zoo: str, name: str, compare_args: str, out: str) -> tuple[str, ...]:
    """MODELS/NAME served beside the baselines on the target (`served_model`), results in {work}/OUT."""
    return served_model(seconds, f"{target.compare_args(zoo)} {compare_args}", f"{MODELS}/{name}", out)


def served_model(seconds: int, compare_args: str, model_dir: str, out: str = "served") -> tuple[str, ...]:
    """MODEL_DIR served beside the baselines (`perf.compare`, 1,000 queries a load, `compare_args`:
    the device, loads, rounds, ...), the carried py-spy on the PATH, capped. The backend stubs import
    numpy from `STUB_SITE` first, as a user's install of this package serves (numpy below 2), where
    it works with the machine's torch; else the machine's numpy, and the log says which."""
    check = f"PYTHONPATH={STUB_SITE}:$PYTHONPATH {PY} -c {shlex.quote(STUB_SITE_CHECK)}"
    return capped(seconds, "bash", "-c", f"STUB=; if {check} 2>/dev/null; then STUB='--stub-site {STUB_SITE}'; fi; "
                  f"echo \"backend stubs: ${{STUB:-numpy of the machine}}\"; "
                  f"PATH=/tmp/site/bin:$PATH {PY} -m perf.compare --model-dir {model_dir} "
                  f"--queries 1000 {compare_args} $STUB --out {{work}}/{out}")


def device_profile(seconds: int, target: Target, name: str) -> tuple[str, ...]:
    """The stand-in's device profile of MODELS/NAME as it serves (stage and unsliced times at every
    bucket, copies, launch, `host_run_s`), measured on the GPU; the stand-in has none to measure."""
    if target.device != "cuda":
        return ("echo", "device profile: none on the stand-in (it replays the committed ones)")
    return capped(seconds, PY, "-m", "perf.gpu.device_profile", "--model-dir", f"{MODELS}/{name}",
                  "--out", "{work}/profile")


def versions(target: Target) -> tuple[tuple[str, ...], ...]:
    smi = (capped(10, "nvidia-smi"),) if target.device == "cuda" else ()
    return (*smi, capped(20, PY, "-c", ENV_REPORT))


# Tier caps: tier 1 and tier 2 fit one budget (`DEVICE_BUDGET_S`) with one machine start, tier 2 on
# the machine tier 1 left up (its slice reused); tier 3 is a further call.
TIER1_S, TIER2_S, TIER3_S = 270, 480, 570
SERVED_NEEDS = ("perf/compare/on_device.py", "perf/compare/__main__.py", "slicer/precision.py",
                "slicer/serving_engine.py", "perf/baselines/model.py")


def tiers(target: Target) -> tuple[Step, ...]:
    """The GPU suite's three tiers on `target`; each command capped, each tier's caps summing to 30 s
    under its time (kept for collecting)."""
    def bert(seconds: int, precision: str) -> tuple[str, ...]:  # BERT-base sliced in `precision`, or reused
        return sliced(seconds, target, "bert", "real", precision, f"bert_{precision}", extra="--max-length 128 ")

    return (
        # versions; BERT-base fp16 sliced on the device (candidates 2 and 4); DVABatch against
        # ZeroBatch at the lone query and 9/10, one round; the device profile the stand-in needs
        Step("tier1", TIER1_S, (
            *versions(target),
            bert(100, "fp16"),
            served(70, target, "bert", "bert_fp16", "--loads 0.9 --rounds 1 --delays ''", "bert_fp16-tier1"),
            device_profile(40, target, "bert_fp16"),
        ), needs=("perf/gpu/device_profile.py", *SERVED_NEEDS)),
        # fp32 beside it; 1/4, 3/5 and 9/10; DelayBatch; two rounds; the hand-off of calls off beside
        # (`sync`); py-spy of every stub thread of DVABatch and ZeroBatch
        Step("tier2", TIER2_S, (
            bert(100, "fp16"),
            bert(90, "fp32"),
            served(140, target, "bert", "bert_fp16", "--loads 0.25,0.6,0.9 --rounds 2 --delays 500,1000 "
                   "--variant sync:hand_off_calls=false --py-spy DVABatch,ZeroBatch", "bert_fp16"),
            served(120, target, "bert", "bert_fp32", "--loads 0.25,0.6,0.9 --rounds 2 --delays 500", "bert_fp32"),
        ), needs=SERVED_NEEDS, rerun=True, follows=True),
        # ResNet-152 224x224 fp16 sliced and served; BERT-base fp16's sustained rate beside
        # ZeroBatch's; the pipeline (stages on streams: the one-stage route off) against the default
        # at 3/5 and 9/10, with each stage's batch sizes and the meta operations counted
        Step("tier3", TIER3_S, (
            bert(90, "fp16"),
            sliced(120, target, "resnet152", "full", "fp16", "resnet152_fp16"),
            served(130, target, "resnet152", "resnet152_fp16", "--loads 0.25,0.6,0.9 --rounds 2 --delays 500,2000",
                   "resnet152_fp16"),
            served(200, target, "bert", "bert_fp16", "--loads 0.6,0.9 --rounds 2 --delays '' "
                   "--variant pipeline:fast_path=false --sustained DVABatch,ZeroBatch", "bert_fp16-tier3"),
        ), needs=SERVED_NEEDS, rerun=True),
    )


# The total budget (`DEVICE_BUDGET_S`) holds one machine start, tier 1 (the one step not marked
# `rerun`) and tier 2 on the machine it left up. The others are further calls, each made where the
# budget has room for it.
STEPS: tuple[Step, ...] = (
    *tiers(GPU),
    # the GPU test module (answers, graphs, fence, overlap) with the CPU property tests beside it, the
    # overlap figures and the real server's check
    Step("gpu", 330, (
        *versions(GPU),
        # the runtime's CPU property tests (the GPU host's own numpy and onnx) beside the GPU tests
        capped(150, "bash", "-c", f"timeout 140 {PY} -m pytest -q -o timeout=60 tests/runtime/test_property.py "
               "tests/runtime/test_property_torch.py tests/unit/test_fences.py --junitxml={out}/junit-runtime.xml "
               f"> {{out}}/runtime-tests.log 2>&1 & {PY} -m pytest -q -rs -o timeout=120 tests/gpu/test_gpu.py "
               "--junitxml={out}/junit-gpu.xml; code=$?; wait; exit $code"),
        capped(40, PY, "-m", "perf.gpu.overlap", "--out", "{work}/overlap"),
        # a CPU instance only where the GPU one fails
        capped(80, "bash", "-c", f"{PY} -m perf.gpu.serve_check --out {{work}}/serve || "
               f"{PY} -m perf.gpu.serve_check --instance cpu --out {{work}}/serve-cpu-instance"),
    ), needs=("tests/gpu/test_gpu.py", "perf/gpu/overlap.py", "perf/gpu/serve_check.py",
              "tests/runtime/test_property.py", "tests/runtime/test_property_torch.py", "tests/unit/test_fences.py",
              "docker/gpu_config.py", "pytest.ini"), rerun=True),
)
STANDIN_STEPS: tuple[Step, ...] = tiers(STANDIN)


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


@dataclass(frozen=True)
class Limits:
    """A job runner's limits the plan is checked against."""

    call_s: int = CALL_LIMIT_S
    budget_s: int = DEVICE_BUDGET_S
    start_s: int = START_S
    transfer_bytes: int = TRANSFER_LIMIT
    command_chars: int = COMMAND_LIMIT


@dataclass
class Plan:
    wheels: list[Wheel]
    tree_bytes: int
    calls: list[DeviceCall]
    problems: list[str] = field(default_factory=list)
    carried_bytes: int = 0  # the carried folder, all of it
    limits: Limits = Limits()  # what it was checked against

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


def plan(repo: Path, wheel_dir: Path, specs: Sequence[str], tree_bytes: int, steps: Sequence[Step] = STEPS,
         limits: Limits = Limits()) -> Plan:
    """Every call, checked: each wheel present, the transfer under the limit, each command short
    enough and naming only files that exist, each call inside its time, and the first call with
    the next (tier 1 and tier 2, the second on the machine the first left up) inside the budget."""
    wheels = [find_wheel(spec, wheel_dir) for spec in specs]
    carried = sum(p.stat().st_size for p in wheel_dir.rglob("*") if p.is_file()) if wheel_dir.is_dir() else 0
    result = Plan(wheels, tree_bytes, [], carried_bytes=carried, limits=limits)
    missing = [w.requirement for w in wheels if w.path is None]
    if missing:
        result.problems.append(f"wheels missing from {wheel_dir} (run python -m perf.gpu.fetch_wheels): {missing}")
    if result.transfer_bytes > limits.transfer_bytes:
        result.problems.append(f"the tree ({tree_bytes / MiB:.1f} MiB) and the carried folder ({result.carried_bytes / MiB:.1f} MiB) "
                               f"are over the {limits.transfer_bytes // MiB} MiB a call carries")
    result.calls = [device_call(step, wheels, wheel_dir, repo) for step in steps]
    for call in result.calls:
        if len(call.command) > limits.command_chars:
            result.problems.append(f"step {call.step.name}: command of {len(call.command)} characters "
                                   f"(limit {limits.command_chars})")
        if call.timeout_s > limits.call_s:
            result.problems.append(f"step {call.step.name}: {call.timeout_s} s (a call runs at most {limits.call_s} s)")
        absent = [name for name in call.names if not (repo / name).is_file()]
        if absent:
            result.problems.append(f"step {call.step.name}: names files that do not exist: {absent}")
    total = opening_seconds(result.calls, limits.start_s)
    if total > limits.budget_s:
        result.problems.append(f"the calls may take {total} s with starts, over the {limits.budget_s} s budget")
    return result


def opening_seconds(calls: Sequence[DeviceCall], start_s: int) -> int:
    """The budget's calls: the first (not a `rerun`) with its machine's start, and those that
    `follow` it on the machine it left up."""
    return sum(c.timeout_s + start_s for c in calls if not c.step.rerun) + sum(c.timeout_s for c in calls
                                                                              if c.step.follows)


def print_plan(result: Plan, repo: Path) -> None:
    print("wheels (perf/gpu/wheels.txt):")
    for w in result.wheels:
        where = w.path.relative_to(repo) if w.path else "MISSING"
        print(f"  {w.requirement:<28} {w.size / 1024:>9.1f} KiB  {where}")
    print(f"transfer: tree {result.tree_bytes / MiB:.2f} MiB + carried {result.carried_bytes / MiB:.2f} MiB = "
          f"{result.transfer_bytes / MiB:.2f} MiB (limit {result.limits.transfer_bytes // MiB} MiB)")
    for k, call in enumerate(result.calls, 1):
        print(f"\ncall {k}/{len(result.calls)}: step {call.step.name}")
        print("  run(" + json.dumps({"timeout_s": call.timeout_s, "carry": list(call.carry),
                                     "command": call.command}, indent=None) + ")")
        print("  runs there, in the repository root:")
        for argv in call.step.commands:
            work = f"{WORK}/{call.step.name}"  # collected into $OUT when the step ends
            print("    " + shlex.join(_filled(argv, work, work)))
    limits = result.limits
    total = opening_seconds(result.calls, limits.start_s)
    print(f"\ntime at most {total / 60:.1f} min (the first call with its {limits.start_s} s start and the one "
          f"that follows it on that machine; a rerun only where the budget has room), "
          f"budget {limits.budget_s / 60:g} min")
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
    began = time.monotonic()
    deadline = began + min(step.timeout_s, seconds or step.timeout_s) - 30  # 30 s kept for collecting
    failures = 0
    kept: list[Path] = []
    with open(work / f"{step.name}.log", "w") as log:
        for argv in step.commands:
            started = time.monotonic()
            failures += _run_logged(_filled(argv, str(work), str(work)), log, deadline)
            line = f"(wall {time.monotonic() - started:.0f} s; the step's so far {time.monotonic() - began:.0f} s)\n"
            print(line, end="", flush=True)
            log.write(line)
            log.flush()
            kept = collect(work, out, step.name, kept)  # results as they come: a call stopped at its limit keeps them
    print(f"step {step.name}: {failures} command(s) failed; wall {time.monotonic() - began:.0f} s "
          f"of {step.timeout_s} s", flush=True)
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


def collect(work: Path, out: Path, name: str, earlier: Sequence[Path] = ()) -> list[Path]:
    """At most `OUT_FILES` files into `out` (no folders): the log, junit XML, figures and JSON as
    they are, everything else (models left out) in NAME-raw.tar.gz; the `earlier` collect's files
    it does not write again are removed (a step collects after each command)."""
    out.mkdir(parents=True, exist_ok=True)
    files = sorted(p for p in work.rglob("*") if p.is_file() and p.suffix != ".onnx")
    direct = sorted((p for p in files if p.suffix in DIRECT_ORDER and p.stat().st_size <= OUT_FILE_LIMIT
                     and not {"model", "repository", ".sliced"} & set(p.relative_to(work).parts[:-1])),
                    key=lambda p: (DIRECT_ORDER.index(p.suffix), str(p)))
    direct = direct[: OUT_FILES - 1]
    kept: list[Path] = []
    for p in direct:
        target = out / (p.name if out / p.name not in kept else f"{p.parent.name}-{p.name}")
        shutil.copyfile(p, target)
        kept.append(target)
    raw = out / f"{name}-raw.tar.gz"
    with tarfile.open(raw, "w:gz") as tar:
        for p in files:
            if p not in direct:
                tar.add(p, arcname=str(p.relative_to(work)))
    kept.append(raw)
    for stale in set(earlier) - set(kept):
        stale.unlink(missing_ok=True)
    return kept


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what")
    step_parser = sub.add_parser("step", help="run one step (on the GPU host)")
    step_parser.add_argument("name", choices=[s.name for s in STEPS])
    step_parser.add_argument("--out", type=Path, required=True)
    step_parser.add_argument("--seconds", type=int, help="the call's time where less than the step plans")
    step_parser.add_argument("--standin", action="store_true",
                             help="a tier rehearsed on the GPU stand-in, here, with the same caps")
    parser.add_argument("--dry-run", action="store_true", help="print and check every call (here)")
    parser.add_argument("--wheels", type=Path, default=DEFAULT_DEST)
    # a job runner's limits (the defaults: the runner the project's own GPU runs went through)
    parser.add_argument("--call-limit", type=int, default=CALL_LIMIT_S, help="seconds one command may run")
    parser.add_argument("--budget", type=int, default=DEVICE_BUDGET_S,
                        help="seconds of the whole run, machine starts included")
    parser.add_argument("--start", type=int, default=START_S, help="seconds a fresh GPU host takes to start")
    parser.add_argument("--transfer-limit", type=int, default=TRANSFER_LIMIT // MiB,
                        help="MiB a call carries: the working tree and the wheels")
    parser.add_argument("--command-limit", type=int, default=COMMAND_LIMIT, help="characters of one command")
    args = parser.parse_args(argv)
    if args.what == "step":
        steps = STANDIN_STEPS if args.standin else STEPS
        if args.name not in {s.name for s in steps}:
            parser.error(f"the stand-in rehearses the tiers: {[s.name for s in steps]}")
        return run_step(next(s for s in steps if s.name == args.name), args.out, args.seconds)
    if not args.dry_run:
        parser.error("give --dry-run (here) or `step NAME --out DIR` (on the GPU host)")
    limits = Limits(args.call_limit, args.budget, args.start, args.transfer_limit * MiB, args.command_limit)
    result = plan(REPO, args.wheels.resolve(), requirements(WHEELS_TXT), tree_size(REPO), limits=limits)
    print_plan(result, REPO)
    return 1 if result.problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
