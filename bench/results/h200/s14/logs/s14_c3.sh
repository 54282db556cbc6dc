#!/usr/bin/env bash
# call 3 (one H200): gpt1.3b at 50/25/10% beside eager (op costs cold, then compiled again warm) with the heap frozen while compile runs (and later
# block-search rounds only early in the search); lora7b at 17.9857GiB (its op costs cold)
set -x
R=$OUT/r; mkdir -p $R
S="python3 -m turnip.bench suite --steps 5 --warmup 2 --no-plots --system-limit 200 --time-limit 500 --compile-again --out $R"
export TURNIP_CACHE_DIR=/tmp/costs_new TURNIP_PLAN_CACHE_DIR=/tmp/plans_new1
timeout 300 $S --models gpt1.3b --budgets 0.5,0.25,0.1 --systems eager,turnip --tag s14_c3 > $R/gpt.log 2>&1
export TURNIP_PLAN_CACHE_DIR=/tmp/plans_new3
timeout 250 python3 -m turnip.bench suite --steps 3 --warmup 1 --no-plots --system-limit 230 --time-limit 240 --out $R --models lora7b --budgets 17.9857GiB --systems turnip --tag s14_c3 > $R/lora.log 2>&1
cd $R && tar czf $OUT/c3.tgz . && cd - && rm -rf $R
ls -la $OUT
