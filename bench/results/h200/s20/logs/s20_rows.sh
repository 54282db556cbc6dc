#!/usr/bin/env bash
# issue 32 (one H200): bench rows beside eager, the code now and the code at the issue's filing (0b4edfc, "old"),
# each run with empty op-cost and plan caches; the new run also compiles each row again (--compile-again: warm)
# usage: s20_rows.sh NEW_COMMIT CALL MODEL:BUDGETS:NEW_SECONDS:OLD_SECONDS[:SYSTEMS] [...]   (OLD_SECONDS 0: no old run;
#   SYSTEMS default eager,turnip)
# needs .snap/old (git archive 0b4edfc, carried) and .whl (carried)
set -x
NEW_COMMIT=$1; CALL=$2; shift 2
source bench/device_setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv
# the old tree as its package-dir mapping installs it (turnip/ plus each subpackage under it)
mkdir -p /tmp/old/turnip && cp -r $REPO/.snap/old/turnip/. /tmp/old/turnip/
for d in ir memgraph planners engine kernels bench; do cp -r $REPO/.snap/old/$d /tmp/old/turnip/$d; done
python3 -c "import turnip; print('new', turnip.__file__)"
PYTHONPATH=/tmp/old:$PYTHONPATH python3 -c "import turnip, turnip.planners.driver as d; print('old', turnip.__file__, d.__file__)"
S="python3 -m turnip.bench suite --steps 5 --warmup 2 --no-plots --isolate peers"
i=0
for spec in "$@"; do
  i=$((i+1))
  IFS=: read M B TNEW TOLD SYS <<< "$spec"; SYS=${SYS:-eager,turnip}
  TURNIP_COMMIT=$NEW_COMMIT TURNIP_CACHE_DIR=/tmp/costs_new_${M}_$i TURNIP_PLAN_CACHE_DIR=/tmp/plans_new_${M}_$i \
    timeout $TNEW $S --systems $SYS --models $M --budgets $B --compile-again --system-limit 300 --time-limit $((TNEW-5)) \
    --out $R/new_$M --tag s20new_c${CALL}_$i > $R/${M}_new_c${CALL}_$i.log 2>&1
  if [ "$TOLD" != 0 ]; then
    TURNIP_COMMIT=0b4edfc PYTHONPATH=/tmp/old:$PYTHONPATH TURNIP_CACHE_DIR=/tmp/costs_old_${M}_$i TURNIP_PLAN_CACHE_DIR=/tmp/plans_old_${M}_$i \
      timeout $TOLD $S --systems $SYS --models $M --budgets $B --system-limit 400 --time-limit $((TOLD-5)) \
      --out $R/old_$M --tag s20old_c${CALL}_$i > $R/${M}_old_c${CALL}_$i.log 2>&1
  fi
done
cd $R && tar czf $OUT/rows_c$CALL.tgz . && ls -la $OUT
