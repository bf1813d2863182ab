"""Offline: cut ONNX models into stages and write model directories the runtime serves."""
