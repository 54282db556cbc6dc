#!/usr/bin/env bash
# issue 32 (one H200 machine, its CPU only): the LLaMA-65B-shaped LoRA step planned on the CPU of the GPU
# machine, as the Done-when asks (the sixteenth session measured 62 s on a 2-core CPU).
# usage: s18_c4.sh COMMIT
set -x
export PYTHONUNBUFFERED=1 TURNIP_COMMIT=$1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
R=$OUT/r; mkdir -p $R
nproc > $R/cpus.txt; lscpu | grep -E "Model name|^CPU\(s\)" >> $R/cpus.txt
mkdir -p /tmp/run && cd /tmp/run
for run in 1 2; do
  CUDA_VISIBLE_DEVICES= /usr/bin/time -v timeout 200 python3 -m turnip.bench.plan_large --layers 80 --budgets 0.5,0.25 \
    --out plan_large_65b_s18_$run.json > $R/plan_large_$run.log 2>&1
done
cp $(python3 -c "from turnip.bench.results import result_path; print(result_path('x').parent)")/plan_large_65b_s18_*.json $R/
cd $R && tar czf $OUT/s18_c4.tgz . && ls -la $OUT
