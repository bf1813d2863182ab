"""GPU runs of dvabatch: the torch engine on CUDA, the GPU timeline of the stages, DVABatch beside
ZeroBatch in one process, and the script (`python -m perf.gpu.run_device`) that plans them as steps
and runs each on a GPU host. Nothing here imports torch at import time."""
