#!/usr/bin/env bash
# Starts a local 3-node RabbitMQ cluster beside the system broker, unless it is already up:
# nodes tcluster1@localhost, tcluster2@localhost, tcluster3@localhost on 127.0.0.1:5681-5683
# (guest/guest), each with its own config file, data and log directories under
# /var/lib/rabbitmq/turnstile-cluster (owned by the rabbitmq user), no plugins. `stop` stops
# the three nodes. Needs root (the nodes run as the rabbitmq user, sharing its Erlang cookie).
#   TURNSTILE_AMQP_URL=amqp://guest:guest@127.0.0.1:5681/%2f,amqp://guest:guest@127.0.0.1:5682/%2f,amqp://guest:guest@127.0.0.1:5683/%2f
set -euo pipefail
base=/var/lib/rabbitmq/turnstile-cluster
names=(tcluster1 tcluster2 tcluster3)
ports=(5681 5682 5683)

up() { rabbitmqctl -n "$1@localhost" -q await_startup --timeout 1 >/dev/null 2>&1; }

if [ "${1:-}" = stop ]; then
  for n in "${names[@]}"; do rabbitmqctl -n "$n@localhost" -q stop >/dev/null 2>&1 || true; done
  exit 0
fi

for i in 0 1 2; do
  n=${names[$i]} p=${ports[$i]} dir=$base/${names[$i]}
  up "$n" && continue
  mkdir -p "$dir"
  printf 'listeners.tcp.local = 127.0.0.1:%s\n' "$p" >"$dir/rabbitmq.conf"
  echo '[].' >"$dir/enabled_plugins"
  chown -R rabbitmq:rabbitmq "$base"
  runuser -u rabbitmq -- env HOME=/var/lib/rabbitmq \
    RABBITMQ_NODENAME="$n@localhost" RABBITMQ_NODE_PORT="$p" RABBITMQ_DIST_PORT=$((p + 20000)) \
    RABBITMQ_CONFIG_FILE="$dir/rabbitmq.conf" RABBITMQ_ENABLED_PLUGINS_FILE="$dir/enabled_plugins" \
    RABBITMQ_MNESIA_BASE="$dir/mnesia" RABBITMQ_LOG_BASE="$dir/log" RABBITMQ_PID_FILE="$dir/pid" \
    rabbitmq-server -detached
done
for n in "${names[@]}"; do rabbitmqctl -n "$n@localhost" -q await_startup --timeout 120; done
for n in "${names[@]:1}"; do
  if ! rabbitmqctl -n "$n@localhost" -q cluster_status 2>/dev/null | grep -q "${names[0]}@localhost"; then
    rabbitmqctl -n "$n@localhost" -q stop_app
    rabbitmqctl -n "$n@localhost" -q join_cluster "${names[0]}@localhost"
    rabbitmqctl -n "$n@localhost" -q start_app
  fi
done
rabbitmqctl -n "${names[0]}@localhost" -q cluster_status | grep -A4 -i "running nodes" || true
