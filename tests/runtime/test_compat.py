"""A model folder sliced by an older dvabatch is refused at load with what to do: re-slice it."""
from __future__ import annotations

import sys

import pytest

# What the slicer wrote into model.py before the runtime's packages were split by layer.
LEGACY_MODEL_PY = """from dvabatch_backend.triton_model import TritonPythonModel  # noqa: F401
"""


def test_an_old_model_py_is_told_to_re_slice() -> None:
    sys.modules.pop("dvabatch_backend.triton_model", None)
    with pytest.raises(ImportError, match="re-slice the model with `dvabatch slice"):
        exec(compile(LEGACY_MODEL_PY, "model.py", "exec"), {})

