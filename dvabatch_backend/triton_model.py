"""What a `model.py` written by a slicer before the adapter moved to `triton_adapter` imports.

Such a model folder was sliced by an older dvabatch: its manifest and stages may not say what this
one needs. It is not loaded; Triton reports this module's error as the model's load error.
"""
raise ImportError(
    "this model's model.py was written by an older dvabatch (it imports dvabatch_backend.triton_model): "
    "re-slice the model with `dvabatch slice MODEL.onnx --out REPOSITORY/NAME`, which writes a current "
    "model.py (it imports dvabatch_backend.triton_adapter.model)")
