"""Input-length distributions for sequence models: GLUE-like presets, "uniform" and "fixed".

    sample_lengths("rte", 1000, max_length=128, rng=np.random.default_rng(0))  # -> int64 [1000]

The paper (§3.1, Figure 4; §8.4) feeds BERT with the sequence lengths of GLUE tasks: most
sentences have 5-20 words, some more than 100. The GLUE data is not shipped here, so every
GLUE preset is a **parametric approximation**: a mixture of log-normal components (median in
tokens, log-space sigma), chosen to resemble each task's BERT-token length histogram (its
bulk, its spread, its tail). They are not fitted to the real data; what they preserve is the
ordering the paper relies on: single-sentence tasks are short with a skewed tail (SST-2 more
imbalanced than CoLA), pair tasks are longer (MRPC narrow, QNLI/RTE with a long tail).

| preset | shape | approx. median / p95 (tokens, unclipped) |
|---|---|---|
| cola  | single sentence, short, little tail          | 10 / 19  |
| sst2  | single sentence, mostly 5-20, a 10 % tail    | 12 / 40  |
| mrpc  | sentence pair, narrow                        | 50 / 80  |
| stsb  | sentence pair, short                         | 27 / 50  |
| qqp   | question pair, short with a tail             | 28 / 60  |
| mnli  | sentence pair, medium                        | 38 / 75  |
| qnli  | question + sentence, medium with a tail      | 46 / 100 |
| rte   | long premise + hypothesis, tail past 100     | 45 / 150 |

"uniform" draws 1..max_length; "fixed" always gives `length` (default max_length); the form
"fixed:16" names the length inline. Every sample is rounded and clipped to [1, max_length], so
with a small `max_length` (e.g. 32 for the test-size BERT) the long presets pile up at the cap.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = ["PRESETS", "LogNormalMix", "describe", "names", "sample_lengths"]


@dataclass(frozen=True)
class LogNormalMix:
    """A mixture of log-normal components over token counts: (weight, median, sigma) each."""

    description: str
    components: tuple[tuple[float, float, float], ...]

    def __post_init__(self) -> None:
        weights = [w for w, _, _ in self.components]
        if not self.components or any(w <= 0 for w in weights) or abs(sum(weights) - 1.0) > 1e-9:
            raise ValueError(f"mixture weights must be positive and sum to 1, got {weights}")
        if any(m <= 0 or s < 0 for _, m, s in self.components):
            raise ValueError(f"medians must be > 0 and sigmas >= 0: {self.components}")

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """Unclipped real-valued lengths."""
        weights = np.array([w for w, _, _ in self.components])
        medians = np.array([m for _, m, _ in self.components])
        sigmas = np.array([s for _, _, s in self.components])
        which = rng.choice(len(weights), size=n, p=weights) if len(weights) > 1 else np.zeros(n, dtype=int)
        return np.exp(np.log(medians[which]) + sigmas[which] * rng.standard_normal(n))


PRESETS: dict[str, LogNormalMix] = {
    "cola": LogNormalMix("CoLA-like: single short sentences, little tail (approximation)",
                         ((1.0, 10.0, 0.40),)),
    "sst2": LogNormalMix("SST-2-like: mostly 5-20 tokens, a tail of longer reviews (approximation)",
                         ((0.9, 11.0, 0.45), (0.1, 35.0, 0.45))),
    "mrpc": LogNormalMix("MRPC-like: sentence pairs, narrow around 50 tokens (approximation)",
                         ((1.0, 50.0, 0.28),)),
    "stsb": LogNormalMix("STS-B-like: short sentence pairs (approximation)",
                         ((1.0, 27.0, 0.38),)),
    "qqp": LogNormalMix("QQP-like: question pairs, short with a tail (approximation)",
                        ((0.95, 27.0, 0.38), (0.05, 70.0, 0.45))),
    "mnli": LogNormalMix("MNLI-like: premise + hypothesis, medium (approximation)",
                         ((1.0, 38.0, 0.42),)),
    "qnli": LogNormalMix("QNLI-like: question + sentence, medium with a long tail (approximation)",
                         ((0.95, 44.0, 0.40), (0.05, 140.0, 0.45))),
    "rte": LogNormalMix("RTE-like: long premise, tail past 100 tokens (approximation)",
                        ((0.7, 35.0, 0.45), (0.3, 95.0, 0.45))),
}

_SPECIAL: dict[str, str] = {
    "uniform": "uniform over 1..max_length",
    "fixed": "every query has the same length (`length`, default max_length; or 'fixed:N')",
}


def names() -> list[str]:
    """Every distribution `sample_lengths` knows."""
    return sorted(PRESETS) + sorted(_SPECIAL)


def describe(name: str) -> str:
    base = name.split(":", 1)[0]
    if base in PRESETS:
        return PRESETS[base].description
    if base in _SPECIAL:
        return _SPECIAL[base]
    raise ValueError(f"unknown length distribution {name!r}; known: {names()}")


def sample_lengths(name: str, n: int, max_length: int, rng: np.random.Generator | int | None = None,
                   *, length: int | None = None) -> np.ndarray:
    """`n` input lengths (int64) from distribution `name`, each in [1, max_length].

    `rng` is a numpy Generator or a seed; the same seed gives the same lengths."""
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    base, _, arg = name.partition(":")
    sampler = _sampler(base, arg, length)
    raw = sampler(n, max_length, rng)
    return np.clip(np.rint(raw), 1, max_length).astype(np.int64)


def _sampler(base: str, arg: str, length: int | None) -> Callable[[int, int, np.random.Generator], np.ndarray]:
    if base in PRESETS:
        if arg:
            raise ValueError(f"preset {base!r} takes no argument (got {arg!r})")
        mix = PRESETS[base]
        return lambda n, _max, rng: mix.sample(n, rng)
    if base == "uniform":
        return lambda n, max_length, rng: rng.integers(1, max_length + 1, size=n)
    if base == "fixed":
        if arg:
            try:
                length = int(arg)
            except ValueError:
                raise ValueError(f"'fixed:N' needs an integer N, got {arg!r}") from None
        if length is not None and length < 1:
            raise ValueError(f"fixed length must be >= 1, got {length}")
        return lambda n, max_length, rng: np.full(n, max_length if length is None else length)
    raise ValueError(f"unknown length distribution {base!r}; known: {names()}")
