#!/usr/bin/env bash
# call 3 (one H200): the llama step exported with op costs measured now (to plan offline: why the 60% row's
# greedy plan simulates slower than the filing code's), then issue 32's rows (s20_rows.sh)
# usage: s20_c3.sh NEW_COMMIT ROW_SPECS...
set -x
NEW_COMMIT=$1; shift
source bench/device_setup.sh
TURNIP_COMMIT=$NEW_COMMIT TURNIP_CACHE_DIR=/tmp/costs_export timeout 150 \
  python3 -m turnip.bench.replan export --models llama --out $R/steps > $R/export_llama.log 2>&1
cd $REPO && bash bench/results/h200/s20/logs/s20_rows.sh $NEW_COMMIT 3 "$@"
