"""`python -m perf.baselines`: see `perf.baselines.main`."""
import sys

from perf.baselines import main

sys.exit(main())
