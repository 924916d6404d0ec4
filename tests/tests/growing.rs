//! Growing a policy: the decision log (`[proxy] decisions`) records every
//! allowed fetch and tunnel with its bytes, off the answer path, in the
//! fact store's file; `policy suggest` proposes an allowlist from what a
//! report-mode tool did; `policy replay` re-decides the recorded traffic
//! under a new policy. Loopback origin on 127.0.0.2, fake DNS.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_e2e::harness::{proxy_section, sample, TestProxy};
use egress_e2e::origin::{echo_origin, http_origin};
use egress_e2e::FakeDns;
use serde_json::Value;
use std::path::Path;
use std::time::{Duration, Instant};

/// A proxy whose facts and decisions go to `store`, with `extra` `[proxy]`
/// keys and `tools`.
async fn proxy_at(dns: FakeDns, store: &Path, extra: &str, tools: &str) -> TestProxy {
    let section = proxy_section(&dns, extra).replace(
        "facts = \"/nonexistent/facts.db\"",
        &format!("facts = \"{}\"", store.display()),
    );
    let text = format!("{section}\n{tools}");
    TestProxy::start_config(dns, &text, None, None).await
}

/// A proxy with `extra` `[proxy]` keys, its store in a temporary directory
/// (returned: the store lives as long as it), and tool `web` allowed to
/// `api.test` on an HTTP origin on 127.0.0.2.
async fn web_proxy(extra: &str) -> (egress_e2e::origin::HttpOrigin, TestProxy, tempfile::TempDir) {
    let origin = http_origin("127.0.0.2:0").await;
    let port = origin.addr.port();
    let dns = FakeDns::start().await;
    dns.set("api.test", &["127.0.0.2"]);
    let dir = tempfile::tempdir().unwrap();
    let tools = format!("[tools.web]\negress = [\"api.test:{port}\"]\n");
    let p = proxy_at(dns, &dir.path().join("facts.db"), extra, &tools).await;
    (origin, p, dir)
}

/// Every decision record the API lists with `query` (e.g. `tool=web`),
/// waiting (up to 5 s) until there are at least `n`.
async fn decisions(p: &TestProxy, query: &str, n: usize) -> Vec<Value> {
    let t0 = Instant::now();
    loop {
        let (status, v) = p
            .control("GET", &format!("/v1/decisions?{query}&limit=1000"), None)
            .await;
        assert_eq!(status, 200, "{v}");
        let list = v["decisions"].as_array().unwrap().clone();
        if list.len() >= n || t0.elapsed() > Duration::from_secs(5) {
            return list;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn decisions_all_records_every_allowed_fetch_with_its_bytes_and_no_denial() {
    let origin = http_origin("127.0.0.2:0").await;
    let port = origin.addr.port();
    let (echo, _) = echo_origin("127.0.0.2:0").await;
    let dns = FakeDns::start().await;
    dns.set("api.test", &["127.0.0.2"]);
    dns.set("other.test", &["127.0.0.2"]);
    let dir = tempfile::tempdir().unwrap();
    let tools = format!(
        "[tools.web]\negress = [\"api.test:{port}\", \"api.test:{}\"]\n[tools.quiet]\negress = [\"api.test:{port}\"]\n",
        echo.port()
    );
    let p = proxy_at(dns, &dir.path().join("facts.db"), "decisions = \"all\"", &tools).await;
    let run = p.run("web").await;
    for i in 0..5 {
        let r = p.get(&run, &format!("http://api.test:{port}/?i={i}"), "").await;
        assert_eq!(r.status, 200);
    }
    let r = p.get(&run, &format!("http://api.test:{port}/missing"), "").await;
    assert_eq!(r.status, 404);
    let (r, mut s) = p.connect(&run, &format!("api.test:{}", echo.port())).await;
    assert_eq!(r.status, 200);
    assert_eq!(egress_e2e::raw::echo_through(&mut s, b"ping").await, b"ping");
    drop(s);
    // A denial is a fact, never a decision record.
    let r = p.get(&run, &format!("http://other.test:{port}/"), "").await;
    assert_eq!(r.status, 403);

    let list = decisions(&p, "tool=web", 7).await;
    assert_eq!(list.len(), 7, "{list:#?}");
    let http: Vec<&Value> = list.iter().filter(|d| d["kind"] == "http").collect();
    assert_eq!(http.len(), 6);
    for d in &http {
        assert_eq!(d["run_id"], run.id.as_str());
        assert_eq!(d["target"], format!("api.test:{port}"));
        assert_eq!(d["method"], "GET");
        assert_eq!(d["outcome"], "ok");
        assert!(d["bytes_up"].as_u64().unwrap() > 0, "{d}");
        assert!(d["bytes_down"].as_u64().unwrap() > 0, "{d}");
        assert!(d["policy"].as_str().unwrap().starts_with("sha256:"));
        assert_eq!(d["resolved"], serde_json::json!(["127.0.0.2"]));
        assert!(d["path"].as_str().unwrap().starts_with('/'), "{d}");
        assert!(!d["path"].as_str().unwrap().contains('?'), "a query is never kept: {d}");
    }
    assert_eq!(http.iter().filter(|d| d["status"] == 200).count(), 5);
    assert_eq!(http.iter().filter(|d| d["status"] == 404).count(), 1);
    let tunnel = list.iter().find(|d| d["kind"] == "connect").unwrap();
    assert_eq!(tunnel["method"], "CONNECT");
    assert_eq!(tunnel["bytes_up"], 4);
    assert_eq!(tunnel["bytes_down"], 4);

    // The run's own records, by cursor; another tool's filter sees none.
    let (_, v) = p
        .control("GET", &format!("/v1/runs/{}/decisions?limit=3", run.id), None)
        .await;
    assert_eq!(v["decisions"].as_array().unwrap().len(), 3);
    let next = v["next"].as_u64().unwrap();
    let (_, v) = p
        .control("GET", &format!("/v1/runs/{}/decisions?after={next}", run.id), None)
        .await;
    assert_eq!(v["decisions"].as_array().unwrap().len(), 4);
    assert!(decisions(&p, "tool=quiet", 0).await.is_empty());
    let (status, _) = p.control("GET", "/v1/decisions?after=9223372036854775808", None).await;
    assert_eq!(status, 400);

    // The live stream replays from the cursor.
    let ev = p.sse_event("/v1/decisions/stream?after=0&tool=web", "").await;
    assert!(
        ev.contains("event: decision") && ev.contains("\"tool\":\"web\""),
        "{ev}"
    );

    let m = p.metrics().await;
    assert_eq!(sample(&m, "egress_decisions_recorded_total"), 7.0);
    assert_eq!(sample(&m, "egress_decisions_dropped_total"), 0.0);
    assert!(sample(&m, "egress_decisions_store_bytes") > 0.0);
    p.shutdown().await;
}

#[tokio::test]
async fn decisions_off_records_nothing() {
    let (origin, p, _dir) = web_proxy("").await;
    let port = origin.addr.port();
    let run = p.run("web").await;
    assert_eq!(p.get(&run, &format!("http://api.test:{port}/"), "").await.status, 200);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(decisions(&p, "tool=web", 0).await.is_empty());
    assert_eq!(sample(&p.metrics().await, "egress_decisions_recorded_total"), 0.0);
}

/// `egress-proxy policy <args>`: exit code and stdout.
fn policy_cmd(args: &[&str]) -> (i32, String) {
    let out = std::process::Command::new(egress_e2e::process::bin("egress-proxy"))
        .arg("policy")
        .args(args)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.code().is_some(), "killed: {stderr}");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned() + &stderr,
    )
}

/// The entries of a proposal's `egress = [...]` with what their comment
/// says: (entry, "listed" | "add", count).
fn proposed(toml: &str) -> Vec<(String, String, u64)> {
    toml.lines()
        .filter_map(|l| {
            let l = l.strip_prefix("    \"")?;
            let (entry, rest) = l.split_once("\",  # ")?;
            let (what, rest) = rest.split_once(": ")?;
            let count = rest.split(' ').next()?.parse().ok()?;
            Some((entry.to_owned(), what.to_owned(), count))
        })
        .collect()
}

/// A config file whose store is `store` and whose tools are `tools`.
fn config_file(dir: &Path, name: &str, dns: &FakeDns, store: &Path, extra: &str, tools: &str) -> std::path::PathBuf {
    let section = proxy_section(dns, extra).replace(
        "facts = \"/nonexistent/facts.db\"",
        &format!("facts = \"{}\"", store.display()),
    );
    let path = dir.join(name);
    std::fs::write(&path, format!("{section}\n{tools}")).unwrap();
    path
}

#[tokio::test]
async fn suggest_proposes_exactly_what_a_report_mode_tool_used_and_no_wildcard_over_a_public_suffix() {
    let origin = http_origin("127.0.0.2:0").await;
    let port = origin.addr.port();
    let dns = FakeDns::start().await;
    let names = ["api.test", "a.one.com", "b.two.com", "x.shop.co.uk", "y.shop.co.uk"];
    for n in names {
        dns.set(n, &["127.0.0.2"]);
    }
    dns.set("inside.test", &["127.0.0.1"]);
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("facts.db");
    let tools = format!("[tools.learner]\negress = [\"api.test:{port}\", \"old.test:{port}\"]\nmode = \"report\"\n");
    let file = config_file(dir.path(), "egress.toml", &dns, &store, "decisions = \"all\"", &tools);
    let text = std::fs::read_to_string(&file).unwrap();
    let p = TestProxy::start_config(dns, &text, None, None).await;
    let run = p.run("learner").await;
    for (name, times) in [
        ("api.test", 1),
        ("a.one.com", 2),
        ("b.two.com", 1),
        ("x.shop.co.uk", 1),
        ("y.shop.co.uk", 3),
    ] {
        for _ in 0..times {
            let r = p.get(&run, &format!("http://{name}:{port}/"), "").await;
            assert_eq!(r.status, 200, "report mode lets {name} through");
        }
    }
    // Resolves into a denied range: reported, never proposed.
    p.get(&run, &format!("http://inside.test:{port}/"), "").await;
    decisions(&p, "tool=learner", 8).await;

    let (status, v) = p.control("GET", "/v1/tools/learner/suggestion", None).await;
    assert_eq!(status, 200, "{v}");
    let adds: Vec<(&str, u64)> = v["add"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["entry"].as_str().unwrap(), e["count"].as_u64().unwrap()))
        .collect();
    let p_ = |n: &str| format!("{n}:{port}");
    let mut want = [
        (p_("y.shop.co.uk"), 3),
        (p_("a.one.com"), 2),
        (p_("b.two.com"), 1),
        (p_("x.shop.co.uk"), 1),
    ];
    want.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let want_ref: Vec<(&str, u64)> = want.iter().map(|(e, c)| (e.as_str(), *c)).collect();
    assert_eq!(adds, want_ref, "{v:#}");
    assert_eq!(v["keep"][0]["entry"], p_("api.test"));
    assert_eq!(v["unused"][0]["entry"], p_("old.test"));
    assert_eq!(v["denied_ranges"][0]["entry"], p_("inside.test"));
    let (status, _) = p.control("GET", "/v1/tools/nobody/suggestion", None).await;
    assert_eq!(status, 404);
    let (status, _) = p.control("GET", "/v1/tools/learner/suggestion?since=soon", None).await;
    assert_eq!(status, 400);
    p.shutdown().await;

    // The command reads the store the config names, and says the same.
    let cfg = file.to_str().unwrap();
    let (code, out) = policy_cmd(&["suggest", "--config", cfg, "--tool", "learner", "--since", "1h"]);
    assert_eq!(code, 0, "{out}");
    let got = proposed(&out);
    let mut expected: Vec<(String, String, u64)> = vec![(p_("api.test"), "listed".into(), 1)];
    expected.extend(want.iter().map(|(e, c)| (e.clone(), "add".to_owned(), *c)));
    assert_eq!(got, expected, "{out}");
    assert!(
        out.contains(&format!("\"{}\"", p_("old.test"))) && out.contains("unused"),
        "{out}"
    );
    assert!(out.contains(&format!("#   \"{}\"", p_("inside.test"))), "{out}");

    let (code, out) = policy_cmd(&["suggest", "--config", cfg, "--tool", "learner", "--wildcards"]);
    assert_eq!(code, 0, "{out}");
    let entries: Vec<String> = proposed(&out).into_iter().map(|(e, _, _)| e).collect();
    assert!(entries.contains(&p_("*.shop.co.uk")), "{out}");
    for bad in ["*.com", "*.co.uk", "*.uk"] {
        assert!(!entries.contains(&p_(bad)), "{bad} proposed:\n{out}");
    }
    assert!(
        entries.contains(&p_("a.one.com")) && entries.contains(&p_("b.two.com")),
        "{out}"
    );
    let (code, out) = policy_cmd(&["suggest", "--config", cfg, "--tool", "learner", "--since", "soon"]);
    assert_eq!(code, 2, "{out}");
}

#[tokio::test]
async fn replay_names_what_a_new_policy_would_deny_and_exits_1_only_then() {
    let origin = http_origin("127.0.0.2:0").await;
    let port = origin.addr.port();
    let dns = FakeDns::start().await;
    for n in ["api.test", "other.test", "new.test"] {
        dns.set(n, &["127.0.0.2"]);
    }
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("facts.db");
    let tool = |egress: &[&str]| {
        let list: Vec<String> = egress.iter().map(|n| format!("\"{n}:{port}\"")).collect();
        format!("[tools.web]\negress = [{}]\n", list.join(", "))
    };
    let file = config_file(
        dir.path(),
        "egress.toml",
        &dns,
        &store,
        "decisions = \"all\"",
        &tool(&["api.test", "other.test"]),
    );
    let text = std::fs::read_to_string(&file).unwrap();
    let dropped = config_file(dir.path(), "dropped.toml", &dns, &store, "", &tool(&["api.test"]));
    let added = config_file(
        dir.path(),
        "added.toml",
        &dns,
        &dir.path().join("elsewhere.db"),
        "",
        &tool(&["api.test", "other.test", "new.test"]),
    );
    let p = TestProxy::start_config(dns, &text, None, None).await;
    let run = p.run("web").await;
    for n in ["api.test", "api.test", "other.test"] {
        assert_eq!(p.get(&run, &format!("http://{n}:{port}/x"), "").await.status, 404);
    }
    assert_eq!(p.get(&run, &format!("http://new.test:{port}/"), "").await.status, 403);
    decisions(&p, "tool=web", 3).await;

    // Over the API: the TOML in a POST body.
    let body = serde_json::json!({ "config": std::fs::read_to_string(&dropped).unwrap() });
    let (status, v) = p.control("POST", "/v1/policy/replay", Some(body)).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["breaks"], true);
    assert_eq!(
        v["tools"][0]["becomes_denied"][0]["target"],
        format!("other.test:{port}")
    );
    assert_eq!(v["tools"][0]["becomes_denied"][0]["reason"], "not_allowlisted");
    let (status, v) = p
        .control(
            "POST",
            "/v1/policy/replay",
            Some(serde_json::json!({ "config": "[proxy]\nlisten = 7\n" })),
        )
        .await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (422, Some("invalid_config")),
        "{v}"
    );
    p.shutdown().await;

    let (code, out) = policy_cmd(&["replay", "--config", dropped.to_str().unwrap()]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains(&format!(
            "becomes DENIED  other.test:{port} (not_allowlisted): 1 record(s), e.g. GET /x"
        )),
        "{out}"
    );
    assert!(
        !out.contains(&format!("api.test:{port}")),
        "api.test is unchanged: {out}"
    );

    let (code, out) = policy_cmd(&[
        "replay",
        "--config",
        added.to_str().unwrap(),
        "--store",
        store.to_str().unwrap(),
        "--tool",
        "web",
    ]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains(&format!("becomes allowed new.test:{port} (not_allowlisted)")),
        "{out}"
    );
    assert!(!out.contains("DENIED"), "{out}");

    let (code, out) = policy_cmd(&["replay", "--config", added.to_str().unwrap()]);
    assert_eq!(code, 2, "no store at the new config's path: {out}");
}

#[tokio::test]
async fn the_decision_log_keeps_to_its_budget_by_dropping_its_oldest_records() {
    use tokio::io::AsyncWriteExt;
    let (origin, p, _dir) = web_proxy("decisions = \"all\"\ndecisions_max_mb = 1\nfacts_max_mb = 1").await;
    let port = origin.addr.port();
    let run = p.run("web").await;
    // Long paths make records large: the 1 MiB budget is crossed in a few
    // thousand fetches on one keep-alive connection.
    let path = format!("/{}", "p".repeat(240));
    let mut s = tokio::net::TcpStream::connect(p.proxy).await.unwrap();
    let n = 4000;
    for i in 0..n {
        let req = format!(
            "GET http://api.test:{port}{path}{i} HTTP/1.1\r\nHost: api.test:{port}\r\nProxy-Authorization: {}\r\n\r\n",
            run.auth()
        );
        s.write_all(req.as_bytes()).await.unwrap();
        let r = egress_e2e::raw::read_response(&mut s, false).await.unwrap();
        assert_eq!(r.status, 404);
    }
    drop(s);
    let t0 = Instant::now();
    let m = loop {
        let m = p.metrics().await;
        if sample(&m, "egress_decisions_recorded_total") + sample(&m, "egress_decisions_dropped_total") >= n as f64
            || t0.elapsed() > Duration::from_secs(10)
        {
            break m;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let pruned = sample(&m, "egress_decisions_pruned_total");
    assert!(pruned > 0.0, "nothing was dropped for the budget");
    assert!(sample(&m, "egress_decisions_store_bytes") <= (1 << 20) as f64);
    let (_, v) = p.control("GET", "/v1/decisions?after=0&limit=1", None).await;
    let oldest = v["decisions"][0]["seq"].as_u64().unwrap();
    assert!(oldest > 1, "the oldest records went first");
    let (_, v) = p
        .control("GET", &format!("/v1/decisions?after={}&limit=1000", n - 10), None)
        .await;
    assert!(
        v["decisions"]
            .as_array()
            .unwrap()
            .iter()
            .any(|d| d["path"] == format!("{path}{}", n - 1)),
        "the newest record is kept"
    );
    // Denials are still recorded beside a full log (the fact store's budget
    // leaving the log's pages out is unit-tested in facts::store).
    for host in ["other.test", "another.test"] {
        let r = p.get(&run, &format!("http://{host}:1/"), "").await;
        assert_eq!(r.status, 403, "{}", r.text());
        assert!(r.header("x-egress-fact-id").is_some());
    }
}
