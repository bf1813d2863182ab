"""The command of a docs page generated from the code (`config_reference`, `cli_reference`): print
it, write it, or check that the page in docs/ is the one the code generates."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable


def page_command(argv: list[str] | None, description: str, page: Path, render: Callable[[], str], module: str) -> int:
    """`--write` writes `render()` to `page`; `--check` exits 1 where `page` differs from it; else
    the page is printed."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=description)
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", action="store_true", help=f"write the page to {page}")
    action.add_argument("--check", action="store_true", help="exit 1 where the page differs from the code")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        page.write_text(text, encoding="utf-8")
    elif args.check:
        if not page.is_file() or page.read_text(encoding="utf-8") != text:
            print(f"{page} is stale: run python -m {module} --write", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(text)
    return 0
