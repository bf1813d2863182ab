"""Layers import only downward: runtime core (0) <- policies (1) <- slicer (2) <- triton adapter (3)
<- tools (4) <- perf (5). Every import in the project's sources is read with `ast` (also those
inside functions and under TYPE_CHECKING; relative ones resolved), mapped to a layer by module
name, and must not reach a higher layer. The runtime core also imports nothing of Triton's."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, Mapping

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("dvabatch_backend", "policies", "slicer", "perf")

# module-name prefix -> layer; a prefix matches the module itself and everything under it, except
# the bare `dvabatch_backend` (the package __init__), which matches only itself
LAYERS: dict[str, int] = {
    "dvabatch_backend": 0,
    "dvabatch_backend.runtime": 0,
    "policies": 1,
    "slicer": 2,
    "dvabatch_backend.triton_adapter": 3,
    "dvabatch_backend.triton_model": 3,  # what an old model.py imports: it says to re-slice
    "dvabatch_backend.tools": 4,
    "perf": 5,
}
LAYER_NAMES = {0: "runtime", 1: "policies", 2: "slicer", 3: "triton adapter", 4: "tools", 5: "perf"}
# third-party modules the runtime core must not import (it runs outside Triton too)
RUNTIME_FORBIDDEN = ("triton_python_backend_utils", "tritonclient")


def layer_of(module: str) -> int | None:
    """The layer of a project module, None for one outside the map (or outside the project)."""
    best, layer = "", None
    for prefix, value in LAYERS.items():
        exact_only = prefix == "dvabatch_backend"
        if module == prefix or (not exact_only and module.startswith(prefix + ".")):
            if len(prefix) > len(best):
                best, layer = prefix, value
    return layer


def is_project(module: str) -> bool:
    return module.split(".")[0] in PACKAGES


def project_sources(root: Path = ROOT) -> dict[str, tuple[str, bool]]:
    """module name -> (source, is_package) for every .py under the project packages."""
    out: dict[str, tuple[str, bool]] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            out[".".join(parts)] = (path.read_text(encoding="utf-8"), is_package)
    return out


def imports(module: str, source: str, is_package: bool, known: set[str]) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) for every import in `source`, wherever it stands."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source, filename=module)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".") if package else []
                base_parts = parts[: len(parts) - (node.level - 1)] if node.level > 1 else parts
                if node.level - 1 > len(parts):
                    yield node.lineno, "<relative import beyond the top package>"
                    continue
                base = ".".join(base_parts)
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                yield node.lineno, sub if sub in known else target  # `from pkg import submodule`


def violations(sources: Mapping[str, tuple[str, bool]]) -> list[str]:
    known = set(sources)
    found: list[str] = []
    for module, (source, is_package) in sorted(sources.items()):
        own = layer_of(module)
        if own is None:
            found.append(f"{module}: not mapped to a layer (add it to LAYERS)")
            continue
        for line, target in sorted(set(imports(module, source, is_package, known))):
            if own == 0 and any(target == f or target.startswith(f + ".") for f in RUNTIME_FORBIDDEN):
                found.append(f"{module}:{line} imports {target} (the runtime core imports nothing of Triton's)")
            if not is_project(target):
                continue
            theirs = layer_of(target)
            if theirs is None:
                found.append(f"{module}:{line} imports {target}, which is not mapped to a layer")
            elif theirs > own:
                found.append(f"{module}:{line} imports {target}: layer {theirs} ({LAYER_NAMES[theirs]}) "
                             f"above layer {own} ({LAYER_NAMES[own]})")
    return found


def test_layers_import_only_downward() -> None:
    sources = project_sources()
    assert "dvabatch_backend.runtime.scheduler" in sources and "perf" in sources  # the scan found the tree
    found = violations(sources)
    assert found == [], "imports against the layering:\n" + "\n".join(found)


def test_the_checker_catches_upward_imports_and_triton_in_the_runtime() -> None:
    sources = {
        "dvabatch_backend": ("from .runtime import *\n", True),
        "dvabatch_backend.runtime": ("from .scheduler import Scheduler\n", True),
        "dvabatch_backend.runtime.scheduler": (
            "import numpy\n"
            "from . import engine\n"
            "def late():\n"
            "    from ..tools import serve\n"  # relative, inside a function: layer 4
            "    import tritonclient.grpc\n"
            "    return serve\n", False),
        "dvabatch_backend.runtime.engine": ("from typing import TYPE_CHECKING\n"
                                            "if TYPE_CHECKING:\n"
                                            "    from policies.api import Policy\n", False),
        "dvabatch_backend.tools": ("", True),
        "dvabatch_backend.tools.serve": ("from perf.load import wire\nfrom ..runtime import scheduler\n", False),
        "policies": ("from dvabatch_backend.runtime import scheduler\n", True),
        "policies.api": ("from dvabatch_backend import Scheduler\n", False),
        "perf": ("", True),
        "perf.load.wire": ("from dvabatch_backend.tools.serve import x\nfrom slicer import cut\n", False),
        "dvabatch_backend.newthing": ("", False),
    }
    # perf and policies import only below themselves, and `from . import engine` stays in the runtime:
    # none of those is reported
    assert violations(sources) == [
        "dvabatch_backend.newthing: not mapped to a layer (add it to LAYERS)",
        "dvabatch_backend.runtime.engine:3 imports policies.api: layer 1 (policies) above layer 0 (runtime)",
        "dvabatch_backend.runtime.scheduler:4 imports dvabatch_backend.tools.serve: layer 4 (tools) above layer 0 (runtime)",
        "dvabatch_backend.runtime.scheduler:5 imports tritonclient.grpc (the runtime core imports nothing of Triton's)",
        "dvabatch_backend.tools.serve:1 imports perf.load.wire: layer 5 (perf) above layer 4 (tools)",
    ]
