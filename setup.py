from setuptools import find_packages, setup

setup(
    name="dvabatch",
    version="0.1.0",
    description="Multi-entry multi-exit batching (DVABatch) as a Triton Inference Server Python backend",
    python_requires=">=3.10",
    packages=find_packages(include=["dvabatch_backend*", "slicer*", "policies*", "perf*"]),
    install_requires=[
        "numpy>=1.24",
        "tqdm>=4.60",
        "onnx>=1.16",
        "onnxruntime>=1.18",
    ],
    extras_require={
        "test": ["pytest>=8", "hypothesis>=6.100", "pytest-timeout>=2.3"],
        "gpu": ["cuda-python>=12.0"],
    },
    entry_points={"console_scripts": ["dvabatch=dvabatch_backend.cli:main"]},
)
