# start 3 (34ea039): where a replayed step's host time goes, alone and beside a spinning thread, and a profile
export PYTHONPATH=$PWD
PROFILE=1 timeout 240 python3 benchmarks/results/2026-11-30_h200_step_host_time/scripts/prof_pre.py 2>&1 | grep -v Warn | tail -90
