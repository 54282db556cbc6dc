#!/usr/bin/env bash
# issue 31 (2 x H200): one multi_gpu command for the Done-when rows at every budget beside the peers, then,
# while time is left, one step's timeline at 25% per GPU. usage: s17_c1.sh COMMIT [MAIN_S] [TIMELINE_S]
set -x
COMMIT=$1; MAIN_S=${2:-470}; TL_S=${3:-90}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TURNIP_COMMIT=$COMMIT
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
R=$OUT/r; mkdir -p $R
nvidia-smi -L > $R/gpus.txt; nvidia-smi topo -m >> $R/gpus.txt
mkdir -p /tmp/run && cd /tmp/run  # not the repository: python -m puts the working directory first on sys.path
timeout $MAIN_S python3 -m turnip.bench multi_gpu --model gpt1.3b --devices 2 --eager-peak 39829110784 \
  --budgets 1.0,0.5,0.25,0.2,0.1 --peers ddp,fsdp2,fsdp2-ckpt,fsdp2-offload-ckpt --steps 5 --warmup 1 \
  --isolate --row-limit 110 --peer-limit 80 --no-plots --out $R/x2.json > $R/x2.log 2>&1
timeout $TL_S python3 -m turnip.bench multi_gpu --model gpt1.3b --devices 2 --eager-peak 39829110784 \
  --budgets 0.25 --steps 3 --warmup 1 --timelines --no-plots --out $R/x2_0.25_timeline.json > $R/x2_0.25_timeline.log 2>&1
gzip -f $R/*.timeline*.json 2>/dev/null
cd $R && tar czf $OUT/s17_c1.tgz . && ls -la $OUT
