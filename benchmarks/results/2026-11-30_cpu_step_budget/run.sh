# the decode-heavy CPU load with and without a step budget of four 256-token chunks plus the batch
set -e
cd /work/main
ARGS="--concurrency 32 --requests 32 --prompt-tokens 512 --max-tokens 256 --max-batch 32"
python benchmarks/bench_serve.py $ARGS --out scratch/cpu/budget/one_chunk -- --no-prefix-cache > scratch/cpu/budget/one_chunk.log 2>&1
python benchmarks/bench_serve.py $ARGS --step-tokens 1056 --out scratch/cpu/budget/budget1056 -- --no-prefix-cache > scratch/cpu/budget/budget1056.log 2>&1
echo done
