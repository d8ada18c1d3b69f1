# the 8B 16 x 32K serve load: this tree, then HEAD before the worker faulted stores in, then this tree at --step-tokens 8208
source scratch/gpu/setup.sh
mkdir -p /tmp/before && tar xzf scratch/gpu/before.tgz -C /tmp/before
ARGS="--random-weights llama-3.1-8b --concurrency 16 --requests 16 --prompt-tokens 32k --max-tokens 256 --max-batch 16 --policy quest"
TOK=$PWD/scratch/gpu/tok
# kernels built by a short load first (the first load of a machine start builds them)
timeout 100 python3 benchmarks/bench_serve.py --random-weights llama-3.1-8b --concurrency 16 --requests 16 --prompt-tokens 4k --max-tokens 16 --max-batch 16 --policy quest --out /tmp/warm -- --tokenizer $TOK 2>&1 | grep "^| batched"
timeout 250 python3 benchmarks/bench_serve.py $ARGS --out $OUT/after -- --tokenizer $TOK 2>&1 | grep -v Warn | grep "^| batched\|Decode steps\|Prefill chunks"
(cd /tmp/before && PYTHONPATH=/tmp/before:/tmp/site timeout 250 python3 benchmarks/bench_serve.py $ARGS --out $OUT/before -- --tokenizer $TOK 2>&1 | grep -v Warn | grep "^| batched\|Decode steps\|Prefill chunks")
timeout 250 python3 benchmarks/bench_serve.py $ARGS --out $OUT/after_8208 -- --tokenizer $TOK --step-tokens 8208 2>&1 | grep -v Warn | grep "^| batched\|Decode steps\|Prefill chunks"
