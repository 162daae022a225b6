#!/usr/bin/env bash
# Shared by the per-mode launch scripts: starts each worker of a mode by hand,
# as you would across hosts (every process needs only the NATS URL).
#
#   NATS_URL      cluster URL(s), comma separated; unset: start `mmpipe nats` here
#   MODEL         built-in name or checkpoint directory (default tiny-qwen2-vl)
#   MMPIPE        the mmpipe command (default: .venv/bin/mmpipe, else mmpipe on PATH)
#   <ROLE>_WORKERS  workers of a role, e.g. ENCODE_WORKERS=2 PREFILL_DECODE_WORKERS=3
#   WORKER_ARGS   extra arguments for every worker (--device cuda:0 --transport nixl ...)
#   BRIDGE_ARGS   extra arguments for the bridge (--port 8000 --api-key ...)
set -euo pipefail
cd "$(dirname "$0")/../.."
MMPIPE=${MMPIPE:-$( [ -x .venv/bin/mmpipe ] && echo .venv/bin/mmpipe || echo mmpipe )}
MODEL=${MODEL:-tiny-qwen2-vl}
pids=()
stop() {
  # Bridge and workers first (they drain), the nats-server last.
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  wait "${pids[@]}" 2>/dev/null || true
  [ -n "${NATS_PID:-}" ] && kill -TERM "$NATS_PID" 2>/dev/null && wait "$NATS_PID" 2>/dev/null
  exit 0
}
trap stop INT TERM

if [ -z "${NATS_URL:-}" ]; then
  NATS_URL=nats://127.0.0.1:${NATS_PORT:-4222}
  setsid "$MMPIPE" nats --port "${NATS_PORT:-4222}" --data-dir "${DATA_DIR:-.mmpipe}" &
  NATS_PID=$!
  sleep 1
fi
# Build the built-in model once, before workers race to do it.
"$MMPIPE" model path "$MODEL" >/dev/null 2>&1 || true

launch_mode() {
  local mode=$1; shift
  for role in processor "$@"; do
    local var
    var=$(echo "${role}_WORKERS" | tr 'a-z+' 'A-Z_')
    for _ in $(seq 1 "${!var:-1}"); do
      # shellcheck disable=SC2086
      "$MMPIPE" worker "$role" --mode "$mode" --nats-url "$NATS_URL" --model "$MODEL" ${WORKER_ARGS:-} &
      pids+=($!)
    done
  done
  # shellcheck disable=SC2086
  "$MMPIPE" bridge --mode "$mode" --nats-url "$NATS_URL" ${BRIDGE_ARGS:-} &
  pids+=($!)
  wait -n "${pids[@]}" || true
  echo "a process of mode $mode exited; stopping the rest" >&2
  stop
}
