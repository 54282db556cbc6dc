#!/usr/bin/env bash
# issue 31 (2 x H200): the Done-when rows, one multi_gpu command beside the peers (its JSON rewritten
# after every row); then the op-cost and plan caches the compiles left, for a later call to carry.
# usage: [DEVICES=4] s17_c2.sh COMMIT BUDGETS PEERS [MAIN_S]    (DEVICES: 2 unless given)
set -x
COMMIT=$1; BUDGETS=$2; PEERS=$3; MAIN_S=${4:-550}; DEVICES=${DEVICES:-2}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TURNIP_COMMIT=$COMMIT
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
if [ -f turnip_cache.tgz ]; then mkdir -p ~/.cache/turnip && tar -xzf turnip_cache.tgz -C ~/.cache/turnip; fi
R=$OUT/r; mkdir -p $R
nvidia-smi -L > $R/gpus.txt
mkdir -p /tmp/run && cd /tmp/run  # not the repository: python -m puts the working directory first on sys.path
timeout $MAIN_S python3 -m turnip.bench multi_gpu --model gpt1.3b --devices $DEVICES --eager-peak 39829110784 \
  --budgets $BUDGETS --peers $PEERS --steps 5 --warmup 1 \
  --isolate --row-limit 170 --peer-limit 90 --no-plots --out $R/x$DEVICES.json > $R/x$DEVICES.log 2>&1
tar czf $OUT/turnip_cache.tgz -C ~/.cache/turnip .
cd $R && tar czf $OUT/s17_r.tgz . && ls -la $OUT
