# the 8B 16 x 32K serve load: this tree, then e513182 (before the stores made ahead), one machine start
source scratch/gpu/setup.sh
mkdir -p /tmp/before && tar xzf scratch/gpu/before.tgz -C /tmp/before
ARGS="--random-weights llama-3.1-8b --concurrency 16 --requests 16 --prompt-tokens 32k --max-tokens 256 --max-batch 16 --policy quest"
which=${1:-after}
if [ "$which" = after ]; then
  timeout 280 python3 benchmarks/bench_serve.py $ARGS --out $OUT/after -- --tokenizer $PWD/scratch/gpu/tok 2>&1 | grep -v Warn | tail -12
else
  cd /tmp/before && PYTHONPATH=/tmp/before:/tmp/site timeout 280 python3 benchmarks/bench_serve.py $ARGS --out $OUT/before -- --tokenizer $OLDPWD/scratch/gpu/tok 2>&1 | grep -v Warn | tail -12
fi
