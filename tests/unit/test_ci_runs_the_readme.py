"""CI runs the README's two commands exactly as written, each in a fresh virtualenv of its own."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def readme_commands() -> list[str]:
    """The bash blocks under the README's "Two commands" heading: the main job, then the tests."""
    section = (ROOT / "README.md").read_text().split("## Two commands", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", section, re.S)]


def test_ci_runs_both_readme_commands_verbatim_each_in_a_fresh_virtualenv() -> None:
    main_job, tests = readme_commands()
    assert "dvabatch demo" in main_job and "pytest" in tests
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    lines = [line.strip() for line in ci]
    assert tests in lines and main_job in lines
    for command in (tests, main_job):
        at = lines.index(command)
        venv = lines[at - 1]  # the line before activates a virtualenv made in this run
        assert venv.startswith("source ") and venv.endswith("/bin/activate"), venv
        folder = venv.removeprefix("source ").removesuffix("/bin/activate")
        assert f"python3 -m venv {folder}" in lines[:at], f"{folder} is not made fresh before {command!r}"
    assert "rm -rf .venv .venv-main" in lines
