# --prefill-thread on the H200 with the decode steps on a high-priority stream, against the same without (a copy
# of the tree whose scheduler keeps the steps on the default stream), after the CUDA tests and a 32K warm-up.
export PYTHONPATH=$PWD  # from the repository root (the device image had its missing wheels installed first)
timeout 120 python3 -m pytest -q -p no:cacheprovider -m cuda tests/serve/test_scheduler.py tests/engine/test_rows.py -k "prefill_thread or detach_from" 2>&1 | tail -3
rm -rf /tmp/nopri && mkdir /tmp/nopri && cp -r tandem benchmarks pyproject.toml /tmp/nopri/
sed -i 's/stream = _priority_stream(self.device) if beside and self.device.type == "cuda" else None/stream = None/' /tmp/nopri/tandem/serve/scheduler.py
grep -c "stream = None" /tmp/nopri/tandem/serve/scheduler.py
ARGS="--random-weights llama-3.1-8b --concurrency 16 --requests 16 --prompt-tokens 32k --max-tokens 256 --max-batch 16 --policy quest"
TOK=$1  # the default model's tokenizer directory
timeout 100 python3 benchmarks/bench_serve.py --random-weights llama-3.1-8b --concurrency 4 --requests 4 --prompt-tokens 32k --max-tokens 32 --max-batch 16 --policy quest --out /tmp/warm -- --tokenizer $TOK --prefill-thread 2>&1 | grep "^| batched"
timeout 170 python3 benchmarks/bench_serve.py $ARGS --out $OUT/priority -- --tokenizer $TOK --prefill-thread 2>&1 | grep -v Warn | grep "^| batched\|Decode steps\|Prefill chunks"
(cd /tmp/nopri && PYTHONPATH=/tmp/nopri:/tmp/site timeout 170 python3 benchmarks/bench_serve.py $ARGS --out $OUT/no_priority -- --tokenizer $TOK --prefill-thread 2>&1 | grep -v Warn | grep "^| batched\|Decode steps\|Prefill chunks")
