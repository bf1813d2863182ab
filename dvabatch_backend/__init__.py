"""dvabatch: multi-entry multi-exit batching (DVABatch) as a Triton Inference Server backend.

Subpackages by layer, each importing only those below it:
  runtime/         the runtime core (scheduler, batch table, queues, buffer pairs, executors, engines)
  triton_adapter/  the `TritonPythonModel` and its metrics, over the runtime
  tools/           the `dvabatch` command line, the server launcher, the demo

The runtime's public names are re-exported here, so `from dvabatch_backend import Scheduler` works.
"""
from .runtime import *  # noqa: F401,F403
from .runtime import __all__  # noqa: F401
