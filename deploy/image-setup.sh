#!/bin/sh
# Shared by both appliance image variants: the unprivileged users and the
# directories the services write to. No secret is ever placed in the image.
set -eu
# The proxy runs as `egress`; the executor as `executor` (tools inherit it
# while isolation is "off"), so a tool cannot read the facts store.
groupadd --system --gid 10001 egress
useradd --system --uid 10001 --gid egress --home-dir /var/lib/loom-egress --shell /usr/sbin/nologin egress
groupadd --system --gid 10002 executor
useradd --system --uid 10002 --gid executor --home-dir /var/lib/loom-executor --shell /usr/sbin/nologin executor
install -d -o egress -g egress -m 0750 /var/lib/loom-egress
install -d -o executor -g executor -m 0750 /var/lib/loom-executor
# The hand-off socket's directory: the proxy's alone to write (the executor
# refuses a socket in a directory others could write: they could replace it).
install -d -o egress -g executor -m 0750 /run/loom-egress
install -d -m 0755 /etc/loom-egress /usr/local/lib/loom-egress/runners
