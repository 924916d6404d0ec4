#!/usr/bin/env python3
"""Writes egress.json and executor.json, the Grafana dashboards of the
appliance. The JSON files are committed; `build.py --check` fails when they
differ from what this script writes (run by the dashboard test).

Every panel answers one question (its title), says what it shows and how to
read it (its description), has a unit, and thresholds where a value is bad.
Queries use only metrics the proxy and the executor export (and the recording
rules in alerts.yml); `$tool` is the templated tool variable.
"""

import json
import pathlib
import sys

DS = {"type": "prometheus", "uid": "prometheus"}
HERE = pathlib.Path(__file__).resolve().parent

GREEN = "green"
AMBER = "orange"
RED = "red"


def thresholds(*steps):
    """steps: (value, color) pairs; the first value is the base (None)."""
    return {"mode": "absolute", "steps": [{"color": c, "value": v} for v, c in steps]}


OK_ONLY = thresholds((None, GREEN))


def target(expr, legend="", ref="A", instant=False, fmt=None):
    t = {"datasource": DS, "refId": ref, "expr": expr, "legendFormat": legend or "__auto"}
    if instant:
        t["instant"] = True
        t["range"] = False
    else:
        t["range"] = True
    if fmt:
        t["format"] = fmt
    return t


class Layout:
    def __init__(self):
        self.y = 0
        self.x = 0
        self.row_h = 0
        self.next_id = 1
        self.panels = []

    def row(self, title):
        self.newline()
        self.panels.append({"type": "row", "id": self.next_id, "title": title, "collapsed": False,
                            "gridPos": {"x": 0, "y": self.y, "w": 24, "h": 1}, "panels": []})
        self.next_id += 1
        self.y += 1

    def newline(self):
        if self.x:
            self.y += self.row_h
            self.x = 0
            self.row_h = 0

    def add(self, panel, w, h):
        if self.x + w > 24:
            self.newline()
        panel["id"] = self.next_id
        self.next_id += 1
        panel["gridPos"] = {"x": self.x, "y": self.y, "w": w, "h": h}
        self.x += w
        self.row_h = max(self.row_h, h)
        self.panels.append(panel)


def tool_links(this_uid, other_uid, other_title):
    """Data links of a per-tool series: narrow this dashboard, or open the other one, to the tool."""
    keep = "${__url_time_range}"
    return [{"title": "Only ${__field.labels.tool} on this dashboard",
             "url": "/d/%s?var-tool=${__field.labels.tool}&%s" % (this_uid, keep)},
            {"title": "${__field.labels.tool} on the %s dashboard" % other_title,
             "url": "/d/%s?var-tool=${__field.labels.tool}&%s" % (other_uid, keep)}]


EGRESS_LINKS = tool_links("egress", "executor", "Executor")
EXECUTOR_LINKS = tool_links("executor", "egress", "Egress")


def timeseries(title, description, targets, unit, thresh=OK_ONLY, stack=False, w=12, h=8, min0=True, links=None):
    custom = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 25 if stack else 10, "showPoints": "never",
              "spanNulls": False, "stacking": {"mode": "normal" if stack else "none", "group": "A"},
              "thresholdsStyle": {"mode": "off" if thresh is OK_ONLY else "line"}}
    defaults = {"unit": unit, "thresholds": thresh, "color": {"mode": "palette-classic"}, "custom": custom}
    if links:
        defaults["links"] = links
    if min0:
        defaults["min"] = 0
    return ({"type": "timeseries", "title": title, "description": description, "datasource": DS,
             "targets": targets, "fieldConfig": {"defaults": defaults, "overrides": []},
             "options": {"legend": {"displayMode": "table", "placement": "right", "showLegend": True,
                                    "calcs": ["lastNotNull", "max"]},
                         "tooltip": {"mode": "multi", "sort": "desc"}}}, w, h)


def stat(title, description, expr, unit, thresh, w=6, h=4, legend=""):
    return ({"type": "stat", "title": title, "description": description, "datasource": DS,
             "targets": [target(expr, legend)],
             "fieldConfig": {"defaults": {"unit": unit, "thresholds": thresh, "color": {"mode": "thresholds"}},
                             "overrides": []},
             "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                         "colorMode": "background", "graphMode": "area", "justifyMode": "auto",
                         "orientation": "auto", "textMode": "auto", "wideLayout": True,
                         "showPercentChange": False}}, w, h)


def table(title, description, expr, unit, thresh, w=12, h=8, links=None):
    return ({"type": "table", "title": title, "description": description, "datasource": DS,
             "targets": [target(expr, instant=True, fmt="table")],
             "fieldConfig": {"defaults": {"unit": unit, "thresholds": thresh, "links": links or [],
                                          "custom": {"align": "auto", "cellOptions": {"type": "color-background"}}},
                             "overrides": []},
             "options": {"showHeader": True, "cellHeight": "sm",
                         "footer": {"show": False, "reducer": ["sum"], "fields": []},
                         "sortBy": [{"displayName": "Value", "desc": True}]},
             "transformations": [{"id": "organize", "options": {"excludeByName": {"Time": True}}}]}, w, h)


def quantiles(buckets_by_le, by, legend_prefix):
    """p50/p95/p99 of a (rate of a) histogram, `buckets_by_le` summed by `by, le`."""
    return [target("histogram_quantile(%s, sum by (%s) (%s))" % (q, by + ", le" if by else "le", buckets_by_le),
                   "%sp%s" % (legend_prefix, int(float(q) * 100)), ref)
            for q, ref in (("0.5", "A"), ("0.95", "B"), ("0.99", "C"))]


def tool_variable(metric):
    q = "label_values(%s, tool)" % metric
    return {"name": "tool", "label": "Tool", "type": "query", "datasource": DS,
            "query": {"query": q, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
            "includeAll": True, "multi": True, "allValue": ".*",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
            "refresh": 2, "sort": 1, "hide": 0, "options": [], "regex": "", "skipUrlSync": False}


def dashboard(uid, title, description, tags, layout, var_metric, links):
    return {"uid": uid, "title": title, "description": description, "tags": tags,
            "editable": False, "graphTooltip": 1, "schemaVersion": 39, "version": 1,
            "time": {"from": "now-15m", "to": "now"}, "refresh": "10s", "timezone": "browser",
            "timepicker": {}, "fiscalYearStartMonth": 0, "liveNow": False, "weekStart": "",
            "links": links,
            "annotations": {"list": [{"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                                      "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
                                      "name": "Annotations & Alerts", "type": "dashboard"}]},
            "templating": {"list": [tool_variable(var_metric)]},
            "panels": layout.panels}


def link(title, uid):
    return {"title": title, "type": "link", "url": "/d/%s" % uid, "icon": "dashboard",
            "tooltip": "", "asDropdown": False, "includeVars": True, "keepTime": True,
            "targetBlank": False, "tags": []}


T = '{tool=~"$tool"}'


def egress():
    L = Layout()
    L.row("Is egress up, and what is being decided?")
    L.add(*stat("Is the proxy up?", "1 when Prometheus scraped the proxy's control listener on its last attempt, 0 when it could not. Nothing leaves the tools network while the proxy is down.",
                'up{job="egress-proxy"}', "none", thresholds((None, RED), (1, GREEN)), w=4))
    L.add(*stat("What share of fetches is denied?", "Denied fetches as a share of all fetches over the last 5 minutes, for the selected tools. A sudden rise means a tool is probing beyond its allowlist or its allowlist is out of date.",
                "sum(tool:egress_denials:rate5m%s) / clamp_min(sum(rate(egress_requests_total%s[5m])), 1e-9)" % (T, T),
                "percentunit", thresholds((None, GREEN), (0.05, AMBER), (0.25, RED)), w=5))
    L.add(*stat("Fetches per second", "All fetches (HTTP requests and CONNECT tunnels) per second over the last 5 minutes, for the selected tools.",
                "sum(rate(egress_requests_total%s[5m]))" % T, "reqps", OK_ONLY, w=5))
    L.add(*stat("Active runs", "Runs not yet ended on the proxy (each warm or busy child of the executor holds one).",
                "sum(egress_runs_active%s)" % T, "short", OK_ONLY, w=5))
    L.add(*stat("Did a fact write fail?", "Denial facts that could not be recorded over the selected range. Any value above 0 means denials failed closed (503 facts_unavailable) and the fact store needs attention.",
                "sum(increase(egress_fact_write_failures_total[$__range]))", "short", thresholds((None, GREEN), (1, RED)), w=5))
    L.add(*timeseries("Which tools fetch, and what is decided?", "Fetches per second by tool and decision (allowed, denied, reported = allowed by a report-mode tool, error = failed upstream). Stacked. Click a series to narrow the dashboard to its tool.",
                      [target("sum by (tool, decision) (tool_decision:egress_requests:rate1m%s)" % T, "{{tool}} {{decision}}")],
                      "reqps", stack=True, links=EGRESS_LINKS))
    L.add(*timeseries("Why are fetches denied?", "Denials per second by reason code (the same words as the X-Egress-Deny-Reason header and the facts). Stacked.",
                      [target("sum by (reason) (tool_reason:egress_denials:rate1m%s)" % T, "{{reason}}")],
                      "reqps", stack=True))
    L.add(*timeseries("Which tools are denied?", "Denials per second by tool, all reasons together. Stacked. Click a series to narrow the dashboard to that tool: \"Why are fetches denied?\" then shows its reasons, and the facts API (GET /v1/facts) holds each denial with its target.",
                      [target("sum by (tool) (tool_reason:egress_denials:rate1m%s)" % T, "{{tool}}")],
                      "reqps", stack=True, links=EGRESS_LINKS))
    L.add(*table("Which tools were denied most? (selected range)", "Denials per tool and reason over the selected time range, most first. The facts API (GET /v1/facts) holds each one with its target and detail.",
                 "sort_desc(topk(10, sum by (tool, reason) (increase(egress_denials_total%s[$__range])) > 0))" % T,
                 "short", thresholds((None, AMBER), (100, RED)), links=EGRESS_LINKS))

    L.row("How fast are fetches, and what fails?")
    L.add(*timeseries("How long do fetches take? (p50, p95, p99 by tool)", "Fetch duration from authentication to the end of the response or tunnel, excluding denials. A tunnel's duration is its whole life. Red above 10 s.",
                      quantiles("tool_le:egress_fetch_duration_seconds_bucket:rate1m%s" % T, "tool", "{{tool}} "),
                      "s", thresholds((None, GREEN), (10, RED))))
    L.add(*timeseries("Which deadlines expire? (timeouts by tool and phase)", "Fetch deadlines (fetch_timeout_ms) that expired per second, by the phase the fetch was in: slot wait, dns, connect, response (before the head) or tunnel.",
                      [target("sum by (tool, phase) (rate(egress_timeouts_total%s[$__rate_interval]))" % T, "{{tool}} {{phase}}")],
                      "reqps", thresholds((None, GREEN), (0.1, RED))))
    L.add(*timeseries("Why do fetches fail? (errors that are not policy)", "Fetches that failed for non-policy reasons per second: dns_not_found, dns_failed, connect_failed, upstream_failed, upstream_tls, timeout, run_ended. These are 502/503/504 answers, not facts.",
                      [target("sum by (tool, reason) (rate(egress_fetch_errors_total%s[$__rate_interval]))" % T, "{{tool}} {{reason}}")],
                      "reqps", thresholds((None, GREEN), (1, RED))))
    L.add(*timeseries("How long do upstream connects take?", "TCP connect time to the vetted, pinned upstream address (all tools). High values point at the network outside, not at the appliance.",
                      quantiles("rate(egress_connect_duration_seconds_bucket[$__rate_interval])", "", ""),
                      "s", thresholds((None, GREEN), (1, RED))))
    L.add(*timeseries("How long do DNS lookups take?", "Lookup time of the proxy's resolver (all tools: lookups are not labelled by tool). Names are resolved once per fetch and pinned.",
                      quantiles("rate(egress_dns_lookup_duration_seconds_bucket[$__rate_interval])", "", ""),
                      "s", thresholds((None, GREEN), (1, RED))))
    L.add(*timeseries("Are DNS lookups failing?", "Lookups per second that gave no address, by kind (not_found, failed), for all tools. The counter appears with the first failure; until then the panel shows 0.",
                      [target("sum by (kind) (rate(egress_dns_failures_total[$__rate_interval])) or on () vector(0)", "{{kind}}")],
                      "reqps", thresholds((None, GREEN), (0.5, RED))))

    L.row("How much traffic and capacity is used?")
    L.add(*timeseries("How many bytes does each tool move?", "Bytes per second relayed through the proxy by tool; up = tool to origin, down = origin to tool. Denied fetches move nothing.",
                      [target("sum by (tool, direction) (rate(egress_bytes_total%s[$__rate_interval]))" % T, "{{tool}} {{direction}}")],
                      "Bps"))
    L.add(*timeseries("How many fetches and tunnels are open?", "Open upstream fetches (http) and CONNECT tunnels (connect) by tool, right now.",
                      [target("sum by (tool, kind) (egress_open_connections%s)" % T, "{{tool}} {{kind}}")],
                      "short", stack=True))
    L.add(*timeseries("Are concurrency slots saturated? (slots in use)", "Concurrency slots held by tool. Each run has max_concurrent_fetches slots; a fetch holds one for its whole life. Pair with the slot wait beside: waiting means the limit is reached.",
                      [target("sum by (tool) (egress_slots_in_use%s)" % T, "{{tool}}")],
                      "short", stack=True))
    L.add(*timeseries("How long do fetches wait for a slot? (p95)", "95th percentile of the time a fetch waited for one of its run's concurrency slots. Above zero means runs hit max_concurrent_fetches; red above 1 s.",
                      [target("histogram_quantile(0.95, sum by (tool, le) (rate(egress_slot_wait_seconds_bucket%s[$__rate_interval])))" % T, "{{tool}}")],
                      "s", thresholds((None, GREEN), (1, RED))))
    L.add(*timeseries("How many runs are active?", "Runs not yet ended, by tool. Warm children hold an inactive run each; a steady climb means runs are leaking (never ended by their kernel).",
                      [target("sum by (tool) (egress_runs_active%s)" % T, "{{tool}}")],
                      "short", stack=True))
    L.add(*timeseries("How do runs end?", "Runs ended per second by tool and why: ended (by the kernel or executor), expired (max_run_ms reached: a leak), shutdown.",
                      [target("sum by (tool, why) (rate(egress_runs_ended_total%s[$__rate_interval]))" % T, "{{tool}} {{why}}")],
                      "reqps"))

    L.row("Are denials recorded durably?")
    L.add(*timeseries("How long does recording a denial take? (p50, p95, p99)", "Time to commit a denial fact to the store (SQLite, group commit) before the client sees the denial. Red above 250 ms.",
                      quantiles("rate(egress_fact_write_duration_seconds_bucket[$__rate_interval])", "", ""),
                      "s", thresholds((None, GREEN), (0.25, RED))))
    L.add(*timeseries("Are fact writes failing?", "Facts per second that could not be recorded (each such denial answered 503 facts_unavailable), and identical denials folded into an existing fact's count (nothing is dropped).",
                      [target("rate(egress_fact_write_failures_total[$__rate_interval])", "write failures", "A"),
                       target("rate(egress_facts_coalesced_total[$__rate_interval])", "coalesced", "B")],
                      "reqps", thresholds((None, GREEN), (0.01, RED))))

    L.row("Are live credentials fresh?")
    L.add(*timeseries("How long until each live credential expires?", "Seconds until each live credential's value (a minted token, a file with ttl_ms, a command, a Secrets Manager secret) may no longer be used, by tool and credential; it climbs back at each refresh. Below 0 (or far below, 0 before any value) requests needing it fail with credential_unavailable. Red under 5 minutes (alert EgressCredentialExpiring when refreshes also fail).",
                      [target("egress_credential_expiry_seconds - time()", "{{tool}} {{credential}}")],
                      "s", thresholds((None, RED), (300, GREEN)), min0=False))
    L.add(*timeseries("Are credential refreshes failing?", "Reads and mints of live credential sources per second, by tool, credential and outcome (ok, error, timeout). A failing source keeps its value in hand until it expires; the run view's credentials[].last_refresh says why.",
                      [target("sum by (tool, credential, outcome) (rate(egress_credential_refresh_total[$__rate_interval]))", "{{tool}} {{credential}} {{outcome}}")],
                      "reqps"))

    L.row("Is the fleet exporting, and do its cells agree?")
    L.add(*stat("How many policies are live across the fleet?", "Distinct policy digests in the cells' egress_cell_info. 1 is right; more means a reload reached some cells and not others (alert EgressFleetPolicyDiverged), and a tool may be allowed on one cell and denied on another.",
                "count(count by (policy) (egress_cell_info))", "none", thresholds((None, GREEN), (2, RED)), w=6))
    L.add(*stat("Is a cell id held twice?", "The most processes reporting one cell id. 1 is right; 2 or more means a second process runs with a cell's id: it exports nothing and is unready (cell_id_in_use) until it is stopped (alert EgressCellIdHeldTwice).",
                "max(count by (cell) (egress_cell_info))", "none", thresholds((None, GREEN), (2, RED)), w=6))
    L.add(*timeseries("How far behind is each cell's export?", "Facts committed on the cell (durable there) and not yet in PostgreSQL, per cell. Amber above 1000 (alert EgressExportLagging); past [export] max_lag the cell is unready (export_lag) and takes no new work, and unexported facts are never pruned.",
                      [target("egress_export_lag_facts", "{{instance}}")],
                      "short", thresholds((None, GREEN), (1000, AMBER)), w=12))
    L.add(*timeseries("How fast are facts exported, and what fails?", "Facts per second written to PostgreSQL, per cell, and failed export attempts per second by kind (a failed batch is retried from the remote cursor: nothing is lost or written twice).",
                      [target("sum by (instance) (rate(egress_export_facts_total[$__rate_interval]))", "{{instance}} exported", "A"),
                       target("sum by (kind) (rate(egress_export_failures_total[$__rate_interval]))", "failures {{kind}}", "B")],
                      "reqps"))
    L.add(*timeseries("How long does an export batch take? (p50, p95, p99)", "One batch is one PostgreSQL transaction (INSERT ... ON CONFLICT DO NOTHING) of up to batch_max facts, across the fleet.",
                      quantiles("rate(egress_export_batch_duration_seconds_bucket[$__rate_interval])", "", ""),
                      "s"))
    L.row("Do the audit sinks keep up?")
    L.add(*timeseries("How far behind is each audit sink?", "Records in the store (facts, decision records) an audit sink ([audit.sinks.NAME]) has not delivered yet, per cell, sink and log. A sink resumes from its own cursor after an outage: nothing is lost, and unexported facts are never pruned (when they fill facts_max_mb, denials fail closed). Alert EgressAuditSinkStalled when one stops delivering.",
                      [target("egress_audit_sink_lag_records", "{{instance}} {{sink}} {{log}}")],
                      "short", thresholds((None, GREEN), (10000, AMBER)), w=12))
    L.add(*timeseries("How fast do the sinks deliver, and what fails?", "Records per second each sink delivered as OCSF events, failed attempts per second by kind (connect, tls, timeout, write, http_4xx, http_429, http_5xx, rejected, read; each is retried with backoff), and decision records deleted by their budget before a sink exported them (alert EgressAuditSinkDropped).",
                      [target("sum by (sink) (rate(egress_audit_sink_exported_total[$__rate_interval]))", "{{sink}} delivered", "A"),
                       target("sum by (sink, kind) (rate(egress_audit_sink_failures_total[$__rate_interval]))", "{{sink}} failures {{kind}}", "B"),
                       target("sum by (sink) (rate(egress_audit_sink_dropped_total[$__rate_interval]))", "{{sink}} dropped before export", "C")],
                      "reqps"))
    L.add(*timeseries("How long since the fact log was last covered by a signed checkpoint?", "Seconds since every committed fact and decision record was last covered by a checkpoint signed with [audit] signing_key_file, per cell (no line without a key). It stays under checkpoint_ms while the writer works; alert EgressAuditCheckpointStale past 15 minutes. Witnesses take the newest from GET /v1/audit/checkpoint.",
                      [target("time() - (egress_audit_signed_through_timestamp_seconds > 0)", "{{instance}}")],
                      "s", thresholds((None, GREEN), (300, AMBER), (900, RED)), w=24))
    return dashboard("egress", "Egress", "What the proxy decides for each tool, how fast, and whether denials are recorded.",
                     ["loom-egress"], L, "egress_requests_total", [link("Executor", "executor")])


def executor():
    L = Layout()
    L.row("Are tools ready to run?")
    L.add(*stat("Is the executor up?", "1 when Prometheus scraped the executor on its last attempt, 0 when it could not.",
                'up{job="egress-executor"}', "none", thresholds((None, RED), (1, GREEN)), w=6))
    L.add(*stat("Invocations per second", "Invocations finished per second over the last 5 minutes, all outcomes, for the selected tools.",
                "sum(rate(executor_invocations_total%s[5m]))" % T, "reqps", OK_ONLY, w=6))
    L.add(*stat("What share of invocations fail?", "Invocations that did not end ok, as a share of all, over the last 5 minutes.",
                'sum(rate(executor_invocations_total{tool=~"$tool",outcome!="ok"}[5m])) / clamp_min(sum(rate(executor_invocations_total%s[5m])), 1e-9)' % T,
                "percentunit", thresholds((None, GREEN), (0.05, AMBER), (0.25, RED)), w=6))
    L.add(*stat("Tools with an empty warm pool", "Tools whose warm pool has no ready child right now: their next invocation waits for a cold start.",
                "count(max by (tool) (executor_pool_ready%s) == 0) or vector(0)" % T,
                "short", thresholds((None, GREEN), (1, AMBER)), w=6))
    L.add(*stat("Fork servers down", "Tools with fork_server = true, invoked in the last 10 minutes, whose fork server did not start or died: their children start a fresh interpreter each (cold starts several times slower) until the executor restarts. `egress-executor doctor` says why.",
                "count(max by (tool) (executor_fork_server_up%s) == 0 and on (tool) sum by (tool) (increase(executor_invocations_total%s[10m])) > 0) or vector(0)" % (T, T),
                "short", thresholds((None, GREEN), (1, AMBER)), w=6))
    L.add(*timeseries("Is each tool's warm pool ready?", "Warm children loaded and waiting for an invocation, by tool. 0 means the next invocation pays a cold start (red).",
                      [target("sum by (tool) (executor_pool_ready%s)" % T, "{{tool}}")],
                      "short", thresholds((None, RED), (1, GREEN))))
    L.add(*timeseries("What state are the children in?", "Live children by tool and state: starting (spawned, not ready), ready (warm), busy (serving an invocation). Stacked.",
                      [target("sum by (tool, state) (executor_children%s)" % T, "{{tool}} {{state}}")],
                      "short", stack=True))
    L.add(*timeseries("How long do cold starts take? (p95 by phase)", "95th percentile cold-start time by tool and phase: spawn (to booted: the runtime came up), load (booted to ready: the tool's code loaded), total. Red above 5 s.",
                      [target("histogram_quantile(0.95, sum by (tool, phase, le) (tool_phase_le:executor_cold_start_seconds_bucket:rate5m%s))" % T, "{{tool}} {{phase}}")],
                      "s", thresholds((None, GREEN), (5, RED))))
    L.add(*timeseries("How long do cold starts take? (p50 by phase)", "Median cold-start time by tool and phase (spawn, load, total).",
                      [target("histogram_quantile(0.5, sum by (tool, phase, le) (tool_phase_le:executor_cold_start_seconds_bucket:rate5m%s))" % T, "{{tool}} {{phase}}")],
                      "s", thresholds((None, GREEN), (5, RED))))

    L.row("How do invocations end?")
    L.add(*timeseries("How do invocations end?", "Invocations per second by tool and outcome: ok, or the error kind (tool_error, timeout, aborted, disconnected, protocol, startup, busy, proxy). Stacked. Click a series to see its tool's egress.",
                      [target("sum by (tool, outcome) (rate(executor_invocations_total%s[$__rate_interval]))" % T, "{{tool}} {{outcome}}")],
                      "reqps", stack=True, links=EXECUTOR_LINKS))
    L.add(*timeseries("Why are children killed?", "Child process trees killed per second by tool and reason (for example timeout, warm_death, protocol). Every child is killed after one invocation; the reason says why.",
                      [target("sum by (tool, reason) (rate(executor_kills_total%s[$__rate_interval]))" % T, "{{tool}} {{reason}}")],
                      "reqps", stack=True))
    L.add(*timeseries("How long do invocations take? (p50, p95, p99 by tool)", "Invocation duration from request to response, by tool. Includes waiting for a warm child.",
                      quantiles("rate(executor_invocation_duration_seconds_bucket%s[$__rate_interval])" % T, "tool", "{{tool}} "),
                      "s", thresholds((None, GREEN), (30, RED))))
    L.add(*timeseries("Are invocations refused for want of a child?", "Invocations per second that failed busy (pool.max children alive and the queue full, or waited too long). Any sustained value means the pool is starved.",
                      [target('sum by (tool) (rate(executor_invocations_total{tool=~"$tool",outcome="busy"}[$__rate_interval])) or sum by (tool) (rate(executor_invocations_total%s[$__rate_interval])) * 0' % T, "{{tool}}")],
                      "reqps", thresholds((None, GREEN), (0.01, RED))))
    return dashboard("executor", "Executor", "The executor's warm pools, cold starts, invocation outcomes and kills, per tool.",
                     ["loom-egress"], L, "executor_invocations_total", [link("Egress", "egress")])


def render(d):
    return json.dumps(d, indent=2, sort_keys=False) + "\n"


def main():
    check = "--check" in sys.argv[1:]
    stale = []
    for name, d in (("egress.json", egress()), ("executor.json", executor())):
        path = HERE / name
        text = render(d)
        if check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        sys.exit("dashboards out of date (run dashboards/build.py): %s" % ", ".join(stale))


if __name__ == "__main__":
    main()
