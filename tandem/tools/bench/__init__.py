"""`tandem bench`: decode speed of Tandem against Hugging Face caches, with the hardware's limits measured.

Support modules: `shapes` (named architectures, models with random weights built on the device),
`bandwidth` (HBM, host-read and PCIe probes, machine description), `baselines` (HF DynamicCache and
offloaded cache, timed per decode step) and `report` (bench.json, bench.md, PNG plots).
"""
