#!/usr/bin/env bash
# The prepared GPU run (device command "bash bench/gpu_run.sh", carry [".gpu"], timeout_s 600; .gpu/
# is built by bench/gpu_payload.sh): unpack the carried packages (Ray and what it needs beyond the
# machine's image), then
#   gpu:        bench/gpu.py (matmul rate, the LM job's MFU, tests/gpu); BENCH_ARGS passes it flags;
#   checkpoint: bench/checkpoint.py with the jobs held to two cores and the S3 stand-in on a third
#               (the async checkpoint ratio with the bucket off the ranks' cores, as a remote one
#               is; on the 2-core CI machine the stand-in shares them); CKPT_ARGS passes it flags.
# PARTS picks them (default both, ~4 + ~3.5 minutes: one device call). The checkpoint part gets what
# is left of RUN_BUDGET_S (570) and is skipped with less than 200 s left. Figures land in $OUT.
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
uname -sr | tee -a $OUT/versions.txt
rc=0
save_ray_logs() {  # of a part that failed: Ray's own words on why
  if [ -d /tmp/ray/session_latest/logs ]; then
    tar -czf "$OUT/ray_logs_$1.tgz" -C /tmp/ray/session_latest logs 2>/dev/null
  fi
}
for part in ${PARTS:-gpu checkpoint}; do
  case $part in
    gpu)
      stamp "bench/gpu.py"
      timeout ${BENCH_TIMEOUT_S:-400} $PY bench/gpu.py ${BENCH_ARGS:-} > $OUT/gpu_bench.txt 2> $OUT/gpu_bench.err
      r=$?
      stamp "bench/gpu.py rc $r"
      [ $r -eq 0 ] || save_ray_logs gpu
      if [ $r -eq 124 ]; then  # cut off: its local Ray may live on, on the CPUs the next part measures
        $PY -m ray.scripts.scripts stop --force > /dev/null 2>&1
      fi
      tail -40 $OUT/gpu_bench.err
      cat $OUT/gpu_bench.txt ;;
    checkpoint)
      left=$(( ${RUN_BUDGET_S:-570} - ($(date +%s) - t0) ))
      lscpu -e > $OUT/cpus.txt 2>&1
      if [ $left -lt 200 ]; then
        stamp "checkpoint: skipped, ${left}s left of RUN_BUDGET_S (PARTS=checkpoint runs it alone)"; r=3
      else
        # --spare-core: two physical cores for the jobs, a third for the S3 stand-in (printed first)
        stamp "bench/checkpoint.py, ${left}s at most"
        timeout $left $PY bench/checkpoint.py --spare-core ${CKPT_ARGS:---where s3 --pairs 2 --alternate-steps 6000} \
          > $OUT/checkpoint_bench.txt 2> $OUT/checkpoint_bench.err
        r=$?
        stamp "bench/checkpoint.py rc $r"
        [ $r -eq 0 ] || save_ray_logs checkpoint
        grep '^\[bench\]' $OUT/checkpoint_bench.err
        tail -5 $OUT/checkpoint_bench.err | grep -v '^\[bench\]'
        cat $OUT/checkpoint_bench.txt
      fi ;;
    *) stamp "PARTS: unknown part $part (gpu, checkpoint)"; r=2 ;;
  esac
  [ $r -eq 0 ] || rc=$r
done
exit $rc
