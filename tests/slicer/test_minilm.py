"""The MiniLM-L6 model built from the package's weights matches an independent reference
computation (Hugging Face transformers on CPU, same safetensors), sentence by sentence."""
from __future__ import annotations

import os

import numpy as np
import onnxruntime as ort
import pytest

from slicer.zoo.transformer import minilm, minilm_dir, tokenize

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A serving system batches queries to use the hardware well.",
    "Short one.",
    "DVABatch lets late queries join a running batch and short queries leave it early.",
]


def _reference(texts: list[str]) -> np.ndarray:
    os.environ["HF_HUB_OFFLINE"] = "1"
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(minilm_dir()))
    model = transformers.AutoModel.from_pretrained(str(minilm_dir())).eval()
    out = []
    with torch.no_grad():
        for text in texts:
            enc = tokenizer(text, return_tensors="pt")
            hidden = model(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).float()
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            out.append(torch.nn.functional.normalize(pooled, dim=-1)[0].numpy())
    return np.stack(out)


def test_minilm_sentence_embeddings_match_transformers() -> None:
    reference = _reference(SENTENCES)
    session = ort.InferenceSession(minilm().SerializeToString(), providers=["CPUExecutionProvider"])
    for text, ref, feed in zip(SENTENCES, reference, tokenize(SENTENCES)):
        (embedding,) = session.run(["sentence_embedding"], {k: v[None] for k, v in feed.items()})
        cosine = float(embedding[0] @ ref / (np.linalg.norm(embedding[0]) * np.linalg.norm(ref)))
        assert cosine >= 0.9999, (text, cosine)
    # the embeddings carry meaning: the two sentences about batching are closer than unrelated ones
    sims = reference @ reference.T
    assert sims[1, 3] > sims[0, 1]
