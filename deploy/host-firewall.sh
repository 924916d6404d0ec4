#!/bin/sh
# Closes the one path out of the `tools` network that Docker leaves open:
# an internal network drops what its containers send to other networks, but
# not what they send to the Docker host itself (the bridge's own address, and
# every host service listening on all addresses). This refuses new
# connections from the tools bridge to the host; replies to connections the
# host opens (Prometheus scrapes, the compose test) still pass.
#
#   deploy/host-firewall.sh apply     (as root, after `docker compose up`)
#   deploy/host-firewall.sh remove
#   deploy/host-firewall.sh status    exit 0 if the rule is in place
set -eu
BRIDGE=${LOOM_TOOLS_BRIDGE:-loom-tools}
RULE="-i $BRIDGE -m conntrack ! --ctstate ESTABLISHED,RELATED -m comment --comment loom-egress-tools -j DROP"
has() { iptables -C INPUT $RULE 2>/dev/null; }
case "${1:-}" in
  apply)  has || iptables -I INPUT 1 $RULE; echo "host-firewall: new connections from $BRIDGE to this host are dropped" ;;
  remove) while has; do iptables -D INPUT $RULE; done; echo "host-firewall: rule removed" ;;
  status) has ;;
  *) echo "usage: $0 apply|remove|status" >&2; exit 2 ;;
esac
