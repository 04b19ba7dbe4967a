#!/usr/bin/env bash
# What one replica costs, for deploy/kubernetes/deployment.yaml's resources: a release
# `turnstile consume` (TURNSTILE_WORKERS, default 16) drains MESSAGES registrations (default
# 20000) of SELLERS sellers (default 100) at LIMIT (default 1000000/1s: out of the way) from the
# local RabbitMQ through the local Redis, calling `turnstile mock-api` (LATENCY_MS, default 0) in
# a process of its own. Prints the drain rate, the replica's CPU (cores, mean over the drain;
# from /proc/<pid>/stat) and its peak resident memory (VmHWM). Cleans up its queues and keys.
set -euo pipefail
cd "$(dirname "$0")/.."
messages=${MESSAGES:-20000}
sellers=${SELLERS:-100}
limit=${LIMIT:-1000000/1s}
name="measure-$$"
port_api=$((20000 + $$ % 10000))
port_http=$((port_api + 1))
bin=target/release/turnstile
cargo build --release -q

export TURNSTILE_AMQP_URL=${TURNSTILE_AMQP_URL:-amqp://guest:guest@127.0.0.1:5672/%2f}
export TURNSTILE_REDIS_URL=${TURNSTILE_REDIS_URL:-redis://127.0.0.1:6379/}
export TURNSTILE_DOWNSTREAM_URL="http://127.0.0.1:$port_api/register/{seller_id}"
export TURNSTILE_QUEUE=$name TURNSTILE_KEY_PREFIX=$name TURNSTILE_LIMIT=$limit
export TURNSTILE_HTTP_ADDR=127.0.0.1:$port_http TURNSTILE_WORKERS=${TURNSTILE_WORKERS:-16}

work=$(mktemp -d)
api=""
replica=""
cleanup() {
  [ -n "$replica" ] && kill -TERM "$replica" 2>/dev/null && wait "$replica" 2>/dev/null
  [ -n "$api" ] && kill "$api" 2>/dev/null
  for q in $(rabbitmqctl list_queues -q name 2>/dev/null | grep "^$name" || true); do
    rabbitmqctl delete_queue -q "$q" >/dev/null 2>&1 || true
  done
  redis-cli -u "$TURNSTILE_REDIS_URL" --scan --pattern "$name*" | xargs -r redis-cli -u "$TURNSTILE_REDIS_URL" del >/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

"$bin" mock-api --limit "$limit" --addr "127.0.0.1:$port_api" --latency-ms "${LATENCY_MS:-0}" >"$work/api.log" 2>&1 &
api=$!
"$bin" consume >"$work/replica.log" 2>&1 &
replica=$!
until curl -sf "127.0.0.1:$port_http/readyz" >/dev/null; do sleep 0.2; done

per_seller=$((messages / sellers))
{ echo sku; seq 1 "$per_seller"; } >"$work/products.csv"
ticks=$(getconf CLK_TCK)
cpu() { awk '{print $14 + $15}' "/proc/$replica/stat"; }
registered() { curl -s "127.0.0.1:$port_api/stats" | python3 -c 'import json,sys; print(json.load(sys.stdin)["registered"])'; }
start_cpu=$(cpu)
start=$(date +%s.%N)
for s in $(seq 1 "$sellers"); do
  "$bin" publish "$work/products.csv" --seller "S-$s" >/dev/null
done
total=$((per_seller * sellers))
until [ "$(registered)" -ge "$total" ]; do sleep 0.2; done
end=$(date +%s.%N)
used=$(( $(cpu) - start_cpu ))
hwm=$(awk '/VmHWM/ {print $2}' "/proc/$replica/status")
python3 - "$total" "$start" "$end" "$used" "$ticks" "$hwm" "$TURNSTILE_WORKERS" <<'EOF'
import sys
total, start, end, used, ticks, hwm, workers = sys.argv[1:]
secs = float(end) - float(start)
print(f"{total} registrations, {workers} workers, published while consuming: {int(total) / secs:.0f} msg/s; "
      f"replica CPU {int(used) / int(ticks) / secs:.2f} cores (mean); peak RSS {int(hwm) / 1024:.1f} MiB")
EOF
