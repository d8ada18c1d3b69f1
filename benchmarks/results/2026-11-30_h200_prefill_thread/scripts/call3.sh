export PYTHONPATH=$PWD  # from the repository root (the device image had its missing wheels installed first)
rm -rf /tmp/o; mkdir -p /tmp/o
timeout 200 python3 benchmarks/results/2026-11-30_h200_prefill_thread/runner_steps.py > /tmp/o/prof_steps.txt 2>&1; grep -v "^-\|^ \|Name\|Warn" /tmp/o/prof_steps.txt | head -14
A="--random-weights smollm2-135m --concurrency 64 --requests 64 --prompt-tokens 2k --max-tokens 128 --max-batch 64 --policy quest"
TOK=$1  # the default model's tokenizer directory
timeout 150 python3 benchmarks/bench_serve.py $A --compare-sequential --sequential-requests 2 --out /tmp/o/s64_turns -- --tokenizer $TOK 2>&1 | grep -v Warn | grep "^| \|Decode steps\|x the seq\|sequential" | tail -6
timeout 90 python3 benchmarks/bench_serve.py $A --out /tmp/o/s64_beside -- --tokenizer $TOK --prefill-thread 2>&1 | grep -v Warn | grep "^| batched\|Decode steps"
tar czf $OUT/all.tgz -C /tmp/o .
