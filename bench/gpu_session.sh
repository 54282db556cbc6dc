#!/usr/bin/env bash
# One call on the lent GPU machine: install what it lacks, check correctness on CUDA, then measure.
# Fetch the wheels here first (../shared/tools/device-wheels.sh puts pulp + highspy in .whl/), then
#   run: TURNIP_COMMIT=<commit> bash bench/gpu_session.sh [suite arguments...]      carry: [".whl"] (and "costs")
#   (TURNIP_COMMIT: a snapshot copied to the GPU machine has no git history; results record it)
# Results (JSON, logs) go to $OUT (or bench/results when $OUT is unset); the op-cost cache the run
# measured is copied there too, for the next call to carry (bench/results/h100/costs-*.json is one).
set -euo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
site_args=()
if ls .whl/tt/*.whl >/dev/null 2>&1; then  # torchtune needs torchao 0.15: a site of its own (device-wheels.sh --peers)
  python3 -m pip install -q --no-index --no-deps --target /tmp/site_tt .whl/tt/*.whl
  site_args=(--site torchtune=/tmp/site_tt)
fi
# DeepSpeed's CPU Adam is JIT-built on first use: the build an earlier call left in $OUT/torch_ext.tgz,
# carried in beside this script's repo root, is meant to be reused (touched, so ninja finds it newer
# than the freshly installed sources). Not confirmed yet: with it carried, llama's first DeepSpeed
# process still spent 68 s before its first step (without: 80-90 s); the rows' init_s will tell.
# One archive: a call brings back at most 8 files.
export TORCH_EXTENSIONS_DIR=/tmp/torch_ext
if [ -f torch_ext.tgz ]; then mkdir -p "$TORCH_EXTENSIONS_DIR" && tar -xzf torch_ext.tgz -C "$TORCH_EXTENSIONS_DIR" \
  && find "$TORCH_EXTENSIONS_DIR" -type f -exec touch {} +; fi
# op costs measured by an earlier run (costs-*.json) spare compile the measuring: carry them in costs/
if [ -d costs ]; then export TURNIP_CACHE_DIR=$PWD/costs; fi
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v "running pip as the 'root'" || true
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
if [ "${TURNIP_CUDA_TESTS:-1}" != 0 ]; then  # ~2 minutes; TURNIP_CUDA_TESTS=0 leaves the call to the suite
  echo "== correctness on CUDA (full log in $OUT/tests.txt)"
  python3 -m pytest -q -p no:logging tests/test_cuda.py tests/test_reuse.py > "$OUT/tests.txt" 2>&1 || true
  python3 -m pytest -q -p no:logging tests/test_costs.py -k cuda >> "$OUT/tests.txt" 2>&1 || true
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.txt" | tail -30
fi
echo "== suite"
python3 -m turnip.bench suite --out "$OUT" --no-plots ${site_args[@]+"${site_args[@]}"} "$@" 2>&1 | tee "$OUT/suite.log" | grep -v "^INFO" | tail -40
if [ -n "${TURNIP_CACHE_DIR:-}" ]; then cp "$TURNIP_CACHE_DIR"/costs-*.json "$OUT"/ 2>/dev/null || true
else cp "${XDG_CACHE_HOME:-$HOME/.cache}"/turnip/costs-*.json "$OUT"/ 2>/dev/null || true; fi
if [ -d "$TORCH_EXTENSIONS_DIR" ]; then tar -czf "$OUT"/torch_ext.tgz -C "$TORCH_EXTENSIONS_DIR" .; fi
