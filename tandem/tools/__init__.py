"""The tools: `tandem bench`, `eval`, `simulate`, `calibrate` and the bad-input catalogue. They import the
runtime (cache, policies, attention, kernels, engine, serve, integrations, models, config); the runtime never
imports them (`tests/test_layering.py`)."""
