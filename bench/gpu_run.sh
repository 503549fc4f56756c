#!/usr/bin/env bash
# The prepared GPU run, copied to .gpu/run.sh by bench/gpu_payload.sh: unpack the carried packages
# (Ray and what it needs beyond the machine's image), then bench/gpu.py (matmul rate, the LM job's
# MFU, tests/gpu). Figures land in $OUT. BENCH_ARGS passes flags to bench/gpu.py.
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
PY=${PY:-python3}
t0=$(date +%s)
stamp() { echo "[run.sh +$(( $(date +%s) - t0 ))s] $*"; }
if [ -z "${SKIP_SITE:-}" ]; then
  tar -xJf .gpu/gpusite.tar.xz -C /tmp || { stamp "unpack failed"; exit 3; }
  export PYTHONPATH=/tmp/gpusite:$PWD
fi
stamp unpacked
$PY -c "import ray, torch, pydantic, boto3, pyarrow; print('ray', ray.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else '')" 2>&1 | tee $OUT/versions.txt
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a $OUT/versions.txt
stamp "bench/gpu.py"
timeout ${BENCH_TIMEOUT_S:-400} $PY bench/gpu.py ${BENCH_ARGS:-} > $OUT/gpu_bench.txt 2> $OUT/gpu_bench.err
rc=$?
stamp "bench rc $rc"
tail -40 $OUT/gpu_bench.err
cat $OUT/gpu_bench.txt
if [ $rc -ne 0 ] && [ -d /tmp/ray/session_latest/logs ]; then
  tar -czf $OUT/ray_logs.tgz -C /tmp/ray/session_latest logs 2>/dev/null
fi
exit $rc
