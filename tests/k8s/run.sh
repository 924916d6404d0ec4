#!/usr/bin/env bash
# The fleet's deploy files. The Kubernetes manifests (deploy/k8s): render the
# base and the tenant overlay with kubectl's kustomize, validate every object
# against the Kubernetes schema (kubernetes-validate --strict: zero errors,
# zero unknown kinds or fields), then the invariants a schema cannot see
# (tests/k8s/invariants.py, which first proves on broken copies that it
# catches each break). Then the SQL views (deploy/sql, tests/k8s/sqlcheck.py). Needs kubectl, the pinned Python packages
# (requirements.txt) and a built egress-proxy (EGRESS_PROXY, default
# target/debug/egress-proxy). Run by .ci/run; a few seconds.
set -euo pipefail
cd "$(dirname "$0")/../.."
KUBE_VERSION=1.37.0
PROXY=${EGRESS_PROXY:-target/debug/egress-proxy}
[ -x "$PROXY" ] || { echo "tests/k8s: no egress-proxy at $PROXY (cargo build -p egress-proxy)" >&2; exit 1; }
command -v kubectl >/dev/null || { echo "tests/k8s: kubectl is not installed" >&2; exit 1; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for k in base overlays/tenant; do
  f="$out/$(basename "$k").yaml"
  kubectl kustomize "deploy/k8s/$k" >"$f"
  # Any ERROR (schema) or WARN (no schema: an unknown kind) fails.
  report=$(kubernetes-validate --strict -k "$KUBE_VERSION" "$f" 2>&1) || true
  if grep -qvE '^INFO .* passed for resource ' <<<"$report"; then
    echo "tests/k8s: deploy/k8s/$k does not validate against Kubernetes $KUBE_VERSION:" >&2
    grep -vE '^INFO .* passed for resource ' <<<"$report" >&2
    exit 1
  fi
  echo "deploy/k8s/$k: $(grep -c '^INFO' <<<"$report") objects valid for Kubernetes $KUBE_VERSION (strict)"
  python3 tests/k8s/invariants.py --proxy "$PROXY" "$f"
done
python3 tests/k8s/invariants.py --proxy "$PROXY" --self-test "$out/tenant.yaml"
# The fleet's SQL views (deploy/sql): PostgreSQL's own parser, and only the
# columns of the exported egress_facts table.
python3 tests/k8s/sqlcheck.py
