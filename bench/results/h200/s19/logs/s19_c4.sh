#!/usr/bin/env bash
# one H200 (issues 31 and 32): eager PyTorch's own run-to-run spread beside turnip's on one GPU at 100% (is
# turnip's spread its kernels' or its own?), turnip's again with cuBLAS's workspace per stream fixed
# (CUBLAS_WORKSPACE_CONFIG, which PyTorch names for deterministic cuBLAS on several streams); then the
# LLaMA-65B-shaped LoRA step planned on this machine's CPU (issue 32's 120 s).
# usage: s19_c4.sh COMMIT [SECONDS]
set -x
COMMIT=$1; END=$((SECONDS + ${2:-555}))
export TURNIP_COMMIT=$COMMIT
source bench/device_setup.sh
PEAK=39829110784
fits() { [ $((END - SECONDS)) -ge $1 ]; }  # run a part only if its time limit still fits the call
python3 -m turnip.bench.host_probe --by-cpu --out $R/probe_start.json
fits 90 && timeout 90 python3 -m turnip.bench.repeatability --model gpt1.3b --eager --steps 2 --runs 3 \
  --out $R/repeat_eager.json > $R/repeat_eager.log 2>&1
fits 90 && timeout 90 python3 -m turnip.bench.repeatability --model gpt1.3b --devices 1 --budget 1.0 --eager-peak $PEAK \
  --steps 2 --runs 3 --out $R/repeat_x1_1.0.json > $R/repeat_x1_1.0.log 2>&1
fits 90 && CUBLAS_WORKSPACE_CONFIG=:4096:8 timeout 90 python3 -m turnip.bench.repeatability --model gpt1.3b --devices 1 \
  --budget 1.0 --eager-peak $PEAK --steps 2 --runs 3 --out $R/repeat_x1_1.0_cublas.json > $R/repeat_x1_1.0_cublas.log 2>&1
fits 200 && CUDA_VISIBLE_DEVICES= /usr/bin/time -v timeout 200 python3 -m turnip.bench.plan_large --layers 80 \
  --budgets 0.5,0.25 --out plan_large_65b_s19.json > $R/plan_large.log 2>&1
cp $(python3 -c "from turnip.bench.results import result_path; print(result_path('x').parent)")/plan_large_65b_s19.json $R/
tar czf $OUT/turnip_cache.tgz -C ~/.cache/turnip .
cd $R && tar czf $OUT/s19_c4.tgz . && ls -la $OUT
