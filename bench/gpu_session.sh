#!/usr/bin/env bash
# One call on the lent GPU machine: install what it lacks, check correctness on CUDA, then measure.
# Fetch the wheels here first (../shared/tools/device-wheels.sh puts pulp + highspy in .whl/), then
#   run: TURNIP_COMMIT=<commit> bash bench/gpu_session.sh [suite arguments...]      carry: [".whl"]
#   (TURNIP_COMMIT: a snapshot copied to the GPU machine has no git history; results record it)
# Results (JSON, logs) go to $OUT (or bench/results when $OUT is unset).
set -euo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v "running pip as the 'root'" || true
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
echo "== correctness on CUDA (full log in $OUT/tests.txt)"
python3 -m pytest -q -p no:logging tests/test_cuda.py > "$OUT/tests.txt" 2>&1 || true
python3 -m pytest -q -p no:logging tests/test_costs.py -k cuda >> "$OUT/tests.txt" 2>&1 || true
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.txt" | tail -30
echo "== suite"
python3 -m turnip.bench suite --out "$OUT" --no-plots "$@" 2>&1 | tee "$OUT/suite.log" | grep -v "^INFO" | tail -40
