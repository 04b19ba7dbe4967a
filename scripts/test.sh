#!/usr/bin/env bash
# README's test command: what the tests need that a fresh machine lacks (headless Chromium,
# docker-compose, promtool, Node and the manifest validator's npm packages, Python 3 with
# pika; installed once), formatting, lints, then every test against the local RabbitMQ and
# Redis (the tests start the local Redis Cluster and the mock downstream they need themselves).
#
# Everything missing is found first. As root with apt-get, it is then installed at once (one
# `apt-get update`, one `apt-get install`); otherwise one message names all of it, with the
# commands to run, and the script exits 1. Nothing is fetched when nothing is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

# --- what is missing ----------------------------------------------------------------------------
packages=()    # Debian packages to install
why=()         # what each is for, as lines of the message
need_promtool= # promtool: unpacked from Debian's prometheus package, not installed

# Headless Chromium for the dashboard test (or CHROMIUM=/path/to/chromium).
if ! command -v chromium >/dev/null 2>&1 && [ -z "${CHROMIUM:-}" ]; then
  packages+=(chromium)
  why+=("chromium: headless Chromium for the dashboard test (or set CHROMIUM=/path/to/chromium)")
fi
# `docker compose config` for tests/monitoring.rs: Compose v2 if the docker CLI has it, else
# Debian's docker-compose (it validates without a Docker engine).
if ! docker compose version >/dev/null 2>&1 && ! command -v docker-compose >/dev/null 2>&1; then
  packages+=(docker-compose)
  why+=("docker-compose: \`docker compose config\` for tests/monitoring.rs (or Docker's Compose v2 plugin)")
fi
# promtool for tests/monitoring.rs: unpacked from Debian's prometheus package into target/tools
# (not installed: that package would also set up a Prometheus server).
if ! command -v promtool >/dev/null 2>&1 && [ -z "${PROMTOOL:-}" ] && [ ! -x target/tools/promtool ]; then
  need_promtool=1
  why+=("promtool (from Debian's prometheus package, unpacked into target/tools, not installed): tests/monitoring.rs (or set PROMTOOL=/path/to/promtool)")
fi
# Node and npm for the Kubernetes manifests' validator (tests/deploy.rs).
if ! command -v node >/dev/null 2>&1; then
  packages+=(nodejs)
  why+=("nodejs: runs deploy/validate/validate.mjs for tests/deploy.rs")
fi
if ! command -v npm >/dev/null 2>&1; then
  packages+=(npm)
  why+=("npm: installs deploy/validate's packages for tests/deploy.rs")
fi
# Python 3 with pika for the upload-service example (tests/python_example.rs, which tries
# $PYTHON, else python3 on the PATH, then Debian's /usr/bin/python3, where python3-pika goes).
if [ -n "${PYTHON:-}" ]; then pythons=("$PYTHON"); else pythons=(python3 /usr/bin/python3); fi
has_pika=
for python in "${pythons[@]}"; do
  if "$python" -c 'import pika' >/dev/null 2>&1; then has_pika=1 && break; fi
done
if [ -z "$has_pika" ]; then
  packages+=(python3-pika)
  why+=("python3-pika: Python 3 and pika for the Python example, tests/python_example.rs (or set PYTHON=/path/to/python3 with pika)")
fi

# Unpacks promtool into target/tools; its scratch directory goes on every exit.
unpack_promtool() {
  unpack="$(mktemp -d)"
  trap 'rm -rf "${unpack:-}"' EXIT
  (cd "$unpack" && apt-get download prometheus >/dev/null 2>&1 && dpkg-deb -x prometheus_*.deb root) || {
    echo "scripts/test.sh: could not fetch Debian's prometheus package for promtool; set PROMTOOL=/path/to/promtool" >&2
    exit 1
  }
  mkdir -p target/tools
  cp "$unpack/root/usr/bin/promtool" target/tools/promtool.partial
  mv target/tools/promtool.partial target/tools/promtool
  rm -rf "$unpack"
  trap - EXIT
}

# --- install it (as root), or say all of it at once ---------------------------------------------
if [ ${#packages[@]} -gt 0 ] || [ -n "$need_promtool" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq
    if [ ${#packages[@]} -gt 0 ]; then
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${packages[@]}" >/dev/null
    fi
    if [ -n "$need_promtool" ]; then unpack_promtool; fi
  else
    {
      echo "scripts/test.sh: the tests need what this machine lacks:"
      for line in "${why[@]}"; do echo "  - $line"; done
      echo "Install it all at once (Debian/Ubuntu), from $PWD:"
      echo "  sudo apt-get update"
      if [ ${#packages[@]} -gt 0 ]; then echo "  sudo apt-get install -y ${packages[*]}"; fi
      if [ -n "$need_promtool" ]; then
        echo "  d=\"\$(mktemp -d)\" && (cd \"\$d\" && apt-get download prometheus && dpkg-deb -x prometheus_*.deb root) && mkdir -p target/tools && cp \"\$d/root/usr/bin/promtool\" target/tools/promtool; rm -rf \"\$d\""
      fi
      echo "then run scripts/test.sh again."
    } >&2
    exit 1
  fi
fi

# --- the validator's npm packages ---------------------------------------------------------------
# Pinned in deploy/validate/package-lock.json; installed again only when that lockfile changed
# since the last install (a copy of it is kept in node_modules).
if ! cmp -s deploy/validate/package-lock.json deploy/validate/node_modules/.turnstile-installed-lock.json; then
  npm ci --prefix deploy/validate --no-audit --no-fund --loglevel=error
  cp deploy/validate/package-lock.json deploy/validate/node_modules/.turnstile-installed-lock.json
fi

cargo fmt --all -- --check
cargo clippy --workspace --all-targets -q -- -D warnings
cargo test --workspace --all-targets "$@"
