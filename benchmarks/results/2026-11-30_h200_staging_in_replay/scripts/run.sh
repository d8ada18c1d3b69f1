# the staged rows' host copies made before the launch (as before 61b4d6e) against during the replay (e7e2229), in
# alternating rounds of one process; then the engine's row and hand-off tests on the GPU
export PYTHONPATH=$PWD
timeout 200 python3 benchmarks/results/2026-11-30_h200_staging_in_replay/scripts/staging_ab.py 2>&1 | grep -v Warn | tail -20
timeout 360 python3 -m pytest -q -p no:cacheprovider tests/engine/test_rows.py tests/engine/test_handoff.py --durations=12 2>&1 | tail -20
