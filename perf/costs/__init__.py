"""What the runtime and the slicer cost, measured: the hand-off cost and overhead over the unsliced
model (`overhead`, in process: `inprocess`), onnxruntime's thread pools (`thread_pool`), the CPU per
query of the served path by part (`served_profile`, py-spy on the stub), and slicing a model over
2 GB (`large_model`)."""
