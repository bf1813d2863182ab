"""The model zoo: ONNX models built by the project from seeded (or shipped) weights."""
