#!/usr/bin/env bash
# Builds .gpu/ for the lent GPU machine (see bench/gpu.py): its image has torch, pyarrow, pytest
# and most of what we use, but not Ray, pydantic, boto3 or FastAPI, and it reaches no package
# registry. This fetches Python 3.12 wheels of the missing packages at the versions in .venv,
# installs them into one folder, drops what a training run never imports (Ray's Java jars,
# RLlib, Ray LLM, botocore's models of services other than S3/STS/EC2/IAM) to stay under the
# tool's 64 MiB per call, and packs it with the run script:
#
#   bench/gpu_payload.sh            # ~3 min here; writes .gpu/gpusite.tar.xz (~42 MB) and .gpu/run.sh
#   device run: command "bash .gpu/run.sh", carry [".gpu"], timeout_s 500
#
# .gpu/ must be ignored (echo /.gpu/ >> .git/info/exclude) so that it travels only when carried.
set -euo pipefail
cd "$(dirname "$0")/.."
PKGS="aiohttp-cors annotated-types boto3 botocore colorful distlib fastapi google-api-core google-auth
googleapis-common-protos grpcio-reflection httptools jmespath jsonschema jsonschema-specifications opencensus
opencensus-context opentelemetry-api opentelemetry-exporter-prometheus opentelemetry-proto opentelemetry-sdk
opentelemetry-semantic-conventions platformdirs proto-plus py-spy pyasn1 pyasn1_modules pydantic pydantic_core
pydantic-settings python-discovery python-dotenv ray referencing rpds-py s3transfer smart_open starlette
tensorboardX typing-inspection uvicorn virtualenv watchfiles websockets"
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
find "$site/botocore/data" -mindepth 1 -maxdepth 1 -type d \
  -not -name s3 -not -name s3control -not -name sts -not -name sso -not -name sso-oidc -not -name ec2 -not -name iam \
  -exec rm -rf {} +
mkdir -p .gpu
tar -cJf .gpu/gpusite.tar.xz -C "$work" gpusite
cp bench/gpu_run.sh .gpu/run.sh
ls -la .gpu
