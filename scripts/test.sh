#!/usr/bin/env bash
# README's test command: formatting, lints, then every test against the local RabbitMQ and Redis
# (the tests start the local Redis Cluster and the mock downstream they need themselves).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -q -- -D warnings
cargo test --workspace --all-targets "$@"
