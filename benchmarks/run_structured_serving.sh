#!/usr/bin/env bash
# Serving throughput with and without a JSON schema at 1 and 64 streams, in one run on one host
# (docs/structured-output.md). Starts `fastdeploy serve`, runs benchmarks/benchmark_serving.py four
# times (plain and `--json-schema default`, at concurrency 1 and 64; a different --seed per run so
# the prefix cache answers nothing), prints each table, writes OUT_DIR/{plain,schema}_{1,64}.json,
# and stops the server whatever happens. Usage:
#
#   bash benchmarks/run_structured_serving.sh OUT_DIR
#
# Environment: SERVE_MODEL (default: the default GGUF), SERVE_ARGS (more `serve` arguments),
# PORT (default 8012), PYTHON (default python3), NUM_PROMPTS_64 (default 512), NUM_PROMPTS_1
# (default 32), OUTPUT_LEN (default 200: the default schema's outputs end well inside it).
set -euo pipefail

OUT=${1:?usage: run_structured_serving.sh OUT_DIR}
PY=${PYTHON:-python3}
PORT=${PORT:-8012}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"
ARGS=(--port "$PORT")
[ -n "${SERVE_MODEL:-}" ] && ARGS+=(--model "$SERVE_MODEL")
# shellcheck disable=SC2206 # word splitting of SERVE_ARGS is intended
[ -n "${SERVE_ARGS:-}" ] && ARGS+=(${SERVE_ARGS})
SERVER_PID=
cleanup() { [ -n "$SERVER_PID" ] && kill "$SERVER_PID" 2>/dev/null && wait "$SERVER_PID" || true; }
trap cleanup EXIT

"$PY" -m fastdeploy.entrypoints.cli.main serve "${ARGS[@]}" >"$OUT/server.log" 2>&1 &
SERVER_PID=$!
"$PY" - "$PORT" "$SERVER_PID" <<'EOF'
import os, sys, time, httpx
port, pid = sys.argv[1], int(sys.argv[2])
deadline = time.monotonic() + 600
while time.monotonic() < deadline:
    try:
        if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
            sys.exit(0)
    except httpx.HTTPError:
        pass
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("the server exited before it was ready (see server.log)")
    time.sleep(1)
sys.exit("the server was not ready within 600 s")
EOF

seed=100
for streams in 1 64; do
  n_var=NUM_PROMPTS_$streams
  default_n=$([ "$streams" = 1 ] && echo 32 || echo 512)
  n=${!n_var:-$default_n}
  clients=$([ "$streams" = 1 ] && echo 1 || echo 8)
  [ "$clients" -gt "$n" ] && clients=$n
  for kind in plain schema; do
    seed=$((seed + 1))
    extra=()
    [ "$kind" = schema ] && extra=(--json-schema default)
    echo "=== $kind, $streams stream(s), $n prompts"
    "$PY" "$HERE/benchmark_serving.py" --base-url "http://127.0.0.1:$PORT" \
      --concurrency "$streams" --num-prompts "$n" --num-clients "$clients" \
      --output-len "${OUTPUT_LEN:-200}" --seed "$seed" "${extra[@]}" \
      --json "$OUT/${kind}_${streams}.json"
  done
done
