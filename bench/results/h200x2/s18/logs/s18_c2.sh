#!/usr/bin/env bash
# issue 31 (2 x H200), the eighteenth session's second call: single compute vertices as one-vertex CUDA
# graphs against plain launches on the same MemGraph (loop_profile --singles-rounds, 25% per GPU), where
# the first GPU's extra 2 MiB segment sits (reserved_diag at 25%), the rows beside DDP and FSDP2 with more
# steps, then while time is left the CUDA tests and the same A/B at 50%. Carries turnip_cache.tgz from
# call 1 (op costs; its plans miss: the runtime reserve changed).
# usage: s18_c2.sh COMMIT [SECONDS]
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
profile() {  # budget fraction, seconds
  fits $2 && timeout $2 python3 -m turnip.bench.loop_profile --model gpt1.3b --devices 2 --budget $1 --eager-peak $PEAK \
    --steps 3 --warmup 2 --singles-rounds 6 --out $R/loop_profile_$1.json > $R/loop_profile_$1.log 2>&1
}
profile 0.25 150
fits 60 && timeout 60 python3 $REPO/bench/results/h200x2/s17/logs/reserved_diag.py 9957277696 $R/reserved_25.json > $R/reserved_25.log 2>&1
fits 200 && timeout 200 python3 -m turnip.bench multi_gpu --model gpt1.3b --devices 2 --eager-peak $PEAK --no-plots \
  --budgets 1.0,0.5,0.25 --peers ddp,fsdp2 --steps 8 --warmup 2 --isolate --row-limit 90 --peer-limit 60 \
  --out $R/x2.json > $R/x2.log 2>&1
fits 100 && (cd $REPO && timeout 100 python3 -m pytest -q -x -p no:logging tests/test_cuda.py > $R/test_cuda.log 2>&1)
profile 0.5 110
tar czf $OUT/turnip_cache.tgz -C ~/.cache/turnip .
cd $R && tar czf $OUT/s18_c2.tgz . && ls -la $OUT
