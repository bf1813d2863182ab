"""The `dvabatch` command as a user meets it: its version, help with defaults, sub-commands, unknown
flags refused, `compare`'s flags handed to `perf.compare`, and docs/cli.md generated from the parser."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from dvabatch_backend.tools import cli, cli_reference

PAGE = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def test_the_cli_page_is_generated_from_the_parser() -> None:
    assert PAGE.read_text(encoding="utf-8") == cli_reference.render(), \
        "docs/cli.md is stale: python -m dvabatch_backend.tools.cli_reference --write"


def test_version_is_the_installed_packages(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"dvabatch {cli.version()}"


@pytest.mark.parametrize("argv", [["slice", "m.onnx", "--out", "x", "--bogus"], ["zoo", "bert"],
                                  ["zoo", "bert", "--out", "b.onnx", "--size", "huge"], ["compare", "d", "--bogus"],
                                  ["zoo", "nosuchmodel", "--out", "b.onnx"]])
def test_unknown_flags_missing_required_ones_and_bad_choices_are_refused(argv, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2 and "error:" in capsys.readouterr().err


def _flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and not isinstance(a, (argparse._HelpAction,
                                                                                 argparse._VersionAction))]


def test_every_flag_has_help_and_its_default_shows() -> None:
    for name, sub in cli_reference._subcommands(cli.build_parser()):
        text = sub.format_help()
        for action in _flags(sub):
            assert action.help, f"dvabatch {name} {action.option_strings[0]} has no help"
            if action.nargs != 0 and action.default not in (None, []):
                assert f"(default: {action.default})" in " ".join(text.split()) or "(default" in action.help, \
                    f"dvabatch {name} {action.option_strings[0]}: its default is not shown"


def test_zoo_list_is_a_sub_command(capsys) -> None:
    assert cli.main(["zoo", "list"]) == 0
    listed = capsys.readouterr().out
    assert "bert" in listed and "resnet152" in listed and "sizes:" in listed


def test_compare_hands_its_flags_to_perf_compare() -> None:
    parser = cli.build_parser()
    own = cli.compare_arguments(parser.parse_args(["compare", "repo/m", "--loads", "0.3,0.6", "--seconds", "20"]))
    assert own == ["--model-dir", "repo/m", "--driver", "own", "--loads", "0.3,0.6", "--seconds", "20"]
    demo = cli.compare_arguments(parser.parse_args(["compare", "--demo", "work/demo", "--out", "o"]))
    assert demo == ["--demo", "work/demo", "--driver", "own", "--out", "o"]
    pa = cli.compare_arguments(parser.parse_args(["compare", "repo/m", "--driver", "perf_analyzer"]))
    assert pa == ["--model-dir", "repo/m", "--driver", "perf_analyzer"]
    stand_in = cli.compare_arguments(parser.parse_args(["compare", "repo/m", "--device", "simulated",
                                                        "--device-profile", "p.json"]))
    assert stand_in == ["--model-dir", "repo/m", "--device", "simulated", "--device-profile", "p.json"]


def test_compare_refuses_flags_its_driver_does_not_take(capsys) -> None:
    assert cli.main(["compare", "repo/m", "--driver", "perf_analyzer", "--loads", "0.5"]) == 2
    assert "--loads and --seconds are the own driver's" in capsys.readouterr().err
    assert cli.main(["compare", "--demo", "d", "--device", "cuda"]) == 2
    assert cli.main(["compare", "repo/m", "--device", "simulated"]) == 2


def test_compare_needs_one_model(capsys) -> None:
    assert cli.main(["compare"]) == 2
    assert "MODEL_DIR or --demo" in capsys.readouterr().err
