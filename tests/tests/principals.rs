//! Scoped principals through the real control API: two kernels and an
//! operator from a principals file. Kernel A cannot see B's runs, facts,
//! decisions or SSE events, cannot end or use B's runs, cannot grant outside
//! its globs or beyond its ttl and uses, cannot reload; each refusal is 403
//! with its reason, and a refused grant or reload is a `CONTROL_ACTION`
//! fact. The operator can do all of it (ending B's run is a fact too). A
//! token removed from the file is refused from the reload on. The policy
//! envelope refuses a reload that widens beyond it (the old policy still
//! decides) and a grant outside it; a reload within it applies, and its
//! answer carries the diff. Loopback origin on 127.0.0.2, fake DNS.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_config::principals::token_hash;
use egress_e2e::harness::{proxy_section, TestProxy, TestRun, TOKEN};
use egress_e2e::origin::http_origin;
use egress_e2e::FakeDns;
use egress_proxy::facts::MemorySink;
use serde_json::{json, Value};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

const A: &str = "kernel-a-token-0123456789abcdef";
const B: &str = "kernel-b-token-0123456789abcdef";
const OPS: &str = "operator-token-0123456789abcdef";

struct World {
    p: TestProxy,
    port: u16,
    config: PathBuf,
    principals: PathBuf,
    dir: tempfile::TempDir,
}

fn private(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
}

fn principals_text(with_b: bool) -> String {
    let kernel = |name: &str, token: &str| {
        format!(
            "[principals.{name}]\ntokens = [\"{}\"]\nscopes = [\"runs:search*\", \"invoke:search*\", \"facts:own\", \"decisions:own\", \"grants:search*\"]\ngrant_max_ttl_ms = 60000\ngrant_max_uses = 5\n\n",
            token_hash(token)
        )
    };
    let mut t = kernel("kernel-a", A);
    if with_b {
        t.push_str(&kernel("kernel-b", B));
    }
    t.push_str(&format!(
        "[principals.operator]\ntokens = [\"{}\"]\nscopes = [\"admin\"]\n",
        token_hash(OPS)
    ));
    t
}

fn config_text(dns: &FakeDns, dir: &Path, port: u16, extra_search: &str, envelope: bool) -> String {
    let envelope = if envelope {
        format!("envelope = \"{}\"\n", dir.join("envelope.toml").display())
    } else {
        String::new()
    };
    format!(
        r#"{}
[control]
principals_file = "{}"

[tools.search]
egress = ["listed.test:{port}"{extra_search}]

[tools.search-b]
egress = ["listed.test:{port}"]

[tools.shell]
egress = ["listed.test:{port}"]
"#,
        proxy_section(dns, &format!("decisions = \"all\"\n{envelope}")),
        dir.join("principals.toml").display(),
    )
}

async fn world(envelope: bool) -> World {
    let origin = http_origin("127.0.0.2:0").await;
    let port = origin.addr.port();
    std::mem::forget(origin);
    let dns = FakeDns::start().await;
    for name in ["listed.test", "denied.test", "extra.test", "wider.corp.test"] {
        dns.set(name, &["127.0.0.2"]);
    }
    let dir = tempfile::tempdir().unwrap();
    let principals = dir.path().join("principals.toml");
    private(&principals, &principals_text(true));
    if envelope {
        private(
            &dir.path().join("envelope.toml"),
            &format!(
                "[proxy]\nallow_ranges = [\"127.0.0.2/32\"]\n[tools.search]\negress = [\"listed.test:{port}\", \"*.corp.test:{port}\"]\n[tools.search-b]\negress = [\"listed.test:{port}\"]\n[tools.shell]\negress = [\"listed.test:{port}\"]\n"
            ),
        );
    }
    let text = config_text(&dns, dir.path(), port, "", envelope);
    let config = dir.path().join("egress.toml");
    std::fs::write(&config, &text).unwrap();
    let p = TestProxy::start_config(
        dns,
        &text,
        Some(config.clone()),
        Some(Arc::new(MemorySink::new(10_000))),
    )
    .await;
    World {
        p,
        port,
        config,
        principals,
        dir,
    }
}

/// A control call as `token`, checked against the OpenAPI document.
async fn call(p: &TestProxy, token: &str, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
    let r = p.control_raw(method, path, body, Some(token)).await;
    (r.status, serde_json::from_slice(&r.body).unwrap_or(Value::Null))
}

async fn run_as(p: &TestProxy, token: &str, tool: &str) -> TestRun {
    let (status, v) = call(p, token, "POST", "/v1/runs", Some(json!({ "tool": tool }))).await;
    assert_eq!(status, 201, "create run: {v}");
    TestRun {
        id: v["run_id"].as_str().unwrap().to_owned(),
        secret: v["secret"].as_str().unwrap().to_owned(),
        url: v["proxy_url"].as_str().unwrap().to_owned(),
    }
}

fn code(v: &Value) -> &str {
    v["error"]["code"].as_str().unwrap_or("")
}

fn ids(v: &Value, list: &str, field: &str) -> Vec<String> {
    v[list]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x[field].as_str().unwrap_or("").to_owned())
        .collect()
}

/// The `CONTROL_ACTION` facts with `reason`, as the control token sees them.
async fn control_actions(p: &TestProxy, reason: &str) -> Vec<Value> {
    p.facts_with_reason(reason)
        .await
        .into_iter()
        .filter(|f| f["type"] == "CONTROL_ACTION")
        .collect()
}

#[tokio::test]
async fn kernels_see_and_touch_only_their_own_runs() {
    let w = world(false).await;
    let p = &w.p;
    let a = run_as(p, A, "search").await;
    let b = run_as(p, B, "search").await;
    // Runs are attributed to their creator.
    let (_, view) = call(p, A, "GET", &format!("/v1/runs/{}", a.id), None).await;
    assert_eq!(view["principal"], "kernel-a");
    // A tool outside A's globs.
    let (s, v) = call(p, A, "POST", "/v1/runs", Some(json!({"tool": "shell"}))).await;
    assert_eq!((s, code(&v)), (403, "scope"), "{v}");
    // B's run: not readable, not endable, not grantable by A.
    let (s, v) = call(p, A, "GET", &format!("/v1/runs/{}", b.id), None).await;
    assert_eq!((s, code(&v)), (403, "not_your_run"), "{v}");
    let (s, v) = call(p, A, "DELETE", &format!("/v1/runs/{}", b.id), None).await;
    assert_eq!((s, code(&v)), (403, "not_your_run"), "{v}");
    let (s, v) = call(p, A, "POST", &format!("/v1/runs/{}/activate", b.id), None).await;
    assert_eq!((s, code(&v)), (403, "not_your_run"), "{v}");
    // Attributing a run to another principal is the executor's (admin's).
    let path = format!("/v1/runs/{}/activate?principal=kernel-b", a.id);
    let (s, v) = call(p, A, "POST", &path, None).await;
    assert_eq!((s, code(&v)), (403, "scope"), "{v}");
    let (_, view) = call(p, A, "GET", &format!("/v1/runs/{}", a.id), None).await;
    assert_eq!(view["principal"], "kernel-a", "{view}");
    // Lists: each kernel its own; the operator and the control token all.
    let (_, v) = call(p, A, "GET", "/v1/runs", None).await;
    assert_eq!(ids(&v, "runs", "run_id"), vec![a.id.clone()]);
    let (_, v) = call(p, B, "GET", "/v1/runs", None).await;
    assert_eq!(ids(&v, "runs", "run_id"), vec![b.id.clone()]);
    for token in [OPS, TOKEN] {
        let (_, v) = call(p, token, "GET", "/v1/runs", None).await;
        let mut all = ids(&v, "runs", "run_id");
        all.sort();
        let mut want = vec![a.id.clone(), b.id.clone()];
        want.sort();
        assert_eq!(all, want);
    }
    // A kernel ends its own run; no control action for that.
    let (s, _) = call(p, A, "DELETE", &format!("/v1/runs/{}", a.id), None).await;
    assert_eq!(s, 200);
    assert!(control_actions(p, "run_ended_by_other").await.is_empty());
    // The operator ends B's run: allowed, and a fact names who did it.
    let (s, v) = call(p, OPS, "DELETE", &format!("/v1/runs/{}", b.id), None).await;
    assert_eq!(s, 200, "{v}");
    let ended = control_actions(p, "run_ended_by_other").await;
    assert_eq!(ended.len(), 1, "{ended:?}");
    assert_eq!(ended[0]["principal"], "operator");
    assert_eq!(ended[0]["run_id"], b.id.as_str());
    // Unknown tokens are 401.
    let (s, _) = call(p, "not-a-token-of-anyone-0123456789", "GET", "/v1/runs", None).await;
    assert_eq!(s, 401);
    // Owner leases are their holder's: another kernel can neither shorten
    // nor release the executor's or another kernel's.
    let lease = json!({"lease_ms": 60000});
    let (s, _) = call(p, TOKEN, "PUT", "/v1/owners/exec-1", Some(lease.clone())).await;
    assert_eq!(s, 200);
    let (s, _) = call(p, A, "PUT", "/v1/owners/kernel-a-owner", Some(lease.clone())).await;
    assert_eq!(s, 200);
    for (token, owner, method) in [
        (A, "exec-1", "PUT"),
        (A, "exec-1", "DELETE"),
        (B, "kernel-a-owner", "PUT"),
        (B, "kernel-a-owner", "DELETE"),
    ] {
        let body = (method == "PUT").then(|| lease.clone());
        let (s, v) = call(p, token, method, &format!("/v1/owners/{owner}"), body).await;
        assert_eq!((s, code(&v)), (403, "not_your_lease"), "{method} {owner}: {v}");
    }
    let (s, _) = call(p, A, "DELETE", "/v1/owners/kernel-a-owner", None).await;
    assert_eq!(s, 200);
}

#[tokio::test]
async fn facts_decisions_and_streams_are_filtered_to_the_caller() {
    let w = world(false).await;
    let p = &w.p;
    let a = run_as(p, A, "search").await;
    let b = run_as(p, B, "search").await;
    for run in [&a, &b] {
        let r = p.get(run, "http://denied.test/", "").await;
        assert_eq!(r.status, 403);
        let r = p.get(run, &format!("http://listed.test:{}/", w.port), "").await;
        assert_eq!(r.status, 200);
    }
    // Facts carry the run's principal; each kernel sees its own.
    for (token, me, run) in [(A, "kernel-a", &a), (B, "kernel-b", &b)] {
        let (s, v) = call(p, token, "GET", "/v1/facts?after=0", None).await;
        assert_eq!(s, 200, "{v}");
        let facts = v["facts"].as_array().unwrap();
        assert!(!facts.is_empty());
        assert!(
            facts
                .iter()
                .all(|f| f["principal"] == me && f["run_id"] == run.id.as_str()),
            "{token}: {facts:?}"
        );
        // Even asking by the other run's id.
        let other = if run.id == a.id { &b } else { &a };
        let (_, v) = call(p, token, "GET", &format!("/v1/runs/{}/facts?after=0", other.id), None).await;
        assert_eq!(v["facts"].as_array().unwrap().len(), 0, "{v}");
        assert!(
            v["next"].as_u64().unwrap() > 0,
            "the cursor moves past what is hidden: {v}"
        );
    }
    // Decisions likewise (the log is written off the answer path: wait for it).
    let mut seen = vec![];
    for _ in 0..100 {
        let (_, v) = call(p, TOKEN, "GET", "/v1/decisions?after=0", None).await;
        seen = v["decisions"].as_array().unwrap().clone();
        if seen.len() >= 2 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(seen.len(), 2, "{seen:?}");
    let (_, v) = call(p, A, "GET", "/v1/decisions?after=0", None).await;
    assert_eq!(ids(&v, "decisions", "run_id"), vec![a.id.clone()]);
    assert_eq!(v["decisions"][0]["principal"], "kernel-a");
    // The SSE stream: A's first fact event is its own, never B's.
    let event = p.sse_event_as(A, "/v1/facts/stream?after=0", "fact").await;
    assert!(event.contains(&a.id) && !event.contains(&b.id), "{event}");
    let event = p.sse_event_as(B, "/v1/decisions/stream?after=0", "decision").await;
    assert!(event.contains(&b.id) && !event.contains(&a.id), "{event}");
    // Suggestions and replays read every record: not for a kernel.
    let (s, v) = call(p, A, "GET", "/v1/tools/search/suggestion", None).await;
    assert_eq!((s, code(&v)), (403, "scope"), "{v}");
}

#[tokio::test]
async fn grants_and_reloads_are_bounded_by_scope_and_refusals_are_facts() {
    let w = world(false).await;
    let p = &w.p;
    let a = run_as(p, A, "search").await;
    let b = run_as(p, B, "search").await;
    let shell = run_as(p, OPS, "shell").await;
    let extra = format!("extra.test:{}", w.port);
    let grant = |uses: u64, ttl: u64| json!({"target": extra, "uses": uses, "ttl_ms": ttl});
    for (run, body, want) in [
        (&b, grant(1, 1000), "not_your_run"),
        (&shell, grant(1, 1000), "not_your_run"),
        (&a, grant(6, 1000), "beyond_scope"),
        (&a, grant(1, 60_001), "beyond_scope"),
    ] {
        let (s, v) = call(p, A, "POST", &format!("/v1/runs/{}/grants", run.id), Some(body.clone())).await;
        assert_eq!((s, code(&v)), (403, want), "{body} on {}: {v}", run.id);
    }
    let refused = control_actions(p, "grant_refused").await;
    assert_eq!(refused.len(), 4, "{refused:?}");
    assert!(refused.iter().all(|f| f["principal"] == "kernel-a"), "{refused:?}");
    // Within its scope: granted, and the run reaches the target.
    let (s, v) = call(
        p,
        A,
        "POST",
        &format!("/v1/runs/{}/grants", a.id),
        Some(grant(5, 60_000)),
    )
    .await;
    assert_eq!(s, 201, "{v}");
    let r = p.get(&a, &format!("http://{extra}/"), "").await;
    assert_eq!(r.status, 200);
    // Reload: not a kernel's; refused as a fact. The operator may.
    let (s, v) = call(p, A, "POST", "/v1/policy/reload", None).await;
    assert_eq!((s, code(&v)), (403, "scope"), "{v}");
    let refused = control_actions(p, "reload_refused").await;
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert_eq!(refused[0]["principal"], "kernel-a");
    let (s, v) = call(p, OPS, "POST", "/v1/policy/reload", None).await;
    assert_eq!(s, 200, "{v}");
    let applied = control_actions(p, "reload_applied").await;
    assert_eq!(applied.len(), 1);
    assert_eq!(applied[0]["principal"], "operator");
    // What the executor refused to start: reported by an admin only.
    let body = json!({"detail": "`/srv/tool.py` is pinned to sha256 aa but hashes to bb"});
    let (s, v) = call(p, A, "POST", "/v1/tools/search/executable_mismatch", Some(body.clone())).await;
    assert_eq!((s, code(&v)), (403, "scope"), "{v}");
    let (s, v) = call(p, OPS, "POST", "/v1/tools/search/executable_mismatch", Some(body)).await;
    assert_eq!(s, 204, "{v}");
    let reported = control_actions(p, "executable_mismatch").await;
    assert_eq!(reported.len(), 1, "{reported:?}");
    assert_eq!(reported[0]["tool"], "search");
    assert!(
        reported[0]["detail"].as_str().unwrap().contains("hashes to bb"),
        "{reported:?}"
    );
}

#[tokio::test]
async fn a_token_removed_from_the_file_is_refused_from_the_reload_on() {
    let w = world(false).await;
    let p = &w.p;
    let b = run_as(p, B, "search").await;
    let (s, _) = call(p, B, "GET", &format!("/v1/runs/{}", b.id), None).await;
    assert_eq!(s, 200);
    private(&w.principals, &principals_text(false));
    let (s, v) = call(p, OPS, "POST", "/v1/policy/reload", None).await;
    assert_eq!(s, 200, "{v}");
    let (s, _) = call(p, B, "GET", &format!("/v1/runs/{}", b.id), None).await;
    assert_eq!(s, 401);
    let changed = control_actions(p, "principals_changed").await;
    assert_eq!(changed.len(), 1, "{changed:?}");
    assert!(
        changed[0]["detail"].as_str().unwrap().contains("removed kernel-b"),
        "{changed:?}"
    );
    assert_eq!(changed[0]["principal"], "operator");
    // A file others can read is refused, and the principals in force stay.
    std::fs::set_permissions(&w.principals, std::fs::Permissions::from_mode(0o644)).unwrap();
    let (s, v) = call(p, OPS, "POST", "/v1/policy/reload", None).await;
    assert_eq!((s, code(&v)), (422, "invalid_config"), "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("0600"), "{v}");
    let (s, _) = call(p, A, "GET", "/v1/runs", None).await;
    assert_eq!(s, 200);
}

#[tokio::test]
async fn the_envelope_bounds_reloads_and_grants() {
    let w = world(true).await;
    let p = &w.p;
    let a = run_as(p, A, "search").await;
    // A reload that opens a wildcard beyond the envelope: refused with the
    // diff, and the old policy still decides.
    let dns = &p.dns;
    std::fs::write(
        &w.config,
        config_text(dns, w.dir.path(), w.port, ", \"*.test:1\"", true),
    )
    .unwrap();
    let (s, v) = call(p, OPS, "POST", "/v1/policy/reload", None).await;
    assert_eq!((s, code(&v)), (422, "beyond_envelope"), "{v}");
    let changes = v["error"]["diff"]["changes"].as_array().unwrap();
    assert!(
        changes
            .iter()
            .any(|c| c["target"].as_str().unwrap().contains("*.test") && c["direction"] == "widens"),
        "{v}"
    );
    assert_eq!(control_actions(p, "beyond_envelope").await.len(), 1);
    // Within it: applied, and the answer carries the diff.
    let within = format!(", \"wider.corp.test:{}\"", w.port);
    std::fs::write(&w.config, config_text(dns, w.dir.path(), w.port, &within, true)).unwrap();
    let (s, v) = call(p, OPS, "POST", "/v1/policy/reload", None).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["widens"], true, "{v}");
    assert!(
        v["changes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c["kind"] == "host_added"),
        "{v}"
    );
    let r = p.get(&a, &format!("http://wider.corp.test:{}/", w.port), "").await;
    assert_eq!(r.status, 200);
    // A grant outside the envelope: 422, and a fact.
    let (s, v) = call(
        p,
        OPS,
        "POST",
        &format!("/v1/runs/{}/grants", a.id),
        Some(json!({"target": format!("extra.test:{}", w.port)})),
    )
    .await;
    assert_eq!((s, code(&v)), (422, "beyond_envelope"), "{v}");
    assert_eq!(control_actions(p, "beyond_envelope").await.len(), 2);
    // The diff endpoint: the candidate against the policy in force.
    let candidate = config_text(dns, w.dir.path(), w.port, "", true);
    let (s, v) = call(p, A, "POST", "/v1/policy/diff", Some(json!({"config": candidate}))).await;
    assert_eq!((s, code(&v)), (403, "scope"), "{v}");
    let (s, v) = call(p, OPS, "POST", "/v1/policy/diff", Some(json!({"config": candidate}))).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["widens"], false, "{v}");
    assert!(
        v["changes"]
            .as_array()
            .unwrap()
            .iter()
            .all(|c| c["direction"] == "narrows"),
        "{v}"
    );
}

#[tokio::test]
async fn refused_credentials_are_counted_into_one_fact() {
    let w = world(false).await;
    let p = &w.p;
    for _ in 0..5 {
        let (s, _) = call(p, "guess-0123456789abcdef0123", "GET", "/v1/runs", None).await;
        assert_eq!(s, 401);
    }
    let mut found = vec![];
    for _ in 0..150 {
        found = control_actions(p, "credential_refused").await;
        if !found.is_empty() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0]["count"], 5, "{found:?}");
}

#[tokio::test]
async fn metrics_can_require_a_principal_with_the_metrics_scope() {
    let dns = FakeDns::start().await;
    let dir = tempfile::tempdir().unwrap();
    let principals = dir.path().join("principals.toml");
    private(
        &principals,
        &format!(
            "[principals.prometheus]\ntokens = [\"{}\"]\nscopes = [\"metrics\"]\n\n[principals.kernel-a]\ntokens = [\"{}\"]\nscopes = [\"runs:*\"]\n",
            token_hash(OPS),
            token_hash(A)
        ),
    );
    let text = format!(
        "{}\n[control]\nprincipals_file = \"{}\"\nmetrics_require_token = true\n",
        proxy_section(&dns, ""),
        principals.display()
    );
    let p = TestProxy::start_config(dns, &text, None, Some(Arc::new(MemorySink::new(100)))).await;
    assert_eq!(p.control_raw("GET", "/metrics", None, None).await.status, 401);
    let (s, v) = call(&p, A, "GET", "/metrics", None).await;
    assert_eq!((s, code(&v)), (403, "scope"), "{v}");
    let r = p.control_raw("GET", "/metrics", None, Some(OPS)).await;
    assert_eq!(r.status, 200);
    assert!(r.text().contains("egress_control_actions_total"), "{}", r.text());
}
