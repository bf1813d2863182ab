"""The slicer's one error type."""
from __future__ import annotations


class SliceError(ValueError):
    """The model cannot be sliced as asked; the message (one line) names the problem."""


def one_line(exc: BaseException, limit: int = 400) -> str:
    """`exc` as one line: its type unless it is ours, its message with newlines and runs of blanks
    collapsed, cut at `limit` characters (onnxruntime's messages carry source paths and signatures)."""
    text = " ".join(str(exc).split())
    if len(text) > limit:
        text = text[: limit - 3].rstrip() + "..."
    if isinstance(exc, SliceError):
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
