"""Comments and docstrings state rules, not the runs that chose them.

A comment or docstring under `dvabatch_backend/`, `policies/` and `slicer/` says what a thing does
and why; the figures that chose it belong on the docs' benchmarks page or in a commit message. This
check fails on a date, a machine or GPU name, or a measured figure (a number with ms, µs, s, %, × or
x) in one, except the lines `comment_allowlist.txt` names, each with its reason.

Run as a script it prints every offending line (`python tests/unit/test_comments_state_rules.py`).
"""
from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECKED = ("dvabatch_backend", "policies", "slicer")
ALLOWLIST = Path(__file__).with_name("comment_allowlist.txt")

_MONTHS = ("January|February|March|April|May|June|July|August|September|October|November|December|"
           "Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec")
PATTERNS: dict[str, re.Pattern[str]] = {
    "date": re.compile(rf"\b(19|20)\d\d-\d\d(-\d\d)?\b|\b\d{{1,2}} ({_MONTHS})\.? (19|20)\d\d\b"
                       rf"|\b({_MONTHS})\.? \d{{1,2}},? (19|20)\d\d\b|\b({_MONTHS}) (19|20)\d\d\b"),
    "machine": re.compile(r"\b(H100|H200|H20|A100|A10G?|A30|A40|V100|P100|T4|L4|L40S?|GH200|B100|B200|MI\d{3}X?"
                          r"|RTX ?\d{3,4}|GTX ?\d{3,4}|Xeon|EPYC|Graviton)\b"
                          r"|\b(\d+|two|four|eight|sixteen) (CPU )?cores\b|\bthis machine\b|\bCI's machine\b",
                          re.IGNORECASE),
    # a number, then a unit of time, a percentage or a ratio; not a size such as 224x224, nor hex
    "figure": re.compile(r"(?<![\w.])(\d+(\.\d+)?|\.\d+)(e-?\d+)?\s?(ms|µs|us|s|%|×|x)(?![\w\d])"
                         r"|(?<![\w.])(\d+(\.\d+)?)-(\d+(\.\d+)?)\s?(ms|µs|us|s|%|×|x)(?![\w\d])"),
}


@dataclass(frozen=True)
class Offence:
    path: str  # relative to the repository root
    line: int
    kind: str  # a key of PATTERNS
    text: str  # the comment or docstring line, stripped

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.kind}: {self.text}"


def prose_lines(source: str) -> dict[int, str]:
    """Line number -> the comment and docstring text on it, for one module's source."""
    lines: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            lines[token.start[0]] = lines.get(token.start[0], "") + token.string
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            first = body[0].lineno
            for offset, text in enumerate(body[0].value.value.splitlines()):
                lines[first + offset] = lines.get(first + offset, "") + " " + text
    return lines


def offences(root: Path = ROOT) -> list[Offence]:
    found: list[Offence] = []
    for package in CHECKED:
        for path in sorted((root / package).rglob("*.py")):
            relative = path.relative_to(root).as_posix()
            for number, text in sorted(prose_lines(path.read_text(encoding="utf-8")).items()):
                for kind, pattern in PATTERNS.items():
                    if pattern.search(text):
                        found.append(Offence(relative, number, kind, text.strip()))
                        break
    return found


@dataclass(frozen=True)
class Allowed:
    path: str
    fragment: str  # text the offending line contains
    reason: str


def allowlist(path: Path = ALLOWLIST) -> list[Allowed]:
    """Entries `path | fragment | reason`, one a line; blank lines and lines starting with # skipped."""
    entries = []
    for raw in path.read_text(encoding="utf-8").splitlines():
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        parts = [part.strip() for part in raw.split(" | ")]
        assert len(parts) == 3 and all(parts), f"{path.name}: want 'path | fragment | reason', got {raw!r}"
        entries.append(Allowed(*parts))
    return entries


def unallowed(found: list[Offence], allowed: list[Allowed]) -> tuple[list[Offence], list[Allowed]]:
    """The offences no entry covers, and the entries that cover none."""
    used: set[Allowed] = set()
    left = []
    for offence in found:
        match = next((a for a in allowed if a.path == offence.path and a.fragment in offence.text), None)
        if match is None:
            left.append(offence)
        else:
            used.add(match)
    return left, [a for a in allowed if a not in used]


def test_patterns_catch_what_they_name() -> None:
    caught = ["measured on 2026-11-28", "on an H200 it", "on 2 cores the", "costs 0.4 ms a call",
              "p99 1.25x ZeroBatch's", "85 % of the queries", "0.67-0.85x of", "took 3.5 s", "a 110 µs copy"]
    passed = ["bs_max rows", "a 224x224 image", "stage k+1", "0x1f", "the s of each", "x2 the batch",
              "every core of its own", "the profile's seconds"]
    for text in caught:
        assert any(p.search(text) for p in PATTERNS.values()), text
    for text in passed:
        assert not any(p.search(text) for p in PATTERNS.values()), text


def test_prose_lines_reads_comments_and_docstrings_only() -> None:
    source = '"""Module 5 ms."""\nx = "10 ms"  # 2 ms\n\n\ndef f():\n    """Line one.\n\n    3 %."""\n    return "4 %"\n'
    lines = prose_lines(source)
    assert sorted(lines) == [1, 2, 6, 7, 8]
    assert "10 ms" not in lines[2] and "2 ms" in lines[2]


def test_comments_and_docstrings_state_rules_not_runs() -> None:
    left, stale = unallowed(offences(), allowlist())
    assert not left, "figures, dates or machines in comments (move them to docs/benchmarks.md, or allowlist " \
                     "with a reason):\n" + "\n".join(map(str, left))
    assert not stale, f"allowlist entries that match nothing: {stale}"


if __name__ == "__main__":
    everything = offences()
    remaining, unused = unallowed(everything, allowlist()) if ALLOWLIST.exists() else (everything, [])
    print("\n".join(map(str, remaining)))
    print(f"{len(everything)} offending lines, {len(remaining)} outside the allowlist, "
          f"{len(unused)} unused allowlist entries", file=sys.stderr)
