#!/usr/bin/env bash
# call 2 (one H200): gpt1.3b at 50% (op costs cold, then compiled again warm) beside eager, after the compact-walk threshold;
# llama at 50/25% (cold, then again)
set -x
R=$OUT/r; mkdir -p $R
S="python3 -m turnip.bench suite --steps 5 --warmup 2 --no-plots --system-limit 200 --time-limit 500 --compile-again --out $R"
export TURNIP_CACHE_DIR=/tmp/costs_new TURNIP_PLAN_CACHE_DIR=/tmp/plans_new1
timeout 200 $S --models gpt1.3b --budgets 0.5 --systems eager,turnip --tag s13_c2 > $R/gpt.log 2>&1
export TURNIP_PLAN_CACHE_DIR=/tmp/plans_new2
timeout 330 $S --models llama --budgets 0.5,0.25 --systems turnip --tag s13_c2 > $R/llama.log 2>&1
cd $R && tar czf $OUT/c2.tgz . && cd - && rm -rf $R
ls -la $OUT
