# warm (a short 32K load), then HEAD before the worker faulted stores in, then this tree: the 8B 16 x 32K load
source scratch/gpu/setup.sh
mkdir -p /tmp/before && tar xzf scratch/gpu/before.tgz -C /tmp/before
ARGS="--random-weights llama-3.1-8b --concurrency 16 --requests 16 --prompt-tokens 32k --max-tokens 256 --max-batch 16 --policy quest"
TOK=$PWD/scratch/gpu/tok
timeout 100 python3 benchmarks/bench_serve.py --random-weights llama-3.1-8b --concurrency 4 --requests 4 --prompt-tokens 32k --max-tokens 32 --max-batch 16 --policy quest --out /tmp/warm -- --tokenizer $TOK 2>&1 | grep "^| batched"
(cd /tmp/before && PYTHONPATH=/tmp/before:/tmp/site timeout 200 python3 benchmarks/bench_serve.py $ARGS --out $OUT/before -- --tokenizer $TOK 2>&1 | grep -v Warn | grep "^| batched\|Decode steps\|Prefill chunks")
timeout 200 python3 benchmarks/bench_serve.py $ARGS --out $OUT/after -- --tokenizer $TOK 2>&1 | grep -v Warn | grep "^| batched\|Decode steps\|Prefill chunks"
