#!/usr/bin/env bash
# issue 31 (4 x H200, the session's last device time): the ordering ablation on four GPUs sharing the host,
# gpt1.3b at 25% of one-GPU eager's peak per GPU, one MemGraph (greedy plans: the compile fits the call),
# both orderings alternating for six rounds.
# usage: s18_c4_x4.sh COMMIT [SECONDS]
set -x
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TURNIP_COMMIT=$1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
R=$OUT/r; mkdir -p $R
nvidia-smi -L > $R/gpus.txt
mkdir -p /tmp/run && cd /tmp/run
timeout ${2:-190} python3 -m turnip.bench.ablation --device cuda --devices 4 --model gpt1.3b --budget 9957277696 \
  --planner greedy --repeat 6 --time-limit 60 --seeds 2 --jitters 0 --out $R/abl_25_x4 > $R/abl_25_x4.log 2>&1
cd $R && tar czf $OUT/s18_c4_x4.tgz . && ls -la $OUT
