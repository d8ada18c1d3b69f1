# the 8B 16-client load at a steady state: 48 requests from 16 clients (each sends its next when one ends), in
# turns, with the static baseline after it, one machine start, after a short 32K warm-up load
export PYTHONPATH=$PWD  # from the repository root (the device image had its missing wheels installed first)
rm -rf /tmp/o; mkdir -p /tmp/o
TOK=$1  # the default model's tokenizer directory
timeout 100 python3 benchmarks/bench_serve.py --random-weights llama-3.1-8b --concurrency 4 --requests 4 --prompt-tokens 32k --max-tokens 32 --max-batch 16 --policy quest --out /tmp/warm -- --tokenizer $TOK 2>&1 | grep "^| batched"
timeout 430 python3 benchmarks/bench_serve.py --random-weights llama-3.1-8b --concurrency 16 --requests 48 --prompt-tokens 32k --max-tokens 256 --max-batch 16 --policy quest --static-baseline --out /tmp/o/steady48 -- --tokenizer $TOK 2>&1 | grep -v Warn | grep "^| batched\|Decode steps\|static\|Prefill chunks"
tar czf $OUT/all.tgz -C /tmp/o .
