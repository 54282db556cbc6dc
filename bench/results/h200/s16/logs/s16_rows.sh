#!/usr/bin/env bash
# issue 32 (one H200): one model's bench rows beside eager, the code at the filing (0b4edfc, "old")
# and the code now ("new", run twice: before and after the old), each run with empty op-cost and plan caches
# usage: s16_rows.sh MODEL BUDGETS NEW_SECONDS OLD_SECONDS NEW_COMMIT [suite flags]
set -x
M=$1; B=$2; TNEW=$3; TOLD=$4; NEW_COMMIT=$5; shift 5
R=$OUT/r; mkdir -p $R/new $R/old $R/new2
nvidia-smi --query-gpu=name,memory.total --format=csv
# the old tree as its package-dir mapping installs it (turnip/ plus each subpackage under it)
mkdir -p /tmp/old/turnip && cp -r .snap/old/turnip/. /tmp/old/turnip/
for d in ir memgraph planners engine kernels bench; do cp -r .snap/old/$d /tmp/old/turnip/$d; done
mkdir -p /tmp/run && cd /tmp/run  # not the repository: python -m puts the working directory first on sys.path
python3 -c "import turnip; print('new', turnip.__file__)"
PYTHONPATH=/tmp/old:$PYTHONPATH python3 -c "import turnip, turnip.planners.driver as d; print('old', turnip.__file__, d.__file__)"
S="python3 -m turnip.bench suite --steps 5 --warmup 2 --no-plots --isolate peers --systems eager,turnip --models $M --budgets $B"
new() {
  local run=$1; shift
  TURNIP_COMMIT=$NEW_COMMIT TURNIP_CACHE_DIR=/tmp/costs_$run TURNIP_PLAN_CACHE_DIR=/tmp/plans_$run \
    timeout $TNEW $S --system-limit 300 --time-limit $((TNEW-5)) --out $R/$run --tag s16$run "$@" > $R/$run.log 2>&1
}
new new "$@"
TURNIP_COMMIT=0b4edfc PYTHONPATH=/tmp/old:$PYTHONPATH TURNIP_CACHE_DIR=/tmp/costs_old TURNIP_PLAN_CACHE_DIR=/tmp/plans_old \
  timeout $TOLD $S --system-limit 400 --time-limit $((TOLD-5)) --out $R/old --tag s16old "$@" > $R/old.log 2>&1
new new2 "$@"
cd $R && tar czf $OUT/rows_$M.tgz . && cd / && rm -rf $R
ls -la $OUT
