#!/usr/bin/env bash
# One call on a lent multi-GPU machine: the multi_gpu rows beside the peers (one command, its JSON
# rewritten after every row), then where the loop's time goes at one budget (bench/loop_profile.py).
#   run: bash bench/gpu_session_multi.sh COMMIT [BUDGETS] [PEERS] [ROWS_S]
#   carry: [".whl"] and, to compile from an earlier call's op costs and plans, "turnip_cache.tgz"
#   env: DEVICES (default: every GPU), MODEL (gpt1.3b), EAGER_PEAK (39829110784, one-GPU eager's
#        peak of gpt1.3b on the H100 hosts, as every multi-GPU table), PROFILE_BUDGET (0.25)
# Results, logs and the caches the compiles left (turnip_cache.tgz, for the next call) go to $OUT.
set -x
COMMIT=$1; BUDGETS=${2:-1.0,0.5,0.25,0.2,0.1}; PEERS=${3:-ddp,fsdp2,fsdp2-offload-ckpt}; ROWS_S=${4:-460}
MODEL=${MODEL:-gpt1.3b}; EAGER_PEAK=${EAGER_PEAK:-39829110784}; PROFILE_BUDGET=${PROFILE_BUDGET:-0.25}
export TURNIP_COMMIT=$COMMIT
DEVICES=${DEVICES:-$(nvidia-smi -L | wc -l)}
source bench/device_setup.sh
timeout $ROWS_S python3 -m turnip.bench multi_gpu --model $MODEL --devices $DEVICES --eager-peak $EAGER_PEAK \
  --budgets $BUDGETS --peers $PEERS --steps 5 --warmup 1 --isolate --row-limit 170 --peer-limit 90 --no-plots \
  --out $R/x$DEVICES.json > $R/x$DEVICES.log 2>&1
timeout 90 python3 -m turnip.bench.loop_profile --model $MODEL --devices $DEVICES --budget $PROFILE_BUDGET \
  --eager-peak $EAGER_PEAK --out $R/loop_profile_x$DEVICES.json > $R/loop_profile_x$DEVICES.log 2>&1
tar czf $OUT/turnip_cache.tgz -C ~/.cache/turnip .
cd $R && tar czf $OUT/results.tgz . && ls -la $OUT
