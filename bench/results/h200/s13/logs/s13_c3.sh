#!/usr/bin/env bash
# call 3 (one H200): lora7b at 20% (op costs cold; turnip), then the LLaMA-65B-shaped LoRA step planned on this host's CPU
set -x
R=$OUT/r; mkdir -p $R
export TURNIP_CACHE_DIR=/tmp/costs_new TURNIP_PLAN_CACHE_DIR=/tmp/plans_new3
timeout 330 python3 -m turnip.bench suite --models lora7b --budgets 0.2 --steps 3 --warmup 1 --no-plots --system-limit 320 --time-limit 320 --out $R --systems turnip --tag s13_c3 > $R/lora7b.log 2>&1
export TURNIP_RESULTS=$R
timeout 200 python3 -m turnip.bench.plan_large --layers 80 --budgets 0.5 --out plan_large_65b_s13.json > $R/plan_large.log 2>&1
cd $R && tar czf $OUT/c3.tgz . && cd - && rm -rf $R
ls -la $OUT
