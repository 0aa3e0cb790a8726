#!/usr/bin/env bash
# Every row of the step-speed table in one run on one CUDA host, then the table
# (benchmarks/step_speed_report.py). Usage:
#
#   bash benchmarks/run_step_speed.sh OUT_DIR [peers] [prefill] [served] [report]
#
# With no part named, all four run in that order (about 10 to 15 minutes on an H200, most of it
# the torch.compile warm-up of the Hugging Face peer). Parts can run in separate calls on the same
# host into the same OUT_DIR (each writes its own files), and `report` reads whatever is there.
#
# Environment:
#   SERVE_MODEL  model of the served and offline rows (default: the default GGUF); a directory
#                with the SmolLM2-135M config.json and tokenizer works with --load-format dummy
#   SERVE_ARGS   more engine arguments for the served and offline rows (e.g. --device cpu)
#   NUM_PROMPTS  prompts of the served and offline rows (default 2048)
#   NUM_CLIENTS  client processes driving the 64 streams of the served row (default 16): httpx
#                spends about 70 us of CPU per streamed chunk on a host whose Python loop reads
#                52 ms (host_speed.py), so at ~40,000 tok/s 8 processes of 8 streams are each
#                40-80% busy on the H200 hosts (loop 68-140 ms) and their own queueing shows up in
#                TTFT and in the streams' idle slots; 16 keep each client well under half busy
#                (at most NUM_PROMPTS)
#   VOCAB_SIZE   prompt token ids of the served row are below this (default 49152, SmolLM2)
#   PORT         server port for the served row (default 8011)
#   PYTHON       interpreter (default python3)
set -euo pipefail

OUT=${1:?usage: run_step_speed.sh OUT_DIR [peers] [prefill] [served] [report]}
shift
PARTS=${*:-peers prefill served report}
PY=${PYTHON:-python3}
PORT=${PORT:-8011}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"
NUM_PROMPTS=${NUM_PROMPTS:-2048}
NUM_CLIENTS=${NUM_CLIENTS:-16}
[ "$NUM_CLIENTS" -gt "$NUM_PROMPTS" ] && NUM_CLIENTS=$NUM_PROMPTS
MODEL_ARGS=(--load-format dummy)
[ -n "${SERVE_MODEL:-}" ] && MODEL_ARGS+=(--model "$SERVE_MODEL")
# shellcheck disable=SC2206 # word splitting of SERVE_ARGS is intended
[ -n "${SERVE_ARGS:-}" ] && MODEL_ARGS+=(${SERVE_ARGS})
SERVER_PID=
cleanup() { [ -n "$SERVER_PID" ] && kill "$SERVER_PID" 2>/dev/null && wait "$SERVER_PID" || true; }
trap cleanup EXIT

# How fast the host's CPU is just before a part starts (host-bound rows move with it; the report
# prints it). A failed probe does not stop the run.
host_probe() { "$PY" "$HERE/host_speed.py" --json "$OUT/host_$1.json" || echo "host probe failed" >&2; }

for part in $PARTS; do
  case $part in
    peers)
      host_probe peers
      "$PY" "$HERE/benchmark_peers.py" --systems fastdeploy-graph hf-compile \
        --models smollm2-135m llama3-8b --batch-sizes 1 16 64 --json "$OUT/peers.json" ;;
    prefill)
      host_probe prefill
      for m in smollm2-135m llama3-8b; do
        "$PY" "$HERE/benchmark_prefill.py" --model "$m" --tokens 16 --decode-batches 1 \
          --iters 50 --json "$OUT/prefill_$m.json"
      done ;;
    served)
      # 64 concurrent streams, 256 prompt and 128 output tokens each, against the offline rate
      # of the same workload on the same host.
      host_probe served
      "$PY" -m fastdeploy.entrypoints.openai.api_server "${MODEL_ARGS[@]}" --port "$PORT" \
        --max-num-seqs 64 --log-level warning > "$OUT/server.log" 2>&1 &
      SERVER_PID=$!
      # One poller for up to 300 s, every 0.1 s (a new interpreter per poll cost ~0.5 s each).
      "$PY" - "$PORT" "$SERVER_PID" <<'POLL' || { echo "server exited; see $OUT/server.log" >&2; exit 1; }
import os, sys, time

import httpx

port, pid = sys.argv[1], int(sys.argv[2])
deadline = time.monotonic() + 300
while time.monotonic() < deadline:
    try:
        if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
            break
    except httpx.HTTPError:
        pass
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit(1)
    time.sleep(0.1)
POLL
      "$PY" "$HERE/benchmark_serving.py" --base-url "http://127.0.0.1:$PORT" --concurrency 64 \
        --num-clients "$NUM_CLIENTS" --num-prompts "$NUM_PROMPTS" --input-len 256 --output-len 128 \
        --vocab-size "${VOCAB_SIZE:-49152}" \
        --seed 3 --json "$OUT/served.json"
      kill -INT "$SERVER_PID"; wait "$SERVER_PID" || true; SERVER_PID=
      "$PY" "$HERE/benchmark_throughput.py" "${MODEL_ARGS[@]}" --num-prompts "$NUM_PROMPTS" \
        --input-len 256 --output-len 128 --range-ratio 0 --max-num-seqs 64 \
        --json "$OUT/offline.json" ;;
    report)
      "$PY" "$HERE/step_speed_report.py" "$OUT" ;;
    *)
      echo "unknown part '$part'; allowed: peers prefill served report" >&2; exit 2 ;;
  esac
done
