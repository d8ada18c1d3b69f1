# start 4 (c4b8627, the staged rows copied in one call per device): the copies one by one against one call, alone,
# beside a spinning thread and beside a prefilling thread; then the engine and cache CUDA tests (cut by the timeout)
export PYTHONPATH=$PWD
timeout 150 python3 benchmarks/results/2026-11-30_h200_step_host_time/scripts/prof_pre.py 2>&1 | grep -v Warn | tail -13
timeout 330 python3 -m pytest -q -m cuda -p no:cacheprovider tests/engine tests/cache 2>&1 | tail -5
