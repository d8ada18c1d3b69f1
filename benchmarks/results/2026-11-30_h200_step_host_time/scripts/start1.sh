# start 1 (34ea039): a replayed 8B step alone, beside a thread spinning in Python and beside a prefilling thread
# (gil.py); then a 16 x 32K warm-up load and the 8B steady load (48 requests from 16 clients, in turns) with its
# static baseline and the decode steps split by how they ran
export PYTHONPATH=$PWD  # from the repository root (the device image had its missing wheels installed first)
S=benchmarks/results/2026-11-30_h200_step_host_time/scripts
timeout 170 python3 $S/gil.py 2>&1 | grep -v Warn | tail -6
rm -rf /tmp/o; mkdir -p /tmp/o
TOK=$1  # the default model's tokenizer directory
timeout 130 python3 benchmarks/bench_serve.py --random-weights llama-3.1-8b --concurrency 16 --requests 16 --prompt-tokens 32k --max-tokens 32 --max-batch 16 --policy quest --out /tmp/warm -- --tokenizer $TOK 2>&1 | grep "^| batched"
timeout 440 python3 benchmarks/bench_serve.py --random-weights llama-3.1-8b --concurrency 16 --requests 48 --prompt-tokens 32k --max-tokens 256 --max-batch 16 --policy quest --static-baseline --out /tmp/o/steady48 -- --tokenizer $TOK 2>&1 | grep -v Warn | grep "^| batched\|Decode steps\|static\|replayed"
tar czf $OUT/all.tgz -C /tmp/o .
