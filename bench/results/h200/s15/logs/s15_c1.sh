#!/usr/bin/env bash
# call 1 (one H200): gpt1.3b at 50/25/10% beside eager (op costs cold, then compiled again warm) with recompute
# chains that run another group's vertex again (a layer norm for the bf16 cast of its output)
set -x
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total --format=csv
S="python3 -m turnip.bench suite --steps 5 --warmup 2 --no-plots --system-limit 200 --time-limit 500 --compile-again --out $R"
export TURNIP_CACHE_DIR=/tmp/costs_new TURNIP_PLAN_CACHE_DIR=/tmp/plans_new1
timeout 330 $S --models gpt1.3b --budgets 0.5,0.25,0.1 --systems eager,turnip --tag s15_c1 > $R/gpt.log 2>&1
cd $R && tar czf $OUT/c1.tgz . && cd - && rm -rf $R
ls -la $OUT
