# start 2 (3950119, the hand-offs served by runs): gil2.py's A/B of the per-hand-off host side against runs,
# alone and beside three kinds of busy thread; then the CUDA tests (cut by the timeout)
export PYTHONPATH=$PWD
timeout 200 python3 benchmarks/results/2026-11-30_h200_step_host_time/scripts/gil2.py 2>&1 | grep -v Warn | tail -18
timeout 340 python3 -m pytest -q -m cuda -p no:cacheprovider tests 2>&1 | tail -6
