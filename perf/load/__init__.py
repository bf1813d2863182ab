"""How queries are sent: arrival schedules (`arrivals`), GLUE-like input lengths (`lengths`), one
query as a Triton request (`wire`), transports that send it (`transport`), our open- and
closed-loop drivers (`drivers`), what a run recorded and its figures (`stats`), and NVIDIA's
perf_analyzer run and read (`perf_analyzer`)."""
