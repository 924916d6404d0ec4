//! `egress-proxy policy diff OLD NEW`: exit codes, the JSON, and the replay
//! join against a recorded store and a running proxy: a fetch the old
//! policy denied and the new one allows shows under the change that allows
//! it. Loopback origin on 127.0.0.2, fake DNS.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_e2e::harness::{proxy_section, TestProxy, TOKEN};
use egress_e2e::origin::http_origin;
use egress_e2e::FakeDns;
use serde_json::Value;
use std::path::{Path, PathBuf};

fn diff_cmd(args: &[&str]) -> (i32, String, String) {
    let out = std::process::Command::new(egress_e2e::process::bin("egress-proxy"))
        .args(["policy", "diff"])
        .args(args)
        .env("EGRESS_CONTROL_TOKEN", TOKEN)
        .output()
        .unwrap();
    assert!(out.status.code().is_some(), "killed");
    (
        out.status.code().unwrap(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

#[tokio::test]
async fn diff_exits_1_on_widening_and_joins_the_recorded_denials_it_would_allow() {
    let origin = http_origin("127.0.0.2:0").await;
    let port = origin.addr.port();
    let dns = FakeDns::start().await;
    for n in ["api.test", "x.more.test"] {
        dns.set(n, &["127.0.0.2"]);
    }
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("facts.db");
    let section = proxy_section(&dns, "decisions = \"all\"").replace(
        "facts = \"/nonexistent/facts.db\"",
        &format!("facts = \"{}\"", store.display()),
    );
    let tool = |egress: &str, extra: &str| format!("{section}\n[tools.web]\negress = [{egress}]\n{extra}");
    let old = write(dir.path(), "old.toml", &tool(&format!("\"api.test:{port}\""), ""));
    let wider = write(
        dir.path(),
        "wider.toml",
        &tool(&format!("\"*.more.test:{port}\", \"api.test:{port}\""), ""),
    );
    // The same reach written otherwise: reordered, a duplicate, and a name
    // under a wildcard it already had.
    let same = write(
        dir.path(),
        "same.toml",
        &tool(&format!("\"api.test:{port}\", \"api.test:{port}\""), ""),
    );
    let narrower = write(dir.path(), "narrower.toml", &tool("", "max_requests_per_run = 10"));
    let bad = write(dir.path(), "bad.toml", &tool(&format!("\"*:{port}\""), ""));

    let p = TestProxy::start_config(dns, &std::fs::read_to_string(&old).unwrap(), None, None).await;
    let run = p.run("web").await;
    assert_eq!(p.get(&run, &format!("http://api.test:{port}/a"), "").await.status, 404);
    for _ in 0..2 {
        let r = p.get(&run, &format!("http://x.more.test:{port}/b"), "").await;
        assert_eq!(r.status, 403);
    }

    // Through the running proxy: it replays its own records under NEW.
    let control = format!("http://{}", p.control);
    // The command blocks: off the runtime that serves the proxy.
    let args = [old.clone(), wider.clone()].map(|p| p.to_str().unwrap().to_owned());
    let (code, out, err) = tokio::task::spawn_blocking(move || diff_cmd(&[&args[0], &args[1], "--control", &control]))
        .await
        .unwrap();
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        out.contains(&format!(
            "WIDENS  tool web: wildcard_added *.more.test:{port}\n    becomes allowed x.more.test:{port} (was not_allowlisted)"
        )),
        "{out}"
    );
    p.shutdown().await;

    let (code, out, err) = diff_cmd(&[
        old.to_str().unwrap(),
        wider.to_str().unwrap(),
        "--format",
        "json",
        "--store",
        store.to_str().unwrap(),
    ]);
    assert_eq!(code, 1, "{out}{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["widens"], true);
    let changes = v["changes"].as_array().unwrap();
    assert_eq!(changes.len(), 1, "{out}");
    let c = &changes[0];
    assert_eq!(
        (&c["direction"], &c["kind"], &c["tool"], &c["target"]),
        (
            &Value::from("widens"),
            &Value::from("wildcard_added"),
            &Value::from("web"),
            &Value::from(format!("*.more.test:{port}"))
        )
    );
    assert_eq!(c["becomes_allowed"][0]["target"], format!("x.more.test:{port}"));
    assert_eq!(c["becomes_allowed"][0]["reason"], "not_allowlisted");
    assert_eq!(c["becomes_allowed"][0]["count"], 2);
    assert_eq!(c["becomes_denied"], Value::Array(vec![]));
    assert!(v["replay"]["replayed"].as_u64().unwrap() >= 3, "{out}");
    assert_eq!(v["replay"]["unattributed"], Value::Array(vec![]));

    let (code, out, _) = diff_cmd(&[old.to_str().unwrap(), same.to_str().unwrap()]);
    assert_eq!((code, out.as_str()), (0, "no change in reach\n"));

    let (code, out, _) = diff_cmd(&[
        old.to_str().unwrap(),
        narrower.to_str().unwrap(),
        "--store",
        store.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "narrowing only: {out}");
    assert!(
        out.contains(&format!(
            "narrows tool web: host_removed api.test:{port}\n    becomes DENIED  api.test:{port} (not_allowlisted): 1 record(s)"
        )),
        "{out}"
    );
    assert!(
        out.contains("narrows tool web: budget_tightened max_requests_per_run (unlimited -> 10)"),
        "{out}"
    );

    let (code, out, err) = diff_cmd(&[old.to_str().unwrap(), bad.to_str().unwrap()]);
    assert_eq!(code, 2, "{out}");
    assert!(
        err.contains(&format!("{}: tools.web.egress[0]", bad.display())) && err.contains("bare '*'"),
        "{err}"
    );
}
