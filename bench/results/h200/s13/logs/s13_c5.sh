#!/usr/bin/env bash
# call 5 (one H200): the GPU tests of the tracing path on torch 2.11 + CUDA, with the recorder
set -x
python3 -m pytest --version
timeout 420 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_concat.py tests/test_costs.py tests/test_interrupts.py tests/test_moe.py tests/test_recorder.py tests/test_constant_checks.py > $OUT/gpu_tests.log 2>&1
tail -30 $OUT/gpu_tests.log
