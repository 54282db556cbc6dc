# Sourced by the multi-GPU call scripts (bench/gpu_session_multi.sh, the calls kept under bench/results/*/logs/):
# installs the carried wheels (.whl/) and this checkout, unpacks a carried turnip_cache.tgz (op costs and
# plans of an earlier call), and leaves the shell in /tmp/run with REPO set to the checkout and R=$OUT/r.
# Not the repository as working directory: python -m puts it first on sys.path.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
REPO=$PWD
if [ -f turnip_cache.tgz ]; then mkdir -p ~/.cache/turnip && tar -xzf turnip_cache.tgz -C ~/.cache/turnip; fi
R=$OUT/r; mkdir -p "$R"
nvidia-smi -L > "$R/gpus.txt"
mkdir -p /tmp/run && cd /tmp/run
