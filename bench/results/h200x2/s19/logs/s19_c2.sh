#!/usr/bin/env bash
# issue 31 (2 x H200), the nineteenth session's second call: attention ops without dropout inside the captured
# segments (b0847d2): the CUDA tests that check it, the rows at 100, 50 and 25% per GPU beside DDP and FSDP2,
# the loop's profile at 25% (launches per step against s18's 2,806), then whether two runs of one MemGraph
# give the same weights (repeatability, at 100% on two GPUs and on one). Carries turnip_cache.tgz (op costs
# and plans of s18 call 3). Around it, the host probe on every CPU (are some cores slower at the loop's
# Python?), and the loop's profile again with the process held to the eight fastest CPUs of the first probe.
# usage: s19_c2.sh COMMIT [SECONDS]
set -x
COMMIT=$1; END=$((SECONDS + ${2:-555}))
export TURNIP_COMMIT=$COMMIT
source bench/device_setup.sh
PEAK=39829110784
fits() { [ $((END - SECONDS)) -ge $1 ]; }  # run a part only if its time limit still fits the call
python3 -m turnip.bench.host_probe --by-cpu --out $R/probe_start.json
fits 100 && (cd $REPO && timeout 100 python3 -m pytest -q -p no:logging tests/test_cuda.py \
  -k "generator or segments_equal" > $R/cuda_tests.log 2>&1)
fits 300 && timeout 300 python3 -m turnip.bench multi_gpu --model gpt1.3b --devices 2 --eager-peak $PEAK --no-plots \
  --budgets 1.0,0.5,0.25 --peers ddp,fsdp2 --steps 8 --warmup 2 --isolate --row-limit 120 \
  --peer-limit 70 --out $R/x2.json > $R/x2.log 2>&1
fits 60 && timeout 60 python3 -m turnip.bench.loop_profile --model gpt1.3b --devices 2 --budget 0.25 --eager-peak $PEAK \
  --steps 3 --warmup 2 --out $R/loop_profile_0.25.json > $R/loop_profile_0.25.log 2>&1
FAST=$(python3 -c "import json; rows = json.load(open('$R/probe_start.json'))['by_cpu']; \
print(','.join(str(r['cpu']) for r in sorted(rows, key=lambda r: r['python_us'])[:8]))")
fits 60 && timeout 60 taskset -c $FAST python3 -m turnip.bench.loop_profile --model gpt1.3b --devices 2 --budget 0.25 \
  --eager-peak $PEAK --steps 3 --warmup 2 --out $R/loop_profile_0.25_fast.json > $R/loop_profile_0.25_fast.log 2>&1
fits 50 && timeout 50 python3 -m turnip.bench.repeatability --model gpt1.3b --devices 2 --budget 1.0 --eager-peak $PEAK \
  --out $R/repeat_x2_1.0.json > $R/repeat_x2_1.0.log 2>&1
fits 40 && timeout $((END - SECONDS)) python3 -m turnip.bench.repeatability --model gpt1.3b --devices 1 --budget 1.0 \
  --eager-peak $PEAK --out $R/repeat_x1_1.0.json > $R/repeat_x1_1.0.log 2>&1
python3 -m turnip.bench.host_probe --by-cpu --out $R/probe_end.json
tar czf $OUT/turnip_cache.tgz -C ~/.cache/turnip .
cd $R && tar czf $OUT/s19_c2.tgz . && ls -la $OUT
