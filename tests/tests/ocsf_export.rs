//! OCSF export from a real run: a proxy with a file store and the whole
//! decision log records denials on several entrances (plain HTTP, CONNECT,
//! SOCKS5, inside interception), a report-mode denial, a pending fetch, a
//! grant, a control action, and allowed fetches and tunnels. Then
//! `egress-proxy facts export --format ocsf` (facts, then decisions) reads
//! the store file, and every event validates against the OCSF 1.8.0 JSON
//! Schema of its class and profiles (`tests/ocsf/validate.py`:
//! ocsf-json-schema and jsonschema from PyPI, pinned). The same events read
//! from the running proxy's control API (`format=ocsf` pages and streams,
//! `facts export --control`, also over https with a client certificate)
//! equal the store's, also for a principal that sees only its own. Loopback
//! origins on 127.0.0.2, fake DNS.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_api::RecordFormat;
use egress_config::principals::token_hash;
use egress_e2e::harness::{proxy_section, TestProxy, TOKEN};
use egress_e2e::origin::{echo_origin, http_origin};
use egress_e2e::process::{bin, python_has, repo_root};
use egress_e2e::FakeDns;
use egress_proxy::control_client::{self, Records};
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::io::Write as _;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

/// `facts export` of `store` with `args`: its JSON lines.
fn export(store: &Path, args: &[&str]) -> Vec<Value> {
    export_text(&[&["--store", store.to_str().unwrap()], args].concat(), &[])
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

/// `facts export` with `args` and `env`: its output, which must succeed.
fn export_text(args: &[&str], env: &[(&str, &str)]) -> String {
    let out = export_run(args, env);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// `facts export` with `args` and `env` (and no other token).
fn export_run(args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    let mut c = Command::new(bin("egress-proxy"));
    c.args(["facts", "export"])
        .args(args)
        .env_remove("EGRESS_CONTROL_TOKEN");
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().unwrap()
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

/// A kernel's token: `facts:own` and `decisions:own`, runs of `web`.
const KERNEL: &str = "kernel-a-token-0123456789abcdef";

/// Every record of a cursor route read page by page (`limit`) as `token`,
/// checked against the OpenAPI document: the list under `key`, and each
/// page's `next`.
async fn pages(p: &TestProxy, token: &str, route: &str, query: &str, key: &str) -> (Vec<Value>, Vec<u64>) {
    let (mut all, mut cursors, mut after) = (vec![], vec![], 0);
    loop {
        let path = format!("{route}?after={after}&limit=2{query}");
        let r = p.control_raw("GET", &path, None, Some(token)).await;
        assert_eq!(r.status, 200, "{path}: {}", String::from_utf8_lossy(&r.body));
        let v: Value = serde_json::from_slice(&r.body).unwrap();
        all.extend(
            v[key]
                .as_array()
                .unwrap_or_else(|| panic!("{path}: no {key}: {v}"))
                .clone(),
        );
        let next = v["next"].as_u64().unwrap();
        cursors.push(next);
        if next == after {
            return (all, cursors);
        }
        after = next;
    }
}

fn as_json(r: egress_e2e::raw::RawResponse) -> (u16, Value) {
    (r.status, serde_json::from_slice(&r.body).unwrap_or(Value::Null))
}

fn seqs(events: &[Value]) -> Vec<u64> {
    events
        .iter()
        .map(|e| e["metadata"]["sequence"].as_u64().unwrap())
        .collect()
}

fn lines(text: &str) -> Vec<Value> {
    text.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

// Multi-threaded: `facts export --control` runs as a child the test waits
// for, while the in-process proxy answers it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_control_api_serves_the_store_s_ocsf_events_to_each_principal_as_it_may_see_them() {
    if !python_has(
        "ocsf_json_schema, jsonschema",
        "pip install -r tests/ocsf/requirements.txt",
    ) {
        return;
    }
    let origin = http_origin("127.0.0.2:0").await;
    let port = origin.addr.port();
    let dns = FakeDns::start().await;
    for name in ["api.test", "other.test"] {
        dns.set(name, &["127.0.0.2"]);
    }
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("facts.db");
    let principals = dir.path().join("principals.toml");
    std::fs::write(
        &principals,
        format!(
            "[principals.kernel-a]\ntokens = [\"{}\"]\nscopes = [\"runs:web\", \"facts:own\", \"decisions:own\"]\n",
            token_hash(KERNEL)
        ),
    )
    .unwrap();
    std::fs::set_permissions(&principals, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let section = proxy_section(&dns, "decisions = \"all\"").replace(
        "facts = \"/nonexistent/facts.db\"",
        &format!("facts = \"{}\"", store.display()),
    );
    let text = format!(
        "{section}\n[control]\nprincipals_file = \"{}\"\n\n[tools.web]\negress = [\"api.test:{port}\"]\n",
        principals.display()
    );
    let cfg = dir.path().join("egress.toml");
    std::fs::write(&cfg, &text).unwrap();
    let p = TestProxy::start_config(dns, &text, Some(cfg), None).await;
    // One run of the control token's, one of the kernel's: each is denied
    // twice and fetches once (the kernel's records come second).
    let (status, v) = as_json(
        p.control_raw("POST", "/v1/runs", Some(json!({"tool": "web"})), Some(KERNEL))
            .await,
    );
    assert_eq!(status, 201, "{v}");
    let mine = egress_e2e::harness::TestRun {
        id: v["run_id"].as_str().unwrap().to_owned(),
        secret: v["secret"].as_str().unwrap().to_owned(),
        url: v["proxy_url"].as_str().unwrap().to_owned(),
    };
    let theirs = p.run("web").await;
    for run in [&theirs, &mine] {
        let r = p.get(run, &format!("http://other.test:{port}/"), "").await;
        assert_eq!(r.deny_reason(), Some("not_allowlisted"));
        let (r, _) = p.connect(run, "other.test:443").await;
        assert_eq!(r.status, 403);
        assert_eq!(p.get(run, &format!("http://api.test:{port}/"), "").await.status, 200);
    }
    // The decision log is written off the answer path: wait for both.
    for _ in 0..100 {
        let (_, v) = p.control("GET", "/v1/decisions?after=0", None).await;
        if v["decisions"].as_array().unwrap().len() >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let s = store.to_str().unwrap();
    let facts_text = export_text(&["--store", s, "--format", "ocsf"], &[]);
    let decisions_text = export_text(&["--store", s, "--format", "ocsf", "--decisions"], &[]);
    let (facts, decisions) = (lines(&facts_text), lines(&decisions_text));
    assert!(facts.len() >= 4 && decisions.len() == 2, "{facts:?} {decisions:?}");

    // Pages: the store's events, and the JSON pages' cursors.
    let (got, ocsf_next) = pages(&p, TOKEN, "/v1/facts", "&format=ocsf", "events").await;
    assert_eq!(got, facts);
    let (json_facts, json_next) = pages(&p, TOKEN, "/v1/facts", "", "facts").await;
    assert_eq!(ocsf_next, json_next, "the cursor is the format's either way");
    assert_eq!(json_facts.len(), facts.len());
    let (got, ocsf_next) = pages(&p, TOKEN, "/v1/decisions", "&format=ocsf", "events").await;
    assert_eq!(got, decisions);
    let (_, json_next) = pages(&p, TOKEN, "/v1/decisions", "&format=json", "decisions").await;
    assert_eq!(ocsf_next, json_next);
    let run_facts = format!("/v1/runs/{}/facts", theirs.id);
    let (got, _) = pages(&p, TOKEN, &run_facts, "&format=ocsf", "events").await;
    let want: Vec<Value> = facts
        .iter()
        .filter(|e| e["metadata"]["correlation_uid"] == theirs.id.as_str())
        .cloned()
        .collect();
    assert_eq!((got.len(), got), (2, want));

    // Streams: the same events, `id:` the cursor, resumable after any.
    let stream = p
        .sse_events_as(TOKEN, "/v1/facts/stream?after=0&format=ocsf", facts.len())
        .await;
    let streamed: Vec<Value> = stream.iter().map(|e| serde_json::from_str(&e.data).unwrap()).collect();
    assert_eq!(streamed, facts);
    for (e, v) in stream.iter().zip(&facts) {
        assert_eq!(
            (e.id.clone(), e.event.as_str()),
            (v["metadata"]["sequence"].to_string(), "fact")
        );
    }
    let resumed = p
        .sse_events_as(
            TOKEN,
            &format!("/v1/facts/stream?after={}&format=ocsf", stream[1].id),
            1,
        )
        .await;
    assert_eq!(serde_json::from_str::<Value>(&resumed[0].data).unwrap(), facts[2]);
    let stream = p.sse_events_as(TOKEN, "/v1/decisions/stream?format=ocsf", 2).await;
    let streamed_decisions: Vec<Value> = stream.iter().map(|e| serde_json::from_str(&e.data).unwrap()).collect();
    assert_eq!(streamed_decisions, decisions);
    assert!(stream.iter().all(|e| e.event == "decision"), "{stream:?}");

    let mut all = streamed;
    all.extend(streamed_decisions);
    let (ok, out) = validate(&all);
    assert!(ok, "{out}");

    // A kernel sees only its own, in OCSF as in JSON, on pages and streams.
    let own = |events: &[Value]| -> Vec<Value> {
        events
            .iter()
            .filter(|e| e["unmapped"]["loom"]["principal"] == "kernel-a")
            .cloned()
            .collect()
    };
    let (own_facts, own_decisions) = (own(&facts), own(&decisions));
    assert!(own_facts.len() == 2 && own_decisions.len() == 1, "{facts:?}");
    let (got, _) = pages(&p, KERNEL, "/v1/facts", "&format=ocsf", "events").await;
    assert_eq!(got, own_facts);
    let (plain, _) = pages(&p, KERNEL, "/v1/facts", "", "facts").await;
    let json_seqs: Vec<u64> = plain.iter().map(|f| f["seq"].as_u64().unwrap()).collect();
    assert_eq!(seqs(&got), json_seqs);
    let (got, _) = pages(&p, KERNEL, "/v1/decisions", "&format=ocsf", "events").await;
    assert_eq!(got, own_decisions);
    let stream = p.sse_events_as(KERNEL, "/v1/facts/stream?format=ocsf", 2).await;
    let streamed: Vec<Value> = stream.iter().map(|e| serde_json::from_str(&e.data).unwrap()).collect();
    assert_eq!(streamed, own_facts);
    let stream = p.sse_events_as(KERNEL, "/v1/decisions/stream?format=ocsf", 1).await;
    assert_eq!(
        serde_json::from_str::<Value>(&stream[0].data).unwrap(),
        own_decisions[0]
    );

    // Another format is refused, in the API's error body.
    for route in [
        "/v1/facts",
        "/v1/decisions",
        "/v1/facts/stream",
        "/v1/decisions/stream",
        &run_facts,
    ] {
        let (status, v) = as_json(
            p.control_raw("GET", &format!("{route}?format=xml"), None, Some(TOKEN))
                .await,
        );
        assert_eq!(
            (status, v["error"]["code"].as_str()),
            (400, Some("bad_request")),
            "{route}: {v}"
        );
        assert!(v["error"]["message"].as_str().unwrap().contains("ocsf"), "{v}");
    }

    // `facts export --control`: byte for byte the store's lines.
    let url = format!("http://{}", p.control);
    let admin = [("EGRESS_CONTROL_TOKEN", TOKEN)];
    let remote = |args: &[&str], env: &[(&str, &str)]| export_text(&[&["--control", &url], args].concat(), env);
    assert_eq!(remote(&["--format", "ocsf"], &admin), facts_text);
    assert_eq!(remote(&["--format", "ocsf", "--decisions"], &admin), decisions_text);
    for args in [
        &["--format", "jsonl"][..],
        &["--decisions"],
        &["--format", "ocsf", "--after", "2"],
    ] {
        assert_eq!(
            remote(args, &admin),
            export_text(&[&["--store", s], args].concat(), &[]),
            "{args:?}"
        );
    }
    let kernel = remote(
        &["--format", "ocsf", "--token-env", "KERNEL_TOKEN"],
        &[("KERNEL_TOKEN", KERNEL)],
    );
    let want: String = facts_text
        .lines()
        .zip(&facts)
        .filter(|(_, e)| own_facts.contains(e))
        .map(|(l, _)| format!("{l}\n"))
        .collect();
    assert_eq!(kernel, want);
    // The reader follows `next` page by page, past pages the principal sees
    // nothing of (the other run's records come first).
    let endpoint = control_client::endpoint(&url).unwrap();
    for (token, want) in [(TOKEN, &facts_text), (KERNEL, &want)] {
        let client = control_client::Client::new(endpoint.clone(), None, None, Some(token.into()))
            .unwrap()
            .page_size(1);
        let mut text = String::new();
        let n = client
            .export(Records::Facts, RecordFormat::Ocsf, 0, &mut |l| {
                text.push_str(l);
                text.push('\n');
                Ok(())
            })
            .await
            .unwrap();
        assert_eq!((n as usize, &text), (want.lines().count(), want));
    }
    // An HTTP failure names its status and the API's code, and fails.
    let out = export_run(
        &["--control", &url],
        &[("EGRESS_CONTROL_TOKEN", "wrong-token-0123456789abcdef")],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("HTTP 401 unauthorized: wrong control token"), "{err}");
    assert!(out.stdout.is_empty());
    p.shutdown().await;
}

/// `facts export --control https://…` with `[control.tls]`: the client
/// certificate names the principal (no token), the CA verifies the API; a
/// certificate naming nobody is refused with the API's `401`, and https
/// without `--ca` is refused before any connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn facts_export_control_speaks_https_with_a_client_certificate() {
    use egress_e2e::pki::{https_call, Ca};
    let origin = http_origin("127.0.0.2:0").await;
    let port = origin.addr.port();
    let dns = FakeDns::start().await;
    dns.set("other.test", &["127.0.0.2"]);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ca = Ca::new("control CA");
    let ca_file = ca.write(d, "ca.pem");
    let server = ca.leaf(d, "server", "control", &["127.0.0.1"]);
    let kernel = ca.leaf(d, "kernel-a", "kernel-a", &["kernel-a.kernels.test"]);
    let stranger = ca.leaf(d, "stranger", "stranger", &["stranger.kernels.test"]);
    let principals = d.join("principals.toml");
    std::fs::write(
        &principals,
        "[principals.kernel-a]\nsubjects = [\"kernel-a.kernels.test\"]\nscopes = [\"runs:*\", \"facts:own\"]\n",
    )
    .unwrap();
    std::fs::set_permissions(&principals, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let store = d.join("facts.db");
    let section = proxy_section(&dns, "").replace(
        "facts = \"/nonexistent/facts.db\"",
        &format!("facts = \"{}\"", store.display()),
    );
    let text = format!(
        "{section}\n[control]\nprincipals_file = \"{}\"\n[control.tls]\ncert = \"{}\"\nkey = \"{}\"\nclient_ca = \"{}\"\n\n[tools.web]\negress = []\n",
        principals.display(),
        server.cert.display(),
        server.key.display(),
        ca_file.display()
    );
    let p = TestProxy::start_config(dns, &text, None, None).await;
    // A run of the kernel's (by its certificate) and one of the control
    // token's, each denied once.
    let r = https_call(
        p.control,
        &ca_file,
        Some(&kernel),
        "POST",
        "/v1/runs",
        Some(json!({"tool": "web"})),
        None,
    )
    .await
    .unwrap();
    assert_eq!(r.status, 201, "{}", r.text());
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    let mine = egress_e2e::harness::TestRun {
        id: v["run_id"].as_str().unwrap().to_owned(),
        secret: v["secret"].as_str().unwrap().to_owned(),
        url: v["proxy_url"].as_str().unwrap().to_owned(),
    };
    let r = https_call(
        p.control,
        &ca_file,
        None,
        "POST",
        "/v1/runs",
        Some(json!({"tool": "web"})),
        Some(TOKEN),
    )
    .await
    .unwrap();
    assert_eq!(r.status, 201, "{}", r.text());
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    let theirs = egress_e2e::harness::TestRun {
        id: v["run_id"].as_str().unwrap().to_owned(),
        secret: v["secret"].as_str().unwrap().to_owned(),
        url: v["proxy_url"].as_str().unwrap().to_owned(),
    };
    for run in [&theirs, &mine] {
        let r = p.get(run, &format!("http://other.test:{port}/"), "").await;
        assert_eq!(r.deny_reason(), Some("not_allowlisted"));
    }

    let s = store.to_str().unwrap();
    let all = export_text(&["--store", s, "--format", "ocsf"], &[]);
    let want: String = all
        .lines()
        .filter(|l| serde_json::from_str::<Value>(l).unwrap()["unmapped"]["loom"]["principal"] == "kernel-a")
        .map(|l| format!("{l}\n"))
        .collect();
    assert_eq!(want.lines().count(), 1, "{all}");
    let url = format!("https://{}", p.control);
    let (ca_s, cert, key) = (
        ca_file.to_str().unwrap(),
        kernel.cert.to_str().unwrap(),
        kernel.key.to_str().unwrap(),
    );
    let got = export_text(
        &[
            "--control",
            &url,
            "--ca",
            ca_s,
            "--cert",
            cert,
            "--key",
            key,
            "--format",
            "ocsf",
        ],
        &[],
    );
    assert_eq!(got, want);
    // The control token over https, verified by the CA: everything.
    let got = export_text(
        &["--control", &url, "--ca", ca_s, "--format", "ocsf"],
        &[("EGRESS_CONTROL_TOKEN", TOKEN)],
    );
    assert_eq!(got, all);
    // A certificate of the CA that names no principal: the API's 401.
    let (cert, key) = (stranger.cert.to_str().unwrap(), stranger.key.to_str().unwrap());
    let out = export_run(&["--control", &url, "--ca", ca_s, "--cert", cert, "--key", key], &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("HTTP 401 unauthorized"), "{err}");
    // https without the CA to verify it: refused, named.
    let out = export_run(&["--control", &url], &[("EGRESS_CONTROL_TOKEN", TOKEN)]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("needs --ca"), "{err}");
    p.shutdown().await;
}
