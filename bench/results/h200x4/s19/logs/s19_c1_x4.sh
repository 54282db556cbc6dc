#!/usr/bin/env bash
# issue 31 (4 x H200), the nineteenth session's first call: the multi_gpu rows on four GPUs beside DDP, FSDP2 and
# FSDP2 + CPU offload + checkpointing at 100, 50 and 25% per GPU, then the ordering ablation on four GPUs at 25%
# (greedy plans, six alternating rounds). Carries turnip_cache.tgz from s18 call 3 (op costs on the H200).
# usage: s19_c1_x4.sh COMMIT [SECONDS]
set -x
COMMIT=$1; END=$((SECONDS + ${2:-555}))
export TURNIP_COMMIT=$COMMIT
source bench/device_setup.sh
PEAK=39829110784
fits() { [ $((END - SECONDS)) -ge $1 ]; }  # run a part only if its time limit still fits the call
fits 360 && timeout 360 python3 -m turnip.bench multi_gpu --model gpt1.3b --devices 4 --eager-peak $PEAK --no-plots \
  --budgets 1.0,0.5,0.25 --peers ddp,fsdp2,fsdp2-offload-ckpt --steps 6 --warmup 2 --isolate --row-limit 150 \
  --peer-limit 80 --out $R/x4.json > $R/x4.log 2>&1
fits 120 && timeout $((END - SECONDS)) python3 -m turnip.bench.ablation --device cuda --devices 4 --model gpt1.3b \
  --budget 9957277696 --planner greedy --repeat 6 --time-limit 50 --seeds 2 --jitters 0 --out $R/abl_25_x4 \
  > $R/abl_25_x4.log 2>&1
tar czf $OUT/turnip_cache.tgz -C ~/.cache/turnip .
cd $R && tar czf $OUT/s19_c1_x4.tgz . && ls -la $OUT
