"""GPU runs of dvabatch: the torch engine on CUDA, the GPU timeline of the stages, DVABatch beside
ZeroBatch in one process, and the device script (`python -m perf.gpu.run_device`) that runs them
all on a lent GPU machine. Nothing here imports torch at import time."""
