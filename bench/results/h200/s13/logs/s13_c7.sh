#!/usr/bin/env bash
# call 7 (a second call of call 6) (one H200): gpt1.3b at 50% beside eager (op costs cold, then compiled again warm), the plans built while the other problem solves
set -x
R=$OUT/r; mkdir -p $R
export TURNIP_CACHE_DIR=/tmp/costs_new TURNIP_PLAN_CACHE_DIR=/tmp/plans_new1
timeout 200 python3 -m turnip.bench suite --steps 5 --warmup 2 --no-plots --system-limit 200 --time-limit 500 --compile-again --out $R --models gpt1.3b --budgets 0.5 --systems eager,turnip --tag s13_c7 > $R/gpt.log 2>&1
cd $R && tar czf $OUT/c7.tgz . && cd - && rm -rf $R
ls -la $OUT
