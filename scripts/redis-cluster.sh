#!/usr/bin/env bash
# Starts a local 3-node Redis Cluster on 127.0.0.1:7101-7103 unless one is already up there.
# Used by .ci/run; the cluster tests start the same one on demand (tests/support/cluster.rs).
set -euo pipefail
ports=(7101 7102 7103)
if redis-cli -p "${ports[0]}" cluster info 2>/dev/null | grep -q cluster_state:ok; then
  exit 0
fi
dir="${TMPDIR:-/tmp}/turnstile-test-cluster"
mkdir -p "$dir"
nodes=()
for port in "${ports[@]}"; do
  redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true
  rm -f "$dir/nodes-$port.conf"
  redis-server --port "$port" --bind 127.0.0.1 --daemonize yes --cluster-enabled yes \
    --cluster-config-file "$dir/nodes-$port.conf" --save "" --appendonly no --dir "$dir" \
    --logfile "$dir/redis-$port.log"
  nodes+=("127.0.0.1:$port")
done
sleep 0.5
redis-cli --cluster create "${nodes[@]}" --cluster-replicas 0 --cluster-yes >/dev/null
for _ in $(seq 1 100); do
  redis-cli -p "${ports[0]}" cluster info | grep -q cluster_state:ok && exit 0
  sleep 0.1
done
echo "the local Redis Cluster did not become ready" >&2
exit 1
