"""slicer/trt.py without TensorRT: it imports, says TensorRT is unavailable, and type-checks.

No GPU and no TensorRT here, so the TensorRT code is checked statically: mypy runs on
slicer/trt.py against the TensorRT 10 type stubs of the `tensorrt-stubs` package, strictly
enough that API misuse (a TensorRT 8 call such as `execute_async_v2`, a wrong argument
type) is an error. A control file of known misuses is checked in the same run and must
produce exactly its expected errors: that proves mypy really saw the stubs, since a
`tensorrt` that resolved to nothing (Any) would let every misuse through.

The published stubs cannot be used as installed, so the test prepares a copy:

- they sit in site-packages as plain `tensorrt/` and `tensorrt_bindings/` folders of .pyi
  files without a `py.typed` marker, which mypy refuses to read there (it reports
  "missing library stubs or py.typed marker" and types everything `Any`); the copy is put
  on `mypy_path` instead;
- `tensorrt_bindings/tensorrt.pyi` has a few lines that are not valid Python (parameters
  named `in`, a parameter without a default after ones with defaults), which stops mypy
  outright; the copy renames those parameters `in_` and gives the others `= ...`;
- `trt.bool` (the data type) is declared at module level, which shadows the builtin in
  every annotation of the stubs: "-> bool" becomes an unanalyzable type that makes mypy
  call `if not parser.parse(...)` branches unreachable; the copy writes `builtins.bool`;
- the stubs' other faults are not ours to report: errors inside the stub modules are
  ignored, their types are still used.

mypy is the only thing skipped on: without it the test skips; without `tensorrt-stubs` it
fails, saying how to install them (`pip install --no-deps tensorrt-stubs==10.13.0.35.1`:
without --no-deps pip also tries to install TensorRT itself, from NVIDIA's index).
"""
from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import keyword
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TARGET = "slicer/trt.py"
STUBS_DISTRIBUTION = "tensorrt-stubs"
STUB_PACKAGES = ("tensorrt", "tensorrt_bindings")
INSTALL_HINT = "pip install --no-deps 'tensorrt-stubs==10.13.0.35.1'"

# Strict: every def typed, no implicit Any generics, unused ignores and unreachable code
# reported. follow_imports=silent: modules trt.py imports (numpy, dvabatch_backend) give
# their types but not their own errors, so only slicer/trt.py and the control are judged.
MYPY_CONFIG = """\
[mypy]
mypy_path = {stubs}
strict = True
warn_unreachable = True
warn_unused_ignores = True
disallow_untyped_defs = True
follow_imports = silent
cache_dir = {cache}
show_error_codes = True
no_color_output = True
pretty = False

[mypy-tensorrt,tensorrt.*,tensorrt_bindings,tensorrt_bindings.*]
ignore_errors = True

[mypy-tensorrt_libs,tensorrt_libs.*]
ignore_missing_imports = True
"""

# Known misuses of the TensorRT 10 API; each line marked `# expect: CODE` must be reported
# with that error code, and no other line may be.
CONTROL = '''\
"""Misuses of the TensorRT 10 Python API that mypy must report with tensorrt-stubs."""
from __future__ import annotations

import tensorrt as trt


def trt8_calls(builder: trt.Builder, network: trt.INetworkDefinition, config: trt.IBuilderConfig,
               engine: trt.ICudaEngine, context: trt.IExecutionContext) -> None:
    builder.build_engine(network, config)  # expect: attr-defined
    context.execute_async_v2([0, 0], 0)  # expect: attr-defined
    engine.get_binding_index("input")  # expect: attr-defined
    config.max_workspace_size = 1 << 30  # expect: attr-defined
    context.set_binding_shape(0, (1, 3))  # expect: attr-defined


def wrong_arguments(context: trt.IExecutionContext, config: trt.IBuilderConfig) -> None:
    context.set_tensor_address("input", "0x0")  # expect: arg-type
    config.set_memory_pool_limit(trt.BuilderFlag.FP16, 1 << 30)  # expect: arg-type
    context.execute_async_v3()  # expect: call-arg


def trt10_calls(builder: trt.Builder, context: trt.IExecutionContext, stream: int) -> bytes:
    network = builder.create_network(0)
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, 1 << 30)
    context.set_input_shape("input", (1, 3))
    context.set_tensor_address("input", 0)
    context.execute_async_v3(stream)
    return bytes(builder.build_serialized_network(network, config))
'''

_DEF_LINE = re.compile(r"^(\s*def \w+\()(.*)(\)\s*(?:->.*)?:\s*)$")


def _split_parameters(text: str) -> list[str]:
    """Split a parameter list at top-level commas (annotations may hold `dict[str, X]`)."""
    parts, depth, current = [], 0, ""
    for char in text:
        depth += char in "([{"
        depth -= char in ")]}"
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    if current.strip():
        parts.append(current)
    return parts


def _repair_def(line: str) -> str:
    """Make one unparsable one-line `def` valid: keyword parameter names get a trailing `_`,
    parameters without a default after ones with defaults get `= ...`."""
    match = _DEF_LINE.match(line)
    if match is None:
        return line
    fixed, seen_default = [], False
    for parameter in _split_parameters(match.group(2)):
        name, colon, rest = parameter.strip().partition(":")
        name = name.strip()
        if keyword.iskeyword(name):
            name += "_"
        parameter = name + colon + rest
        if "=" in parameter:
            seen_default = True
        elif seen_default and not name.startswith("*"):
            parameter += " = ..."
        fixed.append(parameter.strip())
    return match.group(1) + ", ".join(fixed) + match.group(3)


_BUILTIN_BOOL = re.compile(r"(?<![\w.'\"])bool(?![\w'\"])")


def _qualify_builtin_bool(lines: list[str]) -> int:
    """Where the module declares `bool: ...` (TensorRT's data type), make annotations name
    `builtins.bool`. Returns the number of lines changed."""
    if not any(line.startswith("bool:") for line in lines):
        return 0
    changed = 0
    for i, line in enumerate(lines):
        if line.startswith("bool:") or line.startswith("__all__"):
            continue
        new = _BUILTIN_BOOL.sub("builtins.bool", line)
        changed += new != line
        lines[i] = new
    position = next((i + 1 for i, line in enumerate(lines) if line.startswith("from __future__")), 0)
    lines.insert(position, "import builtins")
    return changed


def _repaired_stubs(destination: Path) -> tuple[Path, int]:
    """Copy the installed TensorRT stubs to `destination`, making every file parse.

    Returns the folder for mypy_path and the number of lines repaired.
    """
    try:
        distribution = importlib.metadata.distribution(STUBS_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(f"{STUBS_DISTRIBUTION} is not installed; the test extra needs it: {INSTALL_HINT}")
    version = distribution.version
    assert version.split(".")[0] == "10", f"slicer/trt.py targets TensorRT 10, {STUBS_DISTRIBUTION} is {version}"
    stub_files = [f for f in distribution.files or () if f.parts[0] in STUB_PACKAGES and f.suffix == ".pyi"]
    assert {f.parts[0] for f in stub_files} == set(STUB_PACKAGES), f"unexpected layout of {STUBS_DISTRIBUTION} {version}"
    repaired = 0
    for file in stub_files:
        lines = Path(str(distribution.locate_file(file))).read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            if not line.lstrip().startswith("def "):
                continue
            try:
                ast.parse(line.strip() + " ...")
            except SyntaxError:
                lines[i] = _repair_def(line)
                repaired += 1
        repaired += _qualify_builtin_bool(lines)
        text = "\n".join(lines) + "\n"
        try:
            ast.parse(text, filename=str(file))
        except SyntaxError as exc:
            pytest.fail(f"{STUBS_DISTRIBUTION} {version}: {file} still does not parse after repair: {exc}")
        target = destination / file
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
    return destination, repaired


def _expected_errors(source: str) -> dict[int, str]:
    return {
        number: line.rsplit("# expect:", 1)[1].strip()
        for number, line in enumerate(source.splitlines(), start=1)
        if "# expect:" in line
    }


def test_trt_module_typechecks_against_tensorrt_stubs(tmp_path: Path) -> None:
    pytest.importorskip("mypy", reason="mypy is not installed (it is in the test extra)")
    stubs, _repaired = _repaired_stubs(tmp_path / "stubs")
    control = tmp_path / "trt_misuse_control.py"
    control.write_text(CONTROL, encoding="utf-8")
    config = tmp_path / "mypy.ini"
    config.write_text(MYPY_CONFIG.format(stubs=stubs, cache=tmp_path / "mypy_cache"), encoding="utf-8")

    command = [sys.executable, "-m", "mypy", "--config-file", str(config), TARGET, str(control)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode in (0, 1), f"mypy did not run ({result.returncode}):\n{output}"

    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    in_target = [line for line in errors if Path(line.split(":", 1)[0]).as_posix() == TARGET]
    assert not in_target, f"mypy finds errors in {TARGET}:\n" + "\n".join(in_target)

    reported: dict[int, list[str]] = {}
    for line in errors:
        path, number, rest = line.split(":", 2)
        if Path(path).name == control.name:
            reported.setdefault(int(number), []).append(rest)
    expected = _expected_errors(CONTROL)
    missing = [
        f"line {n}: {CONTROL.splitlines()[n - 1].strip()}"
        for n, code in expected.items()
        if not any(f"[{code}]" in message for message in reported.get(n, []))
    ]
    assert not missing, (
        "mypy let TensorRT API misuse through (are the stubs really used?):\n"
        + "\n".join(missing) + "\n\nmypy said:\n" + output
    )
    unexpected = {n: m for n, m in reported.items() if n not in expected}
    assert not unexpected, f"mypy reports errors on correct TensorRT 10 calls: {unexpected}\n{output}"
    others = [line for line in errors if line not in in_target and Path(line.split(":", 1)[0]).name != control.name]
    assert not others, "mypy reports errors elsewhere:\n" + "\n".join(others)


def test_stub_repair_is_minimal() -> None:
    assert _repair_def("    def f(self, in: list[int], out: list[int]) -> int:") == (
        "    def f(self, in_: list[int], out: list[int]) -> int:"
    )
    assert _repair_def("    def g(self, a: dict[str, int] = None, b: int) -> None:") == (
        "    def g(self, a: dict[str, int] = None, b: int = ...) -> None:"
    )
    lines = ["from __future__ import annotations", "__all__ = ['bool']", "class C:",
             "    def f(self, x: bool) -> list[bool]:", "        ':class:`bool`'", "bool: DataType"]
    assert _qualify_builtin_bool(lines) == 2
    assert lines == ["from __future__ import annotations", "import builtins", "__all__ = ['bool']", "class C:",
                     "    def f(self, x: builtins.bool) -> list[builtins.bool]:", "        ':class:`builtins.bool`'",
                     "bool: DataType"]


def _real_tensorrt_installed() -> bool:
    """A TensorRT package (its `tensorrt/__init__.py`), not just the stubs' .pyi folder."""
    spec = importlib.util.find_spec("tensorrt")
    return spec is not None and spec.origin is not None and spec.origin.endswith(".py")


needs_no_tensorrt = pytest.mark.skipif(_real_tensorrt_installed(), reason="TensorRT is installed here")


@needs_no_tensorrt
def test_import_without_tensorrt() -> None:
    import slicer.trt as trt_module

    assert trt_module.tensorrt_available() is False
    assert set(trt_module.__all__) <= set(dir(trt_module))


def test_stubs_alone_are_not_tensorrt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tensorrt-stubs leaves a `tensorrt/` folder of .pyi files that imports as an empty
    namespace package: tensorrt_available() must not take that for TensorRT."""
    from slicer.trt import tensorrt_available

    (tmp_path / "tensorrt").mkdir()
    (tmp_path / "tensorrt" / "__init__.pyi").write_text("class Builder: ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "tensorrt", raising=False)
    assert tensorrt_available() is False


@needs_no_tensorrt
def test_clear_errors_without_tensorrt(tmp_path: Path) -> None:
    from dvabatch_backend.runtime.manifest import TensorSpec
    from slicer.trt import TrtStageEngine, build_engine, profile_engine

    specs = [TensorSpec("x", "float32", ("batch", "seq", 4))]
    model = tmp_path / "stage.onnx"
    model.write_bytes(b"not used")
    with pytest.raises(ValueError, match="opt_batch"):
        build_engine(model, specs, bs_max=4, max_length=8, opt_batch=5, opt_length=4)
    with pytest.raises(ValueError, match="opt_length"):
        build_engine(model, specs, bs_max=4, max_length=8, opt_batch=2, opt_length=9)
    with pytest.raises(FileNotFoundError):
        build_engine(tmp_path / "missing.onnx", specs, bs_max=4, max_length=8, opt_batch=2, opt_length=4)
    with pytest.raises(RuntimeError, match="TensorRT is not installed"):
        build_engine(model, specs, bs_max=4, max_length=8, opt_batch=2, opt_length=4)
    with pytest.raises(RuntimeError, match="TensorRT is not installed"):
        TrtStageEngine(b"plan", specs, specs, bs_max=4, max_length=8)
    with pytest.raises(RuntimeError, match="TensorRT is not installed"):
        profile_engine(b"plan", specs, [1], [8])


def test_cuda_event_fence_needs_a_gpu() -> None:
    from slicer.trt import CudaEventFence, cuda_available

    if cuda_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(RuntimeError, match="cuda-python is not installed|CUDA call failed"):
        CudaEventFence()
