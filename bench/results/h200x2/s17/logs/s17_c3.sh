#!/usr/bin/env bash
# issue 31 (2 x H200), the call after the rows: the ordering ablation on 2 GPUs at 25% per GPU, the 10% row,
# where the reserved bytes beyond the allocated ones sit, the timeline's clock test, then while time is
# left 25% on one GPU and on two with timelines and the ablation at 50% and 20%. Carries turnip_cache.tgz
# (op costs and plans of the rows' call: same op costs, so the same budgets' compiles find their plans).
# usage: s17_c3.sh COMMIT [SECONDS]
set -x
COMMIT=$1; END=$((SECONDS + ${2:-570}))
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TURNIP_COMMIT=$COMMIT
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
REPO=$PWD
mkdir -p ~/.cache/turnip && tar -xzf turnip_cache.tgz -C ~/.cache/turnip
R=$OUT/r; mkdir -p $R
mkdir -p /tmp/run && cd /tmp/run  # not the repository: python -m puts the working directory first on sys.path
MG="python3 -m turnip.bench multi_gpu --model gpt1.3b --devices 2 --eager-peak 39829110784 --no-plots"
fits() { [ $((END - SECONDS)) -ge $1 ]; }  # run a part only if its time limit still fits the call
ablation() {  # budget bytes, seconds
  fits $2 && timeout $2 python3 -m turnip.bench.ablation --device cuda --devices 2 --model gpt1.3b --budget $1 \
    --repeat 6 --time-limit 60 --seeds 2 --jitters 0 --out $R/abl_$1 > $R/abl_$1.log 2>&1
}
ablation 9957277696 150
fits 240 && timeout 240 $MG --budgets 0.1 --steps 5 --warmup 1 --isolate --row-limit 235 --out $R/x2_0.1.json > $R/x2_0.1.log 2>&1
fits 60 && timeout 60 python3 $REPO/bench/results/h200x2/s17/logs/reserved_diag.py 39829110784 $R/reserved_100.json > $R/reserved_100.log 2>&1
fits 60 && (cd $REPO && timeout 60 python3 -m pytest -q -p no:logging tests/test_cuda.py -k timeline > $R/cuda_timeline_test.log 2>&1)
fits 110 && timeout 110 $MG --budgets 0.25 --steps 5 --warmup 1 --one-device-too --timelines --out $R/x1x2_0.25.json > $R/x1x2_0.25.log 2>&1
ablation 19914555392 100
ablation 7965822156 100
gzip -f $R/*.timeline.json 2>/dev/null
tar czf $OUT/turnip_cache.tgz -C ~/.cache/turnip .
cd $R && tar czf $OUT/s17_c3.tgz . && ls -la $OUT
