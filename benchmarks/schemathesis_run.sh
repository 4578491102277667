#!/usr/bin/env bash
# A long schemathesis run against a real `flexserve serve` (SmolLM2 on the CPU, loopback only):
# requests generated from /openapi.json, every response checked for no 5xx and conformance to the
# document (status code, content type, headers, body schema). The short version runs in `make
# test` (tests/test_schemathesis.py, over a fake executor).
#
#   benchmarks/schemathesis_run.sh [MAX_EXAMPLES_PER_OPERATION]   # default 200
#   SERVE_ARGS="--model /models/x" benchmarks/schemathesis_run.sh 50
#
# Exits with schemathesis's status (0: no failure); the server log is printed on failure.
set -euo pipefail
cd "$(dirname "$0")/.."
MAX_EXAMPLES="${1:-200}"
PY="$PWD/.venv/bin/python"
ST="$PWD/.venv/bin/schemathesis"
KEY="sk-schemathesis-$RANDOM"
WORK="$(mktemp -d -t flexserve-schemathesis-XXXXXX)"
PORT="$($PY -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
URL="http://127.0.0.1:$PORT"

# Short generations (--max-model-len) keep hypothesis' large max_tokens values quick; the
# request timeout bounds what is left (408 is a documented answer).
OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" $PY -m flexserve.entrypoints.cli.main serve \
  --host 127.0.0.1 --port "$PORT" --api-key "$KEY" --state-dir "$WORK/state" \
  --enable-lora --max-loras 2 --max-lora-rank 8 --max-model-len 128 --kv-cache-gib 0.1 \
  --max-num-seqs 8 --max-queue-len 64 --request-timeout-s 60 --max-upload-mb 1 \
  --disable-log-stats --log-level warning ${SERVE_ARGS:-} >"$WORK/server.log" 2>&1 &
SERVER=$!
cleanup() {
  kill -TERM "$SERVER" 2>/dev/null || true
  wait "$SERVER" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

for _ in $(seq 1 900); do
  if curl -fs "$URL/health" >/dev/null 2>&1; then break; fi
  if ! kill -0 "$SERVER" 2>/dev/null; then cat "$WORK/server.log"; exit 1; fi
  sleep 0.2
done

status=0
cd "$WORK"  # schemathesis keeps its state in ./.schemathesis: not in the repository
$ST run "$URL/openapi.json" \
  --checks not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance,response_schema_conformance \
  --max-examples "$MAX_EXAMPLES" --request-timeout 120 \
  -H "Authorization: Bearer $KEY" || status=$?
if [ "$status" -ne 0 ]; then tail -n 100 "$WORK/server.log"; fi
exit "$status"
