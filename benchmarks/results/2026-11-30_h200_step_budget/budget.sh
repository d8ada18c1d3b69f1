# the 8B 16 x 32K serve load at a per-turn token budget: $1 = --step-tokens (none: one chunk a turn), $2 = extra args
source scratch/gpu/setup.sh
ARGS="--random-weights llama-3.1-8b --concurrency 16 --requests 16 --prompt-tokens 32k --max-tokens 256 --max-batch 16 --policy quest"
step=${1:-none}
extra=""
[ "$step" != none ] && extra="--step-tokens $step"
timeout ${3:-500} python3 benchmarks/bench_serve.py $ARGS $2 --out $OUT/step_$step -- --tokenizer $PWD/scratch/gpu/tok $extra 2>&1 | grep -v Warn | tail -16
