"""Operator diversity on this machine: slice UNet and LinkNet (real sizes) and report each stage's
preferred batch size and per-query time over batch sizes (paper §3, Figure 5 / §7.1).

    python -m perf.paper.operator_diversity [--models unet,linknet] [--stages 4] [--size real] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from slicer.slice_model import SliceOptions, slice_model
from slicer.zoo import build


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.paper.operator_diversity", description=__doc__)
    parser.add_argument("--models", default="unet,linknet")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--size", default="real")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--bs-max", type=int, default=64)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            options = SliceOptions(stages=args.stages, max_batch_size=args.bs_max, threads=args.threads, repeats=5,
                                   reference_batch=8)
            report = slice_model(build(name, args.size), Path(tmp) / name, options)
            profile = report.profile
            print(f"\n== {name} ({args.size}), {args.stages} stages, {args.threads} thread(s) per stage")
            print(report.summary())
            sizes = profile["batch_sizes"]
            print("per-query ms by batch size " + " ".join(f"{bs:>7}" for bs in sizes) + "   preferred")
            for stage in profile["stages"]:
                seconds = stage["seconds"]["0"]
                row = " ".join(f"{seconds[str(bs)] / bs * 1e3:7.3f}" for bs in sizes)
                print(f"  {stage['file']:<24} {row}   {stage['preferred_bs']['0']}")
            print("  " + "; ".join(profile["diversity"]["notes"]))
            results[name] = {"profile": profile, "balance": report.chosen.balance}
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
