"""Tuning a served dvabatch model with the tools Triton users know: Model Analyzer (`model_analyzer`)."""
