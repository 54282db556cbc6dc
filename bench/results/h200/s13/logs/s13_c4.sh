#!/usr/bin/env bash
# call 4 (one H200): lora7b at the bytes of 20% of eager's peak (17.9857 GiB, as the earlier sessions ran it), op costs cold
set -x
R=$OUT/r; mkdir -p $R
export TURNIP_CACHE_DIR=/tmp/costs_new TURNIP_PLAN_CACHE_DIR=/tmp/plans_new4
timeout 330 python3 -m turnip.bench suite --models lora7b --budgets 17.9857GiB --steps 3 --warmup 1 --no-plots --system-limit 320 --time-limit 320 --out $R --systems turnip --tag s13_c4 > $R/lora7b.log 2>&1
cd $R && tar czf $OUT/c4.tgz . && cd - && rm -rf $R
ls -la $OUT
