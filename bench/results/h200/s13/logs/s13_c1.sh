#!/usr/bin/env bash
# call 1 (one H200): this tree's tracer against the session-start tree's on CUDA (same TaskGraphs, tracing seconds),
# then gpt1.3b compile (op costs cold, then compiled again warm) at 50/25/10% beside eager
set -x
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total --format=csv
timeout 200 python3 scratch/tracediff.py cuda $R/tracediff_cuda.json gpt1.3b,llama,gpt350m 3 > $R/tracediff.log 2>&1
export TURNIP_CACHE_DIR=/tmp/costs_new TURNIP_PLAN_CACHE_DIR=/tmp/plans_new1
timeout 330 python3 -m turnip.bench suite --models gpt1.3b --budgets 0.5,0.25,0.1 --systems eager,turnip --steps 5 --warmup 2 --no-plots --system-limit 200 --time-limit 500 --compile-again --out $R --tag s13_c1 > $R/suite.log 2>&1
cd $R && tar czf $OUT/c1.tgz . && cd - && rm -rf $R
ls -la $OUT
