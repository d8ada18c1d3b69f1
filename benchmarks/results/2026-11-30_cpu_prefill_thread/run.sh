# the decode-heavy CPU load in turns (one chunk a turn) and with the prefill thread, then again in the other order
cd /work/main
A="--concurrency 32 --requests 32 --prompt-tokens 512 --max-tokens 256 --max-batch 32"
python benchmarks/bench_serve.py $A --out scratch/cpu/beside/turns -- --no-prefix-cache 2>&1 | grep "^| batched\|Decode steps\|Prefill chunks"
python benchmarks/bench_serve.py $A --out scratch/cpu/beside/thread -- --no-prefix-cache --prefill-thread 2>&1 | grep "^| batched\|Decode steps\|Prefill chunks"
python benchmarks/bench_serve.py $A --out scratch/cpu/beside/thread_second -- --no-prefix-cache --prefill-thread 2>&1 | grep "^| batched\|Decode steps\|Prefill chunks"
python benchmarks/bench_serve.py $A --out scratch/cpu/beside/turns_second -- --no-prefix-cache 2>&1 | grep "^| batched\|Decode steps\|Prefill chunks"
