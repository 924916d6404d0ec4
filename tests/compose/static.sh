#!/usr/bin/env bash
# The stack's checks that need no Docker: Prometheus config and rules
# (promtool check, and promtool unit tests for every alert), and the
# dashboards (tests/compose/stackcheck.py). Run by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/../.."
PROMTOOL=$(tests/compose/promtool.sh)
"$PROMTOOL" check config dashboards/prometheus.yml
"$PROMTOOL" check rules dashboards/alerts.yml
"$PROMTOOL" test rules dashboards/tests/alerts_test.yml
python3 tests/compose/stackcheck.py
