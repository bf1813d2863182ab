"""Is dvabatch faster than Triton's own batcher on my model? `python -m perf.compare` (its
`__main__`) serves any sliced model beside ZeroBatch and DelayBatch and drives them with NVIDIA's
perf_analyzer (`by_perf_analyzer`) or our own load generator (`by_own_driver`)."""
