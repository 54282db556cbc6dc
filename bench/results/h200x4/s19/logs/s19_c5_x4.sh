#!/usr/bin/env bash
# issue 31 (4 x H200), the nineteenth session's last call: gpt1.3b's step over four GPUs exported with its
# measured op costs and this host's links, in both weight layouts (replicas; casts made on the owner and
# sent), for planning on the CPU (python -m turnip.bench.replan plan --step ...): why four GPUs at 50% per
# GPU plan slower than two. Carries turnip_cache.tgz (op costs) so nothing already measured is measured again.
# usage: s19_c5_x4.sh COMMIT
set -x
export TURNIP_COMMIT=$1
source bench/device_setup.sh
timeout 200 python3 -m turnip.bench.replan export --models gpt1.3b --devices 4 --no-eager --out $R/steps \
  > $R/export_x4.log 2>&1
timeout 150 python3 -m turnip.bench.replan export --models gpt1.3b --devices 4 --no-eager --casts-travel \
  --out $R/steps > $R/export_x4_casts.log 2>&1
cd $R && tar czf $OUT/s19_c5_x4.tgz . && ls -la $OUT
