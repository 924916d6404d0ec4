//! OCSF export from a real run: a proxy with a file store and the whole
//! decision log records denials on several entrances (plain HTTP, CONNECT,
//! SOCKS5, inside interception), a report-mode denial, a pending fetch, a
//! grant, a control action, and allowed fetches and tunnels. Then
//! `egress-proxy facts export --format ocsf` (facts, then decisions) reads
//! the store file, and every event validates against the OCSF 1.8.0 JSON
//! Schema of its class and profiles (`tests/ocsf/validate.py`:
//! ocsf-json-schema and jsonschema from PyPI, pinned). Loopback origins on
//! 127.0.0.2, fake DNS.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_e2e::harness::{proxy_section, TestProxy};
use egress_e2e::origin::{echo_origin, http_origin};
use egress_e2e::process::{bin, python_has, repo_root};
use egress_e2e::FakeDns;
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::io::Write as _;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

/// `facts export` of `store` with `args`: its JSON lines.
fn export(store: &Path, args: &[&str]) -> Vec<Value> {
    let out = Command::new(bin("egress-proxy"))
        .args(["facts", "export", "--store"])
        .arg(store)
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

/// `tests/ocsf/validate.py` on `events`: (passed, its output).
fn validate(events: &[Value]) -> (bool, String) {
    let mut child = Command::new("python3")
        .arg(repo_root().join("tests/ocsf/validate.py"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    {
        let mut stdin = child.stdin.take().unwrap();
        for e in events {
            writeln!(stdin, "{e}").unwrap();
        }
    }
    let out = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[tokio::test]
async fn every_record_of_a_real_run_exports_as_a_valid_ocsf_event() {
    if !python_has(
        "ocsf_json_schema, jsonschema",
        "pip install -r tests/ocsf/requirements.txt",
    ) {
        return;
    }
    let origin = http_origin("127.0.0.2:0").await;
    let port = origin.addr.port();
    let (echo, _) = echo_origin("127.0.0.2:0").await;
    let dns = FakeDns::start().await;
    for name in ["api.test", "other.test", "extra.test"] {
        dns.set(name, &["127.0.0.2"]);
    }
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("facts.db");
    let section = proxy_section(&dns, "decisions = \"all\"").replace(
        "facts = \"/nonexistent/facts.db\"",
        &format!("facts = \"{}\"", store.display()),
    );
    let text = format!(
        "{section}\n[proxy.interception]\nca_dir = \"{}\"\n\n\
         [tools.web]\negress = [\"api.test:{port}\", \"api.test:{}\"]\nmethods = [\"GET\", \"CONNECT\"]\n\
         [tools.watch]\nmode = \"report\"\negress = []\n\
         [tools.asker]\negress = []\non_unlisted = \"ask\"\nask_timeout_ms = 300\n",
        dir.path().join("ca").display(),
        echo.port()
    );
    let cfg = dir.path().join("egress.toml");
    std::fs::write(&cfg, &text).unwrap();
    let p = TestProxy::start_config(dns, &text, Some(cfg), None).await;
    let run = p.run("web").await;
    // Allowed: a plain request and a tunnel (decision records).
    assert_eq!(p.get(&run, &format!("http://api.test:{port}/"), "").await.status, 200);
    let (r, mut s) = p.connect(&run, &format!("api.test:{}", echo.port())).await;
    assert_eq!(r.status, 200);
    assert_eq!(egress_e2e::raw::echo_through(&mut s, b"ping").await, b"ping");
    drop(s);
    // Denied: plain HTTP, an IP literal, a method, CONNECT, SOCKS5.
    let r = p.get(&run, &format!("http://other.test:{port}/"), "").await;
    assert_eq!(r.deny_reason(), Some("not_allowlisted"));
    let r = p.get(&run, &format!("http://127.0.0.2:{port}/"), "").await;
    assert_eq!(r.deny_reason(), Some("ip_literal"));
    let (r, _) = p.connect(&run, "other.test:443").await;
    assert_eq!(r.status, 403);
    let dest = egress_e2e::socks::Dest::Name("other.test".into(), 443);
    let _ = egress_e2e::socks::connect(p.proxy, (&run.id, &run.secret), &dest).await;
    // Report mode: recorded, let through.
    let watch = p.run("watch").await;
    let _ = p.get(&watch, &format!("http://api.test:{port}/seen"), "").await;
    // Pending: held for a grant that never comes, then denied.
    let asker = p.run("asker").await;
    let r = p.get(&asker, &format!("http://extra.test:{port}/"), "").await;
    assert_eq!(r.deny_reason(), Some("not_allowlisted"));
    // A grant (a fact, and a control action).
    let (status, g) = p
        .control(
            "POST",
            &format!("/v1/runs/{}/grants", run.id),
            Some(json!({ "target": format!("extra.test:{port}") })),
        )
        .await;
    assert_eq!(status, 201, "{g}");
    // A reload (a control action).
    let (status, v) = p.control("POST", "/v1/policy/reload", None).await;
    assert_eq!(status, 200, "{v}");
    tokio::time::sleep(Duration::from_millis(200)).await;
    p.shutdown().await;

    let facts = export(&store, &["--format", "jsonl"]);
    let kinds: BTreeSet<&str> = facts.iter().map(|f| f["type"].as_str().unwrap()).collect();
    for k in ["EGRESS_DENIED", "EGRESS_GRANTED", "EGRESS_PENDING", "CONTROL_ACTION"] {
        assert!(kinds.contains(k), "no {k} among {kinds:?}");
    }
    let mut events = export(&store, &["--format", "ocsf"]);
    assert_eq!(events.len(), facts.len(), "one event per fact");
    for (f, e) in facts.iter().zip(&events) {
        assert_eq!(e["metadata"]["uid"], f["id"], "{e}");
        assert_eq!(e["metadata"]["sequence"], f["seq"], "{e}");
    }
    let decisions = export(&store, &["--format", "ocsf", "--decisions"]);
    assert!(decisions.len() >= 2, "{decisions:?}");
    events.extend(decisions);
    let classes: BTreeSet<u64> = events.iter().filter_map(|e| e["class_uid"].as_u64()).collect();
    for c in [4001, 4002] {
        assert!(classes.contains(&c), "no class {c} among {classes:?}");
    }
    // --after is a cursor.
    let last = facts.last().unwrap()["seq"].as_u64().unwrap();
    assert!(export(&store, &["--after", &last.to_string()]).is_empty());
    let (ok, out) = validate(&events);
    assert!(ok, "{out}");
}
