"""Models the project never built itself, exported as a user's would be, for the light-load benchmark:

    python -m perf.compare.exports gpt --out work/perf/fixed/gpt_small.onnx

`gpt`: a GPT-like decoder, transformers' `GPT2Model` (4 layers, width 256, 4 heads, 128 positions,
a vocabulary of 1,000, seeded weights, no cache), exported by `torch.onnx.export` (TorchScript, opset
17) with its batch and sequence axes dynamic ("N", "T"): about 1-2 ms a lone query on 2 cores.
Needs torch and transformers (the test extras).
"""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Sequence

GPT = dict(vocab_size=1000, n_positions=128, n_embd=256, n_layer=4, n_head=4)


def export_gpt(out: Path, seed: int = 0) -> Path:
    """The GPT-like decoder (module docstring) at `out`: inputs input_ids and attention_mask [N, T]
    (int64), output last_hidden_state [N, T, 256]."""
    import torch
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(seed)
    inner = GPT2Model(GPT2Config(**GPT, use_cache=False, bos_token_id=GPT["vocab_size"] - 1,
                                 eos_token_id=GPT["vocab_size"] - 1)).eval()

    class Decoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state

    ids = torch.randint(0, GPT["vocab_size"], (2, 8))
    axes = {0: "N", 1: "T"}
    out.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(Decoder(), (ids, torch.ones_like(ids)), str(out), input_names=["input_ids", "attention_mask"],
                          output_names=["last_hidden_state"], opset_version=17, dynamo=False,
                          dynamic_axes={"input_ids": axes, "attention_mask": axes, "last_hidden_state": axes})
    return out


EXPORTS = {"gpt": export_gpt}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.compare.exports", description=__doc__.split("\n\n")[0])
    parser.add_argument("name", choices=sorted(EXPORTS))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    print(f"wrote {EXPORTS[args.name](args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
