"""Benchmarks and load tools, in folders by the question each answers (run as `python -m perf.FOLDER.NAME`):

- `perf.compare` -- is dvabatch faster than Triton's own batcher on my model? (`python -m perf.compare`)
- `perf.load` -- how queries are sent: arrival schedules, input lengths, the wire format, transports,
  our open- and closed-loop drivers, what a run recorded, and NVIDIA's perf_analyzer;
- `perf.baselines` -- ZeroBatch and DelayBatch, Triton's dynamic batcher over the unsliced model, and
  the zoo models served beside dvabatch in one server (`perf.baselines.bench`);
- `perf.paper` -- the paper's experiments (§8) and their plots;
- `perf.costs` -- what the runtime and the slicer cost: overhead per hand-off, CPU per query in the
  served path, threads, a model over 2 GB;
- `perf.reliability` -- nothing lost under abuse: fuzzing, soak, overload and admission;
- `perf.tuning` -- Triton's Model Analyzer sweeping a dvabatch model's settings;
- `perf.gpu` -- the GPU suite, planned here and run on a GPU host.

`perf/README.md` has the table: question, command, what it prints, and the test that runs it.
"""
