#!/usr/bin/env bash
# Replicas on the local 3-node RabbitMQ cluster (scripts/rabbitmq-cluster.sh) with quorum
# queues and TURNSTILE_AMQP_URL listing the three nodes: `bench scenario --preset bar` (4
# replicas, 400 + 20x20 at 20/1s) while the node the replicas are connected to (the list's
# first) is stopped STOP_AFTER seconds (default 8) into the backlog, and started again once the
# run is over. Prints the scenario's figures (lost, violations, drain / optimum). Needs root.
# Extra arguments go to `bench scenario`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/rabbitmq-cluster.sh >/dev/null
urls=amqp://guest:guest@127.0.0.1:5681/%2f,amqp://guest:guest@127.0.0.1:5682/%2f,amqp://guest:guest@127.0.0.1:5683/%2f
cargo build --release -q
./target/release/turnstile bench scenario --preset bar --amqp-url "$urls" "$@" &
bench=$!
sleep "${STOP_AFTER:-8}"
echo "broker-failover: stopping tcluster1@localhost, the node the replicas are connected to" >&2
rabbitmqctl -n tcluster1@localhost -q stop_app
status=0
wait "$bench" || status=$?
rabbitmqctl -n tcluster1@localhost -q start_app
exit "$status"
