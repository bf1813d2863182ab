"""The configuration page (docs/configuration.md) says what the code does: every parameter the adapter
reads and every built-in policy's parameter has a row with a default and a meaning, no row names a
parameter that does not exist, and the values an empty config resolves to on the CPU, on CUDA and on
the stand-in are the ones the page gives."""
from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from dvabatch_backend.runtime.settings import RuntimeSettings
from dvabatch_backend.tools import config_reference as ref
from dvabatch_backend.triton_adapter.config import PARAMETERS, POLICY_PREFIX, parse_parameters
from policies import BUILTIN

PAGE = ref.PAGE.read_text(encoding="utf-8")
TARGET_COLUMNS = {name: 1 + i for i, name in enumerate(ref.TARGETS)}  # column of each target's value


def parameter_rows(page: str = PAGE) -> dict[str, list[str]]:
    """The adapter's parameter rows (those with a column per target), by parameter name."""
    width = 3 + len(ref.TARGETS)
    return {cells[0].strip("`"): cells for cells in ref.table_rows(page) if len(cells) == width}


def policy_rows(page: str = PAGE) -> dict[tuple[str, str], list[str]]:
    """The policy parameter rows, by (policy, parameter without the prefix)."""
    return {(cells[1].strip("`"), cells[0].strip("`")[len(POLICY_PREFIX):]): cells
            for cells in ref.table_rows(page) if cells[0].startswith(f"`{POLICY_PREFIX}")}


def test_the_page_is_the_one_the_code_generates() -> None:
    assert PAGE == ref.render(), "docs/configuration.md is stale: python -m dvabatch_backend.tools.config_reference --write"


@pytest.mark.parametrize("target", list(ref.TARGETS))
def test_an_empty_config_resolves_to_the_values_on_the_page(target: str, tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text("{}")
    settings = parse_parameters(ref.TARGETS[target], tmp_path)  # the loader's own call, files checked
    rows = parameter_rows()
    for name, parameter in PARAMETERS.items():
        assert rows[name][TARGET_COLUMNS[target]] == ref.cell(parameter.value(settings)), (name, target)


def check_parameter_rows(page: str) -> None:
    rows = parameter_rows(page)
    assert set(rows) == set(PARAMETERS), f"undocumented: {set(PARAMETERS) - set(rows)}; absent: {set(rows) - set(PARAMETERS)}"
    for name, cells in rows.items():
        assert cells[-2] and cells[-1], f"{name}: no default or no meaning"


def test_every_parameter_has_a_row_with_a_default_and_a_meaning_and_no_row_is_stale() -> None:
    check_parameter_rows(PAGE)


def test_every_policy_parameter_has_a_row_and_a_meaning() -> None:
    expected = {(policy, name) for policy, factory in BUILTIN.items()
                for name, p in inspect.signature(factory.__init__).parameters.items()
                if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    rows = policy_rows()
    assert set(rows) == expected, f"undocumented: {expected - set(rows)}; absent: {set(rows) - expected}"
    for key, cells in rows.items():
        assert cells[-1], f"policy {key[0]!r} parameter {key[1]!r}: no meaning in its constructor's Args"


def test_where_the_library_and_a_served_model_differ_the_page_says_both() -> None:
    differing = ref.served_differences()
    assert {name for name, _, _ in differing} >= {"num_buffer_pairs", "threads_per_stage"}
    for name, library, served in differing:
        assert f"| `{name}` | {ref.cell(library)} | {ref.cell(served)} |" in PAGE
        assert getattr(RuntimeSettings(), name) == library


def test_a_parameter_without_a_meaning_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above bites: a parser added with no meaning, or not on the page, fails it."""
    from dvabatch_backend.triton_adapter import config, parameters

    extra = config.Parameter(parameters.boolean, "", "", lambda s: None)
    monkeypatch.setitem(config.PARAMETERS, "undocumented_knob", extra)
    with pytest.raises(AssertionError, match="undocumented: {'undocumented_knob'}"):
        check_parameter_rows(PAGE)  # the committed page lacks it
    with pytest.raises(AssertionError, match="undocumented_knob: no default or no meaning"):
        check_parameter_rows(ref.render())  # regenerated, its row is empty


def test_docstring_args_reads_each_argument_and_its_continuation() -> None:
    doc = "Summary.\n\nArgs:\n    a: first\n        more.\n    b (int): second.\n\nReturns:\n    x\n"
    assert ref.docstring_args(doc) == {"a": "first more.", "b": "second."}
