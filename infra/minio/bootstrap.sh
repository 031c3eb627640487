#!/usr/bin/env bash
# Start the MinIO of docker-compose.yml, create the bucket for decoupled-diloco runs (versioning
# off: log objects are immutable, versions would only keep dead copies of the advisory head
# hint), print the variables a run needs, and check that create-if-absent is enforced.
# Usage: MINIO_ROOT_USER=... MINIO_ROOT_PASSWORD=... infra/minio/bootstrap.sh [BUCKET]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
: "${MINIO_ROOT_USER:?set MINIO_ROOT_USER}"
: "${MINIO_ROOT_PASSWORD:?set MINIO_ROOT_PASSWORD (at least 8 characters)}"
bucket="${1:-${DDILOCO_BUCKET:-ddiloco}}"
port="${MINIO_PORT:-9000}"
compose=(docker compose -f "$here/docker-compose.yml")

"${compose[@]}" up -d --wait minio
"${compose[@]}" exec -T minio mc alias set local http://127.0.0.1:9000 "$MINIO_ROOT_USER" "$MINIO_ROOT_PASSWORD" >/dev/null
"${compose[@]}" exec -T minio mc mb --ignore-existing "local/$bucket"
if "${compose[@]}" exec -T minio mc version info "local/$bucket" | grep -qi 'enabled'; then
  "${compose[@]}" exec -T minio mc version suspend "local/$bucket"
fi

export AWS_ENDPOINT_URL="http://127.0.0.1:$port" AWS_ACCESS_KEY_ID="$MINIO_ROOT_USER" \
       AWS_SECRET_ACCESS_KEY="$MINIO_ROOT_PASSWORD" AWS_REGION=us-east-1
python="${PYTHON:-$repo/.venv/bin/python}"
[ -x "$python" ] || python=python3
(cd "$repo" && "$python" -m storage.probe "s3://$bucket/ddiloco-probe")

cat <<VARS
# MinIO is ready. Point a run at it with:
export AWS_ENDPOINT_URL=$AWS_ENDPOINT_URL
export AWS_ACCESS_KEY_ID=$MINIO_ROOT_USER
export AWS_SECRET_ACCESS_KEY=<MINIO_ROOT_PASSWORD>
export AWS_REGION=us-east-1
# run location: s3://$bucket/<run-name>
VARS
