#!/usr/bin/env bash
# issue 31 (4 x H200), the nineteenth session's third call: the rows at 100, 50 and 25% per GPU beside DDP, FSDP2
# and FSDP2 + CPU offload + checkpointing in one command (call 1 ran out of time before FSDP2), with attention
# inside the segments (b0847d2) and the plans call 1 cached; then the loop's profile at 25% on four GPUs.
# The host probe on every CPU before and after. Carries turnip_cache.tgz from s19 call 2.
# usage: s19_c3_x4.sh COMMIT [SECONDS]
set -x
COMMIT=$1; END=$((SECONDS + ${2:-555}))
export TURNIP_COMMIT=$COMMIT
source bench/device_setup.sh
PEAK=39829110784
fits() { [ $((END - SECONDS)) -ge $1 ]; }  # run a part only if its time limit still fits the call
python3 -m turnip.bench.host_probe --by-cpu --out $R/probe_start.json
fits 420 && timeout 420 python3 -m turnip.bench multi_gpu --model gpt1.3b --devices 4 --eager-peak $PEAK --no-plots \
  --budgets 1.0,0.5,0.25 --peers ddp,fsdp2,fsdp2-offload-ckpt --steps 8 --warmup 2 --isolate --row-limit 110 \
  --peer-limit 80 --out $R/x4.json > $R/x4.log 2>&1
fits 60 && timeout $((END - SECONDS - 5)) python3 -m turnip.bench.loop_profile --model gpt1.3b --devices 4 --budget 0.25 \
  --eager-peak $PEAK --steps 3 --warmup 2 --out $R/loop_profile_x4_0.25.json > $R/loop_profile_x4_0.25.log 2>&1
python3 -m turnip.bench.host_probe --by-cpu --out $R/probe_end.json
tar czf $OUT/turnip_cache.tgz -C ~/.cache/turnip .
cd $R && tar czf $OUT/s19_c3_x4.tgz . && ls -la $OUT
