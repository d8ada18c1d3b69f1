# the engine's static 32K quest batch at widths 1..16, then in one start the 8B 16 x 32K load beside
# without and with the priority stream, and in turns
export PYTHONPATH=$PWD  # from the repository root (the device image had its missing wheels installed first)
rm -rf /tmp/o; mkdir -p /tmp/o
timeout 200 python3 -m tandem.cli bench --model llama-3.1-8b --contexts 32k --batches 1,2,4,8,16 --policies quest --hf none --steps 24 --out /tmp/o/static 2>&1 | grep "^| tandem" | head -8
ARGS="--random-weights llama-3.1-8b --concurrency 16 --requests 16 --prompt-tokens 32k --max-tokens 256 --max-batch 16 --policy quest"
TOK=$1  # the default model's tokenizer directory
timeout 100 python3 benchmarks/bench_serve.py --random-weights llama-3.1-8b --concurrency 4 --requests 4 --prompt-tokens 32k --max-tokens 32 --max-batch 16 --policy quest --out /tmp/warm -- --tokenizer $TOK --prefill-thread 2>&1 | grep "^| batched"
rm -rf /tmp/nopri && mkdir /tmp/nopri && cp -r tandem benchmarks pyproject.toml /tmp/nopri/
sed -i 's/stream = _priority_stream(self.device) if beside and self.device.type == "cuda" else None/stream = None/' /tmp/nopri/tandem/serve/scheduler.py
(cd /tmp/nopri && PYTHONPATH=/tmp/nopri:/tmp/site timeout 130 python3 benchmarks/bench_serve.py $ARGS --out /tmp/o/no_priority -- --tokenizer $TOK --prefill-thread 2>&1 | grep -v Warn | grep "^| batched\|Decode steps")
timeout 130 python3 benchmarks/bench_serve.py $ARGS --out /tmp/o/priority -- --tokenizer $TOK --prefill-thread 2>&1 | grep -v Warn | grep "^| batched\|Decode steps"
timeout 130 python3 benchmarks/bench_serve.py $ARGS --out /tmp/o/turns -- --tokenizer $TOK 2>&1 | grep -v Warn | grep "^| batched\|Decode steps"
tar czf $OUT/all.tgz -C /tmp/o .
