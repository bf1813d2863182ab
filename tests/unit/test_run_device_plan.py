"""perf.gpu.run_device's planning (its --dry-run) against a temporary wheel folder of small fake
files: every wheel found or named missing, the 64 MiB transfer limit, and every call naming only
files that exist. Nothing is downloaded; nothing runs on a GPU."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from perf.gpu import run_device
from perf.gpu.fetch_wheels import STUB_SITE_DIR, WHEELS_TXT, download_command, requirements
from perf.gpu.run_device import MiB, STEPS, TRANSFER_LIMIT, plan

SPECS = ["hypothesis==6.170.15", "pytest-timeout==2.4.0"]
FILES = ["hypothesis-6.170.15-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
         "pytest_timeout-2.4.0-py3-none-any.whl"]


@pytest.fixture()
def repo(tmp_path: Path) -> Path:
    """A copy of the files the steps name, and a wheel folder of fake wheels (1 KiB each)."""
    root = tmp_path / "repo"
    for call_file in ("perf/gpu/run_device.py", *(n for s in STEPS for n in s.needs)):
        (root / call_file).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(run_device.REPO / call_file, root / call_file)
    wheels = root / "work" / "wheels"
    wheels.mkdir(parents=True)
    for name in FILES:
        (wheels / name).write_bytes(b"0" * 1024)
    return root


def test_plan_finds_every_wheel_and_names_only_existing_files(repo: Path) -> None:
    result = plan(repo, repo / "work" / "wheels", SPECS, tree_bytes=3 * MiB)
    assert result.problems == []
    assert [w.path.name for w in result.wheels] == FILES  # type: ignore[union-attr]
    assert result.transfer_bytes == 3 * MiB + 2 * 1024
    assert [c.step.name for c in result.calls] == [s.name for s in STEPS]
    for call in result.calls:
        assert call.carry == ("work/wheels",)
        assert all((repo / name).is_file() for name in call.names)
        for name in FILES:  # the install names each wheel, by its path in the tree
            assert f"work/wheels/{name}" in call.command
        assert f"perf.gpu.run_device step {call.step.name} --out $OUT" in call.command


def test_the_stubs_numpy_is_unpacked_apart_and_served_with_where_the_machine_takes_it(repo: Path) -> None:
    """A numpy in work/wheels/stub-site/ is unpacked into its own folder, not into /tmp/site (the
    machine's own processes keep their numpy); each served step hands it to the stubs only where a
    process with it first on its path imports torch and reaches CUDA, and says which it used."""
    stub = repo / "work" / "wheels" / STUB_SITE_DIR
    stub.mkdir()
    (stub / "numpy-1.26.4-cp312-cp312-manylinux_2_17_x86_64.whl").write_bytes(b"0" * 1024)
    result = plan(repo, repo / "work" / "wheels", SPECS, tree_bytes=MiB)
    assert result.problems == []
    for call in result.calls:
        unpack = f"-m zipfile -e work/wheels/{STUB_SITE_DIR}/numpy-1.26.4-cp312-cp312-manylinux_2_17_x86_64.whl"
        assert f"{unpack} {run_device.STUB_SITE}" in call.command
        assert "--target /tmp/site" in call.command.split(unpack)[0]
    served = run_device.served_model(60, "--loads 0.5", "/tmp/m")[-1]
    assert f"--stub-site {run_device.STUB_SITE}" in served and "$STUB --out" in served
    assert "import numpy, torch" in served and "backend stubs:" in served
    steps = {s.name: s for s in STEPS}
    assert all(any("$STUB --out" in c[-1] for c in steps[name].commands) for name in ("tier1", "tier2", "tier3"))
    without = plan(repo, repo / "work" / "wheels", [], tree_bytes=MiB)  # nothing carried: nothing unpacked
    assert all("zipfile" not in c.command for c in without.calls)


def test_missing_wheel_is_a_problem(repo: Path) -> None:
    (repo / "work" / "wheels" / FILES[1]).unlink()
    result = plan(repo, repo / "work" / "wheels", SPECS, tree_bytes=MiB)
    assert any("pytest-timeout==2.4.0" in p and "fetch_wheels" in p for p in result.problems)
    assert all(FILES[1] not in c.command for c in result.calls)


def test_a_wheel_of_another_version_is_not_taken(repo: Path) -> None:
    result = plan(repo, repo / "work" / "wheels", ["hypothesis==6.0.0"], tree_bytes=MiB)
    assert result.wheels[0].path is None and result.problems


def test_transfer_over_64_mib_is_a_problem(repo: Path) -> None:
    big = repo / "work" / "wheels" / FILES[0]
    with open(big, "r+b") as f:  # sparse: 63 MiB counted, nothing written
        f.truncate(63 * MiB)
    under = plan(repo, repo / "work" / "wheels", SPECS, tree_bytes=MiB - 2048)
    assert under.transfer_bytes <= TRANSFER_LIMIT and under.problems == []
    over = plan(repo, repo / "work" / "wheels", SPECS, tree_bytes=2 * MiB)
    assert over.transfer_bytes > TRANSFER_LIMIT
    assert any("64 MiB" in p for p in over.problems)


def test_a_step_naming_an_absent_file_is_a_problem(repo: Path) -> None:
    (repo / "perf" / "gpu" / "overlap.py").unlink()
    result = plan(repo, repo / "work" / "wheels", SPECS, tree_bytes=MiB)
    assert any("perf/gpu/overlap.py" in p for p in result.problems)


def test_calls_fit_the_device_limits() -> None:
    """Every call under the per-call time limit; tier 1 (the one the budget counts) with its start,
    and tier 2 after it on the machine it left up, inside the total time budget; each rerun, with
    its own start, under the budget too (it runs on what the first leaves). Tier 1 takes at most 5
    minutes, and each tier's caps leave it 30 s to collect."""
    assert all(s.timeout_s <= run_device.CALL_LIMIT_S for s in STEPS)
    first = [s for s in STEPS if not s.rerun]
    assert [s.name for s in first] == ["tier1"] and first[0].timeout_s <= 300
    assert [s.name for s in STEPS if s.follows] == ["tier2"]
    assert first[0].timeout_s + run_device.START_S + STEPS[1].timeout_s <= run_device.DEVICE_BUDGET_S
    assert all(s.timeout_s + run_device.START_S < run_device.DEVICE_BUDGET_S for s in STEPS if s.rerun)
    for step in STEPS:
        caps = [int(argv[3]) for argv in step.commands if argv[0] == "timeout"]
        assert sum(caps) <= step.timeout_s - 30, step.name


def test_the_stand_in_rehearses_the_tiers_with_the_same_caps() -> None:
    """The same tiers, the same caps per command but the device's own, the device switched: sliced on the CPU into the
    stage count of the stand-in's profiles, served on the stand-in charged from them."""
    gpu = {s.name: s for s in STEPS}
    for rehearsal in run_device.STANDIN_STEPS:
        on_gpu = gpu[rehearsal.name]
        assert rehearsal.timeout_s == on_gpu.timeout_s
        def caps(step: run_device.Step) -> list[str]:  # but the device's own: nvidia-smi, its profile
            return [argv[3] for argv in step.commands if argv[0] == "timeout" and "nvidia-smi" not in argv
                    and "perf.gpu.device_profile" not in argv]

        assert caps(rehearsal) == caps(on_gpu)
        text = " ".join(" ".join(argv) for argv in rehearsal.commands)
        assert "--device cuda" not in text and "--device simulated --device-profile $PWD/perf/gpu/profiles/" in text
    for _, profile in run_device.STANDIN.profiles:
        assert (run_device.REPO / profile).is_file()


def test_the_limits_are_options(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tight = run_device.Limits(call_s=200, budget_s=600, start_s=60, transfer_bytes=MiB, command_chars=100)
    result = plan(repo, repo / "work" / "wheels", SPECS, tree_bytes=2 * MiB, limits=tight)
    problems = result.problems
    run_device.print_plan(result, repo)  # the plan as printed names the limits it was checked against
    printed = capsys.readouterr().out
    assert "(limit 1 MiB)" in printed and "its 60 s start" in printed and "budget 10 min" in printed
    assert any("(a call runs at most 200 s)" in p for p in problems)
    assert any("over the 600 s budget" in p for p in problems)
    assert any("over the 1 MiB a call carries" in p for p in problems)
    assert any("(limit 100)" in p for p in problems)


def test_the_server_bundle_keeps_only_the_device_python(tmp_path: Path) -> None:
    """The tritonserver bundle's filter: the 3.12 stub, not the others; no other Python's libpython."""
    from perf.gpu.fetch_wheels import _bundled

    site = tmp_path
    keep = [site / "pytriton/tritonserver/bin/tritonserver", site / "pytriton/tritonserver/python_backend_stubs/3.12/stub",
            site / "nvidia_pytriton.libs/libtritonserver-1.so", site / "tritonclient/grpc/_client.py"]
    drop = [site / "pytriton/tritonserver/python_backend_stubs/3.13/stub", site / "nvidia_pytriton.libs/libpython3-x.13.so",
            site / "tritonclient/__pycache__/x.pyc"]
    assert all(_bundled(p, site) for p in keep) and not any(_bundled(p, site) for p in drop)


def test_wheels_txt_is_pinned_and_fetched_for_the_device_python() -> None:
    specs = requirements(WHEELS_TXT)
    assert specs and all("==" in s for s in specs)
    command = download_command(specs, Path("/tmp/wheels"))
    assert command[command.index("--python-version") + 1] == "3.12"
    assert "--only-binary=:all:" in command and "--no-deps" in command


def test_collect_brings_back_at_most_eight_flat_files(tmp_path: Path) -> None:
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "a" / "b").mkdir(parents=True)
    for k in range(12):
        (work / "a" / f"fig{k}.png").write_bytes(b"png")
    (work / "a" / "b" / "model.onnx").write_bytes(b"x")
    (work / "a" / "b" / "notes.txt").write_text("raw")
    kept = run_device.collect(work, out, "experiments")
    assert len(kept) <= run_device.OUT_FILES
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in kept)
    assert all(p.is_file() and p.parent == out for p in kept)
    import tarfile

    with tarfile.open(out / "experiments-raw.tar.gz") as tar:
        names = tar.getnames()
    assert "a/b/notes.txt" in names and "a/b/model.onnx" not in names


def test_run_step_logs_every_command_and_collects(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(run_device, "WORK", str(tmp_path / "work"))
    step = run_device.Step("smoke", 60, (("python3", "-c", "print('hello from the step')"),
                                          ("python3", "-c", "import sys; sys.exit(3)")), needs=())
    assert run_device.run_step(step, tmp_path / "out") == 1  # the second command failed
    log = (tmp_path / "out" / "smoke.log").read_text()
    assert "hello from the step" in log and "(exit 3)" in log
    assert log.count("(wall ") == 2  # each command's wall time, and the step's so far


def test_a_step_writes_its_results_as_it_goes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After each command the results so far are in OUT: a call stopped at its limit keeps them. The
    second command checks, while it runs, that the first one's JSON is already there."""
    monkeypatch.setattr(run_device, "WORK", str(tmp_path / "work"))
    out = tmp_path / "out"
    write = "import pathlib; pathlib.Path('{work}/first.json').write_text('{}')"
    check = f"import pathlib, sys; sys.exit(0 if pathlib.Path('{out}/first.json').is_file() else 4)"
    step = run_device.Step("going", 60, (("python3", "-c", write), ("python3", "-c", check)), needs=())
    assert run_device.run_step(step, out) == 0
    assert sorted(p.name for p in out.iterdir()) == ["first.json", "going-raw.tar.gz", "going.log"]
