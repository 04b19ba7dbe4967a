#!/usr/bin/env bash
# README's test command: what the tests need that a fresh machine lacks (headless Chromium),
# formatting, lints, then every test against the local RabbitMQ and Redis (the tests start the
# local Redis Cluster and the mock downstream they need themselves).
set -euo pipefail
cd "$(dirname "$0")/.."
# Headless Chromium for the dashboard test, installed once from Debian's packages if missing.
if ! command -v chromium >/dev/null 2>&1 && [ -z "${CHROMIUM:-}" ]; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq chromium >/dev/null
  else
    echo "scripts/test.sh: the dashboard test needs Chromium: install the chromium package (as root: apt-get install -y chromium) or set CHROMIUM=/path/to/chromium" >&2
    exit 1
  fi
fi
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -q -- -D warnings
cargo test --workspace --all-targets "$@"
