#!/usr/bin/env bash
# BENCHMARKS.md's scaling table: `turnstile bench throughput` (3 rounds, medians) with 1, 2, 4
# and 8 replicas on standalone Redis vs the local 3-node Redis Cluster, and on the system
# RabbitMQ vs the local 3-node RabbitMQ cluster (quorum queues). Starts both clusters if
# needed (scripts/redis-cluster.sh, scripts/rabbitmq-cluster.sh; the RabbitMQ one needs root)
# and writes each run's table to $OUT (default target/bench-scaling/).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-target/bench-scaling}
mkdir -p "$out"
cargo build --release -q
bin=./target/release/turnstile
scripts/redis-cluster.sh >/dev/null
scripts/rabbitmq-cluster.sh >/dev/null
redis_cluster=redis://127.0.0.1:7101/,redis://127.0.0.1:7102/,redis://127.0.0.1:7103/
rabbit_cluster=amqp://guest:guest@127.0.0.1:5681/%2f,amqp://guest:guest@127.0.0.1:5682/%2f,amqp://guest:guest@127.0.0.1:5683/%2f
run() {
  local name=$1
  shift
  echo "== $name" | tee "$out/$name.txt"
  "$bin" bench throughput --replicas 1,2,4,8 "$@" 2>/dev/null | tee -a "$out/$name.txt"
}
run standalone-redis-single-broker
run redis-cluster-single-broker --bench-redis-url "$redis_cluster"
run standalone-redis-broker-cluster --amqp-url "$rabbit_cluster"
run redis-cluster-broker-cluster --bench-redis-url "$redis_cluster" --amqp-url "$rabbit_cluster"
