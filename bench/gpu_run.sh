#!/usr/bin/env bash
# The prepared GPU run, copied to .gpu/run.sh by bench/gpu_payload.sh: unpack the carried packages
# (Ray and what it needs beyond the machine's image), then
#   gpu:        bench/gpu.py (matmul rate, the LM job's MFU, tests/gpu); BENCH_ARGS passes it flags;
#   checkpoint: bench/checkpoint.py with the jobs held to two cores and the S3 stand-in on a third
#               (the async checkpoint ratio with the bucket off the ranks' cores, as a remote one
#               is; on the 2-core CI machine the stand-in shares them); CKPT_ARGS passes it flags.
# PARTS picks them (default both, ~4 + ~3.5 minutes: one device call, timeout_s 600). Figures land in $OUT.
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
      tail -40 $OUT/gpu_bench.err
      cat $OUT/gpu_bench.txt ;;
    checkpoint)
      # the first two CPUs this process may use for the jobs, the third for the stand-in
      read -r job_cpus s3_cpus < <($PY -c "import os; c = sorted(os.sched_getaffinity(0))
print(f'{c[0]},{c[1]} {c[2]}' if len(c) > 2 else '')")
      lscpu -e > $OUT/cpus.txt 2>&1
      if [ -z "${s3_cpus:-}" ]; then
        stamp "checkpoint: fewer than 3 CPUs here, and the stand-in needs a core the two ranks do not train on"; r=2
      else
        stamp "bench/checkpoint.py: jobs on CPUs $job_cpus, the S3 stand-in on $s3_cpus"
        timeout ${CKPT_TIMEOUT_S:-280} $PY bench/checkpoint.py --job-cpus "$job_cpus" --s3-cpus "$s3_cpus" \
          ${CKPT_ARGS:---where s3 --pairs 2 --alternate-steps 6000} \
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
