# syntax=docker/dockerfile:1
#
# turnstile: multi-stage build.
#   docker build -t turnstile .
#   docker run --rm turnstile --help
# The image's default command is `turnstile consume` (configured by TURNSTILE_* env vars);
# the same image runs `mock-api`, `publish`, `status`, `limits`, ... by overriding CMD.

############################
# Builder
############################
FROM rust:1-bookworm AS builder
WORKDIR /build

# 1. Dependencies only: build the dependency graph against stub sources so this layer is
#    cached until a Cargo.toml or Cargo.lock changes. The workspace: the binary at the root,
#    its library crates under crates/ (see README's "Layout").
COPY Cargo.toml Cargo.lock ./
COPY crates/core/Cargo.toml crates/core/
COPY crates/upload/Cargo.toml crates/upload/
COPY crates/ops/Cargo.toml crates/ops/
COPY crates/lab/Cargo.toml crates/lab/
RUN mkdir -p src \
 && echo 'fn main() {}' > src/main.rs \
 && for c in core upload ops lab; do mkdir -p crates/$c/src && : > crates/$c/src/lib.rs; done \
 && cargo build --release --locked --bin turnstile \
 && rm -rf src crates/*/src \
      target/release/turnstile \
      target/release/turnstile.d \
      target/release/.fingerprint/turnstile* \
      target/release/deps/turnstile* \
      target/release/deps/libturnstile*

# 2. The crates themselves. crates/core/lua/ is needed at compile time (the scripts are
#    include_str!'d); tests/ and examples/ are not part of `cargo build` of the binary.
COPY src ./src
COPY crates ./crates
# The commit, for the turnstile_build_info metric (`--build-arg TURNSTILE_GIT_SHA=…`).
ARG TURNSTILE_GIT_SHA=unknown
RUN cargo build --release --locked --bin turnstile \
 && install -m 0755 target/release/turnstile /usr/local/bin/turnstile \
 && /usr/local/bin/turnstile --version

############################
# Runtime
############################
FROM debian:bookworm-slim AS runtime

RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/*

RUN groupadd --system --gid 10001 turnstile \
 && useradd --system --uid 10001 --gid 10001 --no-create-home \
      --home-dir /nonexistent --shell /usr/sbin/nologin turnstile

COPY --from=builder /usr/local/bin/turnstile /usr/local/bin/turnstile
COPY examples/ /app/examples/

WORKDIR /app
USER 10001:10001

ENV RUST_LOG=info

# /metrics, /healthz, /readyz of `turnstile consume` (TURNSTILE_HTTP_ADDR, default 0.0.0.0:9464).
EXPOSE 9464

# No HEALTHCHECK here: the image also runs mock-api and one-shot publishers, so health checks
# are defined per service in docker-compose.yml (bash + /dev/tcp, no curl needed).
ENTRYPOINT ["turnstile"]
CMD ["consume"]
