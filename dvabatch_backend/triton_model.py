"""Kept for `model.py` files written by slicers before the adapter moved to `triton_adapter`.

Those files import `dvabatch_backend.triton_model.TritonPythonModel`; it still loads. Re-slice
to get a `model.py` that imports `dvabatch_backend.triton_adapter.model` directly.
"""
from .triton_adapter.model import TritonPythonModel  # noqa: F401
