#!/usr/bin/env bash
# call 4 (one H200): llama at 50/25% (budgets as bytes of its eager peak) with the final planner (later rounds only
# early, the screen, the frozen heap): call 1's llama at 50% ran 4% slower than the thirteenth session's
set -x
R=$OUT/r; mkdir -p $R
export TURNIP_CACHE_DIR=/tmp/costs_new TURNIP_PLAN_CACHE_DIR=/tmp/plans_new2
timeout 260 python3 -m turnip.bench suite --steps 5 --warmup 2 --no-plots --system-limit 200 --time-limit 500 --compile-again --out $R --models llama --budgets 17.476GiB,8.738GiB --systems turnip --tag s14_c4 > $R/llama.log 2>&1
cd $R && tar czf $OUT/c4.tgz . && cd - && rm -rf $R
ls -la $OUT
