#!/usr/bin/env bash
# issue 31 (2 x H200), the eighteenth session's third call: two runtimes of one MemGraph in one process
# (two_runtimes.py, 25% per GPU), the rows beside DDP, FSDP2 and FSDP2 + CPU offload with eight timed
# steps, the loop's profile at 25%, then while time is left the ordering ablation at 25%. Carries
# turnip_cache.tgz from call 2 (op costs; plans at 100, 50 and 25% for this runtime reserve).
# usage: s18_c3.sh COMMIT [SECONDS]
set -x
COMMIT=$1; END=$((SECONDS + ${2:-560}))
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TURNIP_COMMIT=$COMMIT
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
REPO=$PWD
if [ -f turnip_cache.tgz ]; then mkdir -p ~/.cache/turnip && tar -xzf turnip_cache.tgz -C ~/.cache/turnip; fi
R=$OUT/r; mkdir -p $R
mkdir -p /tmp/run && cd /tmp/run  # not the repository: python -m puts the working directory first on sys.path
PEAK=39829110784
fits() { [ $((END - SECONDS)) -ge $1 ]; }  # run a part only if its time limit still fits the call
fits 80 && timeout 80 python3 $REPO/bench/results/h200x2/s18/logs/two_runtimes.py 9957277696 $R/two_runtimes_25.json > $R/two_runtimes_25.log 2>&1
fits 330 && timeout 330 python3 -m turnip.bench multi_gpu --model gpt1.3b --devices 2 --eager-peak $PEAK --no-plots \
  --budgets 1.0,0.5,0.25,0.2 --peers ddp,fsdp2,fsdp2-offload-ckpt --steps 8 --warmup 2 --isolate --row-limit 170 \
  --peer-limit 80 --out $R/x2.json > $R/x2.log 2>&1
fits 60 && timeout 60 python3 -m turnip.bench.loop_profile --model gpt1.3b --devices 2 --budget 0.25 --eager-peak $PEAK \
  --steps 3 --warmup 2 --out $R/loop_profile_0.25.json > $R/loop_profile_0.25.log 2>&1
fits 100 && timeout 100 python3 -m turnip.bench.ablation --device cuda --devices 2 --model gpt1.3b --budget 9957277696 \
  --repeat 6 --time-limit 60 --seeds 2 --jitters 0 --out $R/abl_25 > $R/abl_25.log 2>&1
tar czf $OUT/turnip_cache.tgz -C ~/.cache/turnip .
cd $R && tar czf $OUT/s18_c3.tgz . && ls -la $OUT
