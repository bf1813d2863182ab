"""A model sliced in fp16, served from the real tritonserver beside ZeroBatch on the same unsliced
fp16 model: both answer concurrent queries of mixed lengths, over HTTP and gRPC, within fp16's
tolerance of the fp32 model run on each query alone, shapes and types included."""
from __future__ import annotations

import threading

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto

from dvabatch_backend.runtime.manifest import Manifest
from dvabatch_backend.tools.serve import TritonServer
from perf.baselines import zero_batch
from slicer.precision import PRECISIONS, output_error
from slicer.profiler import int_bounds, random_inputs
from slicer.slice_model import SliceOptions, slice_model
from slicer.zoo import build

from ..triton_support import Clients

FP16 = PRECISIONS["fp16"]


def test_fp16_served_beside_zerobatch_in_fp16_answers_within_its_tolerance(tmp_path) -> None:
    repo = tmp_path / "repository"
    model = build("bert")
    report = slice_model(model, repo / "bert_fp16", SliceOptions(
        stages=2, max_batch_size=8, max_length=32, repeats=2, calibration_rounds=0, batch_sizes=(1, 2, 4, 8),
        precision="fp16"))
    version_dir = report.out_dir / "1"
    zero_batch(repo, version_dir, "bert_fp16_zerobatch")
    baseline_model = onnx.load(str(repo / "bert_fp16_zerobatch" / "1" / "model.onnx"))
    assert TensorProto.FLOAT16 in {t.data_type for t in baseline_model.graph.initializer}  # the same precision
    manifest = Manifest.load(version_dir / "manifest.json")
    full = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in full.get_outputs()]
    rng = np.random.default_rng(11)
    queries = [{k: v[0] for k, v in random_inputs(manifest.inputs, 1, int(n), rng, int_bounds(model)).items()}
               for n in rng.integers(1, 33, size=8)]
    failures: list[str] = []

    def send(call, served: str, query: dict[str, np.ndarray]) -> None:
        try:
            got = call(served, query)
            expected = full.run(None, {k: v[None] for k, v in query.items()})
            for name, want in zip(names, expected):
                assert got[name].shape == want[0].shape and got[name].dtype == want.dtype, name
                error = output_error(got[name], want[0])
                assert error <= FP16.tolerance, f"{served} {name}: {error:.3g}"
        except Exception as exc:  # collected: every query must be answered within the tolerance
            failures.append(f"{served}: {type(exc).__name__}: {exc}")

    with TritonServer(repo) as server:
        for served in ("bert_fp16", "bert_fp16_zerobatch"):
            server.wait_model_ready(served, timeout=180)
        clients = Clients(server.http_url, server.grpc_url)
        modes = clients.modes()
        work = [(modes[mode], served, query) for served in ("bert_fp16", "bert_fp16_zerobatch")
                for mode, query in zip(sorted(modes) * 2, queries)]
        threads = [threading.Thread(target=send, args=item) for item in work]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert failures == []
