"""The Triton adapter: a thin `TritonPythonModel` over the runtime, and its Prometheus metrics.

Only this package imports `triton_python_backend_utils`.
"""
