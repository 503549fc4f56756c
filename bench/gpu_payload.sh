#!/usr/bin/env bash
# Builds .gpu/ for the lent GPU machine (see bench/gpu.py): its image has torch, pyarrow, pytest
# and most of what we use, but not Ray, pydantic, boto3 or FastAPI, and it reaches no package
# registry. bench/checkpoint.py's S3 stand-in (moto's S3 backend: bench/s3_server.py) comes too,
# with what it imports that the image lacks (the image's list: the device tool's KINDS.md). This
# fetches Python 3.12 wheels of the missing packages at the versions in .venv, installs them into
# one folder, drops what a training run never imports (Ray's Java jars, RLlib, Ray LLM, botocore's
# models of services other than S3/STS/EC2/IAM, moto's services but the few its S3 server uses) to
# stay under the tool's 64 MiB per call, and packs it for bench/gpu_run.sh (tracked, so the run
# is always this checkout's):
#
#   bench/gpu_payload.sh            # ~2 min here; writes .gpu/gpusite.tar.xz (~48 MB)
#   device run: command "bash bench/gpu_run.sh", carry [".gpu"], timeout_s 600
#
# .gpu/ is in .gitignore so that it travels only when carried.
set -euo pipefail
cd "$(dirname "$0")/.."
PKGS="aiohttp-cors annotated-types boto3 botocore colorful distlib fastapi google-api-core google-auth
googleapis-common-protos grpcio-reflection httptools jmespath jsonschema jsonschema-specifications opencensus
opencensus-context opentelemetry-api opentelemetry-exporter-prometheus opentelemetry-proto opentelemetry-sdk
opentelemetry-semantic-conventions platformdirs proto-plus py-spy pyasn1 pyasn1_modules pydantic pydantic_core
pydantic-settings python-discovery python-dotenv ray referencing rpds-py s3transfer smart_open starlette
tensorboardX typing-inspection uvicorn virtualenv watchfiles websockets
moto werkzeug flask flask-cors blinker itsdangerous xmltodict responses cryptography cffi"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
.venv/bin/python -m pip list --format=freeze > "$work/freeze.txt"
for p in $PKGS; do
  grep -i "^${p//[-_]/[-_]}==" "$work/freeze.txt" || { echo "$p is not in .venv (make .venv/.installed first)" >&2; exit 2; }
done > "$work/pins.txt"
plat=()
for t in manylinux1 manylinux2014 manylinux_2_5 manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 manylinux_2_34; do
  plat+=(--platform "${t}_x86_64")
done
opts=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}")
.venv/bin/python -m pip download -q "${opts[@]}" -d "$work/wheels" -r "$work/pins.txt"
.venv/bin/python -m pip install -q --no-compile "${opts[@]}" --target "$work/gpusite" "$work"/wheels/*.whl
site="$work/gpusite"
rm -rf "$site"/ray/jars "$site"/ray/rllib "$site"/ray/llm "$site"/ray/dashboard/client/build/static/js/*.map
# moto's S3 server imports these of its ~180 services (read off a running one that took a PUT, a
# GET, a listing and a DeleteObjects); tests/unit/test_bench_parts.py runs it on such a cut copy
MOTO_KEEP="backend_index backends cloudwatch core events iam moto_api moto_server s3 s3bucket_path server settings
sts utilities"
find "$site/moto" -mindepth 1 -maxdepth 1 -type d $(printf -- '-not -name %s ' $MOTO_KEEP __pycache__) -exec rm -rf {} +
find "$site/botocore/data" -mindepth 1 -maxdepth 1 -type d \
  -not -name s3 -not -name s3control -not -name sts -not -name sso -not -name sso-oidc -not -name ec2 -not -name iam \
  -exec rm -rf {} +
mkdir -p .gpu
tar -cJf .gpu/gpusite.tar.xz -C "$work" gpusite
rm -f .gpu/run.sh  # a copy from before the run script was run in place would go stale
ls -la .gpu
