#!/usr/bin/env bash
# README's test command: what the tests need that a fresh machine lacks (headless Chromium,
# docker-compose, promtool, the manifest validator's npm packages; installed once), formatting,
# lints, then every test against the local RabbitMQ and Redis (the tests start the local Redis
# Cluster and the mock downstream they need themselves).
set -euo pipefail
cd "$(dirname "$0")/.."

# Installs Debian packages (as root, once) or says what is missing.
apt_install() {
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    if [ -z "${APT_UPDATED:-}" ]; then apt-get update -qq; APT_UPDATED=1; fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
  else
    echo "scripts/test.sh: the tests need the Debian package(s) $* (as root: apt-get install -y $*)" >&2
    exit 1
  fi
}

# Headless Chromium for the dashboard test (or CHROMIUM=/path/to/chromium).
if ! command -v chromium >/dev/null 2>&1 && [ -z "${CHROMIUM:-}" ]; then
  apt_install chromium
fi
# `docker compose config` for tests/monitoring.rs: Compose v2 if the docker CLI has it, else
# Debian's docker-compose (it validates without a Docker engine).
if ! docker compose version >/dev/null 2>&1 && ! command -v docker-compose >/dev/null 2>&1; then
  apt_install docker-compose
fi
# promtool for tests/monitoring.rs: unpacked from Debian's prometheus package into target/tools
# (not installed: that package would also set up a Prometheus server).
if ! command -v promtool >/dev/null 2>&1 && [ -z "${PROMTOOL:-}" ] && [ ! -x target/tools/promtool ]; then
  if [ -z "${APT_UPDATED:-}" ] && [ "$(id -u)" = 0 ]; then apt-get update -qq; APT_UPDATED=1; fi
  unpack="$(mktemp -d)"
  (cd "$unpack" && apt-get download prometheus >/dev/null 2>&1 && dpkg-deb -x prometheus_*.deb root) || {
    echo "scripts/test.sh: could not fetch Debian's prometheus package for promtool; set PROMTOOL=/path/to/promtool" >&2
    exit 1
  }
  mkdir -p target/tools && cp "$unpack/root/usr/bin/promtool" target/tools/promtool
  rm -rf "$unpack"
fi
# The Kubernetes manifests' validator (tests/deploy.rs runs deploy/validate/validate.mjs): its
# npm packages, pinned in deploy/validate/package-lock.json, installed again only when that
# lockfile changed since the last install (a copy of it is kept in node_modules).
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  apt_install nodejs npm
fi
if ! cmp -s deploy/validate/package-lock.json deploy/validate/node_modules/.turnstile-installed-lock.json; then
  npm ci --prefix deploy/validate --no-audit --no-fund --loglevel=error
  cp deploy/validate/package-lock.json deploy/validate/node_modules/.turnstile-installed-lock.json
fi
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -q -- -D warnings
cargo test --workspace --all-targets "$@"
