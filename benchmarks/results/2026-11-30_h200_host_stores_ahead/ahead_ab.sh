source scratch/gpu/setup.sh
ARGS="--random-weights llama-3.1-8b --concurrency 16 --requests 16 --prompt-tokens 32k --max-tokens 256 --max-batch 16 --policy quest"
for w in ahead16 ahead2; do
  if [ $w = ahead16 ]; then PP=$PWD/scratch/gpu/ahead16:$PYTHONPATH; else PP=$PYTHONPATH; fi
  PYTHONPATH=$PP timeout 200 python3 benchmarks/bench_serve.py $ARGS --out $OUT/$w -- --tokenizer $PWD/scratch/gpu/tok 2>&1 | grep -E "^\| batched|Prefill chunks"
  sleep 5
done
