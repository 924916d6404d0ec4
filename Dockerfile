# syntax=docker/dockerfile:1
# The appliance image: egress-proxy and egress-executor on Debian, with the
# runtimes the demo tools need (python3, Node.js). Two ways to build:
#
#   docker build -t loom-egress:0.1.0 .
#       the published path: compile in the pinned Rust image, run on the pinned
#       Debian slim image (this is what `docker compose build` does).
#
#   docker build --target local --build-arg ROOTFS=<image> -t loom-egress:local .
#       for machines without an image registry: a base made from Debian packages
#       (deploy/build-rootfs.sh) plus release binaries built on the host
#       (`cargo build --release -p egress-proxy -p egress-executor`; the base has
#       the same Debian release, hence the same glibc). Used by the compose test.
#
# The `local` stages come first so that the legacy builder, which builds every
# stage up to the target, never needs to pull the public images for them.

ARG ROOTFS=loom-egress-rootfs:local

# ---- local: the host's release binaries on a debootstrapped base ------------
FROM ${ROOTFS} AS local
COPY deploy/image-setup.sh /usr/local/lib/loom-egress/image-setup.sh
RUN /usr/local/lib/loom-egress/image-setup.sh
COPY target/release/egress-proxy target/release/egress-executor /usr/local/bin/
COPY executor/runners/ /usr/local/lib/loom-egress/runners/
COPY deploy/start-executor.sh /usr/local/lib/loom-egress/start-executor.sh
USER egress
WORKDIR /var/lib/loom-egress
ENTRYPOINT ["/usr/local/bin/egress-proxy"]
CMD ["serve", "--config", "/etc/loom-egress/egress.toml"]

# ---- local-prometheus: Debian's prometheus package on the same base ----------
FROM ${ROOTFS} AS local-prometheus
RUN mkdir -p /prometheus && chown nobody:nogroup /prometheus
USER nobody
WORKDIR /prometheus
ENTRYPOINT ["/usr/bin/prometheus"]

# ---- build: compile in the pinned Rust image ---------------------------------
FROM rust:1.88.0-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p egress-proxy -p egress-executor \
 && cp target/release/egress-proxy target/release/egress-executor /usr/local/bin/

# ---- runtime: the published image ---------------------------------------------
FROM debian:bookworm-20250520-slim AS runtime
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 nodejs ca-certificates wget \
 && rm -rf /var/lib/apt/lists/*
COPY deploy/image-setup.sh /usr/local/lib/loom-egress/image-setup.sh
RUN /usr/local/lib/loom-egress/image-setup.sh
COPY --from=build /usr/local/bin/egress-proxy /usr/local/bin/egress-executor /usr/local/bin/
COPY executor/runners/ /usr/local/lib/loom-egress/runners/
COPY deploy/start-executor.sh /usr/local/lib/loom-egress/start-executor.sh
USER egress
WORKDIR /var/lib/loom-egress
ENTRYPOINT ["/usr/local/bin/egress-proxy"]
CMD ["serve", "--config", "/etc/loom-egress/egress.toml"]
