"""docker/Dockerfile and deploy/k8s/dvabatch.yaml, checked as far as this machine can (no Docker, no
Kubernetes, no GPU here): the Dockerfile parses (every instruction known, every COPY source in the
repository), its model-building steps run here as written and give a GPU config, and the manifest
parses with the right kinds, probes, GPU limits, Prometheus annotations and ports matching the
image's."""
from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from slicer import model_config

yaml = pytest.importorskip("yaml")

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "docker" / "Dockerfile"
MANIFEST = REPO / "deploy" / "k8s" / "dvabatch.yaml"
INSTRUCTIONS = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME", "USER",
                "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL", "MAINTAINER"}
HTTP, GRPC, METRICS = 8000, 8001, 8002


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments), continuation lines joined, comments left out."""
    joined, current = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        joined.append(current.strip())
        current = ""
    assert not current, "the Dockerfile ends inside a continued line"
    return [(line.split(None, 1)[0], line.split(None, 1)[1] if " " in line else "") for line in joined]


def test_dockerfile_parses_and_copies_only_what_exists() -> None:
    instructions = dockerfile_instructions()
    assert instructions[0] == ("FROM", "nvcr.io/nvidia/tritonserver:24.10-py3")
    assert {name for name, _ in instructions} <= INSTRUCTIONS
    copies = [args.split() for name, args in instructions if name == "COPY"]
    assert copies
    for *sources, _target in copies:
        for source in sources:
            assert (REPO / source).exists(), f"COPY {source}: not in the repository"


def test_dockerfile_ports_and_command() -> None:
    instructions = dict((n, a) for n, a in dockerfile_instructions() if n in ("EXPOSE", "CMD"))
    assert {int(p) for p in instructions["EXPOSE"].split()} == {HTTP, GRPC, METRICS}
    command = json.loads(instructions["CMD"])
    assert command[0] == "tritonserver"
    assert {f"--http-port={HTTP}", f"--grpc-port={GRPC}", f"--metrics-port={METRICS}"} <= set(command)


def test_dockerfile_model_steps_run_here_and_give_a_gpu_config(tmp_path: Path) -> None:
    """The RUN that builds the served model, run as written with its paths moved into tmp_path (and
    `dvabatch`/`python` as this interpreter): the slicer's model folder with a KIND_GPU, torch,
    cuda config."""
    run = next(a for n, a in dockerfile_instructions() if n == "RUN" and "dvabatch slice" in a)
    run = run.replace("${MODEL_NAME}", "token_mlp").replace("/tmp/", f"{tmp_path}/").replace("/models/", f"{tmp_path}/models/")
    for command in run.split("&&"):
        argv = shlex.split(command)
        if argv[0] == "dvabatch":
            argv = [sys.executable, "-m", "dvabatch_backend.tools.cli", *argv[1:]]
        elif argv[0] == "python":
            argv = [sys.executable, *argv[1:]]
        subprocess.run(argv, cwd=REPO, check=True, capture_output=True, timeout=240)
    config = model_config.read(tmp_path / "models" / "token_mlp" / "config.pbtxt")
    assert [g.kind for g in config.instance_group] == [model_config.pb.ModelInstanceGroup.KIND_GPU]
    written = model_config.parameters(config)
    for key, value in (("engine", "torch"), ("device", "cuda"), ("FORCE_CPU_ONLY_INPUT_TENSORS", "yes")):
        assert written[key] == value
    assert (tmp_path / "models" / "token_mlp" / "1" / "manifest.json").is_file()
    assert not (tmp_path / "model.onnx").exists()


def test_gpu_config_replaces_what_was_set() -> None:
    sys.path.insert(0, str(REPO / "docker"))
    try:
        from gpu_config import gpu_config
    finally:
        sys.path.pop(0)
    text = ('name: "m"\ninstance_group [ { kind: KIND_CPU count: 1 } ]\n'
            'parameters: { key: "engine" value: { string_value: "onnxruntime" } }\n'
            'parameters: { key: "policy" value: { string_value: "input" } }\n'
            'parameters: { key: "num_buffer_pairs" value: { string_value: "1" } }\n')
    out = model_config.parse(gpu_config(text, gpus=2))
    (group,) = out.instance_group
    assert group.kind == model_config.pb.ModelInstanceGroup.KIND_GPU and list(group.gpus) == [0, 1]
    written = model_config.parameters(out)
    # the CPU's one pair is dropped for the adapter's GPU default; the engine is replaced
    assert "num_buffer_pairs" not in written and written["engine"] == "torch"
    assert written["policy"] == "input"  # kept
    chosen = {"slicing": {"buffer_pairs": {"chosen": 1, "why": "measured on the device"}}}
    assert model_config.parameters(gpu_config(text, manifest=chosen))["num_buffer_pairs"] == "1"
    with pytest.raises(ValueError):
        gpu_config('name: "m"\n')


def manifest_documents() -> dict[str, dict]:
    documents = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    return {d["kind"]: d for d in documents}


def test_manifest_is_a_deployment_and_a_service() -> None:
    documents = manifest_documents()
    assert set(documents) == {"Deployment", "Service"}
    deployment, service = documents["Deployment"], documents["Service"]
    assert deployment["apiVersion"] == "apps/v1" and service["apiVersion"] == "v1"
    assert deployment["spec"]["replicas"] >= 2
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()


def test_manifest_probes_ports_gpus_and_metrics_match_the_image() -> None:
    documents = manifest_documents()
    pod = documents["Deployment"]["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": HTTP, "grpc": GRPC, "metrics": METRICS}
    exposed = {int(p) for n, a in dockerfile_instructions() if n == "EXPOSE" for p in a.split()}
    assert set(ports.values()) == exposed
    assert container["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    assert container["resources"]["limits"]["nvidia.com/gpu"] >= 1
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == METRICS and annotations["prometheus.io/path"] == "/metrics"
    assert f"--metrics-port={METRICS}" in container["args"] and f"--http-port={HTTP}" in container["args"]
    service_ports = {p["name"]: p["targetPort"] for p in documents["Service"]["spec"]["ports"]}
    assert set(service_ports.values()) <= set(ports)


def test_deploy_files_name_only_files_that_exist() -> None:
    for path in (DOCKERFILE, MANIFEST):
        named = set(re.findall(r"\b((?:docker|deploy|slicer|perf|tests)/[\w./-]+\.(?:py|yaml|md|txt)|docker/Dockerfile)\b",
                               path.read_text()))
        assert named, path
        for name in named:
            assert (REPO / name).exists(), f"{path.name} names {name}, which does not exist"


def test_the_stand_ins_served_config_is_the_gpu_config_on_its_engine() -> None:
    """`perf.compare --device simulated` serves the Docker image's GPU config, its engine the
    stand-in's and its instance on the CPU; `--device cuda` the GPU config itself."""
    from perf.compare.on_device import device_config

    text = ('name: "m"\ninstance_group [ { kind: KIND_CPU count: 1 } ]\n'
            'parameters: { key: "policy" value: { string_value: "input" } }\n'
            'parameters: { key: "num_buffer_pairs" value: { string_value: "1" } }\n')
    simulated = model_config.parse(device_config(text, {}, "simulated", "/profiles/h100.json"))
    written = model_config.parameters(simulated)
    assert (written["engine"], written["device"], written["device_profile"]) == ("simulated", "cpu", "/profiles/h100.json")
    assert written["threads_per_stage"] == "1" and "num_buffer_pairs" not in written and written["policy"] == "input"
    assert [g.kind for g in simulated.instance_group] == [model_config.pb.ModelInstanceGroup.KIND_CPU]
    cuda = model_config.parse(device_config(text, {}, "cuda", None))
    assert model_config.parameters(cuda)["engine"] == "torch"
    assert [g.kind for g in cuda.instance_group] == [model_config.pb.ModelInstanceGroup.KIND_GPU]
